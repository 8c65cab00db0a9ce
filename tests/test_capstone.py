"""The capstone (13), what is not a variant: the judge's registration, the skeleton's verdict,
the watch's report of the GradScaler and the judge's decisions on recorded runs.

The right jobs and the classic mistakes, launched for real, are in
``tests/test_exercise_variants.py`` (one launch of each, and the reference's five runs once per
set of arguments), among them a resume that leaves out the GradScaler, launched in float16 on
the CPU (``--amp-dtype float16``). Here: where the reference enables the scaler (float16 only,
by default a GPU's dtype, seen with torch.cuda reporting GPUs), the watch's report of a real
CPU scaler, the reference's checkpoint round-tripping one, and the judge's reading of runs
recorded as a GPU run reports them (steps the scaler skipped included)."""

from __future__ import annotations

import ast
import json
import os
import warnings
from unittest import mock
from pathlib import Path

import pytest
import torch
from test_exercises_hints import answer_named

import ddplab
from ddplab import RunResult, events
from ddplab.capstone import _Watch
from ddplab.lab import grading, judges
from ddplab.lab.judges import capstone as judge13, metric

ROOT = Path(__file__).resolve().parent.parent
SKELETON = ROOT / "exercises" / "capstone.py"


def test_registered_with_its_skeleton():
    assert judges.load_all()["13"].skeleton == "capstone.py"
    assert judges.skeleton_path("13") == SKELETON
    assert judge13.unanswered(SKELETON)


def test_the_judges_launches_are_the_notebooks():
    """Notebook 13's five ``NAME = lab.run(folder, *args, n=N)`` calls are the judge's LAUNCHES
    (which ``ddplab check 13`` and the variants launch); the two resumes start from the
    checkpoints the killed run left, and the job is launched by no other call."""
    cells = json.loads((ROOT / "notebooks" / "13_capstone.ipynb").read_text())["cells"]
    tree = ast.parse("\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code"))
    made, starts = {}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and getattr(
                node.value.func, "attr", None) == "run":
            assert node.value.func.value.id == "lab", ast.unparse(node)
            folder, *extra = node.value.args
            keywords = {k.arg: k.value for k in node.value.keywords}
            name = node.targets[0].id
            made[name] = (tuple(a.value for a in extra), folder.value,
                          keywords["n"].value if "n" in keywords else 2)
            starts[name] = getattr(keywords.get("checkpoints"), "id", None)
    assert {name: made.get(name) for name in judge13.RUNS} == judge13.LAUNCHES
    assert starts == {"ddp": None, "fsdp": None, "killed": None, "resumed": "killed",
                      "resharded": "killed"}
    launches = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Call) and
                getattr(n.func, "attr", None) == "launch"]
    assert len(launches) == 1 and "../exercises/capstone.py" in launches[0], launches
    assert "lab.leave_unfinished_save(killed)" in ast.unparse(tree)


def test_ddplab_check_launches_the_five_runs(tmp_path, monkeypatch):
    launched = []

    def launch(target, size, spec, timeout, args=(), on_event=None):
        launched.append((size, list(args)))
        Path(args[1]).mkdir(parents=True, exist_ok=True)   # the checkpoint folder
        return RunResult(status="failed", returncode=1, wall_time=0.0, world_size=size)

    monkeypatch.setattr(grading, "_launch", launch)
    job = tmp_path / "capstone.py"
    job.write_text("# a job without its TODO\n")
    outcome = grading._judge_capstone(grading.LAUNCHES["13"], str(job), 300.0, 0.0)
    folders = [Path(args[1]).name for _, args in launched]
    assert [(size, args[2:]) for size, args in launched] == [   # ddp where FSDP2 cannot run
        (size, [judge13.fsdp_strategy(size) if a == "fsdp" else a for a in extra])
        for extra, _, size in judge13.LAUNCHES.values()]
    assert folders == [folder for _, folder, _ in judge13.LAUNCHES.values()]
    assert "the ddp run" in outcome.message, outcome
    assert outcome.sizes == list(grading.LAUNCHES["13"].sizes) == sorted(
        {size for _, _, size in judge13.LAUNCHES.values()})


def test_the_skeleton_is_told_to_write_the_job(tmp_path):
    result = ddplab.launch(str(SKELETON), 2, args=["--checkpoint-dir", str(tmp_path)],
                           quiet=True, live=False, timeout=300)   # a safety net
    assert result.ok, result.error
    message = ddplab.check("13", result).message
    assert "reported no steps" in message and "log_step" in message
    assert not answer_named("13", message), message   # the spec's report, not the job's code


# ----------------------------------------------------------------------------- the GradScaler


@pytest.mark.parametrize("gpus,amp_dtype,dtype", [
    (0, None, torch.bfloat16), (0, "float16", torch.float16),
    (2, None, torch.float16), (2, "bfloat16", torch.bfloat16)])
def test_the_reference_scales_the_loss_of_float16_only(monkeypatch, gpus, amp_dtype, dtype):
    from ddplab.workers import capstone as reference

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    device = reference.this_device()
    assert device == (torch.device("cuda", 1) if gpus else torch.device("cpu"))
    assert reference.precision(amp_dtype, device) == (dtype, dtype == torch.float16)


@pytest.mark.parametrize("gpus,processes,device", [
    (1, 1, "cuda"), (1, 2, "cpu"), (1, 4, "cpu"), (2, 2, "cuda"), (2, 4, "cpu"), (0, 1, "cpu")])
