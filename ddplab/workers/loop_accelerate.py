"""One training loop, three ways (2/3): Hugging Face Accelerate (the ``bench`` extra).

Run it::

    torchrun --nproc-per-node 2 -m ddplab.workers.loop_accelerate
    accelerate launch --num_processes 2 -m ddplab.workers.loop_accelerate

Needs ``pip install accelerate`` (``pip install -e '.[bench]'``). The same loop as
``loop_ddp.py``, section by section; the comments say what Accelerate does for you.

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
from ddplab.dist import pick_backend
from ddplab.loops import parse_args, report_epoch, report_result

try:
    from accelerate import Accelerator
except ImportError as error:  # pragma: no cover - depends on the extra
    raise SystemExit("this version needs Accelerate: pip install accelerate "
                     "(or pip install -e '.[bench]')") from error


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Setup, data, model, loop, save, cleanup: through an ``Accelerator``."""
    args = parse_args("loop_accelerate", argv)
    # [setup]
    # Reads torchrun's variables, joins the group, picks backend and device. On gloo, cpu=True:
    # the CPU, whatever Accelerate would pick by itself.
    accelerator = Accelerator(cpu=pick_backend() == "gloo")
    device = accelerator.device
    # [/setup]
    # [data]
    split = data.load_dataset("digits", as_tensors=False)
    loader = DataLoader(split.train, batch_size=args.batch_size, shuffle=True)
    # [/data]
    # [model]
    torch.manual_seed(args.seed)
    model = models.build_model("cnn", split.num_classes, split.in_channels)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # Moves the model, wraps it in DDP, shards the loader (a new order every epoch, no
    # set_epoch to forget) and moves each batch to the device.
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    # [/model]
    # [loop]
    for epoch in range(args.epochs):
        for inputs, labels in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(inputs), labels)
            accelerator.backward(loss)            # loss.backward(), scaled under fp16 AMP
            optimizer.step()
        report_epoch(epoch, loss)
    # [/loop]
    # [save]
    path = os.path.join(args.checkpoint_dir, "model.pt")
    accelerator.wait_for_everyone()               # a barrier: every rank is done training
    accelerator.save(accelerator.unwrap_model(model).state_dict(), path)   # rank 0 only
    accelerator.wait_for_everyone()               # complete before anyone reads
    # [/save]
    report_result("accelerate", accelerator.unwrap_model(model), split, device, path,
                  accelerator.is_main_process)
    # [cleanup]
    accelerator.end_training()                    # destroys the process group
    # [/cleanup]


if __name__ == "__main__":
    main()
