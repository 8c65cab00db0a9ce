"""Model parallel by hand: a model's layers split over processes, activations sent forward and
gradients sent back with send/recv, and micro-batches to shrink the pipeline's idle "bubble".

Run it::

    torchrun --nproc-per-node 2 -m ddplab.workers.pipeline
    python -m ddplab launch --nproc-per-node 2 ddplab.workers.pipeline --micro-batches 1 2 4 8

Rank r holds stage r: a contiguous slice of the MLP's layers (the first stage also holds the
input layer, the last one the head and the loss). One training step runs the GPipe schedule:
every micro-batch forward through all stages, then every micro-batch backward in reverse order;
a stage sends its output to the next rank and, in backward, the gradient of its input to the
previous rank. For each ``--micro-batches`` value the step is timed ``--repeats`` times (after
one warm-up step) and the least disturbed run (the shortest) is reported.

To check the split, every rank also builds the unsplit model and runs the same batch through it
(a real pipeline never would: that is what it is there to avoid).

Events:

- ``pipeline`` (every rank, one per micro-batch count): ``micro_batches``, ``stages``,
  ``grad_error`` (largest difference between this stage's gradients and the unsplit model's),
  ``output_error`` (last rank: outputs against the unsplit model's; None elsewhere),
  ``param_bytes`` (this stage's weights), ``full_param_bytes`` (the whole model's) and
  ``bytes_sent`` (activations and gradients this rank sent in one step).
- ``span`` (every rank, one per micro-batch, phase and micro-batch count): ``micro_batches``,
  ``micro``, ``phase`` (``forward`` or ``backward``), ``start`` and ``end`` in seconds since
  the step began (all ranks leave a barrier together just before).
- ``library`` (every rank, with ``--library``): the same check for
  ``torch.distributed.pipelining``'s ``ScheduleGPipe`` (torch >= 2.4): ``output_error``,
  ``grad_error``; ``available`` False when the installed torch lacks it.

Lesson: 11.
"""

from __future__ import annotations

import argparse
import copy
import inspect
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as torch_dist
import torch.nn.functional as F
from torch import nn

from ddplab import data, dist, events
from ddplab.pipelining import Timeline, backward, forward


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the worker's command line (see ``--help``)."""
    p = argparse.ArgumentParser(prog="python -m ddplab.workers.pipeline",
                                description=__doc__.split("\n")[0])
    p.add_argument("--micro-batches", type=int, nargs="+", default=[1, 4],
                   help="micro-batch counts to run (each divides the batch)")
    p.add_argument("--dataset", choices=("digits", "cifar10"), default="digits")
    p.add_argument("--data-root", default="data", help="where CIFAR-10 lives")
    p.add_argument("--batch-size", type=int, default=256, help="the whole batch of one step")
    p.add_argument("--hidden", type=int, default=512, help="width of the hidden layers")
    p.add_argument("--depth", type=int, default=4,
                   help="hidden-to-hidden layers, shared equally by the stages")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per micro-batch count")
    p.add_argument("--library", action="store_true",
                   help="also check torch.distributed.pipelining's ScheduleGPipe")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    uneven = [m for m in args.micro_batches if m < 1 or args.batch_size % m]
    if uneven:
        p.error(f"--micro-batches {uneven} do not divide --batch-size {args.batch_size}: "
                "pick divisors, so that every micro-batch has the same size.")
    return args


# [split]
def build_model(inputs: int, hidden: int, depth: int, classes: int) -> nn.Sequential:
    """The unsplit model: an input layer, ``depth`` hidden blocks and a head."""
    def block(n_in: int, n_out: int) -> nn.Sequential:
        return nn.Sequential(nn.Linear(n_in, n_out), nn.ReLU())
    return nn.Sequential(nn.Sequential(nn.Flatten(), block(inputs, hidden)),
                         *[block(hidden, hidden) for _ in range(depth)],
                         nn.Linear(hidden, classes))


def stage_layers(model: nn.Sequential, rank: int, stages: int) -> list[nn.Module]:
    """Stage ``rank`` of ``stages``: its share of the hidden blocks (plus input layer or head)."""
    stem, *blocks, head = model
    if len(blocks) % stages:
        raise SystemExit(f"--depth {len(blocks)} does not divide into {stages} stages: pick a "
                         f"multiple of the number of processes.")
    per_stage = len(blocks) // stages
    first, last = rank == 0, rank == stages - 1
    return [*([stem] if first else []), *blocks[rank * per_stage:(rank + 1) * per_stage],
            *([head] if last else [])]


def split_model(model: nn.Sequential, rank: int, stages: int) -> nn.Sequential:
    """A copy of stage ``rank``'s layers: all this process keeps of the model."""
    return copy.deepcopy(nn.Sequential(*stage_layers(model, rank, stages)))
# [/split]




def train_step(stage: nn.Module, x: torch.Tensor, y: torch.Tensor, micro_batches: int,
               hidden: int, info: dist.DistInfo) -> tuple[list, list[dict[str, Any]], int]:
    """One pipelined step (gradients land in ``stage``).

    Returns:
        This stage's outputs, the timeline's spans and the bytes this rank sent (activations
        to the next stage, gradients to the previous one).
    """
    stage.zero_grad(set_to_none=True)
    dist.barrier()                                   # start the clocks together
    timeline = Timeline(info.device)
    inputs, outputs = forward(stage, list(x.chunk(micro_batches)), hidden, info, timeline)
    backward(inputs, outputs, list(y.chunk(micro_batches)), info, timeline)
    sent = [] if info.rank == info.world_size - 1 else outputs
    sent += [] if info.rank == 0 else [t.grad for t in inputs]
    return outputs, timeline.spans, sum(t.numel() * t.element_size() for t in sent)