def test_the_reference_runs_on_gpus_only_when_every_process_gets_one(monkeypatch, gpus,
                                                                     processes, device):
    from ddplab.workers import capstone as reference

    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(processes))
    monkeypatch.setenv("LOCAL_RANK", str(processes - 1))
    with mock.patch.multiple(torch.cuda, is_available=mock.Mock(return_value=gpus > 0),
                             device_count=mock.Mock(return_value=gpus)):
        got = reference.this_device()
    assert got.type == device
    assert got.index == (processes - 1 if device == "cuda" else None)


def test_the_reference_turns_determinism_on_for_gpus_only(monkeypatch):
    from ddplab.workers import capstone as reference

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              torch.backends.cudnn.benchmark)
    try:
        assert not reference.deterministic(torch.device("cpu"))
        assert not torch.are_deterministic_algorithms_enabled()
        assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
        assert reference.deterministic(torch.device("cuda", 0))
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1:]


def _reported(capsys) -> list[dict]:
    return [e for e in map(events.parse, capsys.readouterr().out.splitlines()) if e]


def _train(watch: _Watch, scaler, steps: int = 3) -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer.register_step_pre_hook(watch.optimizer_step)  # this optimizer only
    for step in range(steps):
        optimizer.zero_grad()
        loss = model(torch.ones(4, 3)).square().sum()
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        watch.log_step(step, loss)


@pytest.mark.parametrize("enabled", [True, False, None])
def test_the_watch_reports_the_grad_scaler_that_stepped(capsys, enabled):
    scaler = None if enabled is None else torch.amp.GradScaler("cpu", init_scale=1024.0,
                                                                 enabled=enabled)
    _train(_Watch(), scaler)
    reported = [e["value"]["scaler"] for e in _reported(capsys) if e.get("name") == "step"]
    assert len(reported) == 3
    if enabled:   # after each step's update(): the growth count climbs
        assert reported[-1] == json.loads(json.dumps(scaler.state_dict()))
        assert len({json.dumps(r, sort_keys=True) for r in reported}) == 3
    else:
        assert reported == [None, None, None]


