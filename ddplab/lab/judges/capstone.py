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

Lesson: 13.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import pickle
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from ... import env
from . import is_run_result, judge, metric, metrics, run_failed

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
REFERENCE = "ddplab.workers.capstone"
SKELETON = "exercises/capstone.py"
CLOSE = 1e-3          # the loss and gradients of the first steps, against the reference
WEIGHTS = 0.02        # summed squares of the final weights, same world size, another style
ACCURACY = 0.03
RESHARD_LOSS, RESHARD_WEIGHTS, RESHARD_ACCURACY = 0.5, 0.10, 0.15  # 2 -> 4 ranks
RIGHT_SO_FAR = "right so far"   # the verdict on some of the five runs, all right
LATER_TIMEOUT, LATER_FACTOR = 60.0, 6   # a launch after the first: at least, first's wall x
GRACE, GRACE_FACTOR = 20.0, 2   # after a rank exits (or all reach the last step): at least, x
_REFERENCES: dict[tuple, Any] = {}
CACHE_ENV = "DDPLAB_REFERENCE_CACHE"   # a folder: the reference's runs, shared by processes


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
    from .. import checks

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


# ------------------------------------------------------------------ the facts


def _args(result: Any) -> dict[str, Any]:
    return metric(result, "args").get(0) or {}


def rank_steps(result: Any) -> dict[int, dict[int, Any]]:
    """Every rank's step reports, by step number: ``rank_steps(run)[0][5]["loss"]`` is rank 0's
    loss at step 5 (the notebook's plots and the judge read the same)."""
    return {rank: {s["step"]: s for s in values}
            for rank, values in metrics(result, "step").items()}


def summed_squares(result: Any) -> Optional[float]:
    """The summed squares of the final weights (summed over ranks' shards under FSDP): equal for
    two runs that end with the same weights, whatever their strategy or world size."""
    weights = metric(result, "weights")
    if not weights:
        return None
    if _args(result).get("strategy") == "fsdp":
        return sum(sum(w["squares"]) for w in weights.values())
    return sum(weights[min(weights)]["squares"])


def _accuracy(result: Any) -> Optional[float]:
    return metric(result, "accuracy").get(0)


def _close(a: Optional[float], b: Optional[float], rel: float) -> bool:
    return a is not None and b is not None and math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


def _other_lr(a: Optional[float], b: Optional[float]) -> bool:
    """Two LRs that differ; None is a step the GradScaler skipped (overflowing float16
    gradients): it ran with no LR to compare."""
    return a is not None and b is not None and not _close(a, b, 1e-6)


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


def _launch_reference(world_size: int, args: dict[str, Any]) -> Any:
    import ddplab

    folder = tempfile.mkdtemp(prefix="ddplab-13-reference-")
    argv: list[str] = ["--checkpoint-dir", folder]
    for name, value in sorted(args.items()):
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv += [flag] if value else []
        elif value is not None:
            argv += [flag, str(value)]
    try:
        return ddplab.launch(REFERENCE, world_size, args=argv, quiet=True, live=False,
                             timeout=1800)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def cache_key(key: tuple) -> str:
    """The name of a reference run's entry in ``DDPLAB_REFERENCE_CACHE``: a hash of ``key``
    (world size, arguments), torch's and ddplab's versions and the reference's sources."""
    import importlib.util

    import torch

    import ddplab

    digest = hashlib.sha256(repr((key, torch.__version__, ddplab.__version__)).encode())
    for module in (REFERENCE, "ddplab.capstone"):
        spec = importlib.util.find_spec(module)
        digest.update(Path(spec.origin).read_bytes() if spec and spec.origin else b"?")
    return f"capstone-reference-{digest.hexdigest()[:32]}.pickle"


def _cache_file(key: tuple) -> Optional[Path]:
    folder = os.environ.get(CACHE_ENV)
    return Path(folder) / cache_key(key) if folder else None


def _read_cached(path: Path) -> Any:
    try:
        with open(path, "rb") as file:
            found = pickle.load(file)
    except Exception:   # missing, cut short, or written by another version: launch again
        return None
    return found if is_run_result(found) and getattr(found, "ok", False) else None


def _write_cached(path: Path, result: Any) -> None:
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("wb", dir=path.parent, prefix=".tmp-",
                                         delete=False) as file:
            temporary = file.name
            pickle.dump(result, file)
        os.replace(temporary, path)
    except Exception:   # a cache that cannot be written only costs the next process a launch
        if temporary:
            with contextlib.suppress(OSError):
                os.unlink(temporary)


# ------------------------------------------------------------------ one unbroken run