def max_error(mine: Sequence[torch.Tensor], reference: Sequence[torch.Tensor]) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(mine, reference))


def param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def reference(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, info: dist.DistInfo
              ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The unsplit model's output on the whole batch, and its gradients of this rank's layers."""
    model.zero_grad(set_to_none=True)
    out = model(x)
    F.cross_entropy(out, y).backward()
    mine = nn.Sequential(*stage_layers(model, info.rank, info.world_size))
    return out.detach(), [p.grad.clone() for p in mine.parameters()]


# [library-loss]
def library_loss(micro_batches: int) -> tuple[Callable[..., torch.Tensor], dict[str, Any]]:
    """``ScheduleGPipe``'s loss function and options for the whole batch's mean loss."""
    from torch.distributed.pipelining import ScheduleGPipe

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # the whole batch's mean, as the micro-batches are equal (the batch divides by them)
        return F.cross_entropy(out, target) / micro_batches

    # torch 2.6 sums the micro-batches' gradients; later versions divide by their number
    # unless told not to (scale_grads=False), so the loss above is right for both.
    unscaled = {"scale_grads": False} \
        if "scale_grads" in inspect.signature(ScheduleGPipe).parameters else {}
    return loss_fn, unscaled
# [/library-loss]


def run_library(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, micro_batches: int,
                info: dist.DistInfo) -> dict[str, Any]:
    """The same split and step with ``torch.distributed.pipelining`` (GPipe schedule)."""
    try:
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    except ImportError:  # torch < 2.4
        return events.emit("library", available=False)
    loss_fn, options = library_loss(micro_batches)        # shown after exercise 1's verdict
    # [library]
    stage_module = split_model(model, info.rank, info.world_size)
    stage = PipelineStage(stage_module, info.rank, info.world_size, info.device)
    schedule = ScheduleGPipe(stage, n_microbatches=micro_batches, loss_fn=loss_fn, **options)
    last = info.rank == info.world_size - 1
    if info.rank == 0:
        out = schedule.step(x)
    elif last:
        out = schedule.step(target=y)
    else:
        out = schedule.step()
    # [/library]
    ref_out, wanted = reference(model, x, y, info)
    grads = [p.grad for p in stage_module.parameters()]
    return events.emit("library", available=True, micro_batches=micro_batches,
                       output_error=max_error([out], [ref_out]) if last else None,
                       grad_error=max_error(grads, wanted))


def main(argv: Optional[Sequence[str]] = None) -> list[dict[str, Any]]:
    """Run a pipelined step for each micro-batch count; return this rank's ``pipeline`` events."""
    args = parse_args(argv)
    info = dist.setup()
    if info.world_size < 2:
        raise SystemExit("a pipeline needs at least 2 processes: torchrun --nproc-per-node 2 ...")
    split = data.load_dataset(args.dataset, root=args.data_root)
    images, labels = split.train.tensors
    x, y = images[:args.batch_size].to(info.device), labels[:args.batch_size].to(info.device)
    if split.batch_transform is not None:
        x = split.batch_transform(x)

    # [model]
    torch.manual_seed(args.seed)            # every rank builds the same model ...
    model = build_model(x[0].numel(), args.hidden, args.depth, split.num_classes).to(info.device)
    stage = split_model(model, info.rank, info.world_size)   # ... and keeps only its stage
    # [/model]
    ref_out, wanted = reference(model, x, y, info)

    train_step(stage, x, y, max(args.micro_batches), args.hidden, info)   # warm-up
    found = []
    for micro_batches in args.micro_batches:
        runs = [train_step(stage, x, y, micro_batches, args.hidden, info)
                for _ in range(args.repeats)]
        outputs, spans, sent = min(runs, key=lambda run: _makespan(run[1], info))
        last = info.rank == info.world_size - 1
        for span in spans:
            events.emit("span", micro_batches=micro_batches, **span)
        found.append(events.emit(
            "pipeline", micro_batches=micro_batches, stages=info.world_size,
            output_error=max_error([torch.cat(outputs).detach()], [ref_out]) if last else None,
            grad_error=max_error([p.grad for p in stage.parameters()], wanted),
            param_bytes=param_bytes(stage), full_param_bytes=param_bytes(model),
            bytes_sent=sent))
    if args.library:
        run_library(model, x, y, max(args.micro_batches), info)
    dist.print0(f"pipeline of {info.world_size} stages, micro-batches {args.micro_batches}")
    dist.cleanup()
    return found


def _makespan(spans: list[dict[str, Any]], info: dist.DistInfo) -> float:
    """The step's duration over all ranks (so that every rank keeps the same run)."""
    t = torch.tensor([max(s["end"] for s in spans)], dtype=torch.float64, device=info.device)
    torch_dist.all_reduce(t, op=torch_dist.ReduceOp.MAX)
    return float(t.item())


if __name__ == "__main__":
    main()
