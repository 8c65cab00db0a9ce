"""Judge of the capstone (lesson 13): the learner's training job, judged by what its runs did.

The learner writes ``exercises/capstone.py`` whole (only the data set, the model, the command
line and the reports are given, by ``ddplab.capstone``) and launches it five times::

    ddplab.check("13", {"ddp": ..., "fsdp": ..., "killed": ..., "resumed": ..., "resharded": ...})

- ``ddp``: unbroken, ``--strategy ddp``, 2 ranks, ``--amp-dtype float16`` (a GradScaler to
  judge on every machine; a GPU's default). Compared step by step with the reference job
  (``ddplab.workers.capstone``) launched here with the same arguments: every rank's samples
  and LR exactly, the loss of the first steps within 0.1% and their gradients within 5%,
  the final weights (summed squares) within 2% and the accuracy within 3 points (a right job
  in another style may round differently); a GradScaler where the reference's scales (float16),
  and a part of the distributed checkpoint written by every rank.
- ``fsdp``: unbroken, ``--strategy fsdp``, 2 ranks, float16: the same samples, LRs, autocast
  and GradScaler as ``ddp``, the inputs as the data set gives them (not cast by a
  ``MixedPrecisionPolicy``), weights sharded (each rank holds other values) in more than one
  unit (each block, then the root), the same summed squares within 2%.
- ``killed``: ``ddp``, 2 ranks, ``--kill-rank 1 --kill-at-step K``, a fresh folder. Before
  the resumes, :func:`leave_unfinished_save` puts beside its newest checkpoint what a kill
  during the next save leaves (a folder of DCP parts without ``.metadata``): a resume that
  reads it is named.
- ``resumed``: the killed run's folder, 2 ranks: it must start at the last checkpoint before
  step K and from there equal ``ddp`` **bit for bit** (samples, losses, the optimizer's state,
  the GradScaler's state, the final weights and accuracy).
- ``resharded``: a copy of the killed run's folder, 4 ranks and ``--strategy fsdp``, the
  default dtype (judged: bfloat16 on CPU ranks, float16 on GPUs): the same start step, the
  rest of that epoch's samples, and within a stated tolerance of ``ddp`` (another world size
  is another global batch and LR): the mean loss within 0.5, the summed squares of the
  weights within 10%, the accuracy within 15 points.

Where FSDP2 cannot run (CPU ranks on torch < 2.7, also where GPUs are fewer than the
processes: :func:`fsdp_strategy`), the ``fsdp`` and ``resharded`` runs are launched with
``--strategy ddp`` and judged as DDP runs: what only
FSDP2 does (sharded weights, its units) is left out.

One run alone (or some of the five) is judged as far as it goes; the verdict then asks for the
rest. A ``reference`` entry (a launch of the reference with the ``ddp`` run's arguments) may be
handed in too; without it the judge launches it once per set of arguments in a process, and
where ``DDPLAB_REFERENCE_CACHE`` names a folder, once for every process that shares it (a
class's grading: see :func:`_reference`).

The judge reads in parts: what a run reported (``facts``), one unbroken run against the
reference (``unbroken``), the killed, resumed and resharded runs (``resume``), and the reference's
runs with their cache on disk (``reference``). Their names are all importable from here.

Lesson: 13.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from .... import env
from .. import is_run_result, judge, run_failed

# the parts' names, importable from here too (the tests and notebook 13 read some)
from .facts import _args, default_dtype, rank_steps, summed_squares  # noqa: F401
from .reference import (CACHE_ENV, REFERENCE, _cache_file, _launch_reference,  # noqa: F401
                        _read_cached, _write_cached, cache_key)
from .resume import (RESHARD_ACCURACY, RESHARD_LOSS, RESHARD_WEIGHTS,  # noqa: F401
                     _killed_hint, _resharded_hint, _resumed_hint, _unfinished_hint)
from .unbroken import (ACCURACY, CLOSE, WEIGHTS, _fsdp_hint, _load_hint,  # noqa: F401
                       _single_hint, _strategy_hint)

#: The five launches, as notebook 13 makes them: extra arguments, folder, processes. The
#: resumed run goes on in the killed run's folder, the resharded run in a copy of it. Four
#: runs in float16 (a GPU's default; a CPU's on demand), so that the GradScaler, its save and
#: its restore are judged on every machine; the resharded run in the default dtype, which is
#: judged there (bfloat16 on CPU ranks). (At the old default --lr 0.02 the float16 job's state
#: at step 24 diverged under 4 ranks' peak, 0.08: mean loss 2.03 against 0.78, in either dtype;
#: at 0.01 the 4-rank resume ends within RESHARD_* with a wide margin.)
F16 = ("--amp-dtype", "float16")
LAUNCHES = {"ddp": (F16, "ddp", 2), "fsdp": (("--strategy", "fsdp", *F16), "fsdp", 2),
            "killed": ((*F16, "--kill-rank", "1", "--kill-at-step", "24"), "job", 2),
            "resumed": (F16, "job", 2), "resharded": (("--strategy", "fsdp"), "job-4", 4)}
RUNS = tuple(LAUNCHES)
SKELETON = "exercises/capstone.py"
RIGHT_SO_FAR = "right so far"   # the verdict on some of the five runs, all right
LATER_TIMEOUT, LATER_FACTOR = 60.0, 6   # a launch after the first: at least, first's wall x
GRACE, GRACE_FACTOR = 20.0, 2   # after a rank exits (or all reach the last step): at least, x
_REFERENCES: dict[tuple, Any] = {}


def launch_runs(launch: Callable[..., Any], folder: Path,
                names: Iterable[str] = RUNS) -> dict[str, Any]:
    """The launches ``names`` (all five by default) in the notebook's order, in ``folder``:
    ``launch(processes, args)`` for each; the copy of the killed run's folder is made after it.
    ``--strategy fsdp`` becomes :func:`fsdp_strategy`'s answer for the launch's processes.
    The launches after a ddp run that ended well get ``timeout`` and ``on_event`` keywords
    too (:func:`hang_watch`): a hang there ends as soon as it is certain. After the killed
    run, :func:`leave_unfinished_save` adds an unfinished save to its folder."""
    runs, names = {}, set(names)
    for name, (extra, job, nprocs) in LAUNCHES.items():
        if name in names:
            extra = tuple(fsdp_strategy(nprocs) if a == "fsdp" else a for a in extra)
            first = runs.get("ddp")
            watch = hang_watch(first, nprocs) if getattr(first, "ok", False) else {}
            runs[name] = launch(nprocs, ["--checkpoint-dir", str(folder / job), *extra],
                                **watch)
        if name == "killed" and (folder / "job").exists():
            leave_unfinished_save(folder / "job")
            shutil.copytree(folder / "job", folder / "job-4")
    return runs


def leave_unfinished_save(folder: Path) -> Optional[Path]:
    """What a kill during a save would leave beside the newest complete checkpoint in
    ``folder``: a folder named as the next save (the last number in the newest's name moved on
    by the step between the two newest, else by 1) that holds copies of the newest's DCP parts
    (``*.distcp``) and nothing else, no ``.metadata`` (which DCP writes last). A resume must
    skip it for the newest complete one. Returns it; None where no complete checkpoint has a
    number in its name (nothing added)."""
    def number(path: Path) -> Optional[re.Match]:
        found = list(re.finditer(r"\d+", path.name))
        return found[-1] if found else None

    done = sorted((m.parent for m in Path(folder).rglob(".metadata") if number(m.parent)),
                  key=lambda path: int(number(path).group()))
    if not done:
        return None
    newest, last = done[-1], number(done[-1])
    step = int(last.group()) - int(number(done[-2]).group()) if len(done) > 1 else 1
    name = (newest.name[:last.start()] + str(int(last.group()) + max(step, 1)).zfill(
        len(last.group())) + newest.name[last.end():])
    unfinished = newest.with_name(name)
    if unfinished.exists():
        return None
    unfinished.mkdir()
    for part in newest.glob("*.distcp"):
        shutil.copy2(part, unfinished / part.name)
    return unfinished


def hang_watch(first: Any, nprocs: int) -> dict[str, Any]:
    """``timeout`` and ``on_event`` for a launch of the job on ``nprocs`` processes after its
    first launch ``first`` ended well: a hang ends as soon as it is certain, not at the
    notebook's timeout (minutes).

    Certain: a rank has exited (its ``weights`` report) while another is still running; or every
    rank reported the first run's last step (same world size) and the job has not ended. Then
    the job gets ``GRACE_FACTOR`` times the first run's whole time (evaluation included; at
    least ``GRACE`` s) and is ended as at a timeout, each rank's stack taken. Any other hang
    ends at ``LATER_FACTOR`` times the first run's time (at least ``LATER_TIMEOUT`` s): on the
    digits, about a minute.
    """
    wall = float(first.wall_time or 0.0)
    grace = max(GRACE, GRACE_FACTOR * wall)
    steps = rank_steps(first).get(0, {})
    last = max(steps) if steps and nprocs == first.world_size else None
    done: set[Any] = set()

    def on_event(event: dict) -> Optional[float]:
        if event.get("name") == "weights":
            return grace
        value = event.get("value")
        if last is not None and event.get("name") == "step" and isinstance(value, dict) and \
                value.get("step") == last:
            done.add(event.get("rank"))
        return grace if len(done) >= nprocs else None

    return {"timeout": max(LATER_TIMEOUT, LATER_FACTOR * wall), "on_event": on_event}


def fsdp_strategy(nprocs: int) -> str:
    """The ``--strategy`` of an fsdp run on ``nprocs`` processes on this machine: ``"fsdp"``,
    or ``"ddp"`` where FSDP2 cannot run: on CPU ranks (no GPU for every process, as the jobs
    place them) with torch < 2.7, as ``ddplab.sharded.fsdp_problem`` says in the ranks. The
    judge then expects DDP there and leaves out FSDP2's checks."""
    facts = env.probe()
    release = tuple(int(part) for part in re.findall(r"\d+", facts["torch"])[:2])
    return "fsdp" if facts["gpu_count"] >= nprocs or release >= (2, 7) else "ddp"


