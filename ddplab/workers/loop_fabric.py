"""One training loop, three ways (3/3): Lightning Fabric.

Run it::

    torchrun --nproc-per-node 2 -m ddplab.workers.loop_fabric
    fabric run --devices 2 ddplab/workers/loop_fabric.py

Needs ``pip install lightning`` (or only ``lightning-fabric``), which the course's environment
does not install: lesson 07b shows this file but runs it only where Lightning is installed.
Fabric's documentation: https://lightning.ai/docs/fabric/stable/. The same loop as
``loop_ddp.py``, section by section; the comments say what Fabric does for you.

Events: as ``loop_ddp``.

Lesson: 07b.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from ddplab import data, models
from ddplab.loops import parse_args, report_epoch, report_result

try:
    from lightning_fabric import Fabric
except ImportError:  # pragma: no cover - depends on what is installed
    try:
        from lightning.fabric import Fabric
    except ImportError as error:
        raise SystemExit("this version needs Lightning Fabric: pip install lightning "
                         "(or lightning-fabric)") from error


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Setup, data, model, loop, save, cleanup: through ``Fabric``."""
    args = parse_args("loop_fabric", argv)
    # [setup]
    fabric = Fabric(strategy="ddp",         # picks backend and device, joins the group
                    devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                    num_nodes=int(os.environ.get("WORLD_SIZE", "1"))
                    // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    fabric.launch()                         # under torchrun: nothing more to start
    device = fabric.device
    # [/setup]
    # [data]
    split = data.load_dataset("digits", as_tensors=False)
    loader = DataLoader(split.train, batch_size=args.batch_size, shuffle=True)
    loader = fabric.setup_dataloaders(loader)     # DistributedSampler, set_epoch, .to(device)
    # [/data]
    # [model]
    torch.manual_seed(args.seed)
    model = models.build_model("cnn", split.num_classes, split.in_channels)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)   # to the device, wrapped in DDP
    # [/model]
    # [loop]
    for epoch in range(args.epochs):
        for inputs, labels in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(inputs), labels)
            fabric.backward(loss)                 # loss.backward(), scaled under fp16 AMP
            optimizer.step()
        report_epoch(epoch, loss)
    # [/loop]
    # [save]
    path = os.path.join(args.checkpoint_dir, "model.pt")
    fabric.save(path, {"model": model})           # rank 0 writes, unwrapped; then a barrier
    # [/save]
    report_result("fabric", model.module, split, device, path, fabric.global_rank == 0)
    # [cleanup]
    fabric.barrier()                    # Fabric leaves the group to the end of the process
    # [/cleanup]


if __name__ == "__main__":
    main()
