"""Judge of exercise 12: the tensor-parallel plan of a Llama-like block, with sequence parallel.

The skeleton (``exercises/tp_plan.py``) reports one ``tp_plan`` metric per rank: each weight's
placement after the learner's ``parallelize``, the attention's head count and its rows of
``wq``, the tokens each RMSNorm ran on, the two sides of each residual sum of the block (each a
DTensor or not, and its tokens on the rank), the output's type and shape, the largest differences
from the unsharded block (output, every parameter's gradient, the input's gradient) and the
collectives of one forward and one backward (``CommDebugMode``); and an ``error`` metric when
the plan, the forward or the backward raised.

Right means: the linear layers split column-wise then row-wise, whole heads per rank, the norms
sequence-parallel, the whole output back on every rank, every difference within
:data:`TOLERANCE`, and no more collectives than the reference plan's (:data:`REFERENCE`).

Lesson: 12.
"""

from __future__ import annotations

from typing import Any, Optional

from . import judge, metric, run_failed

#: Largest difference from the unsharded block (output and gradients, float32, values near 1)
#: that still counts as equal: the sharded sums add in another order, about 1e-6 apart.
TOLERANCE = 1e-4
#: The reference plan's collectives in one forward and one backward, on any number of ranks:
#: gather the sequence before attention and before the feed-forward, reduce-scatter after each,
#: gather the block's output (and the mirror image in backward).
REFERENCE = {"forward": {"all_gather_into_tensor": 3, "reduce_scatter_tensor": 2},
             "backward": {"all_gather_into_tensor": 3, "reduce_scatter_tensor": 2}}
COLWISE = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
ROWWISE = ("attention.wo", "feed_forward.w2")
NORMS = ("attention_norm", "ffn_norm")
#: Block.forward's residual sums, in order: the residual, the sub-block added to it, and the
#: sub-block's last layer (whose output is the sub-block's).
RESIDUALS = (("x", "attention", "attention.wo"), ("h", "feed_forward", "feed_forward.w2"))
SKELETON = "exercises/tp_plan.py"


@judge("12", "tp_plan.py",
       "write the tensor-parallel plan of a Llama-like block (column-wise, row-wise, local "
       "heads, sequence-parallel norms) so that it equals the unsharded block and communicates "
       "no more than needed")
def judge_tp_plan(result: Any) -> Optional[str]:
    failed = run_failed(result)
    if failed:
        return failed
    facts, errors = metric(result, "tp_plan"), metric(result, "error")
    if not facts:
        return (f"the run reported nothing: launch {SKELETON} on 2 or 4 processes and change "
                "only the function parallelize.")
    for rank in sorted(facts):
        hint = _rank_hint(facts[rank], errors.get(rank))
        if hint:
            return hint
    return None


def _rank_hint(f: dict[str, Any], error: Optional[dict[str, Any]]) -> Optional[str]:
    placements = f.get("placements")
    if placements is None:
        return _error_hint(error) or "parallelize returned nothing the run could use."
    if all(p == "not a DTensor" for p in placements.values()):
        return ("nothing is split yet: every weight is still whole on every rank. Write "
                "parallelize from its docstring: a plan for parallelize_module, one style per "
                "layer (torch.distributed.tensor.parallel).")
    # A head count that disagrees with wq fails in Attention.forward's view; an attention
    # rewritten to view with -1 runs right with any count, and is not told otherwise.
    hint = (_layers_hint(placements) or (_heads_hint(f) if error else None)
            or _norms_hint(f, placements))
    if hint:
        return hint
    if error:
        return _residual_hint(f, error) or _error_hint(error)
    return _output_hint(f) or _collectives_hint(f)