def _load_hint(result: Any) -> Optional[str]:
    for rank, steps in sorted(rank_steps(result).items()):
        for step in sorted(steps):
            for load in steps[step].get("loads") or []:
                if load["map_location"] is None:
                    return (f"rank {rank} read {load['file']} with torch.load and no "
                            "map_location: its tensors go back to the device that saved them "
                            "(rank 0's GPU, for every rank). Load onto this rank's device.")
    return None


def _strategy_hint(result: Any, strategy: str) -> Optional[str]:
    got = _args(result).get("strategy")
    if got != strategy:
        return f"launch it with --strategy {strategy} (it ran with {got})."
    if result.world_size != 2:
        return f"launch it on 2 processes (it ran on {result.world_size})."
    first = min(rank_steps(result).get(0, {0: None}))
    if first != 0:
        return (f"it started at step {first}: an unbroken run starts from nothing, in a "
                "--checkpoint-dir of its own.")
    return None


def _single_hint(result: Any, reference: Any) -> Optional[str]:
    """The first thing in which one unbroken run differs from the reference's, or None."""
    if not reference.ok:
        return f"the reference run failed here ({reference.error}): report this to the course."
    mine, ref = rank_steps(result), rank_steps(reference)
    if set(mine) != set(ref):
        return (f"ranks {sorted(ref)} should report steps; ranks {sorted(mine)} did: every "
                "rank calls log_step.")
    epochs = max(1, int(_args(result).get("epochs", 1)))
    per_epoch = math.ceil(len(ref[0]) / epochs)
    hint = _inputs_hint(mine, ref, "the reference") or _samples_hint(mine, ref, per_epoch)
    if hint:
        return hint
    for rank in sorted(ref):
        if sorted(mine[rank]) != sorted(ref[rank]):
            return (f"rank {rank} reported steps {_span(mine[rank])}, the reference "
                    f"{_span(ref[rank])}: count optimizer steps from 0 over the whole job.")
    for hint in (_autocast_hint(mine, ref), _scaler_hint(mine, ref),
                 _lr_hint(mine, ref, _args(result), result),
                 _loss_hint(mine, ref, result.world_size),
                 _lr_hint(mine, ref, _args(result), result, skipped=True),
                 _save_hint(result, mine), _eval_hint(result, reference)):
        if hint:
            return hint
    return None


def _span(steps: dict[int, Any]) -> str:
    return f"{min(steps)}..{max(steps)}" if steps else "none"


def _samples_hint(mine: dict, ref: dict, per_epoch: int) -> Optional[str]:
    def read(steps: dict[int, Any], first: int, last: int) -> list[float]:
        return [x for s in range(first, last) for x in steps.get(s, {}).get("samples", [])]

    ranks = sorted(ref)
    if mine == {} or all(mine[r].get(s, {}).get("samples") == ref[r][s]["samples"]
                         for r in ranks for s in ref[r]):
        return None
    hint = _epoch_hint(mine, ref, per_epoch)
    if hint:
        return hint
    share = read(ref[0], 0, per_epoch)
    epoch0 = {r: read(mine[r], 0, per_epoch) for r in ranks}
    if len(ranks) > 1 and all(epoch0[r] == epoch0[0] for r in ranks):
        return ("every rank read the same samples in the same order: give each rank its own "
                "share with a DistributedSampler (num_replicas = world size, rank = this rank).")
    if len(ranks) > 1 and len(epoch0[0]) >= 2 * len(share) - len(ranks):
        return (f"rank 0 read {len(epoch0[0])} samples in the first epoch, its share is "
                f"{len(share)}: give the DataLoader the DistributedSampler as sampler=.")
    seen: dict[float, int] = {}
    for r in ranks:
        for x in set(epoch0[r]):
            seen[x] = seen.get(x, 0) + 1
    overlap = sum(1 for n in seen.values() if n > 1)
    if overlap > len(ranks):
        if epoch0[0] == read(ref[0], 0, per_epoch):
            return (f"in the first epoch {overlap} samples were read by more than one rank, "
                    "though rank 0 read its share right: every rank's DistributedSampler must "
                    "use the same seed. With seed + rank, each rank shuffles its own "
                    "permutation and the shares overlap (and other samples are never read).")
        return (f"in the first epoch {overlap} samples were read by more than one rank: the "
                "ranks' shares must not overlap (one DistributedSampler per rank, the same "
                "seed everywhere).")
    if all(epoch0[r] == read(ref[r], 0, per_epoch) for r in ranks):
        for r in ranks:
            if read(mine[r], per_epoch, 2 * per_epoch) == epoch0[r]:
                return (f"rank {r} read its share in the same order in every epoch: call "
                        "set_epoch(epoch) on the sampler at the start of every epoch.")
    return ("the ranks read other samples, or in another order, than the reference: one "
            "DistributedSampler per rank (shuffle, seed = --seed), set_epoch(epoch) every epoch, "
            "and the DataLoader's batch size --batch-size.")


