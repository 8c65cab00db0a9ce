"""Exercise 06: mixed precision with gradient clipping in a DDP training loop. Three functions.

Run it from notebook 06 (about 10 s; a hang is ended after 60 s, and the judge says where each
rank waited), or from the repository root::

    python -m ddplab launch --nproc-per-node 2 --timeout 60 exercises/amp.py
    torchrun --standalone --nproc-per-node 2 exercises/amp.py

and hand the launch's result to the judge: ``ddplab.check("06", result)``.

The goal: train with automatic mixed precision, correct on a CPU and on a CUDA GPU alike, and
clip the gradients to a total norm of ``max_norm`` on the way, as large models are trained.
Notebook 06 showed the plain AMP step (``torch.autocast`` and ``torch.amp.GradScaler``); adding
clipping to it is where it goes wrong: until the scaler unscales them, the gradients are
multiplied by the scale (65536 to start), so ``max_norm`` must be applied to the true ones.
Write the three functions marked ``TODO(exercise)`` from their docstrings. Look up in PyTorch's
documentation: "Automatic Mixed Precision package - torch.amp" (which dtype autocast uses on
each device type; the GradScaler's methods) and the "CUDA Automatic Mixed Precision examples"
(its section "Working with Unscaled Gradients", gradient clipping).

The fixed part of this file watches the run and reports facts (``metric`` events, one per fact
and rank): whether every forward pass ran under autocast and in which dtype, the dtypes of the
weights, gradients and loss, every step's loss, which of the scaler's methods each step called
and in which order, and the norm of the gradients the optimizer stepped with. Where the run's
own scaler is off (bfloat16 needs none), a few more steps run with one on, as float16 on a GPU
has it, so the clipping is judged on every device. The judge reads those facts; nothing here is
judged by its text.

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

#: Steps run with a scaler on (at the scale a float16 run starts with) after the run's own.
PROBE_STEPS = 4


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="exercises/amp.py", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=24, help="optimizer steps per rank")
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--max-norm", type=float, default=0.5, help="clip the gradients' total norm")
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


def grad_norm(model: nn.Module) -> Optional[float]:
    """The 2-norm of all the gradients taken together (one vector); None if there are none."""
    grads = [p.grad.detach().float() for p in model.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) if grads \
        else None


class CountingScaler(torch.amp.GradScaler):
    """A GradScaler that records which of its methods each step called, in order (for the judge).

    The fixed part hands your ``train_step`` one of these, set up like the scaler your
    ``make_scaler`` built (or switched on, for the extra steps); it behaves exactly like it.
    """

    def __init__(self, like: torch.amp.GradScaler, device_type: str, on: bool = False) -> None:
        super().__init__(device_type, enabled=on or like.is_enabled())
        if like.is_enabled() and not on:
            self.load_state_dict(like.state_dict())
        self.calls = {"scale": 0, "unscale_": 0, "step": 0, "update": 0}
        self.order: list[str] = []   # this step's calls; the fixed part empties it
        self.stepping = False

    def scale(self, outputs: Any) -> Any:
        self._count("scale")
        return super().scale(outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if not self.stepping:        # step() calls unscale_ itself when you did not
            self._count("unscale_")
        super().unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        self._count("step")
        self.stepping = True
        try:
            return super().step(optimizer, *args, **kwargs)
        finally:
            self.stepping = False

    def update(self, new_scale: Any = None) -> None:
        self._count("update")
        super().update(new_scale)

    def _count(self, call: str) -> None:
        self.calls[call] += 1
        self.order.append(call)


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
               amp_dtype: torch.dtype, max_norm: float) -> torch.Tensor:
    """One optimizer step in mixed precision, with gradient clipping; returns the loss.

    The forward pass and the loss computed under autocast in ``amp_dtype`` on the inputs'
    device type; backward and the optimizer step outside it, through the scaler (on the scaled
    loss; the step skipped after an overflow; the scale updated every step). Before the
    optimizer steps, the gradients are clipped so that their total norm is at most
    ``max_norm``: the norm of the true gradients, whatever the scaler's scale is. The weights
    stay float32: autocast casts copies per operation.
    """
    optimizer.zero_grad(set_to_none=True)
    # TODO(exercise) 3: make this a mixed-precision step that clips the gradients, as the
    # docstring says.
    loss = F.cross_entropy(model(inputs), labels)
    loss.backward()
    optimizer.step()
    return loss


def observed_step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: Any,
                  batch: tuple[torch.Tensor, torch.Tensor], amp_dtype: torch.dtype,
                  max_norm: float, stepped: list[Optional[float]]) -> tuple[Any, dict]:
    """Run ``train_step`` once; return its loss and what the step did (its scaler calls in
    order, the scale, the norm of the gradients the optimizer stepped with and after the step).
    A RuntimeError of the scaler (``unscale_`` twice, or after ``step``) ends the step early."""
    if isinstance(scaler, CountingScaler):
        scaler.order = []
    scale = scaler.get_scale() if isinstance(scaler, torch.amp.GradScaler) and \
        scaler.is_enabled() else 1.0
    stepped.clear()
    loss, raised = None, None
    try:
        loss = train_step(model, optimizer, scaler, *batch, amp_dtype, max_norm)
    except RuntimeError:
        if not isinstance(scaler, CountingScaler) or "unscale_" not in scaler.order:
            raise
        raised = "RuntimeError"
    return loss, {"order": list(getattr(scaler, "order", [])), "scale": scale,
                  "stepped_norm": stepped[0] if stepped else None,
                  "norm_after": grad_norm(model), "raised": raised}


def batches(loader: Any) -> Any:
    """The loader's batches, epoch after epoch, without end."""
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        yield from loader
        epoch += 1


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
    stepped: list[Optional[float]] = []   # the norm of the gradients the optimizer stepped with
    optimizer.register_step_pre_hook(lambda *_: stepped.append(grad_norm(net)))

    amp_dtype = autocast_dtype(device)
    scaler = make_scaler(device, amp_dtype)
    scaler_before = scaler_facts(scaler)
    counted = CountingScaler(scaler, device.type) if isinstance(
        scaler, torch.amp.GradScaler) else scaler
    probe = CountingScaler(scaler, device.type, on=True) if isinstance(
        scaler, torch.amp.GradScaler) and not scaler.is_enabled() else None
    losses: list[float] = []
    steps: list[dict] = []   # what each step with a scaler on did
    loss: Any = torch.zeros(())
    feed = batches(loader)
    for _ in range(args.steps):
        out, step = observed_step(model, optimizer, counted, next(feed), amp_dtype,
                                  args.max_norm, stepped)
        if counted is not None and counted.is_enabled() or step["raised"]:
            steps.append(step)
        if step["raised"]:
            break
        loss = out
        losses.append(float(out.detach().float()))
    for _ in range(PROBE_STEPS if probe and not (steps and steps[-1]["raised"]) else 0):
        steps.append(observed_step(model, optimizer, probe, next(feed), amp_dtype,
                                   args.max_norm, stepped)[1])
        if steps[-1]["raised"]:
            break

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
        "max_norm": args.max_norm, "scaled_steps": steps,
    }
    for key, value in facts.items():
        events.emit("metric", name=key, value=value)
    ends = f"{losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "none"
    print(f"rank {info.rank}: {len(losses)} steps on {device}, loss {ends}, autocast in "
          f"{watch.under_autocast}/{watch.forwards} forwards {sorted(watch.autocast_dtypes)}, "
          f"scaler {facts['scaler']}", flush=True)

    # cleanup
    dist.cleanup()


if __name__ == "__main__":
    main()
