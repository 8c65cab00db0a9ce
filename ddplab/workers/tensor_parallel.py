"""Tensor parallel on device meshes: DeviceMesh, DTensor placements,
ColwiseParallel/RowwiseParallel, and 2-D parallelism (FSDP2 over one mesh dimension, tensor
parallel over the other).

Run it::

    torchrun --nproc-per-node 4 -m ddplab.workers.tensor_parallel
    python -m ddplab launch --nproc-per-node 4 ddplab.workers.tensor_parallel --parts mesh placements
    python -m ddplab launch --nproc-per-node 1 ddplab.workers.tensor_parallel --parts 2d

The parts run one after the other in one job (``--parts``, default all of them):

- ``mesh``: a 1-D mesh over every rank and, with 4 or more (an even number), a 2-D mesh
  ``(dp, tp)``; each rank sums the ranks of its ``tp`` and ``dp`` groups over that group.
- ``placements``: one small tensor as a ``DTensor`` with ``Shard(0)``, ``Shard(1)``,
  ``Replicate()`` and ``Partial()``, what each rank stores, and which collective each
  ``redistribute`` runs; a RowwiseParallel layer's bias.
- ``mlp`` and ``attention``: ``parallelize_module`` with ``ColwiseParallel`` /
  ``RowwiseParallel`` over the 1-D mesh, against the same module unsharded: outputs,
  gradients, bytes per rank, collectives, and the forward time of both.
- ``sp``: sequence parallel on a residual LayerNorm + MLP block (the sequence split over the
  ranks outside the TP region), against the same block unsharded; the same block called with
  the whole sequence (event ``sp_whole``); and section ``mlp``'s
  attention with each of ``q``, ``k``, ``v`` gathering the sequence itself (event
  ``sp_attention``, read only after the notebook's question about it).
- ``2d``: an MLP trained on the digits with TP over ``tp`` and ``fully_shard`` over ``dp``
  (4 or more ranks); alone (1 process) the same MLP trains unsharded on the same global
  batches, the single-process reference.

Events:

- ``mesh`` (every rank): ``mesh_1d``, ``mesh_2d`` (lists of ranks, None below 4 ranks),
  ``coordinate`` (this rank's ``(dp, tp)``), ``tp_group``, ``dp_group``, ``tp_sum``, ``dp_sum``
  (the sums of the ranks over each group, by ``all_reduce`` on it).
- ``placement`` (every rank): ``placement``, ``local`` (what this rank stores, as lists),
  ``full`` (the whole tensor, ``full_tensor()``).
- ``redistribute`` (rank 0): ``source``, ``target``, ``collectives`` (name -> count).
- ``bias`` (every rank): ``bias`` (a RowwiseParallel layer's whole bias) and ``local`` (what
  this rank's output holds at a zero input, before the reduction).
- ``sp`` (every rank): ``module`` (``norm_mlp``: ``x + mlp(norm(x))`` under sequence
  parallel), and ``sp_attention`` (every rank): the attention with q, k, v each
  ``ColwiseParallel(input_layouts=Shard(1))``; both with
  ``local_shape`` and ``shape`` (this rank's input and the whole), ``output_error``,
  ``grad_error`` (every parameter's gradient, gathered) and ``input_grad_error`` (this rank's
  slice of ``x.grad``) against the module run whole in one process, ``forward_collectives``,
  ``backward_collectives``, ``activation_bytes`` (this rank's output) and
  ``whole_activation_bytes`` (the whole output, what plain TP keeps on every rank); for
  ``norm_mlp`` also ``norm_grad_placement`` (the norm's weight
  gradient after backward) and ``norm_summed_collectives`` (turning it whole).
- ``sp_whole`` (every rank): the same block inside ``PrepareModuleInput`` /
  ``PrepareModuleOutput``, called with the whole ``x``: ``in_shape``, ``out_shape``,
  ``output_is_dtensor``, ``output_error``, ``input_grad_error``, ``forward_collectives``,
  ``backward_collectives``.
- ``tp`` (every rank): ``module`` (``mlp`` or ``attention``), ``dims``, ``tp_size``,
  ``output_error``, ``grad_error`` (the parameters') and ``input_grad_error`` (``x.grad``):
  the largest differences from the unsharded module,
  ``param_bytes`` (this rank's), ``full_param_bytes``, ``placements`` (per parameter),
  ``forward_collectives``, ``backward_collectives``, ``activation_bytes`` (one all-reduced
  output), ``forward_ms`` and ``unsharded_forward_ms`` (medians).
- ``loss`` (rank 0, one per step of ``2d``): ``mode`` (``2d`` or ``single``), ``step``,
  ``loss`` (mean over the global batch); ``weights`` (rank 0, at the end): ``mode``,
  ``values`` (every parameter, whole, flattened); ``memory_2d`` (every rank): ``param_bytes``,
  ``full_param_bytes``, ``placements``, ``dims``; ``comm_2d`` (every rank): the first 2-D
  step's ``forward_collectives`` and ``backward_collectives``.
- ``skipped`` (rank 0): ``part``, ``reason``, when a part cannot run here.
- ``plan_try`` (every rank, with ``--mlp-plan``): section ``mlp``'s MLP under the plan given
  on the command line: ``plan``, and either ``error`` (the type and first line of what was
  raised, or the shape of an output that is not the whole) or ``output_error``, ``grad_error``,
  ``input_grad_error`` (of ``x.grad``), ``param_bytes``, ``full_param_bytes``,
  ``forward_collectives``, ``backward_collectives``.

FSDP2 on the CPU needs torch 2.7 (see ``ddplab.sharded``); below, ``2d`` is skipped on
the CPU and says why. Everything else runs on gloo from torch 2.6 on.

Lesson: 12.
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import time
import warnings
from contextlib import nullcontext
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as torch_dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               PrepareModuleOutput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from ddplab import data, dist, events
from ddplab.sharded import collectives, fsdp_problem, fully_shard, local_bytes

PARTS = ("mesh", "placements", "mlp", "attention", "sp", "2d")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the worker's command line (see ``--help``)."""
    p = argparse.ArgumentParser(prog="python -m ddplab.workers.tensor_parallel",
                                description=__doc__.split("\n")[0])
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--dim", type=int, default=16, help="model width (divisible by the ranks)")
    p.add_argument("--hidden", type=int, default=64, help="MLP hidden width (divisible too)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (divisible too)")
    p.add_argument("--batch-size", type=int, default=16,
                   help="the whole batch (2d: split over the dp groups)")
    p.add_argument("--seq", type=int, default=6, help="attention sequence length")
    p.add_argument("--steps", type=int, default=5, help="training steps of the 2d part")
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--repeats", type=int, default=20, help="timed forwards per module")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mlp-plan", nargs="+", metavar="LAYER=STYLE", default=None,
                   help="with --parts mlp: try this plan on the MLP instead (layers up, down; "
                        f"styles {', '.join(STYLES)})")
    return p.parse_args(argv)