def test_the_reference_checkpoint_holds_the_grad_scaler(tmp_path):
    """What the reference does on a GPU (an enabled scaler saved and resumed), on the CPU."""
    from ddplab.workers import capstone as reference

    def job():
        model = torch.nn.Linear(3, 2)
        return (model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                torch.amp.GradScaler("cpu", init_scale=1024.0))

    model, optimizer, scaler = job()
    for _ in range(3):
        optimizer.zero_grad()
        scaler.scale(model(torch.ones(4, 3)).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
    scaler.update(512.0)   # as after an overflow: no longer the initial scale
    progress = {"step": 3, "epoch": 0, "samples": 12}
    with warnings.catch_warnings():   # dcp without a process group: one process, as here
        warnings.simplefilter("ignore", UserWarning)
        reference.save(str(tmp_path), 3, model, optimizer, scaler, progress)
        again = job()
        assert reference.resume(str(tmp_path), *again) == progress
    assert again[2].state_dict() == scaler.state_dict() != job()[2].state_dict()


# ----------------------------------------------------------------------------- recorded runs

TRAINED = {"scale": 32768.0, "growth_factor": 2.0, "backoff_factor": 0.5,
           "growth_interval": 2000}   # the scaler as a GPU run reports it: halved once


def _step(rank: int, step: int, scaler) -> dict:
    return {"step": step, "loss": 2.0 / (step + 1) + rank, "time": float(step),
            "samples": [float(1000 * step + 10 * rank + i) for i in range(4)],
            "autocast": ["float16"], "optimizer_steps": 1, "lr": 0.04 * min(1, (step + 1) / 10),
            "grad": 0.5 + step, "state": 0.1 * step, "scaler": scaler,
            "written": [f"step-{step}/__{rank}_0.distcp"] if step and step % 8 == 0 else [],
            "loads": [], "bytes": None, "changed": {}, "wrapper_evals": 0, "eval_samples": 0}


SKIPPED = {"optimizer_steps": 0, "lr": None, "grad": None, "state": None}  # by the GradScaler


def _run(steps, scaler=lambda step: {**TRAINED, "_growth_tracker": step + 1}, *,
         state=lambda step: 0.1 * step, fault=None, status="ok", skipped=()) -> RunResult:
    """A 2-rank ddp run as the capstone's events report it (``skipped``: the steps whose
    float16 gradients overflowed, so that the GradScaler skipped the optimizer's step)."""
    found = {}
    for rank in (0, 1):
        found[rank] = [{"kind": "metric", "rank": rank, "name": "args", "value": {
            "strategy": "ddp", "epochs": 2, "save_every": 8, "lr": 0.02, "warmup_steps": 10,
            "batch_size": 2}}]
        found[rank] += [{"kind": "metric", "rank": rank, "name": "step",
                         "value": {**_step(rank, s, scaler(s)), "state": state(s),
                                   **(SKIPPED if s in skipped else {})}}
                        for s in steps]
        found[rank].append({"kind": "metric", "rank": rank, "name": "weights", "value": {
            "sums": [1.0], "squares": [2.0], "wrapper_evals": 0, "eval_samples": 0,
            "sharded_units": 0, "files": ["step-8/.metadata"]}})
    if fault is not None:
        found[1].append({"kind": "metric", "rank": 1, "name": "fault",
                         "value": {"step": fault, "rank_0_saving": False}})
    found[0].append({"kind": "metric", "rank": 0, "name": "accuracy", "value": 0.9})
    return RunResult(status=status, returncode=0 if status == "ok" else 1, wall_time=1.0,
                     world_size=2, events=found)


def test_a_resume_without_the_grad_scaler_is_named():
    unbroken, killed = _run(range(32)), _run(range(27), fault=26, status="failed")
    assert judge13._resumed_hint(_run(range(24, 32)), killed, unbroken) is None
    def fresh(step: int) -> dict:   # a new scaler from step 24 on: the initial scale
        return {**TRAINED, "scale": 65536.0, "_growth_tracker": step - 23}

    hint = judge13._resumed_hint(_run(range(24, 32), scaler=fresh), killed, unbroken)
    assert "not the GradScaler" in hint and "holds the scaler too" in hint, hint
    assert "state_dict" not in hint   # the requirement (point 8), not the call
    neither = _run(range(24, 32), scaler=fresh, state=lambda step: 0.0)
    assert "not the optimizer's state" in judge13._resumed_hint(neither, killed, unbroken)
    # the new scaler's larger scale overflows the first step: the scaler is named, not the
    # optimizer (the skipped step's optimizer state is not there to compare)
    overflowed = _run(range(24, 32), scaler=fresh, skipped=(24,))
    assert "not the GradScaler" in judge13._resumed_hint(overflowed, killed, unbroken)


def test_a_float16_job_that_never_scales_is_told_so_before_any_resume():
    """No GradScaler at all is named in the ddp run (the reference's scaler skipped step 1,
    this job stepped there), not later as a resume that left the scaler out (above)."""
    never = _run(range(32), scaler=lambda step: None)
    message = ddplab.check("13", {"ddp": never, "reference": _run(range(32), skipped=(1,))}
                           ).message
    assert "the ddp run" in message and "float16 needs a GradScaler" in message, message
    unscaled = _run(range(32), scaler=lambda step: None)   # bfloat16: the reference's neither
    message = ddplab.check("13", {"ddp": never, "reference": unscaled}).message
    assert "what the DDP run did is right" in message, message


def test_a_checkpoint_without_a_rank_s_part_is_named():
    ddp = _run(range(32))
    for event in ddp.events[1]:   # rank 0 alone saved (torch.save after a barrier, say)
        if event["name"] == "step":
            event["value"]["written"] = []
    message = ddplab.check("13", {"ddp": ddp, "reference": _run(range(32))}).message
    assert "rank 1 wrote no part of a distributed checkpoint" in message, message


def test_a_cpu_run_has_no_scaler_to_compare():
    unbroken, killed = _run(range(32), scaler=lambda step: None), _run(range(27), fault=26)
    assert judge13._resumed_hint(_run(range(24, 32), scaler=lambda step: None), killed,
                                 unbroken) is None


def test_a_step_the_grad_scaler_skipped_is_compared_as_such():
    ddp = _run(range(32), skipped=(1, 20))
    message = ddplab.check("13", {"ddp": ddp, "reference": ddp}).message
    assert "what the DDP run did is right" in message, message
    message = ddplab.check("13", {"ddp": ddp, "reference": _run(range(32), skipped=(20,))}).message
    assert "step 1: no optimizer step ran" in message and "GradScaler skips" in message, message


def test_one_run_alone_is_judged_and_asks_for_the_others():
    ddp = _run(range(32))
    verdict = ddplab.check("13", {"ddp": ddp, "reference": ddp})
    assert "what the DDP run did is right" in verdict.message and "fsdp, killed" in verdict.message
    assert not verdict and not judge13.judged_wrong(verdict)    # notebook 13 goes on launching
    assert "hand in all five" in verdict.message   # to one who calls ddplab.check with one run


def test_the_notebooks_partial_verdict_says_the_cells_below_launch_the_rest(capsys, monkeypatch):
    _machine(monkeypatch, "2.6.0", 0)   # no FSDP2 here: a ddp run stands for the fsdp one
    ddp = _run(range(32))
    verdict = judge13.check_so_far({"ddp": ddp, "fsdp": ddp, "reference": ddp})
    assert capsys.readouterr().out.strip() == verdict.message
    assert "right so far" in verdict.message and "killed, resumed, resharded" in verdict.message
    assert "hand in" not in verdict.message and "fsdp" not in verdict.message, verdict.message
    assert not verdict and not judge13.judged_wrong(verdict)
    other = {"ddp": ddp, "reference": _run(range(32), skipped=(20,))}
    wrong = judge13.check_so_far(other)
    assert "not yet: the ddp run" in wrong.message and judge13.judged_wrong(wrong)
    assert wrong.message == ddplab.check("13", other).message   # as ddplab.check says it


def test_a_first_run_judged_wrong_stops_the_notebooks_launches():
    verdict = ddplab.check("13", {"ddp": _run(range(32)),
                                  "reference": _run(range(32), skipped=(20,))})
    assert judge13.judged_wrong(verdict), verdict.message


# ----------------------------------------------------------------------------- FSDP2 or not

def _machine(monkeypatch, torch_version: str, gpus: int) -> None:
    """The machine the judge asks about (ddplab's probe, as notebook 13's first cells do)."""
    monkeypatch.setattr(ddplab.env, "probe", lambda refresh=False: {
        "torch": torch_version, "gpu_count": gpus})


@pytest.mark.parametrize("torch_version,gpus,on_2,on_4", [
    ("2.6.0", 0, "ddp", "ddp"), ("2.6.0+cu124", 4, "fsdp", "fsdp"),
    ("2.6.0+cu124", 2, "fsdp", "ddp"), ("2.6.0+cu124", 1, "ddp", "ddp"),
    ("2.7.1", 0, "fsdp", "fsdp"), ("2.14.1+cpu", 0, "fsdp", "fsdp"), ("2.14.1", 1, "fsdp", "fsdp")])
def test_the_fsdp_runs_use_ddp_where_fsdp2_cannot_run(monkeypatch, tmp_path, torch_version,
                                                      gpus, on_2, on_4):
    """Notebook 13 and ``ddplab check 13`` launch what the judge expects: ``--strategy ddp``
    for an fsdp run whose ranks land on the CPU (no GPU, or fewer GPUs than its processes) on
    torch 2.6, where the job refuses fsdp."""
    _machine(monkeypatch, torch_version, gpus)
    assert (judge13.fsdp_strategy(2), judge13.fsdp_strategy(4)) == (on_2, on_4)
    launched = judge13.launch_runs(lambda nprocs, args: args, tmp_path)
    assert {name: args[args.index("--strategy") + 1] for name, args in launched.items()
            if "--strategy" in args} == {"fsdp": on_2, "resharded": on_4}


@pytest.mark.parametrize("gpus,processes,device", [
    (0, 2, "cpu"), (1, 1, "cuda"), (1, 2, "cpu"), (2, 2, "cuda"), (2, 4, "cpu")])
def test_the_job_refuses_fsdp_by_the_device_its_rank_runs_on(monkeypatch, tmp_path, capsys,
                                                             gpus, processes, device):
    """``parse_args`` asks ``fsdp_problem`` about the device the rank trains on: the CPU when
    the GPUs are fewer than the processes (the reference's placement), not any GPU there is."""
    from ddplab import capstone, sharded

    asked = []
    monkeypatch.setattr(sharded, "fsdp_problem", lambda d: asked.append(d.type) or "refused")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(processes))
    monkeypatch.setenv("WORLD_SIZE", str(processes))
    with mock.patch.multiple(torch.cuda, is_available=mock.Mock(return_value=gpus > 0),
                             device_count=mock.Mock(return_value=gpus)):
        with pytest.raises(SystemExit):
            capstone.parse_args(["--strategy", "fsdp", "--checkpoint-dir", str(tmp_path)])
    assert asked == [device] and "--strategy fsdp: refused" in capsys.readouterr().err


