"""Notebook 13's launches: which job its cells launch, into which folder, and when they stop.

After the learner's first launch, one object holds what the cells below need::

    lab = Capstone(first, "../exercises/capstone.py", data=DATA, work=WORK, timeout=TIMEOUT)
    if lab.launching("Section 3"):
        ddp = lab.run("ddp", "--amp-dtype", "float16")
    verdict = lab.judge({"ddp": ddp, ...})

- The job: the learner's file once it is no longer the skeleton (which trains nothing), else
  the reference job, so that every cell shows what a right job does. The reference is named
  only by :meth:`Capstone.show_reference`, once the judge has said the learner's job is right.
- A run: ``--checkpoint-dir`` a folder of its own, emptied first (a cell run again starts from
  nothing), or filled with the checkpoints a killed run left (``checkpoints=killed``);
  ``--strategy fsdp`` becomes ``ddp`` where FSDP2 cannot run here (the judge's
  ``fsdp_strategy``); after a first launch that ended well, a hang ends once it is certain
  (the judge's ``hang_watch``).
- The stops: a section launches nothing once the judge found the learner's job wrong, or once
  the file changed since its first launch was judged (a wrong job may hang in every launch);
  it says why in one line.

The five runs the judge reads are ``judges.capstone.LAUNCHES``; tests/test_capstone.py checks
that the notebook's ``lab.run`` calls are those.

Lesson: 13.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional, Union

from .judges import capstone as judge
from .showcode import show

WRONG = "the judge found your job wrong. Fix what it named, then run the notebook again."
CHANGED = "your job changed since section 2 judged it: run the notebook again from the top."
UNJUDGED = "run section 4 first: it judges the five runs this section builds on."
FAULT = "the judge named the fault of the reference job without {!r} (above): set WITHOUT back."
TODO = "Your job ran: delete the `# TODO(exercise)` line in exercises/capstone.py."
BROKEN = "The run above failed: fix what it says (your file still holds its TODO line)."

# ``without=`` of :class:`Capstone`: one piece taken out of the reference job (the line that
# does it, and what replaces it), so that the judge and the notebook's checks show they catch it.
WITHOUT = {
    "scaler": ('    if state["scaler"]:\n        scaler.load_state_dict(state["scaler"])\n', ""),
    "set_epoch": ("sampler.set_epoch(epoch)", "pass"),
}


class Capstone:
    """The cells' launches after the first one, ``first`` (a launch of ``job`` on 2 processes),
    which is judged here (``verdict``: the judge's line is printed).

    Args:
        first: the ``RunResult`` of the learner's first launch.
        job: the learner's file.
        data: the workload's arguments, given to every launch.
        work: the folder under which each run gets its own (new for every ``Capstone``).
        timeout: seconds per launch at most.
        without: while ``job`` is the skeleton, launch the reference job without one piece,
            a key of ``WITHOUT``: ``"scaler"`` (a resume leaves the GradScaler new) or
            ``"set_epoch"`` (every epoch the same order). None: the reference as it is.
    """

    def __init__(self, first: Any, job: Union[str, Path], *, data: Any = (),
                 work: Union[str, Path], timeout: float, without: Optional[str] = None):
        self.first, self.job, self.data, self.timeout = first, Path(job), list(data), timeout
        self.verdict = judge.check_so_far(first)
        self.skeleton = judge.unanswered(self.job, first)
        self._judged = self.job.read_bytes()   # the job this verdict is about
        self.go = self.skeleton or not judge.judged_wrong(self.verdict)
        self.why = WRONG
        self.final: Any = None   # the verdict on the five runs (:meth:`judge`)
        self.hint: Optional[str] = None   # the reference's five runs: the judge's hint, if any
        self.folder = Path(tempfile.mkdtemp(dir=work))
        self._runs: dict[int, tuple[Any, Path]] = {}
        self._kept: dict[int, Path] = {}
        self._said = False
        self.without = without if self.skeleton else None
        self._target = judge.REFERENCE
        if self.without:   # a copy of the reference's file, that piece taken out
            import importlib.util

            if without not in WITHOUT:
                raise ValueError(f"without={without!r}: one of {sorted(WITHOUT)}, or None")
            old, new = WITHOUT[without]
            text = Path(importlib.util.find_spec(judge.REFERENCE).origin).read_text()
            assert text.count(old) == 1, f"the reference job has no one {without!r} line"
            self._target = str(self.folder / f"reference_without_{without}.py")
            Path(self._target).write_text(text.replace(old, new))
        elif without:
            print(f"without={without!r} left out: it takes a piece from the reference job, and "
                  "the runs below use yours")
        if not self.skeleton and judge.unanswered(self.job):   # a job under the TODO line
            print(TODO if first.ok else BROKEN)

    @property
    def yours(self) -> bool:
        """Whether the cells launch the learner's job (else the reference's)."""
        return not self.skeleton

    @property
    def correct(self) -> bool:
        """Whether the five runs were judged right (the whole reference's are, by the course;
        with a piece taken out, ``without``, the judge's ``hint`` says whether they were)."""
        return self.final is not None and (bool(self.final) if self.yours else self.hint is None)

    def launching(self, section: str, judged: bool = False) -> bool:
        """Whether ``section`` launches (``judged``: only after :meth:`judge` said right);
        when not, one line says why."""
        if self.go and self.job.read_bytes() != self._judged:
            self.go, self.why = False, CHANGED
        why = self.why if not self.go else None
        if why is None and judged and not self.correct:
            why = FAULT.format(self.without) if self.final and self.hint else UNJUDGED
        if why:
            print(f"{section}: not launched, {why}")
            return False
        if not self._said:
            self._said = True
            print("the runs below use", "your job" if self.yours else
                  f"the reference job without {self.without!r}" if self.without else
                  "the reference job (yours is still the skeleton)")
        return True

    def run(self, folder: str, *args: Any, n: int = 2, checkpoints: Any = None) -> Any:
        """Launch the job on ``n`` processes with ``--checkpoint-dir`` the run's ``folder``:
        emptied first, or a copy of the checkpoints that run ``checkpoints`` left. The run's
        :meth:`title` is printed first: its ranks' lines follow it."""
        path = self.folder / folder
        args = tuple(judge.fsdp_strategy(n) if a == "fsdp" and i and args[i - 1] == "--strategy"
                     else a for i, a in enumerate(args))
        shutil.rmtree(path, ignore_errors=True)
        if checkpoints is not None:
            shutil.copytree(self.checkpoints(checkpoints), path)
        print(self.title(folder, args, n, checkpoints), flush=True)   # before the run's output
        watch = judge.hang_watch(self.first, n) if self.yours and self.first.ok else {}
        import ddplab

        result = ddplab.launch(
            str(self.job) if self.yours else self._target, n,
            args=[*self.data, "--checkpoint-dir", path, *args],
            quiet=not self.yours and "--kill-rank" in args,   # its rank 0's traceback
            timeout=min(self.timeout, watch.get("timeout", self.timeout)),
            on_event=watch.get("on_event"))
        self._runs[id(result)] = (result, path)
        return result

    def title(self, folder: str, args: Any, n: int, checkpoints: Any = None) -> str:
        """The line :meth:`run` prints before a launch, so that its ranks' lines below say
        which run they belong to: ``"run 'ddp' on 2 processes (--amp-dtype float16):"``."""
        extra = " ".join(str(a) for a in args)
        start = (f", from the checkpoints of run {self._runs[id(checkpoints)][1].name!r}"
                 if checkpoints is not None else "")
        ranks = f"{n} process{'es' * (n != 1)}"
        return f"run {folder!r} on {ranks}" + (f" ({extra})" if extra else "") + start + ":"

    def checkpoints(self, result: Any) -> Path:
        """The folder of checkpoints run ``result`` left (as :meth:`leave_unfinished_save` left
        it, also after a later run in the same folder)."""
        return self._kept.get(id(result)) or self._runs[id(result)][1]

    def leave_unfinished_save(self, result: Any) -> Optional[Path]:
        """Beside the newest checkpoint of run ``result``, what a kill during the next save
        leaves (the judge's ``leave_unfinished_save``); that folder is then kept as it is, for
        every run started from its checkpoints. Returns the unfinished save's folder (in the
        kept copy), or None."""
        path = self._runs[id(result)][1]
        unfinished = judge.leave_unfinished_save(path)
        kept = Path(tempfile.mkdtemp(dir=self.folder))
        shutil.copytree(path, kept, dirs_exist_ok=True)
        self._kept[id(result)] = kept
        return unfinished and kept / unfinished.relative_to(path)

    def judge(self, runs: dict[str, Any]) -> Any:
        """The learner's runs judged: ``ddplab.check("13", runs)`` on all five (printed), the
        judge's line on fewer (the cells below launch the rest); a section after a mistake
        launches nothing. The reference's five runs are judged too, in one line (``hint``: the
        judge's message, None when right; with a piece taken out, ``without``, the judge compares
        them with a launch of the whole reference). Returns the verdict (None for the
        reference's runs)."""
        whole = set(runs) == set(judge.RUNS)
        if not self.yours:
            if whole:
                # the ddp run is the reference's, but not without a piece: then one launch more
                reference = {} if self.without else {"reference": runs["ddp"]}
                self.hint = judge.judge_capstone({**runs, **reference})
                self.final = True
                print("the reference job's five runs:",
                      "judged correct" if self.hint is None else f"the judge says: {self.hint}")
            return None
        import ddplab

        verdict = ddplab.check("13", runs) if whole else judge.check_so_far(runs)
        if whole:
            self.final = verdict
        if judge.judged_wrong(verdict):
            self.go, self.why = False, WRONG
        return verdict

    def show_reference(self) -> None:
        """The reference job, once the judge said the learner's job is right; else a line."""
        if self.yours and self.correct:
            show(judge.REFERENCE)
        else:
            print("The reference job is shown here once the judge says your job is correct.")


def throughput(result: Any, batch_size: int) -> float:
    """Samples per second over all ranks: from the median time between two steps of rank 0
    over the second half of its steps (the first half pays for start-up); nan below 3 steps."""
    times = sorted(s["time"] for s in judge.rank_steps(result).get(0, {}).values())
    half = times[len(times) // 2:]
    gaps = sorted(b - a for a, b in zip(half, half[1:]))
    if not gaps:
        return float("nan")
    return result.world_size * batch_size / gaps[(len(gaps) - 1) // 2]
