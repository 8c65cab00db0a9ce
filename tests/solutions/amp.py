"""Reference solution of exercise 06 (the tests run it; the notebook never shows it).

Exercise 06: mixed precision in a DDP training loop. Fill in the four TODO(exercise) blocks.

Run it from notebook 06, or from the repository root::

    python -m ddplab launch --nproc-per-node 2 exercises/amp.py
    torchrun --standalone --nproc-per-node 2 exercises/amp.py

and hand the launch's result to the judge: ``ddplab.check("06", result)``.

What to write (PyTorch's AMP recipe, with today's names):

1. the autocast dtype for this process's device: ``torch.bfloat16`` on a CPU (CPU autocast
   computes in bfloat16), ``torch.float16`` on a CUDA GPU;
2. a ``torch.amp.GradScaler`` for ``device.type`` that is enabled only when the dtype is
   float16: fp16 gradients underflow without loss scaling, bf16 has float32's range and
   needs none (a disabled scaler passes everything through unchanged);
3. the forward pass *and the loss* inside ``with torch.autocast(device.type, dtype=...)``;
4. ``backward()`` on the scaled loss, then the optimizer step and the scale update through the
   scaler.

The fixed part of this file watches the run and reports facts (``metric`` events, one per fact
and rank): whether every forward pass ran under autocast and in which dtype, the dtypes of the
weights, gradients and loss, every step's loss, and the state of the scaler. The judge reads
those facts; nothing here is judged by its text.

Lesson: 06.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddplab import data, dist, events, models


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="exercises/amp.py", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=24, help="optimizer steps per rank")
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


class Watch:
    """Record, at every forward pass of ``layer``, whether autocast was on and what came out."""

    def __init__(self, layer: nn.Module, device_type: str) -> None:
        self.device_type = device_type
        self.forwards = 0
        self.under_autocast = 0
        self.autocast_dtypes: set[str] = set()
        self.output_dtypes: set[str] = set()
        layer.register_forward_hook(self.hook)

    def hook(self, _module: nn.Module, _inputs: Any, output: torch.Tensor) -> None:
        self.forwards += 1
        if torch.is_autocast_enabled(self.device_type):
            self.under_autocast += 1
            self.autocast_dtypes.add(name(torch.get_autocast_dtype(self.device_type)))
        self.output_dtypes.add(name(output.dtype))


def name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def scaler_facts(scaler: Any) -> dict[str, Any]:
    """What the learner's scaler is now: enabled or not, its scale and growth tracker.

    ``update()`` counts good steps in the growth tracker and halves the scale after an
    overflow, so a scaler that really stepped and updated differs from a fresh one.
    """
    if not isinstance(scaler, torch.amp.GradScaler):
        return {"exists": scaler is not None, "enabled": False, "type": type(scaler).__name__}
    state = scaler.state_dict()  # {} when disabled
    return {"exists": True, "enabled": scaler.is_enabled(), "type": type(scaler).__name__,
            "scale": state.get("scale"), "growth_tracker": state.get("_growth_tracker")}


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)

    # setup: one process per device (gloo and the CPU here, nccl and cuda:<local_rank> on GPUs)
    info = dist.setup()
    device = info.device

    # data: this rank's share of the digits training set, already on the device
    split = data.load_dataset("digits")
    loader = data.make_loader(split.train, args.batch_size, num_replicas=info.world_size,
                              rank=info.rank, seed=args.seed, device=device,
                              batch_transform=split.batch_transform)

    # model: same seed on every rank, float32 weights, wrapped in DDP
    torch.manual_seed(args.seed)
    net = models.build_model("cnn", split.num_classes, split.in_channels).to(device)
    watch = Watch(net[0], device.type)  # the first convolution: on autocast's list
    model = DDP(net, device_ids=info.device_ids) if info.world_size > 1 else net
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    # 1. CPU autocast computes in bfloat16; CUDA autocast in float16 (its default)
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16

    # 2. only float16 needs loss scaling; a disabled scaler passes everything through
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)

    scaler_before = scaler_facts(scaler)
    losses: list[float] = []
    loss = torch.zeros(())
    epoch = 0
    while len(losses) < args.steps:
        loader.set_epoch(epoch)
        for inputs, labels in loader:
            if len(losses) == args.steps:
                break
            optimizer.zero_grad(set_to_none=True)

            # 3. forward and loss under autocast; backward outside it
            with torch.autocast(device.type, dtype=amp_dtype):
                output = model(inputs)
                loss = F.cross_entropy(output, labels)

            # 4. scale the loss, step (skipped after an overflow), update the scale
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()

            losses.append(float(loss.detach().float()))
        epoch += 1

    # report what happened (the judge reads these events)
    grad = next(p.grad for p in net.parameters() if p.grad is not None)
    facts = {
        "device_type": device.type, "forwards": watch.forwards,
        "forwards_under_autocast": watch.under_autocast,
        "autocast_dtypes": sorted(watch.autocast_dtypes),
        "layer_output_dtypes": sorted(watch.output_dtypes),
        "weight_dtype": name(next(net.parameters()).dtype), "grad_dtype": name(grad.dtype),
        "loss_dtype": name(loss.dtype), "losses": losses,
        "scaler_before": scaler_before, "scaler": scaler_facts(scaler),
    }
    for key, value in facts.items():
        events.emit("metric", name=key, value=value)
    print(f"rank {info.rank}: {len(losses)} steps on {device}, loss {losses[0]:.3f} -> "
          f"{losses[-1]:.3f}, autocast in {watch.under_autocast}/{watch.forwards} forwards "
          f"{sorted(watch.autocast_dtypes)}, scaler {facts['scaler']}", flush=True)

    # cleanup
    dist.cleanup()


if __name__ == "__main__":
    main()