def _epoch_hint(mine: dict, ref: dict, per_epoch: int) -> Optional[str]:
    """Epochs of another length than the reference's (a tail dropped), before any comparison of
    samples that counts on the reference's epochs."""
    pads = ("each rank reads its share of the whole training set, padded to equal length (the "
            "DistributedSampler's drop_last=False), in batches of --batch-size, the last one "
            "short (the DataLoader's drop_last=False)")
    for r in sorted(ref):
        if mine.get(r) and sorted(mine[r]) == list(range(len(mine[r]))) and \
                len(mine[r]) != len(ref[r]):
            return (f"rank {r} reported {len(mine[r])} steps, the reference {len(ref[r])} "
                    f"({per_epoch} an epoch): every epoch {pads}.")
    short = [(r, s) for r in sorted(ref) for s in ref[r]
             if mine[r].get(s, {}).get("samples") != ref[r][s]["samples"]]
    if short and all(s in mine[r] and
                     0 < len(mine[r][s]["samples"]) < len(ref[r][s]["samples"]) and
                     ref[r][s]["samples"][:len(mine[r][s]["samples"])] == mine[r][s]["samples"]
                     for r, s in short):
        r, s = short[0]
        held = len(mine[r][s]["samples"])
        return (f"rank {r}, step {s}: the last batch of the epoch held {held} "
                f"sample{'s' * (held != 1)}, the reference's {len(ref[r][s]['samples'])}: "
                f"every epoch {pads}.")
    return None


def _inputs_hint(mine: dict, ref: dict, whose: str) -> Optional[str]:
    """Inputs that reached the model in another dtype than in ``ref`` (a MixedPrecisionPolicy
    casts them before the model's forward; the data set gives float32)."""
    for rank in sorted(ref):
        for step in sorted(ref[rank]):
            got = mine.get(rank, {}).get(step, {}).get("inputs")
            want = ref[rank][step].get("inputs")
            if got and want and got != want:
                return (f"rank {rank}, step {step}: the model received its inputs in "
                        f"{', '.join(got)}, {whose}'s in {', '.join(want)} (as the data set "
                        "gives them): a MixedPrecisionPolicy (its param_dtype) casts the "
                        "inputs, with the weights, before the model's forward (or the job cast "
                        "them itself). Keep the inputs as they are and run the forward pass and "
                        "the loss under torch.autocast in --amp-dtype, with either strategy.")
    return None


def default_dtype(args: dict[str, Any], nprocs: int) -> str:
    """Autocast's dtype of a run: ``--amp-dtype``, else float16 where the ranks get a GPU each
    (as the jobs place them) and bfloat16 on CPU ranks."""
    return args.get("amp_dtype") or (
        "float16" if env.probe()["gpu_count"] >= nprocs else "bfloat16")


def _autocast_hint(mine: dict, ref: dict) -> Optional[str]:
    for rank in sorted(ref):
        for step in sorted(ref[rank]):
            got, want = mine[rank][step]["autocast"], ref[rank][step]["autocast"]
            if got != want:
                return (f"rank {rank}, step {step}: the forward passes ran with autocast "
                        f"{got}, the reference with {want} (None: no autocast). Compute the "
                        "output and the loss under torch.autocast in --amp-dtype (by "
                        "default bfloat16 on a CPU, float16 on a GPU).")
    return None


def _scaler_hint(mine: dict, ref: dict) -> Optional[str]:
    """A float16 job that never scales its loss (the reference's GradScaler stepped, no
    enabled scaler stepped this job's optimizer)."""
    for rank in sorted(ref):
        scaled = [s for s in ref[rank] if ref[rank][s].get("scaler") is not None]
        if scaled and all(mine[rank][s].get("scaler") is None for s in scaled):
            return (f"rank {rank} trained in float16 without a GradScaler: float16 needs a "
                    "GradScaler (its narrow range rounds small gradients to zero). Scale the "
                    "loss with torch.amp.GradScaler, enabled whenever the dtype is float16.")
    return None