# [mesh]
def make_meshes(info: dist.DistInfo) -> tuple[DeviceMesh, Optional[DeviceMesh]]:
    """A 1-D mesh over every rank, and a 2-D ``(dp, tp)`` mesh of ``(world / 2, 2)`` ranks."""
    mesh_1d = init_device_mesh(info.device.type, (info.world_size,), mesh_dim_names=("tp",))
    if info.world_size < 4 or info.world_size % 2:
        return mesh_1d, None
    mesh_2d = init_device_mesh(info.device.type, (info.world_size // 2, 2),
                               mesh_dim_names=("dp", "tp"))   # a row per dp index: the tp groups
    return mesh_1d, mesh_2d


def show_meshes(mesh_1d: DeviceMesh, mesh_2d: Optional[DeviceMesh], info: dist.DistInfo) -> None:
    """Each rank's place in the meshes, and a sum of ranks over each of its groups."""
    found: dict[str, Any] = {"mesh_1d": mesh_1d.mesh.tolist(), "mesh_2d": None}
    if mesh_2d is not None:
        found.update(mesh_2d=mesh_2d.mesh.tolist(), coordinate=mesh_2d.get_coordinate())
        for name in ("tp", "dp"):
            group = mesh_2d[name]                               # a 1-D sub-mesh: my row or column
            mine = torch.tensor([float(info.rank)], device=info.device)
            torch_dist.all_reduce(mine, group=group.get_group())  # over that group only
            found.update({f"{name}_group": group.mesh.tolist(), f"{name}_sum": mine.item()})
    events.emit("mesh", **found)
# [/mesh]


# [placements]
def show_placements(mesh: DeviceMesh, info: dist.DistInfo) -> None:
    """One tensor under each placement: what every rank stores, and the whole it stands for."""
    n = info.world_size
    whole = torch.arange(2 * n * n, dtype=torch.float32, device=info.device).reshape(2 * n, n)
    for name, placement in (("Shard(0)", Shard(0)), ("Shard(1)", Shard(1)),
                            ("Replicate()", Replicate())):
        tensor = distribute_tensor(whole, mesh, [placement])     # each keeps its piece
        events.emit("placement", placement=name, local=tensor.to_local().tolist(),
                    full=tensor.full_tensor().tolist())
    # Partial: every rank holds a summand; the tensor is their sum, not yet computed. Here each
    # holds whole / n (quarters of integers on 4 ranks: exact), so the sum is the same whole.
    mine = whole / n
    partial = DTensor.from_local(mine, mesh, [Partial()])
    events.emit("placement", placement="Partial()", local=mine.tolist(),
                full=partial.full_tensor().tolist())
    sharded = distribute_tensor(whole, mesh, [Shard(0)])
    replicated = distribute_tensor(whole, mesh, [Replicate()])
    moves = [("Partial()", partial, "Replicate()", Replicate()),
             ("Partial()", partial, "Shard(0)", Shard(0)),
             ("Shard(0)", sharded, "Replicate()", Replicate()),
             ("Shard(0)", sharded, "Shard(1)", Shard(1)),
             ("Replicate()", replicated, "Shard(0)", Shard(0))]
    for source, tensor, target, placement in moves:
        with collectives() as sent:
            tensor.redistribute(mesh, [placement]).to_local()
        if info.is_main:
            events.emit("redistribute", source=source, target=target, collectives=sent)


def rowwise_bias(mesh: DeviceMesh, info: dist.DistInfo) -> None:
    """What each rank adds of a RowwiseParallel layer's bias: its output before the reduction."""
    layer = nn.Linear(2 * info.world_size, 3).to(info.device)
    bias = layer.bias.detach().clone()
    layer = parallelize_module(layer, mesh, RowwiseParallel(output_layouts=Partial()))
    zeros = torch.zeros(1, 2, device=info.device)              # this rank's slice of a zero input
    events.emit("bias", bias=bias.tolist(), local=layer(zeros)[0].tolist())
# [/placements]


# [modules]
class MLP(nn.Module):
    """A transformer's feed-forward block: ``dim -> hidden -> dim``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(x)))


class Attention(nn.Module):
    """Multi-head causal self-attention, without biases (as in Llama)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # -1, not the number of heads: under TP each rank holds only its share of the heads.
        q, k, v = (proj(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))   # (batch, heads, seq, head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).flatten(2))        # the heads side by side again


# Column-wise first (each rank its slice of outputs: hidden units, or heads), row-wise last
# (each rank multiplies its slice; the partial outputs are summed by one all-reduce).
PLANS = {"mlp": {"up": ColwiseParallel(), "down": RowwiseParallel()},
         "attention": {"q": ColwiseParallel(), "k": ColwiseParallel(),
                       "v": ColwiseParallel(), "out": RowwiseParallel()}}
# [/modules]


# [try_plan]
STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
          "colwise_gathered": lambda: ColwiseParallel(output_layouts=Replicate())}