@pytest.mark.parametrize("torch_version,gpus", [("2.6.0", 0), ("2.7.0", 0), ("2.6.0", 1)])
def test_an_fsdp_run_with_ddp_is_right_only_where_fsdp2_cannot_run(monkeypatch, torch_version,
                                                                    gpus):
    _machine(monkeypatch, torch_version, gpus)
    ddp = _run(range(32))
    message = ddplab.check("13", {"ddp": ddp, "fsdp": _run(range(32)), "reference": ddp}).message
    if judge13.fsdp_strategy(2) == "ddp":   # FSDP2's own checks (sharded weights) left out
        assert "what the DDP run did is right" in message and "fsdp," not in message, message
    else:
        assert "the fsdp run: launch it with --strategy fsdp" in message, message


def test_the_kill_blames_a_save_only_when_the_rank_did_not_wait_for_it(monkeypatch, tmp_path):
    """Rank 1's view at the kill (the given part): rank 0 starts its save KILL_SAVE_DELAY_S
    late, so a rank that arrives sooner did not wait for it (a save without a barrier); one that
    arrives later waited in a collective or a barrier, and rank 0 may still be returning from
    the save: that is no fault of the job (it was once called one on a busy machine)."""
    import os
    import threading

    from ddplab import capstone

    monkeypatch.setattr(capstone.tempfile, "gettempdir", lambda: str(tmp_path))
    watch = _Watch()
    for case, (began_ago, ended_after) in {"no barrier": (0.0, None),
                                           "waited, save returning": (2.0, 0.3),
                                           "waited, save returned": (2.0, 0.0)}.items():
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", case.replace(" ", "-").replace(",", ""))
        began = Path(watch.marker("began"))
        began.parent.mkdir(parents=True)
        began.touch()
        os.utime(began, (began.stat().st_atime, began.stat().st_mtime - began_ago))
        end = None
        if ended_after is not None:
            end = threading.Timer(ended_after, Path(watch.marker("ended")).touch)
            end.start()
            if not ended_after:
                end.join()
        saving, saved = watch.rank_0_saving()
        if end is not None:
            end.join()
        assert saving == (case == "no barrier") and saved, case
        assert not began.parent.exists()  # the markers go with the answer
    # a job that saves after other steps: no save began; the rank says so once it stops waiting
    monkeypatch.setattr(capstone, "SAVE_WAIT_S", 0.2)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "no-save")
    assert watch.rank_0_saving() == (False, False)


# ------------------------------------------------------------------------- the TODO line left in


