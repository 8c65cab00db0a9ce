"""Judges of exercise 11 (one step of a two-stage pipeline, forward and backward, with send and
recv) and 11b (FSDP2 and distributed checkpoints).

The skeleton (``exercises/pipeline_forward.py``) reports, as ``metric`` events, the checksum of
every activation rank 0 computed (``sent``), of every input rank 1 ran its stage on
(``received``) and whether autograd tracked it (``tracked``), how far rank 1's output is from
the unsplit model's (``output_error``), each rank's sends and receives (``messages``), how far
its gradients are from the unsplit model's for the whole batch's mean loss and for two wrong
ones (``gradients``), and, when a send or recv found no partner or raised, the phase, the call
under way and the error (``p2p_error``).

11b's skeleton (``exercises/fsdp2.py``) is launched three times (save on 2 ranks, load on 4 and
in one process) and judged as a set: how the parameters are laid out and the learner's estimate
of the bytes per rank (``layout``), the bytes held after a step (``held``), one forward's dtype and
all-gathers and the dtype the gradients were averaged in (``forward``), the losses beside one
process's (``loss``, ``one_process``), the checkpoint's files and keys (``files``, ``keys``),
fingerprints of every weight and Adam state after the save and after each load (``saved``,
``loaded``), and what ``shard``, ``save`` or ``load`` raised.

Lesson: 11.
"""

from __future__ import annotations

import math
import re
from typing import Any, Optional

from . import judge, metric, metrics

#: Largest difference from the unsplit model's output that still counts as equal.
TOLERANCE = 1e-5


@judge("11", "pipeline_forward.py",
       "write both passes of a two-stage pipeline with send and recv, so that one step's "
       "outputs and gradients equal the unsplit model's, with 4 messages each way")
def pipeline_forward(result: Any) -> Optional[str]:
    sent, received = metric(result, "sent").get(0), metric(result, "received").get(1)
    failed = metric(result, "p2p_error")
    hint = _pipeline_failed({r: e for r, e in failed.items() if e["phase"] == "forward"})
    if hint is not None:
        return hint
    if sent is None or received is None:
        raised = metric(result, "step_error")
        if raised:
            rank, e = min(raised.items())
            return (f"rank {rank} raised {e['type']} in {e['phase']} ({e['error']}; its "
                    "traceback is printed above).")
        return ("the run reported no checksums: launch exercises/pipeline_forward.py on 2 "
                "processes and change only the TODO(exercise) blocks.")
    if len(received) != len(sent):
        return (f"rank 1 ran its stage {len(received)} times for {len(sent)} micro-batches: "
                "receive one activation per micro-batch, inside the loop of forward_stage.")
    if not any(received):
        exchanged = sum(sum(c.values()) for c in metric(result, "messages").values())
        if not exchanged:   # the untouched skeleton: say what the run did, not what to write
            return ("rank 1 ran its stage on zeros: no message travelled between the ranks, "
                    "so rank 1 never computed on what rank 0 computed.")
        return ("rank 1 ran its stage on zeros: messages went, but none reached the tensor "
                "rank 1 computes on. Rank 0 must send each activation to rank 1, and rank 1 "
                "must receive it into that buffer before computing on it.")
    for micro, (a, b) in enumerate(zip(sent, received)):
        if not math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6):
            return (f"micro-batch {micro}: rank 1 computed on something other than the "
                    "activation rank 0 computed for it. Send each activation once, in order, "
                    "and receive it right before rank 1 uses it.")
    error = metric(result, "output_error").get(1)
    if error is None or error > TOLERANCE:
        return (f"the activations arrived, but the output differs from the unsplit model's "
                f"by {error}: rank 1 must run its stage on the received activation.")
    if not all(metric(result, "tracked").get(1, [])):
        return ("rank 1 ran its stage on a received activation that autograd does not track "
                "(requires_grad is False: recv fills a plain tensor). Its backward then "
                "computes no gradient of the loss with respect to that input, so rank 1 has "
                "no gradient to send back and rank 0's layers never learn. Make the received "
                "activation require a gradient before the stage runs on it.")
    raised = metric(result, "step_error")
    if raised:
        rank, e = min(raised.items())
        return (f"the forward pass is right; then rank {rank} raised {e['type']} in "
                f"{e['phase']} ({e['error']}; its traceback is printed above).")
    hint = _pipeline_failed(failed)   # (in backward: the forward pass is right)
    if hint:
        return f"the forward pass is right; then {hint}"
    return _pipeline_backward(result, len(sent))