def _lr_hint(mine: dict, ref: dict, args: dict, result: Any, skipped: bool = False
             ) -> Optional[str]:
    """Another LR than the reference's in a step both stepped; with ``skipped``, a step that
    only one of them stepped (the GradScaler skipped it in the other): judged after the losses,
    whose mistakes change where float16 gradients overflow."""
    base, world = args.get("lr"), result.world_size
    for rank in sorted(ref):
        for step in sorted(ref[rank]):
            got, want = mine[rank][step]["lr"], ref[rank][step]["lr"]
            if got == want or _close(got, want, 1e-6):   # None, None: both steps skipped
                continue
            if (got is None or want is None) != skipped:
                continue
            if got is None or want is None:
                return (f"step {step}: {'no' if got is None else 'an'} optimizer step ran "
                        f"before log_step, {'one' if got is None else 'none'} in the "
                        "reference's (a GradScaler skips a step whose float16 gradients "
                        "overflow; the same job overflows in the same steps).")
            said = f"step {step}: the LR was {got:.6g}, it should be {want:.6g}"
            if _close(got, base, 1e-6):
                return (f"{said}: the LR is never scaled nor warmed up (it stays --lr). Set it "
                        "before every optimizer step.")
            if world > 1 and _close(got * world, want, 1e-6):
                return (f"{said}: the LR is not scaled with the world size (the linear "
                        "scaling rule: the global batch is world size times larger).")
            if step == 0 and _close(got, ref[rank][max(ref[rank])]["lr"], 1e-6):
                return (f"{said}: no warm-up; the LR climbs linearly to its peak over "
                        "--warmup-steps steps.")
            return (f"{said}. Count steps over the whole job and warm up over "
                    "--warmup-steps steps to --lr x world size.")
    return None


def _logged_hint(mine: dict, ref: dict) -> Optional[str]:
    """Every rank logged one loss in each of the first steps, the mean (or sum) over the ranks
    of the reference's own losses: the loss was all-reduced before ``log_step``."""
    ranks, first = sorted(ref), sorted(ref[0])[:3]
    if len(ranks) < 2 or not first:
        return None
    for how, combine in (("mean", lambda xs: sum(xs) / len(xs)), ("sum", sum)):
        said = []
        for step in first:
            got = [mine[r][step]["loss"] for r in ranks]
            want = [ref[r][step]["loss"] for r in ranks]
            if max(want) - min(want) <= CLOSE * abs(max(want)) or not all(
                    _close(g, got[0], 1e-6) for g in got) or not _close(got[0], combine(want),
                                                                            CLOSE):
                break
            said.append((step, got[0], want))
        else:
            step, got, want = said[0]
            return (f"step {step}: every rank logged the loss {got:.5g}, the {how} of the "
                    f"ranks' own losses ({', '.join(f'{w:.5g}' for w in want)} in the "
                    f"reference): each rank calls log_step with its own loss, the loss of its "
                    f"batch, not the {how} over the ranks (DDP and FSDP average the gradients, "
                    "not the loss).")
    return None


def _loss_hint(mine: dict, ref: dict, world: int) -> Optional[str]:
    hint = _logged_hint(mine, ref)
    if hint:
        return hint
    for step in sorted(ref[0])[:3]:
        for rank in sorted(ref):
            got, want = mine[rank][step], ref[rank][step]
            if _close(got["loss"], want["loss"], CLOSE) and (
                    None in (got["grad"], want["grad"]) or got["grad"] == want["grad"] or
                    _close(got["grad"], want["grad"], 0.05)):
                continue   # (a grad of None: a step the GradScaler skipped, judged after)
            if world > 1 and (_close(got["loss"] * world, want["loss"], CLOSE) or (
                    got["grad"] is not None and
                    _close(got["grad"] * world * world, want["grad"], 0.05))):
                return (f"step {step}: the loss (or its gradient) is 1/{world} of the "
                        "reference's: do not divide the loss by the world size; DDP (and "
                        "FSDP) already average the gradients over the ranks.")
            if step > 0 and _close(got["loss"], want["loss"], CLOSE) and None not in (
                    got["grad"], want["grad"]):
                return (f"step {step}: the loss is right but the gradient is not "
                        f"({got['grad']:.4g} against {want['grad']:.4g} summed squares): the "
                        "gradients of the previous steps are still in it. Zero them "
                        "(optimizer.zero_grad()) before every backward pass.")
            return (f"rank {rank}, step {step}: the loss was {got['loss']:.5g}, the "
                    f"reference's {want['loss']:.5g}: cross-entropy of the model's output "
                    "on the batch, one optimizer step per batch.")
    return None


