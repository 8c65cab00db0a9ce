"""The course's answers to exercises, shown by a notebook only once the judge has said the
learner's run is correct: ``answers.show_after(verdict, "10")`` names no file, so nothing above
the verdict points at the answer.

The answer files need torch only (a rank may import them); ``show_after`` imports ddplab's code
viewer only when it shows something.

Lessons: 04 (sampler), 10 (running_loss), 11 (sharding), 12 (tensor_parallel).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# exercise -> (its answer's file in this folder, the ``# [name]`` section shown)
SHOWN = {"04": ("sampler.py", "left-out"),
         "10": ("running_loss.py", "running-loss"),
         "11": ("sharding.py", "pipeline-step"),
         "11b": ("sharding.py", "fsdp2-precision"),
         "12": ("tensor_parallel.py", "llama_plan")}


def show_after(verdict: Any, exercise: str) -> bool:
    """Show the course's answer to ``exercise`` if ``verdict`` (``ddplab.check``'s) is true;
    otherwise say that it will appear here once the judge says the run is correct.

    Returns:
        Whether the answer was shown.

    Raises:
        KeyError: no answer is kept for ``exercise``.
    """
    name, section = SHOWN[exercise]
    if not verdict:
        print("The course's answer appears here once the judge says your run is correct.")
        return False
    from ddplab.lab.showcode import show

    show(Path(__file__).with_name(name), section)
    return True