def _pipeline_failed(failed: dict[int, Any]) -> Optional[str]:
    """A hint when a rank's send or recv found no partner (``p2p_error``), else None."""
    waits = {rank: e for rank, e in failed.items() if e.get("waiting")}
    if len(waits) == 2 and all(e["waiting"] in ("recv", "irecv") for e in waits.values()):
        where = " and ".join(f"rank {r} in {e['phase']}" for r, e in sorted(waits.items()))
        return (f"deadlock: both ranks waited in recv at once ({where}), each for a message "
                "the other would send only after its own recv returned, until the process "
                "group's timeout ended them (their errors are printed above). Blocking "
                "messages must pair up in the same order on both sides: GPipe sends every "
                "activation first, then every gradient, the last micro-batch first.")
    for rank, e in sorted(waits.items()):
        other, what = 1 - rank, ("an activation" if rank == 1 else "a gradient") \
            if e["waiting"] in ("recv", "irecv") else None
        if what:
            return (f"rank {rank} waited in recv, in {e['phase']}, for {what} that rank "
                    f"{other} never sent (its error is printed above): every recv needs its "
                    f"send on the other rank, one per micro-batch.")
        return (f"rank {rank}'s {e['waiting']} in {e['phase']} was never received (its error "
                f"is printed above): rank {other} must receive every message rank {rank} "
                "sends, one per micro-batch.")
    return None


def _pipeline_backward(result: Any, micro_batches: int) -> Optional[str]:
    """The forward pass was right: judge the gradients and the messages of the step."""
    gradients, messages = metric(result, "gradients"), metric(result, "messages")
    for rank in (1, 0):
        found = gradients.get(rank)
        if found is None:
            return "the step reported no gradients: change only the TODO(exercise) blocks."
        if not found:
            return (f"rank {rank}'s parameters have no gradient after backward_stage: each "
                    "rank must run backward through its stage for every micro-batch "
                    "(rank 1 from the loss, rank 0 from the gradient rank 1 sends it).")
        if found["mean"] <= TOLERANCE:
            continue
        if found["sum"] <= TOLERANCE:
            return (f"rank {rank}'s gradients are those of the sum of the {micro_batches} "
                    "micro-batches' mean losses, about {0} times too large: each micro-batch's "
                    "loss is a mean over its own samples only. Weight each by its share of "
                    "the batch (its samples / all samples), so that they add up to the whole "
                    "batch's mean.".format(micro_batches))
        if found["mean_of_means"] <= TOLERANCE:
            return (f"rank {rank}'s gradients are those of the mean of the micro-batches' mean "
                    f"losses (each divided by {micro_batches}): right only when every "
                    "micro-batch has as many samples, and here they have 8, 8, 8 and 6. "
                    "Weight each by its share of the batch (its samples / all samples).")
        if rank == 0:
            return ("rank 1's gradients are right, rank 0's are not: rank 0 must run backward "
                    "from the gradient rank 1 sent for the same micro-batch (the gradient of "
                    "the loss with respect to rank 1's input), in the order rank 1 sends them.")
        return (f"rank 1's gradients differ from the unsplit model's by {found['mean']:.1e}: "
                "one backward per micro-batch, of the whole batch's mean loss.")
    for rank in (0, 1):
        counts = messages.get(rank, {})
        if counts != {"send": micro_batches, "recv": micro_batches}:
            return (f"rank {rank} sent {counts.get('send')} and received {counts.get('recv')} "
                    f"messages for {micro_batches} micro-batches: the gradients are right, but "
                    "one step needs one activation forward and one gradient back per "
                    f"micro-batch, {micro_batches} each way.")
    return None


# ------------------------------------------------------------------ 11b: FSDP2 and DCP

#: The three launches of exercise 11b, by name: train and save on 2 ranks, load on 4 and on 1.
FSDP2_RUNS = {"save": 2, "load4": 4, "load1": 1}
#: (Both tolerances are stated in the skeleton's spec, point 4.)
#: Largest difference of a step's loss from one process's (bfloat16 forward on both sides;
#: the ranks round their own gradients to bfloat16 before the float32 average, one process
#: rounds the whole batch's).
LOSS_TOLERANCE = 5e-3
#: Largest distance of the trained weights from one process's, as a share of how far training
#: moved them (Adam's first steps move every weight by about the learning rate, whatever the
#: size of its gradient, so a gradient that bfloat16 rounds across zero moves the other way).
WEIGHT_TOLERANCE = 0.15


@judge("11b", "fsdp2.py",
       "shard a transformer per block with FSDP2 and bfloat16 compute, estimate its bytes per "
       "rank, train it as one process would, save it with DCP on 2 ranks and load it on 4 and 1")
