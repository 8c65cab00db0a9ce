"""Judge of the coding exercise of lesson 10 (debugging): uneven inputs, and a loop with a
collective of its own.

``exercises/uneven_join.py`` gives every rank a different number of batches (rank 0 the most),
and its loop all-reduces each step's loss for the job's running mean. ``Join([model])`` alone
does not make it finish: a rank that ran out of batches answers DDP's collectives, not the
loss's. The judge reads what the run did: a collective that timed out or raised
(``error``, with the line each rank was on; a run the launch's timeout ended is explained from
its stacks before the judge is asked), else every rank's ``batches``, its batch ``losses``,
which of its batches each forward ran on (``inputs``), the ``mean_loss`` its ``train()``
returned and the ``checksum`` of its final weights. Right means: every rank finished, the
shards still uneven, every rank trained on each of its own batches once, the weights identical
on every rank, and every rank's mean loss the mean over every batch of every rank. Any way that
gets there is right.

Lesson: 10.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from ...torch_words import COLLECTIVE_TIMEOUT
from . import judge, metric


@judge("10", "uneven_join.py", "make DDP training with uneven inputs finish on every rank, "
       "each rank training on all of its batches, with the job's mean loss right")
def judge_uneven_join(result: Any) -> Optional[str]:
    errors = metric(result, "error")
    if errors:
        places = {rank: (error.get("line"), error.get("function", "?"),
                         (error.get("code") or "").split("  #")[0].strip())
                  for rank, error in errors.items()}
        if any(COLLECTIVE_TIMEOUT.search(str(error.get("message"))) for error in errors.values()):
            return _hang_hint(places)
        said = "; ".join(f"rank {rank} at line {line} (in {function}: `{code}`): "
                         f"{str(errors[rank].get('message')).rstrip('.')}"
                         for rank, (line, function, code) in sorted(places.items()))
        return (f"the training raised on some ranks ({said}). The job must finish on every "
                "rank with every batch trained: an error that stops the ranks early is not "
                "a way out of the hang.")
    batches, losses, means, checksums = (metric(result, name) for name in (
        "batches", "losses", "mean_loss", "checksum"))
    ranks = set(range(result.world_size)) if result.world_size else {0}
    for name, found in (("batches", batches), ("losses", losses), ("mean_loss", means),
                        ("checksum", checksums)):
        if set(found) != ranks:
            return (f"the run did not report {name!r} from every rank: the reporting part of "
                    "main() must run unchanged (restore it from the skeleton if you edited it).")
    if len(set(batches.values())) == 1 and len(ranks) > 1:
        return ("every rank got the same number of batches, so nothing was uneven: keep "
                "uneven_batches() as it is, and make the loop itself cope with it.")
    for rank in sorted(ranks):
        if len(losses[rank]) > batches[rank]:
            return _extra_steps_hint(rank, len(losses[rank]), batches[rank],
                                     metric(result, "inputs").get(rank))
        if len(losses[rank]) < batches[rank]:
            return (f"rank {rank} trained on {len(losses[rank])} batches but has "
                    f"{batches[rank]}: every rank must train on all of its own batches (do "
                    "not stop early or skip batches; the ranks that finish first must wait "
                    "for the others).")
    if len(set(checksums.values())) != 1:
        return ("the ranks ended with different weights "
                f"({', '.join(f'rank {r}: {c:.6f}' for r, c in sorted(checksums.items()))}): "
                "every optimizer step must use the gradients averaged over the ranks still "
                "training, and the ranks that finished early must end with the final weights.")
    every = [loss for rank in sorted(ranks) for loss in losses[rank]]
    mean = sum(every) / len(every)
    wrong = {rank: m for rank, m in sorted(means.items())
             if not math.isclose(m, mean, rel_tol=1e-5, abs_tol=1e-7)}
    if wrong:
        said = ", ".join(f"rank {r}: {m:.6f}" for r, m in wrong.items())
        return (f"the mean loss train() returned is wrong ({said}): the mean over all "
                f"{len(every)} batches of every rank is {mean:.6f}. Every rank's mean must "
                "count each batch of each rank once, including the batches trained after "
                "another rank ran out.")
    return None


def _extra_steps_hint(rank: int, steps: int, batches: int, inputs: Optional[list]) -> str:
    """A rank that trained more steps than it has batches: name the batch it repeated (from
    the batch each forward ran on), or the steps on inputs that are none of its batches."""
    said = f"{steps} steps for its {batches} batches"
    once = ("Every rank must train on each of its own batches once: a rank that runs out "
            "must answer the others' collectives until they are done (Join), not make up "
            "batches to even out the shards.")
    counts = {i: (inputs or []).count(i) for i in range(batches)}
    repeated = [i for i, n in counts.items() if n > 1]
    if repeated:
        n = counts[repeated[0]]
        times = {2: "twice", 3: "three times"}.get(n, f"{n} times")
        return (f"rank {rank} trained on its batch {repeated[0] + 1} {times} ({said}): a shard "
                "padded by repeating a batch counts that batch more than once, in the averaged "
                f"gradients and in the mean loss, as if the data held it {times}. {once}")
    strange = (inputs or []).count(-1)
    if strange:
        return (f"rank {rank} trained {said}, {strange} of its forwards on inputs that are "
                f"none of its batches. {once}")
    return f"rank {rank} reported {steps} losses for its {batches} batches. {once}"


def _hang_hint(places: dict[int, tuple]) -> str:
    """Explain timed-out collectives from the line each rank was on, naming the classic
    mistakes: no rank answers DDP's all-reduce, or Join answers DDP's and not the loss's."""
    what = "a collective timed out"
    where = ", ".join(f"rank {rank} at line {line} (in {function}: `{code}`)"
                      for rank, (line, function, code) in sorted(places.items()))
    codes = {rank: code for rank, (_, _, code) in places.items()}
    if any(".backward(" in code for code in codes.values()):
        return (f"{what} ({where}): the ranks that ran out of batches left the loop, so the "
                "all-reduce of DDP's gradients in a backward() of the rank still training "
                "waits for ranks that never join it. A rank that has run out must keep "
                "answering the others' collectives until every rank is done (notebook 10, "
                "section 4).")
    joined = [rank for rank, code in codes.items() if "Join(" in code]
    mine = [rank for rank, code in codes.items() if "Join(" not in code]
    if joined and mine:
        return (f"{what} ({where}): Join([model]) shadows only DDP's collectives: your loss "
                f"all_reduce is still waiting on the rank that finished (rank {joined[0]}, "
                f"inside Join, answers DDP's all-reduces, not yours). {_EVERY_COLLECTIVE}")
    return (f"{what} ({where}): the ranks are not calling the same collectives the same "
            f"number of times. {_EVERY_COLLECTIVE}")


_EVERY_COLLECTIVE = ("Every collective of the loop, DDP's and your own, must be answered by "
                     "the ranks that ran out of batches, or be called the same number of "
                     "times on every rank.")