def try_plan(plan: dict[str, str], mesh: DeviceMesh, info: dist.DistInfo,
             args: argparse.Namespace) -> None:
    """Section ``mlp``'s MLP under ``plan`` (layer -> style name, or "none"): right or not?"""
    reference = build("mlp", args, info.device)
    styles = {layer: STYLES[style]() for layer, style in plan.items() if style != "none"}
    model = parallelize_module(build("mlp", args, info.device), mesh, styles)
    torch.manual_seed(args.seed + 1)
    x = torch.randn(args.batch_size, args.dim, device=info.device, requires_grad=True)
    x_reference = x.detach().clone().requires_grad_(True)     # the same input, its own gradient
    try:
        with collectives() as forward:
            out = model(x)
        with collectives() as backward:
            out.pow(2).mean().backward()
    except Exception as error:              # a plan whose layouts do not fit raises here
        said = (str(error).strip().splitlines() or [""])[0][:200]
        events.emit("plan_try", plan=plan, error=f"{type(error).__name__}: {said}")
        return
    whole = reference(x_reference)
    if out.shape != whole.shape:            # e.g. "down": "colwise": each rank returns its slice
        events.emit("plan_try", plan=plan, error=f"each rank returned an output of shape "
                    f"{tuple(out.shape)}, not the MLP's {tuple(whole.shape)}: a slice of it")
        return
    whole.pow(2).mean().backward()
    pairs = zip(model.parameters(), reference.parameters())
    grads = [largest_gap(p.grad, r.grad) for p, r in pairs]
    events.emit("plan_try", plan=plan, output_error=largest_gap(out, reference(x)),
                grad_error=max(grads), input_grad_error=largest_gap(x.grad, x_reference.grad),
                param_bytes=local_bytes(model.parameters()),
                full_param_bytes=local_bytes(reference.parameters()),
                forward_collectives=forward, backward_collectives=backward)