def test_a_job_written_under_the_todo_line_is_the_learners(tmp_path):
    """A right job whose ``# TODO(exercise)`` line was not deleted: its first launch reported
    steps, so it is judged as the learner's, not taken for the skeleton."""
    job = tmp_path / "capstone.py"
    job.write_text((ROOT / "tests" / "solutions" / "capstone.py").read_text() +
                   "\n# TODO(exercise): the job (see the specification above).\n")
    trained, skeleton = _run(range(32)), RunResult(status="ok", returncode=0, wall_time=1.0,
                                                   world_size=2, events={0: [], 1: []})
    assert judge13.unanswered(job) and judge13.unanswered(job, skeleton)
    assert not judge13.unanswered(job, trained)
    assert not judge13.unanswered(job, _run(range(3), status="failed"))   # a job, if a broken one
    assert judge13.unanswered(SKELETON, skeleton)
    assert not judge13.unanswered(ROOT / "tests" / "solutions" / "capstone.py", skeleton)


def test_ddplab_check_launches_the_five_runs_of_a_job_that_kept_its_todo(tmp_path, monkeypatch):
    launched = []

    def launch(target, size, spec, timeout, args=(), on_event=None):
        launched.append(Path(args[1]).name)
        Path(args[1]).mkdir(parents=True, exist_ok=True)
        if launched == ["first"]:
            return _run(range(32))   # it trained: the learner's job
        return RunResult(status="failed", returncode=1, wall_time=0.0, world_size=size)

    monkeypatch.setattr(grading, "_launch", launch)
    job = tmp_path / "capstone.py"
    job.write_text("# TODO(exercise): the job (see the specification above).\n")
    outcome = grading._judge_capstone(grading.LAUNCHES["13"], str(job), 300.0, 0.0)
    assert "the ddp run" in outcome.message and outcome.sizes == list(grading.LAUNCHES["13"].sizes)
    assert launched == ["first", *(folder for _, folder, _ in judge13.LAUNCHES.values())]


def test_ddplab_check_launches_a_job_that_kept_its_todo_once_when_that_run_fails(tmp_path,
                                                                                monkeypatch):
    """A failed (or hung) first run of a file that kept its TODO is judged alone: five more
    launches would fail, or hang to their timeouts, as it did."""
    launched = []

    def launch(target, size, spec, timeout, args=(), on_event=None):
        launched.append(Path(args[1]).name)
        return _run(range(3), status="failed")

    monkeypatch.setattr(grading, "_launch", launch)
    job = tmp_path / "capstone.py"
    job.write_text("# TODO(exercise): the job (see the specification above).\n")
    outcome = grading._judge_capstone(grading.LAUNCHES["13"], str(job), 300.0, 0.0)
    assert launched == ["first"] and outcome.sizes == list(grading.LAUNCHES["13"].sizes)[:1]


def test_a_killed_run_that_did_not_die_on_rank_1_says_what_it_did_instead():
    from ddplab.failures import RankFailure
    from ddplab.launcher.results import RunResult
    from ddplab.lab.judges import capstone as judge

    fault = {1: [{"kind": "metric", "name": "fault", "rank": 1,
                  "value": {"step": 5, "rank_0_saving": False}}]}
    lost = RankFailure(rank=0, exitcode=1, message="RuntimeError: the peer went away")
    killed = RunResult(status="failed", returncode=1, wall_time=1.0, world_size=2,
                       events=fault, root_cause=lost)
    hint = judge._killed_hint(killed, killed)
    assert "did not die on rank 1 (rank 0 failed first: RuntimeError: the peer went away)" in hint
    killed.root_cause = RankFailure(rank=0, exitcode=None)  # (its exit unknown: not "None")
    assert "(rank 0 failed first: its exit unreported)" in judge._killed_hint(killed, killed)
    killed.root_cause = RankFailure(rank=0, exitcode=3)
    assert "(rank 0 failed first: exit code 3)" in judge._killed_hint(killed, killed)
    no_fault = RunResult(status="ok", returncode=0, wall_time=1.0, world_size=2)
    assert "(it reported no fault)" in judge._killed_hint(no_fault, no_fault)


# ------------------------------------------------------------------ a hang after the first launch


def test_the_launches_after_a_right_first_one_end_a_hang_once_it_is_certain(tmp_path):
    first = _run(range(32))   # ddp, 2 ranks, steps 0..31, 1 s
    watch = judge13.hang_watch(first, 2)
    assert watch["timeout"] == judge13.LATER_TIMEOUT   # a minute on the digits, not 300 s
    on_event = watch["on_event"]
    step = lambda rank, s: {"kind": "metric", "rank": rank, "name": "step", "value": {"step": s}}
    assert on_event(step(0, 31)) is None and on_event(step(1, 30)) is None   # training
    assert on_event(step(1, 31)) == judge13.GRACE   # every rank at the last step: then ended
    exited = {"kind": "metric", "rank": 1, "name": "weights", "value": {}}
    assert judge13.hang_watch(first, 4)["on_event"](exited) == judge13.GRACE  # rank 1 is gone
    assert judge13.hang_watch(first, 4)["on_event"](step(0, 31)) is None   # 4 ranks: other steps
    slow = _run(range(32))
    slow.wall_time = 100.0   # CIFAR-10: a first run of minutes scales both
    assert judge13.hang_watch(slow, 2)["timeout"] == 600.0
    assert judge13.hang_watch(slow, 2)["on_event"](exited) == 200.0

    launched = []

    def launch(nprocs, args, **watch):
        launched.append((nprocs, sorted(watch)))
        return first
    judge13.launch_runs(launch, tmp_path)
    assert launched == [(2, [])] + [(n, ["on_event", "timeout"]) for _, _, n in
                                    list(judge13.LAUNCHES.values())[1:]]