def _layers_hint(placements: dict[str, str]) -> Optional[str]:
    for name in COLWISE:
        got = placements.get(f"{name}.weight")
        if got != "[Shard(dim=0)]":
            return (f"{name} is {_style(got)}, but it reads the whole input and must give each "
                    "rank whole outputs of its own (heads, or hidden units), computed without "
                    "communication: that layer is column-wise (its weight split by output "
                    "rows, Shard(0)).")
    for name in ROWWISE:
        got = placements.get(f"{name}.weight")
        if got != "[Shard(dim=1)]":
            reads = "heads" if name.startswith("attention") else "hidden units that w1 and w3"
            return (f"{name} is {_style(got)}, but it reads the {reads} split over the ranks: "
                    "it must be row-wise (its weight split by input columns, Shard(1)), each "
                    "rank multiplying its slice and the partial results summed once.")
    return None


def _style(placement: Optional[str]) -> str:
    return {"[Shard(dim=0)]": "column-wise (weight Shard(0))",
            "[Shard(dim=1)]": "row-wise (weight Shard(1))",
            "[Replicate()]": "replicated (a whole copy on every rank)"}.get(
        placement or "", "not split (a plain tensor)")


def _heads_hint(f: dict[str, Any]) -> Optional[str]:
    heads = f["wq_rows"] // f["head_dim"]
    if f["n_heads"] == heads:
        return None
    return (f"hard-coded head count: each rank holds {heads} of the {f['n_heads_full']} heads "
            f"(its wq has {f['wq_rows']} rows of head_dim {f['head_dim']}), but the attention "
            f"views q, k and v as {f['n_heads']} heads, the whole model's count (Attention."
            "forward reads self.n_heads). On each rank the attention must work with the heads "
            "that rank holds.")


def _norms_hint(f: dict[str, Any], placements: dict[str, str]) -> Optional[str]:
    world, seq = f["world_size"], f["seq"]
    for norm in NORMS:
        if placements.get(f"{norm}.weight") == "not a DTensor":
            return (f"{norm} is not sequence-parallel: every rank normalises the whole "
                    "sequence. Sequence parallelism has each rank normalise its 1/N of the "
                    "sequence, the norm's weight replicated.")
    tokens = f.get("norm_tokens") or {}
    for norm, n in tokens.items():
        if n * world == seq:
            continue
        if n == seq:
            return (f"a plan that forgets the input layout: the block gets the whole x on every "
                    f"rank, but SequenceParallel takes a plain tensor for this rank's slice of "
                    f"the sequence, so {norm} ran on {n} tokens per rank, a sequence "
                    f"{world} times too long. The block's input layout must be declared: it "
                    "arrives whole on every rank (Replicate()), its first norm wants this "
                    "rank's slice of the sequence (Shard(1)), and the residual sums want plain "
                    "tensors.")
        return (f"{norm} ran on {n} tokens per rank; sequence parallel gives each rank "
                f"{seq // world} of the {seq}.")
    return None


def _residual_hint(f: dict[str, Any], error: dict[str, Any]) -> Optional[str]:
    """A forward that raised at a residual sum whose two sides, plain tensors, hold different
    tokens on the rank: name the layout the sum received and the one it needed."""
    sides = f.get("residual_sides") or {}
    if error.get("stage") != "forward":
        return None
    for residual, sub, last in RESIDUALS:
        mine, added = sides.get(residual), sides.get(sub)
        if not mine or not added or residual == "x" and "h" in sides:
            continue   # not reached, or the sum was made (the next one's residual is its result)
        plain = mine["type"] == added["type"] == "Tensor"   # (a DTensor: _error_hint says it)
        if not plain or mine["tokens"] == added["tokens"]:
            continue
        got, got_said = _layout(added["tokens"], f)
        needed, needed_said = _layout(mine["tokens"], f)
        said = (f"the forward raised {error['type']} at the residual sum {residual} + "
                f"{sub}(...) of Block.forward: {sub} returned {got} ({got_said}), and the "
                f"residual {residual} is {needed} ({needed_said}): the sum needed {needed} from "
                f"{sub}. ")
        if (got, needed) == ("Replicate()", "Shard(1)"):
            return said + (f"What {sub} returns is {last}'s output, and a row-wise layer "
                           "returns the whole sum on every rank unless its plan says "
                           "otherwise: it must hand on the residual's layout, each rank the "
                           "sum for its own slice of the sequence.")
        return said + (f"What {sub} returns is {last}'s output: its output_layouts must give "
                       f"the layout of the residual it is added to.")
    return None


