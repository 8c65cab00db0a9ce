"""Judge of the coding exercise of lesson 10 (debugging): uneven inputs finished with ``Join``.

``exercises/uneven_join.py`` gives every rank a different number of batches (rank 0 the most).
The judge reads what the run reported: a collective that timed out (``error``), every rank's
``batches`` and ``steps``, and the ``checksum`` of its final weights. Right means: no timeout,
the shards still uneven, every rank trained on all of its own batches, and the weights
identical on every rank.

Lesson: 10.
"""

from __future__ import annotations

from typing import Any, Optional

from . import judge, metric


@judge("10", "uneven_join.py", "make DDP training with uneven inputs finish on every rank, "
       "each rank training on all of its batches (Join)")
def judge_uneven_join(result: Any) -> Optional[str]:
    errors = metric(result, "error")
    if errors:
        return _timeout_hint(errors)
    batches, steps, checksums = (metric(result, name) for name in ("batches", "steps",
                                                                     "checksum"))
    ranks = set(range(result.world_size)) if result.world_size else {0}
    for name, found in (("batches", batches), ("steps", steps), ("checksum", checksums)):
        if set(found) != ranks:
            return (f"the run did not report {name!r} from every rank: the reporting part of "
                    "main() must run unchanged (restore it from the skeleton if you edited it).")
    if len(set(batches.values())) == 1 and len(ranks) > 1:
        return ("every rank got the same number of batches, so nothing was uneven: keep "
                "uneven_batches() as it is, and make the loop itself cope with it.")
    for rank in sorted(ranks):
        if steps[rank] != batches[rank]:
            return (f"rank {rank} took {steps[rank]} optimizer steps but has {batches[rank]} "
                    "batches: every rank must train on all of its own batches (do not stop "
                    "early or skip batches; Join lets the ranks that finish first wait for "
                    "the others).")
    if len(set(checksums.values())) != 1:
        return ("the ranks ended with different weights "
                f"({', '.join(f'rank {r}: {c:.6f}' for r, c in sorted(checksums.items()))}): "
                "give Join the DDP model itself, `Join([model])`, so that the ranks that "
                "finished early take part in the others' all-reduces and receive the final "
                "weights.")
    return None


def _timeout_hint(errors: dict[int, Any]) -> str:
    """Explain a timed-out collective: which rank waited where, and what to do."""
    where = ", ".join(f"rank {rank} in {error.get('where', '?')}"
                      for rank, error in sorted(errors.items()))
    return (f"a collective timed out ({where}): a rank that still had batches called "
            "backward(), whose all-reduce waits for every rank, while the ranks that had run "
            "out of batches had left the loop. Wrap the training loop in train() in "
            "`with Join([model]):` so that finished ranks keep answering the others' "
            "all-reduces until every rank is done.")
