"""Exercise 06: mixed precision in a DDP training loop. Three functions to write.

Run it from notebook 06 (about 10 s; a hang is ended after 60 s, and the judge says where each
rank waited), or from the repository root::

    python -m ddplab launch --nproc-per-node 2 --timeout 60 exercises/amp.py
    torchrun --standalone --nproc-per-node 2 exercises/amp.py

and hand the launch's result to the judge: ``ddplab.check("06", result)``.

The goal: train with automatic mixed precision, the way PyTorch's AMP recipe does it today
(``torch.autocast`` and ``torch.amp.GradScaler``; the older ``torch.cuda.amp`` names are
deprecated), correct on a CPU and on a CUDA GPU alike. Write the three functions marked
``TODO(exercise)`` from their docstrings; notebook 06 showed what each piece does. Look up in
PyTorch's documentation: "Automatic Mixed Precision package - torch.amp" (which dtype autocast
uses on each device type, and which ops it runs in lower precision) and the "CUDA Automatic Mixed
Precision examples" (the order of the scaler's calls in a training step).

The fixed part of this file watches the run and reports facts (``metric`` events, one per fact
and rank): whether every forward pass ran under autocast and in which dtype, the dtypes of the
weights, gradients and loss, every step's loss, and what the scaler was asked to do. The judge
reads those facts; nothing here is judged by its text.

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


class CountingScaler(torch.amp.GradScaler):
    """A GradScaler that counts its ``scale``, ``step`` and ``update`` calls (for the judge).

    The fixed part hands your ``train_step`` one of these, set up like the scaler your
    ``make_scaler`` built; it behaves exactly like that scaler.
    """

    def __init__(self, like: torch.amp.GradScaler, device_type: str) -> None:
        super().__init__(device_type, enabled=like.is_enabled())
        if like.is_enabled():
            self.load_state_dict(like.state_dict())
        self.calls = {"scale": 0, "step": 0, "update": 0}

    def scale(self, outputs: Any) -> Any:
        self.calls["scale"] += 1
        return super().scale(outputs)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        self.calls["step"] += 1
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale: Any = None) -> None:
        self.calls["update"] += 1
        super().update(new_scale)


def scaler_facts(scaler: Any) -> dict[str, Any]:
    """What a scaler is now: enabled or not, its scale and growth tracker, the calls it got.

    ``update()`` counts good steps in the growth tracker and halves the scale after an
    overflow, so a scaler that really stepped and updated differs from a fresh one.
    """
    if not isinstance(scaler, torch.amp.GradScaler):
        return {"exists": scaler is not None, "enabled": False, "type": type(scaler).__name__}
    state = scaler.state_dict()  # {} when disabled
    return {"exists": True, "enabled": scaler.is_enabled(), "type": type(scaler).__name__,
            "scale": state.get("scale"), "growth_tracker": state.get("_growth_tracker"),
            "calls": dict(getattr(scaler, "calls", {}))}


def autocast_dtype(device: torch.device) -> torch.dtype:
    """The dtype autocast should compute in on ``device``: the one autocast uses by default on a
    CPU, and on a CUDA GPU the 16-bit format that needs loss scaling."""
    # TODO(exercise) 1: write this function from its docstring.
    return torch.float32


def make_scaler(device: torch.device, amp_dtype: torch.dtype) -> torch.amp.GradScaler:
    """The gradient scaler for training in ``amp_dtype`` on ``device``.

    Always build one (the same training step then runs on every device); it scales the loss
    only where ``amp_dtype``'s small range makes gradients underflow, and is switched off (and
    passes everything through unchanged) where the dtype does not need it.
    """
    # TODO(exercise) 2: write this function from its docstring.
    return None


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer,
               scaler: torch.amp.GradScaler, inputs: torch.Tensor, labels: torch.Tensor,
               amp_dtype: torch.dtype) -> torch.Tensor:
    """One optimizer step in mixed precision; returns the loss.

    The forward pass and the loss computed under autocast in ``amp_dtype`` on the inputs'
    device type; backward and the optimizer step outside it, through the scaler (on the scaled
    loss; the step skipped after an overflow; the scale updated every step). The weights stay
    float32: autocast casts copies per operation.
    """
    # TODO(exercise) 3: make this step a mixed-precision step, as the docstring says.
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(inputs), labels)
    loss.backward()
    optimizer.step()
    return loss


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

    amp_dtype = autocast_dtype(device)
    scaler = make_scaler(device, amp_dtype)
    scaler_before = scaler_facts(scaler)
    counted = CountingScaler(scaler, device.type) if isinstance(
        scaler, torch.amp.GradScaler) else scaler
    losses: list[float] = []
    loss = torch.zeros(())
    epoch = 0
    while len(losses) < args.steps:
        loader.set_epoch(epoch)
        for inputs, labels in loader:
            if len(losses) == args.steps:
                break
            loss = train_step(model, optimizer, counted, inputs, labels, amp_dtype)
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
        "scaler_before": scaler_before, "scaler": scaler_facts(counted),
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