# ------------------------------------------------------------------------- the reference's cache


def test_the_reference_runs_are_cached_on_disk_across_processes(tmp_path, monkeypatch):
    """With DDPLAB_REFERENCE_CACHE, a second process (here: the in-process cache emptied) reads
    the reference's run from the folder instead of launching it; other arguments are another
    entry; an unreadable entry is launched again and replaced; a failed run is never kept."""
    launched = []

    def launch(target, nprocs, args=(), **_):
        launched.append((target, nprocs, list(args)))
        status = "failed" if "0.5" in args else "ok"
        return RunResult(status=status, returncode=0, wall_time=1.0, world_size=nprocs,
                         events={0: [{"kind": "metric", "rank": 0, "name": "accuracy",
                                      "value": len(launched)}]})

    monkeypatch.setattr(ddplab, "launch", launch)
    monkeypatch.setattr(judge13, "_REFERENCES", {})
    monkeypatch.setenv(judge13.CACHE_ENV, str(tmp_path / "cache"))
    run = _run(range(4))
    first = judge13._reference(run)
    assert len(launched) == 1 and launched[0][:2] == (judge13.REFERENCE, 2)
    assert "--lr" in launched[0][2] and "--warmup-steps" in launched[0][2]
    entries = list((tmp_path / "cache").iterdir())
    assert len(entries) == 1 and not entries[0].name.startswith(".tmp-")   # written whole
    monkeypatch.setattr(judge13, "_REFERENCES", {})   # another process
    again = judge13._reference(run)
    assert len(launched) == 1 and again == first and again.events == first.events
    other = _run(range(4))
    for event in other.events[0]:
        if event["name"] == "args":
            event["value"] = {**event["value"], "lr": 0.04}
    judge13._reference(other)
    assert len(launched) == 2 and len(list((tmp_path / "cache").iterdir())) == 2
    entries[0].write_bytes(b"not a pickle")   # cut short, or another version's
    monkeypatch.setattr(judge13, "_REFERENCES", {})
    relaunched = judge13._reference(run)
    assert len(launched) == 3 and metric(relaunched, "accuracy") == {0: 3}
    monkeypatch.setattr(judge13, "_REFERENCES", {})
    assert metric(judge13._reference(run), "accuracy") == {0: 3} and len(launched) == 3
    failed = _run(range(4))
    for event in failed.events[0]:
        if event["name"] == "args":
            event["value"] = {**event["value"], "lr": 0.5}
    assert not judge13._reference(failed).ok
    assert len(list((tmp_path / "cache").iterdir())) == 2   # not kept
    monkeypatch.setattr(judge13, "_REFERENCES", {})
    judge13._reference(failed)
    assert len(launched) == 5


def test_the_cache_key_follows_the_versions_and_the_reference_source(monkeypatch):
    key = (2, (("lr", 0.02),))
    name = judge13.cache_key(key)
    assert name == judge13.cache_key(key) != judge13.cache_key((4, (("lr", 0.02),)))
    monkeypatch.setattr(ddplab, "__version__", ddplab.__version__ + ".dev1")
    assert judge13.cache_key(key) != name


def test_an_unfinished_save_is_left_beside_the_newest_checkpoint(tmp_path):
    for step in (8, 16, 24):
        (tmp_path / f"step-{step:03d}").mkdir()
        for name in (".metadata", "__0_0.distcp", "__1_0.distcp"):
            (tmp_path / f"step-{step:03d}" / name).write_text(f"{step}{name}")
    (tmp_path / "step-024" / "done").write_text("a marker of the job's own")
    unfinished = judge13.leave_unfinished_save(tmp_path)
    assert unfinished == tmp_path / "step-032"   # numbered as the next save
    assert sorted(os.listdir(unfinished)) == ["__0_0.distcp", "__1_0.distcp"]   # no .metadata
    assert (unfinished / "__1_0.distcp").read_text() == "24__1_0.distcp"
    plain = tmp_path / "plain"
    (plain / "latest").mkdir(parents=True)
    (plain / "latest" / ".metadata").write_text("")
    assert judge13.leave_unfinished_save(plain) is None   # no number to go on from
    assert os.listdir(plain) == ["latest"]


def test_a_resume_that_reads_an_unfinished_save_is_named():
    resumed = _run(range(24, 32), status="failed")
    resumed.events[0].append({"kind": "metric", "rank": 0, "name": "read",
                              "value": {"folder": "step-32", "complete": False}})
    hint = judge13._unfinished_hint(resumed)
    assert "step-32" in hint and "without DCP's .metadata" in hint, hint
    assert judge13._unfinished_hint(_run(range(24, 32), status="failed")) is None


# --------------------------------------------------------------- the notebook's launches (lab)