# [/try_plan]


def build(name: str, args: argparse.Namespace, device: torch.device) -> nn.Module:
    """The module called ``name``, from the seed (so every rank builds the same weights)."""
    torch.manual_seed(args.seed)
    module = MLP(args.dim, args.hidden) if name == "mlp" else Attention(args.dim, args.heads)
    return module.to(device)


def median_ms(run: Callable[[], Any], repeats: int) -> float:
    """Median wall time of ``run()`` in milliseconds, after one warm-up call."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def largest_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference between two tensors (DTensors are gathered first)."""
    a = a.full_tensor() if isinstance(a, DTensor) else a
    return (a - b).abs().max().item()


# [tp]
def tensor_parallel(name: str, mesh: DeviceMesh, info: dist.DistInfo,
                    args: argparse.Namespace) -> dict[str, Any]:
    """Shard module ``name`` over ``mesh`` and compare it with the unsharded module."""
    reference = build(name, args, info.device)                 # the same weights, whole
    full_param_bytes = local_bytes(reference.parameters())
    model = parallelize_module(build(name, args, info.device), mesh, PLANS[name])
    torch.manual_seed(args.seed + 1)                           # the same input on every rank
    shape = (args.batch_size, args.dim) if name == "mlp" else (args.batch_size, args.seq, args.dim)
    x = torch.randn(*shape, device=info.device, requires_grad=True)
    x_reference = x.detach().clone().requires_grad_(True)     # the same input, its own gradient
    with collectives() as forward:
        out = model(x)
    with collectives() as backward:
        out.pow(2).mean().backward()
    reference(x_reference).pow(2).mean().backward()
    pairs = zip(model.parameters(), reference.parameters())
    grads = [largest_gap(p.grad, r.grad) for p, r in pairs]
    with torch.no_grad():
        forward_ms = median_ms(lambda: model(x), args.repeats)
        unsharded_ms = median_ms(lambda: reference(x), args.repeats)
    return events.emit(
        "tp", module=name, tp_size=mesh.size(), output_error=largest_gap(out, reference(x)),
        grad_error=max(grads), input_grad_error=largest_gap(x.grad, x_reference.grad),
        param_bytes=local_bytes(model.parameters()),
        full_param_bytes=full_param_bytes, activation_bytes=out.numel() * out.element_size(),
        placements={n: str(p.placements) for n, p in model.named_parameters()},
        forward_collectives=forward, backward_collectives=backward, forward_ms=forward_ms,
        unsharded_forward_ms=unsharded_ms,
        dims={"dim": args.dim, "hidden": args.hidden, "heads": args.heads})