def unanswered(path: Any, first: Any = None) -> bool:
    """Whether the learner's file is still the skeleton: it keeps its ``TODO(exercise)`` line
    and, when its first launch ``first`` is given, that launch ran and reported no steps (the
    skeleton's). A job written under the TODO line, the line left in, is the learner's."""
    if "TODO(exercise)" not in Path(path).read_text():
        return False
    return first is None or (first.ok and not rank_steps(first))


def check_so_far(runs: Any) -> Any:
    """``ddplab.check("13", runs)`` on the first of the five launches, as notebook 13 asks it:
    where they are right, one line says so (the notebook's cells below launch the rest) rather
    than asking the learner to hand in all five."""
    from ... import checks

    hint = judge_capstone(runs)
    if hint is not None and RIGHT_SO_FAR in hint:
        given = {"ddp"} if is_run_result(runs) else set(runs)
        hint = (f"{RIGHT_SO_FAR}; the cells below launch the rest "
                f"({', '.join(name for name in RUNS if name not in given)}).")
    elif hint is not None:
        hint = f"not yet: {hint}"
    message = f"Exercise 13 ({Path(SKELETON).name}): {hint or 'correct!'}"
    print(message)
    return checks.Verdict("13", hint is None, message)


def judged_wrong(verdict: Any) -> bool:
    """Whether ``ddplab.check("13", ...)`` found a mistake in the runs it was given: false when
    they were right, also when it only asks for the launches not handed in yet. Notebook 13 then
    launches the job no further (a wrong job could hang in every launch)."""
    return not verdict and RIGHT_SO_FAR not in verdict.message