def _save_hint(result: Any, mine: dict) -> Optional[str]:
    weights = metric(result, "weights")
    if not any(w.get("files") for w in weights.values()):
        return ("no checkpoint was written under --checkpoint-dir: save one every "
                "--save-every steps.")
    # a whole checkpoint: half the model's bytes at least, in a file that is not DCP's part
    floor = max(1, (weights.get(0) or {}).get("model_bytes", 0) // 2)
    for step in sorted(mine[0]):
        reports = {r: mine[r].get(step) or {} for r in mine}
        whole = any(size >= floor for report in reports.values()
                    for size in (report.get("changed") or {}).values())
        wrote = {r: report.get("bytes") or 0 for r, report in reports.items()}
        for rank in sorted(mine):
            if rank != 0 and whole and wrote[0] >= floor and wrote[rank] >= floor:
                return (f"step {step}: rank {rank} wrote a checkpoint as big as rank 0's: "
                        "with torch.save only rank 0 writes (every rank holds the same "
                        "weights); with torch.distributed.checkpoint every rank calls "
                        "dcp.save and writes only its own part.")
    for rank in sorted(mine):
        if not any(name.endswith(".distcp") for s in mine[rank].values() for name in s["written"]):
            return (f"rank {rank} wrote no part of a distributed checkpoint: save with "
                    "torch.distributed.checkpoint, where every rank calls dcp.save and writes "
                    "its own part (a checkpoint that then loads onto any world size).")
    saves = {step: {str(Path(name).parent) for name in report["written"] if
                    name.endswith(".distcp")} for step, report in mine[0].items()}
    seen: dict[str, int] = {}
    for step, folders in sorted(saves.items()):
        for folder in folders:
            if folder in seen:
                return (f"step {step}: rank 0 wrote its part into {folder} again (first written "
                        f"in step {seen[folder]}): a save that overwrites the last complete "
                        "checkpoint leaves nothing to resume from if it dies half-way. Save "
                        "each checkpoint in a folder of its own.")
            seen[folder] = step
    return None


def _eval_hint(result: Any, reference: Any) -> Optional[str]:
    weights = metric(result, "weights")
    if any(w["wrapper_evals"] for w in weights.values()):
        return ("the evaluation ran the DDP-wrapped model on rank 0 alone: the wrapper's "
                "forward belongs to every rank (it may wait for the others). Evaluate a plain "
                "model on rank 0: the one inside the wrapper, or a copy holding the full "
                "weights.")
    got, want = _accuracy(result), _accuracy(reference)
    if got is None:
        return "no accuracy was reported: rank 0 evaluates and calls log_accuracy(accuracy)."
    scored = (weights.get(0) or {}).get("eval_samples", 0)
    whole = (metric(reference, "weights").get(0) or {}).get("eval_samples", 0)
    if 0 < scored < whole:   # (0: a model the given part does not see, never judged so)
        return (f"rank 0 scored {scored} test samples, the reference {whole}: rank 0 scores "
                "the whole test set (a loader of its own, without the training's "
                "DistributedSampler).")
    if want is not None and abs(got - want) > ACCURACY:
        return (f"rank 0 reported an accuracy of {got:.4f}, the reference {want:.4f}: score "
                "the trained model on the whole test set, in eval mode.")
    mine, theirs = summed_squares(result), summed_squares(reference)
    if not _close(mine, theirs, WEIGHTS):
        return (f"the final weights differ from the reference's (summed squares {mine} "
                f"against {theirs}).")
    return None


def _fsdp_hint(fsdp: Any, ddp: Any, sharded: bool = True) -> Optional[str]:
    """What the fsdp run did wrong; ``sharded=False``: a DDP run where FSDP2 cannot run."""
    mine, ref = rank_steps(fsdp), rank_steps(ddp)
    hint = _inputs_hint(mine, ref, "the ddp run")
    if hint:
        return hint
    for rank in sorted(ref):
        for step in sorted(ref[rank]):
            got, want = mine.get(rank, {}).get(step), ref[rank][step]
            if got is None or got["samples"] != want["samples"] or _other_lr(got["lr"],
                                                                             want["lr"]):
                return (f"rank {rank}, step {step}: other samples or another LR than in the "
                        "ddp run; --strategy changes the wrapping only.")
            if got["autocast"] != want["autocast"]:
                return (f"rank {rank}, step {step}: the forward passes ran with autocast "
                        f"{got['autocast']}, the ddp run's with {want['autocast']} (None: no "
                        "autocast): --strategy changes the wrapping only. Run the forward pass "
                        "and the loss under torch.autocast in --amp-dtype with FSDP2 too.")
        scaled = [s for s in ref[rank] if ref[rank][s].get("scaler") is not None]
        if scaled and all(mine[rank][s].get("scaler") is None for s in scaled):
            return (f"rank {rank} trained in float16 without a GradScaler, the ddp run with "
                    "one: float16 needs a GradScaler with either strategy.")
    weights = metric(fsdp, "weights")
    if sharded and len({tuple(w["sums"]) for w in weights.values()}) < len(weights):
        return ("every rank holds the same weights: with --strategy fsdp, shard the model "
                "with fully_shard (each block, then the root), so that each rank holds a part.")
    units = min(w.get("sharded_units", 0) for w in weights.values())
    if sharded and units < 2:
        return (f"fully_shard made {units} unit(s) of the model: shard each block that holds "
                "parameters, then the root, so that a rank gathers one block's weights at a "
                "time (the whole model at once is DDP's memory again).")
    if not _close(summed_squares(fsdp), summed_squares(ddp), WEIGHTS):
        return (f"the final weights differ from the ddp run's (summed squares "
                f"{summed_squares(fsdp)} against {summed_squares(ddp)}).")
    if _accuracy(fsdp) is None or abs(_accuracy(fsdp) - _accuracy(ddp)) > ACCURACY:
        return (f"rank 0 reported an accuracy of {_accuracy(fsdp)}, the ddp run "
                f"{_accuracy(ddp)}: evaluate the full weights (gathered from the shards).")
    return None


# ------------------------------------------------------------------ killed, then resumed


def _fault(killed: Any) -> dict[str, Any]:
    """What the killed rank reported as it died: the step, and whether rank 0 was saving."""
    return next(iter(metric(killed, "fault").values()), None) or {}


def _kill_step(killed: Any) -> Optional[int]:
    return _fault(killed).get("step")


def _resume_step(killed: Any) -> int:
    """The step the last checkpoint before the kill holds: every --save-every steps."""
    every = int(_args(killed).get("save_every", 1))
    return (_kill_step(killed) or 0) // every * every


def _killed_hint(killed: Any, ddp: Any) -> Optional[str]:
    step = _kill_step(killed)
    cause = killed.root_cause
    if step is None or killed.ok or cause is None or cause.rank != 1:
        how = cause and (cause.message or cause.signal or (
            "its exit unreported" if cause.exitcode is None else f"exit code {cause.exitcode}"))
        seen = ("it reported no fault" if step is None else "it ended ok" if killed.ok else
                "no rank failed" if cause is None else f"rank {cause.rank} failed first: {how}")
        return (f"the killed run did not die on rank 1 ({seen}): launch it with --kill-rank 1 "
                "--kill-at-step K (mid-epoch, after a checkpoint) and a --checkpoint-dir of "
                "its own.")
    differs = [k for k, v in _args(ddp).items() if _args(killed).get(k) != v]
    if differs or killed.world_size != ddp.world_size:
        return ("launch the killed run like the ddp run (same arguments, 2 processes), "
                f"plus the fault (it differs in {', '.join(differs) or 'world size'}).")
    if min(rank_steps(killed).get(0, {0: None})) != 0:
        return "the killed run must start from nothing: give it a --checkpoint-dir of its own."
    if _fault(killed).get("rank_0_saving"):
        return (f"rank 1 went on to step {step} while rank 0 was still writing the checkpoint "
                "before it: had rank 1's machine failed there, the job would have lost that "
                "checkpoint. No rank may go past a save before the checkpoint is whole (a "
                "barrier after rank 0's torch.save; dcp.save waits by itself).")
    if _resume_step(killed) == 0:
        return ("the kill came before the first checkpoint: kill in a later step "
                "(--kill-at-step beyond --save-every).")
    return None


def _resumed_hint(resumed: Any, killed: Any, ddp: Any) -> Optional[str]:
    want = _resume_step(killed)
    mine, ref = rank_steps(resumed), rank_steps(ddp)
    if _args(resumed).get("strategy") != "ddp" or resumed.world_size != ddp.world_size:
        return "launch the resumed run like the ddp run: --strategy ddp, 2 processes."
    first = min(mine[0])
    if first == 0:
        return (f"the resumed run started again from step 0: find the newest complete "
                f"checkpoint in --checkpoint-dir (step {want}) and load it.")
    if first < want:
        return _early_hint(resumed, killed, ddp, first, want)
    if first > want:
        return (f"the resumed run started at step {first}; the last checkpoint holds step "
                f"{want}: resume from the step the checkpoint holds.")
    for rank in sorted(ref):
        for step in sorted(mine[rank]):
            got, exp = mine[rank][step], ref[rank].get(step, {})
            if got["samples"] != exp.get("samples"):
                return _order_hint(rank, step, got["samples"], ref[rank])
            if step == first and got["loss"] != exp.get("loss"):
                return (f"rank {rank}, step {step}: the loss differs from the unbroken run's "
                        "on the same batch: load the model's weights from the checkpoint.")
            skipped = got["optimizer_steps"] != exp.get("optimizer_steps")  # by one scaler
            if step == first and got["state"] != exp.get("state") and not skipped:
                return (f"rank {rank}, step {step}: the weights are restored but not the "
                        "optimizer's state (SGD's momentum): load the optimizer too (and "
                        "the GradScaler's, where one is enabled).")
            if step == first and got.get("scaler") != exp.get("scaler"):
                return (f"rank {rank}, step {step}: the weights are restored but not the "
                        f"GradScaler (its state {got.get('scaler')}, the unbroken "
                        f"run's {exp.get('scaler')}): a new scaler starts from its initial "
                        "scale and skips or overflows steps the unbroken job did not. Save "
                        "scaler.state_dict() in the checkpoint and load it on resume.")
            if got["lr"] != exp.get("lr"):
                return (f"step {step}: the LR was {got['lr']}, the unbroken run's "
                        f"{exp.get('lr')}: the step count comes from the checkpoint.")
            if got["loss"] != exp.get("loss"):
                return (f"rank {rank}, step {step}: the resumed run drifted from the "
                        "unbroken one: the checkpoint must hold everything training depends "
                        "on, and the resume restore all of it.")
    if summed_squares(resumed) != summed_squares(ddp) or _accuracy(resumed) != _accuracy(ddp):
        return (f"the resumed run ended with other weights or accuracy than the unbroken one "
                f"({summed_squares(resumed)}, {_accuracy(resumed)} against {summed_squares(ddp)}, "
                f"{_accuracy(ddp)}): on the same world size a resume is exact.")
    return None


def _saved_after(run: Any) -> list[int]:
    """The steps after which rank 0 wrote a part of a distributed checkpoint (reported with the
    step after them)."""
    return sorted(step - 1 for step, report in rank_steps(run).get(0, {}).items()
                  if any(name.endswith(".distcp") for name in report["written"]))


def _folders(report: dict) -> set[str]:
    return {str(Path(name).parent) for name in report.get("written") or []
            if name.endswith(".distcp")}


def _early_hint(resumed: Any, killed: Any, ddp: Any, first: int, want: int) -> str:
    """Why the resume started before step ``want`` (the killed run's last checkpoint was whole:
    a rank that went past an unfinished save is named with the killed run)."""
    every = int(_args(killed).get("save_every", 1))
    if not _fault(killed).get("rank_0_saved", True):
        after = [s for s in _saved_after(killed) if s < want]
        did = f" (it saved after steps {', '.join(map(str, after))})" if after else ""
        return (f"the resumed run started at step {first}: the killed run saved no checkpoint "
                f"after step {want - 1}, the last --save-every-th step before the kill{did}. "
                f"Save once every --save-every-th step is done (with {every}: after steps "
                f"{every - 1}, {2 * every - 1}, {3 * every - 1}, ...), so that the resume "
                f"begins at step {want}.")
    read = {r["folder"] for values in metrics(resumed, "read").values() for r in values
            if r.get("complete")}
    steps = rank_steps(ddp).get(0, {})
    newest = _folders(steps.get(want, {}))
    known = set().union(*(_folders(report) for report in steps.values()))
    if read and newest and read <= known:
        if read & newest:
            return (f"the resumed run started at step {first}, from {sorted(read & newest)[0]}"
                    f": the complete checkpoint saved once step {want - 1} was done, from which "
                    f"the job goes on at step {want}. The step the checkpoint records (or the "
                    f"one the resume counts from it) is off by {want - first}.")
        return (f"the resumed run loaded {', '.join(sorted(read))}, not the newest complete "
                f"checkpoint ({sorted(newest)[0]}, saved after step {want - 1}): resume from "
                "the newest one whose save finished.")
    return (f"the resumed run started at step {first}; the killed run saved a complete "
            f"checkpoint after step {want - 1} (no rank went past it before it was whole): load "
            f"the newest complete checkpoint and go on at the step after the one it holds "
            f"({want}).")


def _order_hint(rank: int, step: int, batch: list, unbroken: dict) -> str:
    """The resumed run's batch at ``step`` is not the unbroken run's: at another place of the
    unbroken rank's order (a wrong skip or epoch), or nowhere in it (another order)."""
    order = [x for s in sorted(unbroken) for x in unbroken[s]["samples"]]
    n = len(batch)
    if n and any(order[i:i + n] == batch for i in range(len(order) - n + 1)):
        return (f"rank {rank}, step {step}: the resumed run read other samples than the "
                "unbroken one: the checkpoint holds where in the epoch the job was; the "
                "resumed job sets that epoch and skips the batches done.")
    return (f"rank {rank}, step {step}: the resumed run read its samples in another order "
            "than the unbroken job (its batch there is in no epoch of the unbroken rank's "
            "order): the sampler was seeded or shuffled otherwise after the resume. Give the "
            "DistributedSampler the same seed, --seed, in every launch: set_epoch(epoch) then "
            "replays the epoch's order.")


def _unfinished_hint(run: Any) -> Optional[str]:
    """A run that read a checkpoint folder without DCP's ``.metadata`` (and then failed)."""
    bad = sorted({r["folder"] for values in metrics(run, "read").values() for r in values
                  if not r.get("complete")})
    if not bad:
        return None
    return (f"it read {bad[0]}, a checkpoint folder without DCP's .metadata: an unfinished "
            "save (DCP writes .metadata last, once every part is on disk; a kill during a "
            "save leaves such a folder, and the launches left one beside the killed run's "
            "newest checkpoint). Resume from the newest complete checkpoint, one whose "
            ".metadata exists.")


def _resharded_hint(resharded: Any, killed: Any, ddp: Any, strategy: str = "fsdp"
                    ) -> Optional[str]:
    if _args(resharded).get("strategy") != strategy or resharded.world_size != 4:
        return (f"launch the resharded run on 4 processes with --strategy {strategy}, on a "
                "copy of the killed run's folder.")
    want = _resume_step(killed)
    mine, ref = rank_steps(resharded), rank_steps(ddp)
    dtype = default_dtype(_args(resharded), resharded.world_size)
    for rank, steps in sorted(mine.items()):
        for step, report in sorted(steps.items()):
            if report["autocast"] != [dtype]:
                return (f"on 4 ranks, step {step}: rank {rank}'s forward passes ran with "
                        f"autocast {report['autocast']}, expected {dtype} (None: no "
                        "autocast): --amp-dtype, else float16 on a GPU and bfloat16 on a "
                        "CPU, whatever dtype the checkpoint was saved in.")
    first = min(mine[0])
    if first != want:
        return (f"the resharded run started at step {first}, the killed run's last "
                f"checkpoint holds step {want}: load it (torch.distributed.checkpoint "
                "reshards it onto 4 ranks).")
    args = _args(resharded)
    peak, warmup = args["lr"] * resharded.world_size, args["warmup_steps"]
    for step, report in sorted(mine[0].items()):
        rule = peak * min(1.0, (step + 1) / warmup) if warmup else peak
        if _other_lr(report["lr"], rule):
            return (f"on 4 ranks step {step} ran with the LR {report['lr']}, the rule gives "
                    f"{rule:.6g}: the peak follows the world size of this launch, not the "
                    "one the checkpoint was saved with.")
    epochs = max(1, int(_args(ddp).get("epochs", 1)))
    per_epoch = math.ceil(len(ref[0]) / epochs)
    end = (want // per_epoch + 1) * per_epoch
    wanted = sorted(x for r in ref.values() for s in range(want, end) for x in r[s]["samples"])
    steps = math.ceil((end - want) * ddp.world_size / resharded.world_size)
    got = sorted(x for r in mine.values() for s, v in r.items() if first <= s < first + steps
                 for x in v["samples"])
    if len(set(got) ^ set(wanted)) > 4:
        return ("on 4 ranks the resumed epoch did not go on with the samples the killed job "
                "had not yet trained on: record in the checkpoint how far into the epoch the "
                "job was in samples, not in steps of one world size.")
    losses = [v["loss"] for r in mine.values() for v in r.values()]
    base = [v["loss"] for r in ref.values() for s, v in r.items() if s >= want]
    if abs(sum(losses) / len(losses) - sum(base) / len(base)) > RESHARD_LOSS:
        return (f"on 4 ranks the mean loss was {sum(losses) / len(losses):.3f}, the unbroken "
                f"run's over the same part of the job {sum(base) / len(base):.3f}: load the "
                "model and the optimizer from the checkpoint.")
    if not _close(summed_squares(resharded), summed_squares(ddp), RESHARD_WEIGHTS):
        return (f"on 4 ranks the final weights are far from the unbroken run's (summed "
                f"squares {summed_squares(resharded)} against {summed_squares(ddp)}).")
    accuracy = _accuracy(resharded)
    if accuracy is None or abs(accuracy - _accuracy(ddp)) > RESHARD_ACCURACY:
        return (f"on 4 ranks the accuracy was {accuracy}, the unbroken run's "
                f"{_accuracy(ddp)}.")
    return None