def fsdp2(runs: Any) -> Optional[str]:
    from . import is_run_result, run_failed

    if is_run_result(runs):
        runs = {"save": runs}
    hint = _fsdp2_save(runs.get("save"), run_failed)
    if hint is not None:
        return hint
    if any(name not in runs for name in FSDP2_RUNS):
        return ("the sharded training is right. Now hand the judge all three launches, "
                '{"save": ..., "load4": ..., "load1": ...}: the save on 2 ranks, then --load of '
                "the same folder on 4 ranks and in one process.")
    saved, keys = metric(runs["save"], "saved")[0], metric(runs["save"], "keys").get(0, [])
    for name in ("load4", "load1"):
        hint = _fsdp2_load(name, runs[name], saved, keys, run_failed)
        if hint is not None:
            return hint
    return None


def _fsdp2_save(run: Any, run_failed: Any) -> Optional[str]:
    """The training run (2 ranks): sharding, precision, bytes, equality, the save."""
    if run is None:
        return 'hand the judge the launches as a dict: {"save": ..., "load4": ..., "load1": ...}.'
    error, root_first = metric(run, "shard_error"), metric(run, "root_first")
    if error:
        rank, text = min(error.items())
        if any(root_first.values()):
            return (f"shard raised on rank {rank} ({text}) after the root was already "
                    "sharded: fully_shard on the root first made every parameter a shard, "
                    "and fully_shard on a block then finds parameters it cannot shard again. "
                    "Wrong wrapping order: a parameter is sharded once, by the first fully_shard "
                    "that takes it, and the root's took the blocks' too.")
        return f"shard raised on rank {rank}: {text} (its traceback is printed above)."
    layout = metric(run, "layout")   # reported before training: judged even if it crashed
    if not layout:
        return "the save launch (2 ranks) " + (
            f"failed: {run_failed(run)}" if run_failed(run) else
            "reported nothing: change only the four functions of the exercise.")
    if layout[0]["world_size"] != 2:
        return ("the first launch must train and save on 2 ranks: launch exercises/fsdp2.py on "
                "2 processes with --save FOLDER.")
    size, params, blocks = 2, layout[0]["num_params"], layout[0]["blocks"]
    plain = layout[0]["not_sharded"]
    if layout[0]["param_bytes"] == 4 * params:
        return ("shard sharded nothing: every rank trains a full copy of its own. Write shard "
                "from points 1 and 2 of the spec.")
    if plain:
        return (f"{len(plain)} parameters are not sharded ({', '.join(plain[:4])}...): they "
                "belong to no block, and only fully_shard on the root takes them. Without it "
                "each rank keeps and trains its own copy (their gradients are never averaged), "
                "in float32 beside the blocks' 16-bit compute. Point 1 wants every parameter "
                "a shard.")
    failed = run_failed(run)
    if failed:
        return f"the save launch (2 ranks) failed: {failed}"
    share = 4 * params // size
    for rank, found in sorted(layout.items()):
        if found["param_bytes"] != share:
            return (f"rank {rank} stores {found['param_bytes']} bytes of weights; 1/{size} of "
                    f"the float32 model ({params} parameters) is {share}. The shards must stay "
                    "float32 (the precision policy casts copies for compute, not the shards).")
    forward = metric(run, "forward").get(0, {})
    if forward.get("allgather", 0) < blocks + 1:
        return (f"one forward ran {forward.get('allgather', 0)} all-gather(s) for {blocks} "
                "blocks: no per-block sharding. fully_shard on the root only gathers the whole "
                "model at once, so every weight is whole on every rank during the step. Point 1 "
                "wants the weights gathered block by block, each just before it runs.")
    dtype = forward.get("dtype")
    if dtype == "float32":
        return ("forward computed in float32: no mixed precision. Point 2 wants forward and "
                "backward in bfloat16, with the shards and the gradients' average in float32.")
    if dtype == "float16":
        return ("forward computed in float16, whose range needs a scaled loss (a GradScaler) "
                "to keep small gradients from flushing to zero; nothing scales it here. "
                "Point 2 wants bfloat16, which has float32's range and needs no scaling.")
    if dtype != "bfloat16":
        return f"forward computed in {dtype}; point 2 wants bfloat16."
    averaged = forward.get("averaged")
    if averaged in ("bfloat16", "float16"):
        return (f"the gradients were averaged over the ranks in {averaged}: after backward, "
                f"every gradient holds {averaged} values only. A MixedPrecisionPolicy that is "
                "told only the compute dtype reduces in it too (its docstring), so each average "
                f"was rounded to {averaged}. Point 2 wants the average in float32.")
    held = metric(run, "held")
    for rank, found in sorted(layout.items()):
        measured = sum(held[rank].values())
        estimate = found["estimate"]
        if not isinstance(estimate, (int, float)) or abs(estimate - measured) > 0.01 * measured:
            return (f"bytes_per_rank({params}, {size}) returned {estimate}, but rank {rank} "
                    f"stores {measured} bytes for weights, gradients and Adam's state. Count "
                    "the bytes of each per parameter (in the dtype they are stored in, not the "
                    "one they compute in) and what sharding does to them.")
    reference = metric(run, "one_process").get(0)
    losses = metrics(run, "loss").get(0, [])
    if reference is None or len(losses) != len(reference["losses"]):
        return "the run reported no losses: change only the four functions of the exercise."
    gap = max(abs(a - b) for a, b in zip(losses, reference["losses"]))
    if gap > LOSS_TOLERANCE or reference["weight_gap"] > WEIGHT_TOLERANCE:
        return (f"the sharded run differs from one process training on the whole batches: "
                f"losses by up to {gap:.1e} (tolerance {LOSS_TOLERANCE:g}), trained weights by "
                f"{reference['weight_gap']:.0%} of what training moved them (tolerance "
                f"{WEIGHT_TOLERANCE:.0%}). Point 2 wants the gradients averaged in float32.")
    save_error = metric(run, "save_error")
    if save_error:
        rank, text = min(save_error.items())
        return f"save raised on rank {rank}: {text}"
    files = metric(run, "files").get(0, [])
    if ".metadata" not in files:
        return (f"the checkpoint folder holds {files or 'nothing'}, not a distributed "
                "checkpoint (DCP writes a .metadata beside the ranks' files). A torch.save of "
                "each rank's sharded state dict can only be read back by as many ranks, each "
                "its own file. Point 5 wants one checkpoint that loads on any number of "
                "ranks.")
    if 0 not in metric(run, "saved"):
        return "the save launch reported no weights: change only the four functions."
    return None