def _lab(tmp_path, monkeypatch, yours: bool, without=None):
    """A ``Capstone`` after a first launch of the skeleton (or of a job without its TODO line,
    judged right so far), whose launches are recorded, not run: each leaves two checkpoints."""
    from ddplab.lab import capstone_run

    launched = []

    def launch(target, nprocs, args=(), **options):
        launched.append((target, nprocs, [str(a) for a in args], options))
        folder = Path(args[args.index("--checkpoint-dir") + 1])
        for step in (8, 16):
            (folder / f"step-{step:03d}").mkdir(parents=True, exist_ok=True)
            for name in (".metadata", "__0_0.distcp", "__1_0.distcp"):
                (folder / f"step-{step:03d}" / name).write_text(name)
        return _run(range(32))

    monkeypatch.setattr(ddplab, "launch", launch)
    monkeypatch.setattr(judge13, "_reference", lambda run: run)   # no launch of the reference
    job = tmp_path / "capstone.py"
    job.write_text("# my job\n" if yours else SKELETON.read_text())
    first = _run(range(32)) if yours else RunResult(status="ok", returncode=0, wall_time=1.0,
                                                    world_size=2, events={0: [], 1: []})
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    lab = capstone_run.Capstone(first, job, data=["--dataset", "digits"], work=work,
                                timeout=300.0, without=without)
    return lab, launched


@pytest.mark.parametrize("piece, line", [("scaler", "scaler.load_state_dict("),
                                         ("set_epoch", "sampler.set_epoch(")])
def test_the_lab_can_take_one_piece_out_of_the_reference(tmp_path, monkeypatch, piece, line):
    """Notebook 13's ``WITHOUT``: while the learner's job is the skeleton, the lab launches a
    copy of the reference job with that one piece taken out, the rest as it is; a learner's
    own job is launched as it is."""
    import importlib.util

    lab, launched = _lab(tmp_path, monkeypatch, False, without=piece)
    lab.run("ddp", "--amp-dtype", "float16")
    reference = Path(importlib.util.find_spec(judge13.REFERENCE).origin).read_text()
    copy = Path(launched[0][0]).read_text()
    assert line in reference and line not in copy
    compile(copy, "copy", "exec")
    kept = [l for l in reference.splitlines() if l in copy.splitlines()]
    assert len(reference.splitlines()) - len(kept) in (1, 2)   # only that piece's lines
    (tmp_path / "yours").mkdir()
    mine, launched = _lab(tmp_path / "yours", monkeypatch, True, without=piece)
    mine.run("ddp", "--amp-dtype", "float16")
    assert mine.without is None and launched[0][0] == str(tmp_path / "yours" / "capstone.py")
    with pytest.raises(ValueError):
        _lab(tmp_path / "yours", monkeypatch, False, without="momentum")


@pytest.mark.parametrize("yours", [False, True])
def test_the_labs_runs_are_what_ddplab_check_launches(tmp_path, monkeypatch, yours):
    """``lab.run``, called as the notebook calls it, launches what ``launch_runs`` (``ddplab
    check 13``) launches (``--strategy fsdp`` made ``ddp`` where FSDP2 cannot run), each run in
    its own folder: the reference job while the learner's is the skeleton, else the learner's,
    with the watch that ends a hang once it is certain."""
    lab, launched = _lab(tmp_path, monkeypatch, yours)
    runs = {}
    for name, (extra, folder, nprocs) in judge13.LAUNCHES.items():
        start = runs["killed"] if name in ("resumed", "resharded") else None
        runs[name] = lab.run(folder, *extra, n=nprocs, checkpoints=start)
        if name == "killed":
            lab.leave_unfinished_save(runs[name])
    other = tmp_path / "judge"
    judged = judge13.launch_runs(lambda nprocs, args, **watch: (nprocs, args), other)
    assert len(launched) == len(judged) == 5
    for (target, n, args, options), (nprocs, want) in zip(launched, judged.values()):
        assert target == (str(tmp_path / "capstone.py") if yours else judge13.REFERENCE)
        assert n == nprocs and args[:2] == ["--dataset", "digits"]
        assert args[2:] == [str(a).replace(str(other), str(lab.folder)) for a in want]
        assert options["timeout"] == (judge13.LATER_TIMEOUT if yours else 300.0)
        assert (options["on_event"] is not None) == yours
        assert options["quiet"] == (not yours and "--kill-rank" in args)


def test_a_resume_starts_from_the_killed_runs_checkpoints_each_time(tmp_path, monkeypatch):
    lab, _ = _lab(tmp_path, monkeypatch, yours=False)
    lab.run("job", "--kill-rank", "1")
    (lab.folder / "job" / "stale").write_text("a file of an earlier run")
    killed = lab.run("job", "--kill-rank", "1")   # the cell run again: from nothing
    assert not (lab.folder / "job" / "stale").exists()
    unfinished = lab.leave_unfinished_save(killed)
    assert unfinished.name == "step-024" and not (unfinished / ".metadata").exists()
    assert unfinished.parent == lab.checkpoints(killed) != lab.folder / "job"
    for _ in range(2):   # the resumes' cell run twice: from the killed run's checkpoints
        lab.run("job", checkpoints=killed)
        assert sorted(os.listdir(lab.folder / "job")) == ["step-008", "step-016", "step-024"]
        assert sorted(os.listdir(lab.folder / "job" / "step-024")) == [
            "__0_0.distcp", "__1_0.distcp"]
        (lab.folder / "job" / "step-016" / ".metadata").unlink()   # as a resume may change it