# [/tp]


def attention_input_once(mesh: DeviceMesh, info: dist.DistInfo,
                         args: argparse.Namespace) -> dict[str, Any]:
    """Section tp's attention with its input declared once, on the block (PrepareModuleInput):
    count the collectives of one forward and one backward."""
    plan = {"": PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Replicate()),
            **PLANS["attention"]}
    model = parallelize_module(build("attention", args, info.device), mesh, plan)
    torch.manual_seed(args.seed + 1)
    x = torch.randn(args.batch_size, args.seq, args.dim, device=info.device, requires_grad=True)
    with collectives() as forward:
        out = model(x)
    with collectives() as backward:
        out.pow(2).mean().backward()
    return events.emit("tp_input_once", forward_collectives=forward,
                       backward_collectives=backward)


# [sp]
class NormMLP(nn.Module):
    """A residual block: ``x + mlp(norm(x))``, the norm a LayerNorm, the MLP section mlp's."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(dim), MLP(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))      # the residual sum acts on this rank's tokens


# Outside the TP region each rank holds 1/N of the tokens (Shard(1): dimension 1 is the
# sequence); up gathers the whole sequence, down hands back this rank's tokens, summed.
SP_PLAN = {"norm": SequenceParallel(),
           "mlp.up": ColwiseParallel(input_layouts=Shard(1)),
           "mlp.down": RowwiseParallel(output_layouts=Shard(1))}


def sequence_parallel(mesh: DeviceMesh, info: dist.DistInfo, args: argparse.Namespace) -> None:
    """NormMLP under SP_PLAN, each rank fed its slice of the sequence, against the whole."""
    torch.manual_seed(args.seed)
    reference = NormMLP(args.dim, args.hidden).to(info.device)
    model = parallelize_module(copy.deepcopy(reference), mesh, SP_PLAN)
    found = run_on_slices(model, reference, mesh, info, args)
    with collectives() as summed:
        model.norm.weight.grad.full_tensor()   # what the optimizer needs: the whole gradient
    events.emit("sp", module="norm_mlp", **found, norm_summed_collectives=summed,
                norm_grad_placement=str(list(model.norm.weight.grad.placements)))
# [/sp]


def sequence_parallel_whole(mesh: DeviceMesh, info: dist.DistInfo,
                            args: argparse.Namespace) -> None:
    """NormMLP under SP_PLAN, called with the whole sequence and returning it whole."""
    torch.manual_seed(args.seed)
    reference = NormMLP(args.dim, args.hidden).to(info.device)
    # [prepare]
    model = parallelize_module(copy.deepcopy(reference), mesh, SP_PLAN)
    # the block receives x whole (Replicate) and needs its tokens (Shard(1)): a local slice
    parallelize_module(model, mesh, PrepareModuleInput(
        input_layouts=Replicate(), desired_input_layouts=Shard(1), use_local_output=True))
    # it returns its tokens (Shard(1)); the caller gets the whole output: an all-gather
    parallelize_module(model, mesh, PrepareModuleOutput(
        output_layouts=Shard(1), desired_output_layouts=Replicate()))
    # [/prepare]
    torch.manual_seed(args.seed + 1)                            # the same input on every rank
    x = torch.randn(args.batch_size, 2 * mesh.size(), args.dim, device=info.device)
    x_reference = x.clone().requires_grad_(True)
    x.requires_grad_(True)
    with collectives() as forward:
        out = model(x)                                          # whole in, whole out
    with collectives() as backward:
        out.pow(2).sum().backward()
    reference(x_reference).pow(2).sum().backward()
    events.emit("sp_whole", module="norm_mlp", in_shape=list(x.shape), out_shape=list(out.shape),
                output_error=largest_gap(out, reference(x_reference)),
                input_grad_error=largest_gap(x.grad, x_reference.grad),
                output_is_dtensor=isinstance(out, DTensor),
                forward_collectives=forward, backward_collectives=backward)


def sequence_parallel_attention(mesh: DeviceMesh, info: dist.DistInfo,
                                args: argparse.Namespace) -> None:
    """Section attention's module, each of q, k and v given its input as slices of the sequence."""
    reference = build("attention", args, info.device)
    plan = {name: ColwiseParallel(input_layouts=Shard(1)) for name in ("q", "k", "v")}
    plan["out"] = RowwiseParallel(output_layouts=Shard(1))
    model = parallelize_module(copy.deepcopy(reference), mesh, plan)
    events.emit("sp_attention", module="attention",
                **run_on_slices(model, reference, mesh, info, args))