@judge("13", "capstone.py", "a DDP and an FSDP2 job with a DistributedSampler and set_epoch, "
       "AMP, a scaled and warmed-up LR, distributed checkpoints saved mid-epoch, evaluation on "
       "rank 0; killed, resumed bit for bit, and resumed on 4 ranks")
def judge_capstone(answer: Any) -> Optional[str]:
    runs = {"ddp": answer} if is_run_result(answer) else dict(answer)
    unknown = set(runs) - set(RUNS) - {"reference"}
    if unknown or not runs or not all(is_run_result(r) for r in runs.values()):
        return ("hand in the launches as a dict: {'ddp': ..., 'fsdp': ..., 'killed': ..., "
                f"'resumed': ..., 'resharded': ...}} (got {sorted(runs)}).")
    for name in ("ddp", "fsdp", "resumed", "resharded"):
        if name in runs:
            failed = run_failed(runs[name])
            if failed:
                return f"the {name} run: {_unfinished_hint(runs[name]) or failed}"
    for name in RUNS:
        if name in runs and not rank_steps(runs[name]) and name != "killed":
            return (f"the {name} run reported no steps: write the job as {SKELETON} specifies, "
                    "and call log_step(step, loss) after every optimizer step.")
    for name in RUNS:
        hint = _load_hint(runs[name]) if name in runs else None
        if hint:
            return f"the {name} run: {hint}"
    if "ddp" not in runs:
        return "hand in the unbroken DDP run too: {'ddp': ..., ...}."
    ddp = runs["ddp"]
    hint = _strategy_hint(ddp, "ddp") or _single_hint(ddp, runs.get("reference") or
                                                      _reference(ddp))
    if hint:
        return f"the ddp run: {hint}"
    if "fsdp" in runs:
        strategy = fsdp_strategy(LAUNCHES["fsdp"][2])
        hint = (_strategy_hint(runs["fsdp"], strategy) or
                _fsdp_hint(runs["fsdp"], ddp, sharded=strategy == "fsdp"))
        if hint:
            return f"the fsdp run: {hint}"
    missing = [name for name in RUNS if name not in runs]
    if missing:
        return (f"what the DDP run did is {RIGHT_SO_FAR}. To judge the rest, hand in all "
                f"five launches, {{'ddp': ..., "
                f"'fsdp': ..., 'killed': ..., 'resumed': ..., 'resharded': ...}} (missing: "
                f"{', '.join(missing)}).")
    return (_killed_hint(runs["killed"], ddp) or
            _resumed_hint(runs["resumed"], runs["killed"], ddp) or
            _resharded_hint(runs["resharded"], runs["killed"], ddp,
                            fsdp_strategy(LAUNCHES["resharded"][2])))


# ------------------------------------------------------------------ the reference's run


def _reference(result: Any) -> Any:
    """A launch of the reference job with this run's arguments and world size, made once per
    process; and once for every process where the environment variable ``DDPLAB_REFERENCE_CACHE``
    names a folder (a class's grading runs each submission in a process of its own): kept there
    as a pickle of the ``RunResult`` (a run that ended well only), under a key of the world size,
    the arguments, torch's and ddplab's versions and the source of the reference job and of the
    given part it imports (:func:`cache_key`). An entry that cannot be read is launched again and
    replaced; one is written whole or not at all (a temporary file, then ``os.replace``)."""
    args = _args(result)
    key = (result.world_size, tuple(sorted(args.items())))
    if key not in _REFERENCES:
        cached = _cache_file(key)
        found = _read_cached(cached) if cached else None
        if found is None:
            found = _launch_reference(result.world_size, args)
            if cached and found.ok:
                _write_cached(cached, found)
        _REFERENCES[key] = found
    return _REFERENCES[key]