def _fsdp2_load(name: str, run: Any, saved: dict[str, str], keys: list[str],
                run_failed: Any) -> Optional[str]:
    """A load run (4 ranks, or one process): the weights and Adam's state as saved (``keys``:
    the checkpoint's)."""
    size = FSDP2_RUNS[name]
    where = f"on {size} ranks" if size > 1 else "in one process"
    error = metric(run, "load_error")
    if error:
        rank, text = min(error.items())
        return (f"loading {where} raised on rank {rank} ({text}): a DCP load at another world "
                "size done the wrong way. Files of each rank's own shards (torch.save, or "
                "to_local()) fit only the sharding that wrote them; torch.distributed."
                "checkpoint's load reads into each rank exactly the pieces its new shards "
                "need, for any number of ranks.")
    failed = run_failed(run)
    if failed:
        return f"the load {where} failed: {failed}"
    layout = metric(run, "layout").get(0)
    if layout is None or layout["world_size"] != size:
        return f"launch the load of {name} {where}, with --load and the saved folder."
    loaded = metric(run, "loaded").get(0)
    if loaded is None:
        return f"the load {where} reported nothing: change only the four functions."
    weights = [k for k in saved if k.endswith(":weight") and loaded.get(k) != saved[k]]
    if weights:
        total = sum(k.endswith(":weight") for k in saved)
        return (f"after the load {where}, {len(weights)} of {total} weights differ from those "
                f"saved ({weights[0].split(':')[0]}, ...): load must fill the model's own "
                "parameters, in place.")
    state = [k for k in saved if loaded.get(k) != saved[k]]
    moments = [k for k in keys if k.endswith((".exp_avg", ".exp_avg_sq"))]
    if state and moments and all(k.endswith(":weight") for k in loaded):
        numbered = [k for k in moments if re.search(r"(^|\.)state\.\d+\.", k)]
        how = (f", keyed by parameter number as the optimizer's own state_dict() keys it "
               f"({numbered[0]}, ...)" if numbered else "")
        return (f"the checkpoint holds Adam's state{how}, but after the load {where} the "
                "optimizer has none: a fresh optimizer's own state_dict() is empty (Adam makes "
                "its state at its first step), and dcp.load fills only the entries of the dict "
                "it is given. The dict it fills must already hold every entry of Adam's "
                "state, keyed the same on any sharding: what the spec's get_state_dict and "
                "set_state_dict (torch.distributed.checkpoint.state_dict) are for.")
    if state:
        return (f"the weights came back {where}, but not Adam's state ({state[0]}, ...): "
                "save and load the optimizer too (its two moments and its step count).")
    return None