def run_on_slices(model: nn.Module, reference: nn.Module, mesh: DeviceMesh,
                  info: dist.DistInfo, args: argparse.Namespace) -> dict[str, Any]:
    """Feed ``model`` this rank's tokens and ``reference`` all of them; compare, count."""
    torch.manual_seed(args.seed + 1)                            # the same input on every rank
    x = torch.randn(args.batch_size, 2 * mesh.size(), args.dim, device=info.device)
    mine = x.chunk(mesh.size(), dim=1)[mesh.get_local_rank()].clone().requires_grad_(True)
    x.requires_grad_(True)
    with collectives() as forward:
        out = model(mine)                                       # this rank's tokens, out
    with collectives() as backward:
        out.pow(2).sum().backward()
    expected = reference(x)
    expected.pow(2).sum().backward()
    rank = mesh.get_local_rank()
    pairs = zip(model.parameters(), reference.parameters())
    grads = [largest_gap(p.grad, r.grad) for p, r in pairs]
    return {"local_shape": list(mine.shape), "shape": list(x.shape),
            "output_error": largest_gap(out, expected.chunk(mesh.size(), dim=1)[rank]),
            "grad_error": max(grads),
            "input_grad_error": largest_gap(mine.grad, x.grad.chunk(mesh.size(), dim=1)[rank]),
            "forward_collectives": forward, "backward_collectives": backward,
            "activation_bytes": out.numel() * out.element_size(),
            "whole_activation_bytes": expected.numel() * expected.element_size()}


# [2d]
def build_classifier(args: argparse.Namespace, split: data.DataSplit,
                     device: torch.device) -> nn.Sequential:
    """A two-layer MLP for the digits: ``64 -> hidden -> 10``, from the seed."""
    torch.manual_seed(args.seed)
    inputs = split.train.tensors[0][0].numel()
    return nn.Sequential(nn.Flatten(), nn.Linear(inputs, args.hidden), nn.ReLU(),
                         nn.Linear(args.hidden, split.num_classes)).to(device)


def shard_2d(model: nn.Sequential, mesh_2d: DeviceMesh) -> nn.Sequential:
    """TP inside each ``tp`` group, then FSDP2 over the ``dp`` groups: 2-D parallelism."""
    parallelize_module(model, mesh_2d["tp"], {"1": ColwiseParallel(), "3": RowwiseParallel()})
    return fully_shard(model, mesh=mesh_2d["dp"])               # shards the TP shards again