def test_each_run_is_named_before_its_ranks_output(tmp_path, monkeypatch, capsys):
    """Two runs in one cell print the same kind of line ("[rank0] test accuracy ..."): each
    launch is preceded by a line naming its run, its processes and its arguments."""
    lab, launched = _lab(tmp_path, monkeypatch, yours=False)
    capsys.readouterr()
    monkeypatch.setattr(ddplab, "launch", lambda *a, _launch=ddplab.launch, **k: (
        print("[rank0] the run's own line"), _launch(*a, **k))[1])
    killed = lab.run("job", "--kill-rank", "1", "--kill-at-step", "24")
    lab.run("job-4", "--strategy", "fsdp", n=4, checkpoints=killed)
    lines = capsys.readouterr().out.splitlines()
    strategy = judge13.fsdp_strategy(4)
    assert lines == [
        "run 'job' on 2 processes (--kill-rank 1 --kill-at-step 24):",
        "[rank0] the run's own line",
        f"run 'job-4' on 4 processes (--strategy {strategy}), from the checkpoints of run 'job':",
        "[rank0] the run's own line"], lines
    assert len(launched) == 2


def test_the_lab_stops_after_a_mistake_or_a_change(tmp_path, monkeypatch, capsys):
    lab, _ = _lab(tmp_path, monkeypatch, yours=True)
    assert "right so far" in capsys.readouterr().out
    assert lab.launching("Section 3") and "use your job" in capsys.readouterr().out
    assert not lab.launching("Section 5", judged=True)   # section 4 has not judged the five
    assert "run section 4 first" in capsys.readouterr().out
    monkeypatch.setattr(judge13, "_reference", lambda run: _run(range(32)))
    wrong = {name: _run(range(32), skipped=(20,)) for name in ("ddp", "fsdp")}
    assert judge13.judged_wrong(lab.judge(wrong)) and not lab.go
    assert not lab.launching("Section 4") and "found your job wrong" in capsys.readouterr().out
    lab, _ = _lab(tmp_path, monkeypatch, yours=True)
    lab.job.write_text("# my job, changed\n")
    assert not lab.launching("Section 3") and "job changed" in capsys.readouterr().out
    lab.job.write_text("# my job\n")
    assert not lab.launching("Section 3")   # until the notebook runs again from the top
    skeleton, _ = _lab(tmp_path, monkeypatch, yours=False)
    assert skeleton.go and skeleton.launching("Section 3")   # the reference runs instead
    assert "the reference job" in capsys.readouterr().out


def test_the_reference_is_named_only_once_the_learners_job_is_judged_right(tmp_path,
                                                                          monkeypatch, capsys):
    from ddplab.lab import checks, showcode

    five = {name: _run(range(32)) for name in judge13.RUNS}
    for yours, right in ((False, True), (True, False), (True, True)):
        lab, _ = _lab(tmp_path, monkeypatch, yours)
        monkeypatch.setattr(ddplab, "check", lambda key, runs, right=right: checks.Verdict(
            key, right, "correct!" if right else "not yet"))
        lab.show_reference()   # before any verdict on the five runs
        assert judge13.REFERENCE not in capsys.readouterr().out
        lab.judge(five)
        lab.show_reference()
        shown = capsys.readouterr().out
        assert (shown.strip() == showcode.source(judge13.REFERENCE).strip()) == (
            yours and right), shown[:200]


def test_the_references_five_runs_are_judged_in_one_line(tmp_path, monkeypatch, capsys):
    """While the learner's job is the skeleton, section 4 judges the reference's five runs and
    says so in one line: correct, or the judge's message."""
    five = {name: _run(range(32)) for name in judge13.RUNS}
    lab, _ = _lab(tmp_path, monkeypatch, yours=False)
    capsys.readouterr()
    judged = []
    monkeypatch.setattr(judge13, "judge_capstone", lambda runs: judged.append(runs))   # right
    assert lab.judge({"ddp": five["ddp"]}) is None and capsys.readouterr().out == ""   # not all
    assert judged == [] and not lab.correct
    assert lab.judge(five) is None and lab.hint is None and lab.correct
    assert judged[0]["reference"] is five["ddp"]   # compared with itself: the course's job
    assert capsys.readouterr().out == "the reference job's five runs: judged correct\n"
    monkeypatch.setattr(judge13, "judge_capstone", lambda runs: "step 3 differs")
    lab.judge(five)
    assert capsys.readouterr().out == ("the reference job's five runs: the judge says: "
                                       "step 3 differs\n")


def test_a_reference_with_a_piece_taken_out_is_not_correct_once_the_judge_names_it(
        tmp_path, monkeypatch, capsys):
    """WITHOUT set: the judge's line names the fault, the proofs after it verify nothing
    (``correct`` is False) and section 5 says why it launches nothing."""
    five = {name: _run(range(32)) for name in judge13.RUNS}
    lab, _ = _lab(tmp_path, monkeypatch, yours=False)
    monkeypatch.setattr(judge13, "judge_capstone", lambda runs: "the GradScaler differs")
    lab.judge(five)
    capsys.readouterr()
    assert lab.hint == "the GradScaler differs" and not lab.correct
    lab.without = "scaler"
    assert not lab.launching("Section 5", judged=True)
    said = capsys.readouterr().out
    assert "without 'scaler'" in said and "set WITHOUT back" in said and "section 4" not in said
    monkeypatch.setattr(judge13, "judge_capstone", lambda runs: None)   # the whole reference
    lab.judge(five)
    assert lab.correct