def _layout(tokens: int, f: dict[str, Any]) -> tuple[str, str]:
    """The layout of a plain tensor holding ``tokens`` of the sequence on each rank."""
    seq, world = f["seq"], f["world_size"]
    if tokens == seq:
        return "Replicate()", f"the whole sequence, {seq} tokens on every rank"
    if tokens * world == seq:
        return "Shard(1)", f"this rank's {tokens} of the {seq} tokens"
    return f"{tokens} tokens on each rank", f"the sequence has {seq}"


def _error_hint(error: Optional[dict[str, Any]]) -> Optional[str]:
    if not error:
        return None
    return (f"the {error['stage']} raised {error['type']}: {error['message']} Check each "
            "module's input and output layouts: a DTensor and a plain tensor cannot be added "
            "(the residual sums of Block.forward work on plain tensors), and "
            "a layer must receive the layout its style expects.")


def _output_hint(f: dict[str, Any]) -> Optional[str]:
    if f.get("output_type") == "DTensor":
        return ("the block returns a DTensor: the run wants the whole output on every rank as "
                "a plain tensor.")
    shape, seq = f.get("output_shape"), f["seq"]
    if shape and shape[1] != seq:
        return (f"the block returns {shape[1]} of the {seq} tokens (shape {shape}): this rank's "
                "slice of the sequence. The block must return the whole sequence on every "
                "rank.")
    if f.get("output_error") is None or f["output_error"] > TOLERANCE:
        return (f"the output differs from the unsharded block's by {f.get('output_error')}: "
                "check which layers are column-wise and which row-wise, and the layouts "
                "between them.")
    grads = f.get("grad_errors") or {}
    worst = max(grads, key=lambda n: float("inf") if grads[n] is None else grads[n],
                default=None)
    if worst is not None and (grads[worst] is None or grads[worst] > TOLERANCE):
        return (f"the output is right, but the gradient of {worst} differs from the unsharded "
                f"block's by {grads[worst]}: a layout that is right in forward is wrong in "
                "backward (an input declared Replicate that is not the same on every rank?).")
    if f.get("input_grad_error") is None or f["input_grad_error"] > TOLERANCE:
        return (f"the output and the weights' gradients are right, but x.grad differs from the "
                f"unsharded block's by {f.get('input_grad_error')}: the block's input layout "
                "must be declared, so that its gradient is summed back over the ranks.")
    return None


def _collectives_hint(f: dict[str, Any]) -> Optional[str]:
    for phase in ("forward", "backward"):
        mine = f.get(f"{phase}_collectives") or {}
        if not mine:
            continue   # a torch without CommDebugMode counts nothing
        want = REFERENCE[phase]
        if sum(mine.values()) <= sum(want.values()):
            continue
        counts = ", ".join(f"{op} x{n}" for op, n in sorted(mine.items()))
        gathers = mine.get("all_gather_into_tensor", 0)
        if phase == "forward" and gathers > want["all_gather_into_tensor"]:
            return (f"computes right but communicates too much: {gathers} all-gathers in "
                    f"forward ({counts}), where the reference plan needs "
                    f"{want['all_gather_into_tensor']}. Each column-wise layer gathered the "
                    "sequence for itself; the reference gathers it once per sub-block, "
                    "before the sub-block, so attention's and feed_forward's input layouts "
                    "must be declared too.")
        return (f"computes right but communicates too much: {phase} ran {counts}, where the "
                f"reference plan runs {sum(want.values())} collectives. Declare each module's "
                "input and output layouts so that DTensor never has to redistribute by "
                "itself.")
    return None