def train_2d(mesh_2d: Optional[DeviceMesh], info: dist.DistInfo,
             args: argparse.Namespace) -> None:
    """Train on the digits: 2-D over ``mesh_2d``, or unsharded when this is one process."""
    split = data.load_dataset("digits")
    model = build_classifier(args, split, info.device)
    full_param_bytes = local_bytes(model.parameters())
    dp_size, dp_rank, mode = 1, 0, "single" if mesh_2d is None else "2d"
    if args.batch_size % (1 if mesh_2d is None else mesh_2d["dp"].size()):
        raise SystemExit(f"--batch-size {args.batch_size} does not divide by the dp groups "
                         f"({mesh_2d['dp'].size()}): pick a multiple.")
    if mesh_2d is not None:
        model = shard_2d(model, mesh_2d)
        dp_size, dp_rank = mesh_2d["dp"].size(), mesh_2d.get_coordinate()[0]
        events.emit("memory_2d", param_bytes=local_bytes(model.parameters()),
                    full_param_bytes=full_param_bytes,
                    dims={name: mesh_2d[name].size() for name in ("dp", "tp")},
                    placements={n: str(p.placements) for n, p in model.named_parameters()})
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    images, labels = split.train.tensors
    for step in range(args.steps):                             # the same global batches alone
        rows = torch.arange(step * args.batch_size, (step + 1) * args.batch_size) % len(images)
        mine = rows.view(dp_size, -1)[dp_rank]                 # my dp group's share; both TP
        x, y = images[mine].to(info.device), labels[mine].to(info.device)   # ranks get it
        first = step == 0 and mesh_2d is not None               # its collectives counted
        with collectives() if first else nullcontext({}) as forward, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module")   # a view: unchanged
            loss = F.cross_entropy(model(x), y)
        with collectives() if first else nullcontext({}) as backward:
            loss.backward()                                    # FSDP2 averages over dp
        if first:
            events.emit("comm_2d", forward_collectives=forward, backward_collectives=backward)
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        if mesh_2d is not None:
            torch_dist.all_reduce(mean, group=mesh_2d["dp"].get_group())
        if info.is_main:
            events.emit("loss", mode=mode, step=step + 1, loss=mean.item() / dp_size)
    whole = [p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()]
    if info.is_main:                                           # the trained weights, gathered
        events.emit("weights", mode=mode, values=[w.detach().flatten().tolist() for w in whole])
# [/2d]


def read_plan(items: Sequence[str]) -> dict[str, str]:
    """``["up=colwise", "down=none"]`` -> ``{"up": "colwise", "down": "none"}``; exit if unknown."""
    plan = dict(item.partition("=")[::2] for item in items)
    for layer, style in plan.items():
        if layer not in ("up", "down") or style not in (*STYLES, "none"):
            raise SystemExit(f"--mlp-plan {layer}={style}: the layers are up and down, the "
                             f"styles {', '.join(STYLES)} or none")
    return plan


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Run the requested parts in order."""
    args = parse_args(argv)
    info = dist.setup()
    if info.world_size == 1:
        if args.parts != ["2d"]:
            raise SystemExit("alone this worker runs only the single-process reference: "
                             "--parts 2d (or launch 2 or more processes for the rest)")
        train_2d(None, info, args)
        return
    if args.dim % args.heads:
        raise SystemExit(f"--dim {args.dim} does not divide by --heads {args.heads}: pick a "
                         "multiple of the number of heads.")
    for name, size in (("--hidden", args.hidden), ("--heads", args.heads)):
        if size % info.world_size:
            raise SystemExit(f"{name} {size} does not divide by the {info.world_size} ranks: "
                             f"tensor parallel splits it evenly; pick a multiple.")
    if not info.is_main:   # DTensor's warnings (logged) are the same on every rank: rank 0's only
        logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)
    mesh_1d, mesh_2d = make_meshes(info)
    for part in args.parts:
        if part == "mesh":
            show_meshes(mesh_1d, mesh_2d, info)
        elif part == "placements":
            show_placements(mesh_1d, info)
            rowwise_bias(mesh_1d, info)
        elif part == "sp":
            sequence_parallel(mesh_1d, info, args)
            sequence_parallel_whole(mesh_1d, info, args)
            sequence_parallel_attention(mesh_1d, info, args)
        elif part == "mlp" and args.mlp_plan:
            try_plan(read_plan(args.mlp_plan), mesh_1d, info, args)
        elif part in ("mlp", "attention"):
            tensor_parallel(part, mesh_1d, info, args)
            if part == "attention":
                attention_input_once(mesh_1d, info, args)
        else:
            problem = (None if mesh_2d else "2-D parallelism here needs 4 (or an even number "
                       "above 4) processes: --nproc-per-node 4") or fsdp_problem(info.device)
            if problem:
                dist.print0(f"skipping 2d: {problem}")
                if info.is_main:
                    events.emit("skipped", part="2d", reason=problem)
            else:
                train_2d(mesh_2d, info, args)
    dist.print0(f"ran {', '.join(args.parts)} on {info.world_size} processes ({info.backend})")
    dist.cleanup()


if __name__ == "__main__":
    main()
