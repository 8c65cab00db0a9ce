"""One training loop, three ways (1/3): plain PyTorch DDP, every step written out.

Run it::

    torchrun --nproc-per-node 2 -m ddplab.workers.loop_ddp
    python -m ddplab launch --nproc-per-node 2 ddplab.workers.loop_ddp --epochs 2

The same small CNN on the digits as ``loop_accelerate.py`` (Hugging Face Accelerate) and
``loop_fabric.py`` (Lightning Fabric); the three files share their sections (``setup``,
``data``, ``model``, ``loop``, ``save``, ``cleanup``) so that lesson 07b can show them side by
side. ``ddplab.workers.plain_ddp`` is the full version of this one (resume, timing, reports).

Events: ``epoch`` (every rank, per epoch): ``epoch``, ``loss`` (this rank's mean);
``result`` (rank 0, at the end): ``library``, ``accuracy`` (test set), ``saved`` (the file).

Lesson: 07b.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from ddplab import data, models
from ddplab.dist import pick_backend
from ddplab.loops import parse_args, report_epoch, report_result


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Setup, data, model, loop, save, cleanup: by hand."""
    args = parse_args("loop_ddp", argv)
    # [setup]
    backend = pick_backend()                       # nccl with a GPU per process, else gloo
    dist.init_process_group(backend)
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # [/setup]
    # [data]
    split = data.load_dataset("digits", as_tensors=False)
    sampler = DistributedSampler(split.train, seed=args.seed)      # this rank's share
    loader = DataLoader(split.train, batch_size=args.batch_size, sampler=sampler)
    # [/data]
    # [model]
    torch.manual_seed(args.seed)
    model = models.build_model("cnn", split.num_classes, split.in_channels).to(device)
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # [/model]
    # [loop]
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)                                   # a new order every epoch
        for inputs, labels in loader:
            inputs, labels = inputs.to(device), labels.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(inputs), labels)
            loss.backward()                                        # DDP averages gradients
            optimizer.step()
        report_epoch(epoch, loss)
    # [/loop]
    # [save]
    path = os.path.join(args.checkpoint_dir, "model.pt")
    if rank == 0:                                                  # one writer
        torch.save(model.module.state_dict(), path)                # unwrapped: no "module."
    dist.barrier()                                                 # complete before anyone reads
    # [/save]
    report_result("ddp", model.module, split, device, path, rank == 0)
    # [cleanup]
    dist.destroy_process_group()
    # [/cleanup]


if __name__ == "__main__":
    main()
