"""Coding exercises 06 (AMP) and 08 (collectives): skeletons judged wrong with a useful hint,
reference solutions judged right, and the judges' device rules on runs this machine cannot make
(CUDA float16), built from a real run's facts."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from test_exercises_hints import answer_named, changes_outside_todo

import ddplab
from ddplab.lab import judges
from ddplab.launcher.results import RunResult

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = ROOT / "tests" / "solutions"


@pytest.fixture(scope="module")
def run(shared_run):
    def ran(path: Path, nprocs: int) -> RunResult:
        result = shared_run(path, nprocs)   # one launch, shared with the other exercise tests
        assert result.ok, result.error
        return result
    return ran


@pytest.fixture(scope="module")
def amp_solution(run) -> RunResult:
    return run(SOLUTIONS / "amp.py", 2)


@pytest.fixture(scope="module")
def collective_solution(run) -> RunResult:
    return run(SOLUTIONS / "collective.py", 4)


def with_facts(result: RunResult, **changes: object) -> RunResult:
    """A copy of ``result`` whose metric facts are changed on every rank."""
    fake = copy.deepcopy(result)
    for events in fake.events.values():
        for event in events:
            if event.get("kind") == "metric" and event["name"] in changes:
                value = changes[event["name"]]
                event["value"] = value(event["value"]) if callable(value) else value
    return fake


def test_both_exercises_are_registered_with_their_skeletons():
    known = judges.load_all()
    assert known["06"].skeleton == "amp.py" and known["08"].skeleton == "collective.py"
    for key in ("06", "08"):
        skeleton = judges.skeleton_path(key)
        assert "# TODO(exercise)" in skeleton.read_text()
        assert (SOLUTIONS / skeleton.name).is_file()
        assert "# TODO(exercise)" not in (SOLUTIONS / skeleton.name).read_text()


def test_the_amp_solution_only_fills_the_skeletons_gaps():
    key = "06"
    skeleton = judges.skeleton_path(key).read_text().splitlines()
    solution = (SOLUTIONS / judges.skeleton_path(key).name).read_text().splitlines()
    assert changes_outside_todo(skeleton, solution) == [], key


# ----------------------------------------------------------------------------- 06


def test_amp_skeleton_runs_and_is_judged_wrong(run):
    verdict = ddplab.check("06", run(judges.skeleton_path("06"), 2))
    assert not verdict
    assert "without autocast" in verdict.message and "TODO 3" in verdict.message
    assert not answer_named("06", verdict.message), verdict.message   # the run, not the code


def test_amp_solution_is_judged_right_on_this_machine(amp_solution):
    assert ddplab.check("06", amp_solution)
    device = judges.metric(amp_solution, "device_type")
    dtypes = judges.metric(amp_solution, "autocast_dtypes")
    scaler = judges.metric(amp_solution, "scaler")
    assert set(dtypes) == set(device) == {0, 1}
    for rank, kind in device.items():   # the device decides, as in PyTorch's AMP recipe
        assert dtypes[rank] == ["bfloat16" if kind == "cpu" else "float16"]
        assert scaler[rank]["enabled"] == (kind == "cuda")
        assert scaler[rank]["calls"] == {"scale": 24, "unscale_": 24, "step": 24, "update": 24}
    steps, max_norm = judges.metric(amp_solution, "scaled_steps"), judges.metric(
        amp_solution, "max_norm")
    for rank, kind in device.items():   # on a CPU, the extra steps with a scaler on
        assert len(steps[rank]) == (24 if kind == "cuda" else 4)
        for step in steps[rank]:        # clipped as true gradients: exactly max_norm here
            assert step["order"] == ["scale", "unscale_", "step", "update"]
            assert step["scale"] > 1 and not step["raised"]
            assert abs(step["stepped_norm"] - max_norm[rank]) < 1e-3 * max_norm[rank]


def test_fp16_on_cuda_needs_an_enabled_scaler_that_steps(amp_solution):
    cuda = dict(device_type="cuda", autocast_dtypes=["float16"],
                layer_output_dtypes=["float16"])
    calls = {"scale": 24, "step": 24, "update": 24}
    stepped = {"exists": True, "enabled": True, "type": "CountingScaler", "scale": 32768.0,
               "growth_tracker": 12, "calls": calls}
    fresh = {"exists": True, "enabled": True, "type": "GradScaler", "scale": 65536.0,
             "growth_tracker": 0}
    assert ddplab.check("06", with_facts(amp_solution, **cuda, scaler_before=fresh,
                                          scaler=stepped))
    disabled = ddplab.check("06", with_facts(amp_solution, **cuda))   # the CPU's disabled one
    assert not disabled and "underflow" in disabled.message and "TODO 2" in disabled.message
    never_updated = ddplab.check("06", with_facts(amp_solution, **cuda, scaler_before=fresh,
                                                  scaler={**fresh, "calls": calls}))
    assert not never_updated and "scale never changed" in never_updated.message


def test_bf16_on_cpu_needs_no_scaler_enabled(amp_solution):
    enabled = {"exists": True, "enabled": True, "type": "GradScaler", "scale": 65536.0,
               "growth_tracker": 0}
    verdict = ddplab.check("06", with_facts(amp_solution, device_type="cpu",
                                            scaler_before=enabled))
    assert not verdict and "needs no loss scaling" in verdict.message


def test_on_cpu_the_disabled_scaler_must_still_be_built_and_used(amp_solution):
    none = ddplab.check("06", with_facts(amp_solution, scaler_before={
        "exists": False, "enabled": False, "type": "NoneType"}, scaler={
        "exists": False, "enabled": False, "type": "NoneType"}))
    assert not none and "not a torch.amp.GradScaler" in none.message
    bypassed = ddplab.check("06", with_facts(amp_solution, scaler=lambda s: {
        **s, "calls": {"scale": 24, "step": 0, "update": 24}}))
    assert not bypassed and "step() 0 times" in bypassed.message


@pytest.mark.parametrize("changes, words", [
    (dict(autocast_dtypes=["float16"]), "should be bfloat16"),
    (dict(weight_dtype="bfloat16"), "do not convert the model"),
    (dict(loss_dtype="bfloat16"), "computed outside autocast"),
    (dict(losses=lambda xs: [*xs[:-1], float("nan")]), "inf or NaN"),
    (dict(losses=lambda xs: list(reversed(xs))), "did not go down"),
    (dict(forwards_under_autocast=lambda n: n - 1), "without autocast"),
])
def test_amp_hints_name_the_mistake(amp_solution, changes, words):
    verdict = ddplab.check("06", with_facts(amp_solution, **changes))
    assert not verdict and words in verdict.message


def steps_changed(**change: object):
    return lambda steps: [{**step, **change} for step in steps]


@pytest.mark.parametrize("change, words", [
    (dict(order=["scale", "step", "update", "unscale_"]), "after scaler.step()"),
    (dict(order=["unscale_", "scale", "step", "update"]), "before backward"),
    (dict(order=["scale", "unscale_", "unscale_"], raised="RuntimeError", stepped_norm=None),
     "twice"),
    (dict(stepped_norm=0.5 / 65536, scale=65536.0), "the clip saw the scaled gradients"),
    (dict(stepped_norm=2.0, norm_after=2.0), "they were not clipped"),
    (dict(stepped_norm=2.0, norm_after=0.5), "clipped after scaler.step()"),
])
def test_amp_clipping_hints_name_the_mistake(amp_solution, change, words):
    verdict = ddplab.check("06", with_facts(amp_solution, scaled_steps=steps_changed(**change)))
    assert not verdict and words in verdict.message and "TODO 3" in verdict.message


def test_a_skipped_step_is_not_judged_for_clipping(amp_solution):   # an overflow skips it
    assert ddplab.check("06", with_facts(amp_solution, scaled_steps=lambda steps: [
        {**steps[0], "stepped_norm": None}, *steps[1:]]))


def test_amp_facts_missing_from_a_rank_are_reported(amp_solution):
    fake = copy.deepcopy(amp_solution)
    fake.events[1] = [e for e in fake.events[1] if e.get("name") != "losses"]
    verdict = ddplab.check("06", fake)
    assert not verdict and "'losses'" in verdict.message


# ----------------------------------------------------------------------------- 08


def test_collective_skeleton_runs_and_is_judged_wrong(run):
    verdict = ddplab.check("08", run(judges.skeleton_path("08"), 4))
    assert not verdict
    assert "nothing was exchanged" in verdict.message and "TODO 1" in verdict.message
    assert not calls_named(verdict.message)   # the mistake and the requirement, not the code
    assert not answer_named("08", verdict.message), verdict.message


def calls_named(message: str) -> list[str]:
    """The torch.distributed calls a hint spells out (it should name none)."""
    return [call for call in ("all_reduce", "get_world_size", "isend", "irecv", "send(",
                              "recv(", "wait", "ReduceOp") if call in message]


def test_collective_solution_is_judged_right(collective_solution):
    assert ddplab.check("08", collective_solution)
    inputs = judges.metric(collective_solution, "input")
    sums = judges.metric(collective_solution, "ring_sum")
    expected = [sum(column) for column in zip(*inputs.values())]
    assert len(inputs) == 4 and all(v == pytest.approx(expected, rel=1e-5)
                                    for v in sums.values())


def test_collective_hints(collective_solution):
    inputs = judges.metric(collective_solution, "input")
    total = [sum(column) for column in zip(*inputs.values())]
    summed = ddplab.check("08", with_facts(collective_solution, average=total))
    assert not summed and "the sum over ranks" in summed.message
    assert "4 times the mean" in summed.message
    backwards = ddplab.check("08", shifted_from(collective_solution, +1))
    assert not backwards and "other way" in backwards.message
    nothing = ddplab.check("08", shifted_from(collective_solution, 0))
    assert not nothing and "nothing arrived" in nothing.message
    for verdict in (summed, backwards, nothing):
        assert not calls_named(verdict.message), verdict.message


def shifted_from(result: RunResult, offset: int) -> RunResult:
    """A copy of ``result`` in which rank r's ring_shift returned rank r + offset's input."""
    inputs = judges.metric(result, "input")
    fake = copy.deepcopy(result)
    for rank, events in fake.events.items():
        for event in events:
            if event.get("name") == "shifted":
                event["value"] = inputs[(rank + offset) % len(inputs)]
    return fake


def test_a_failed_run_is_explained_before_any_judging(collective_solution):
    failed = copy.deepcopy(collective_solution)
    failed.status = "timeout"
    verdict = ddplab.check("08", failed)
    assert not verdict and "timeout ended it" in verdict.message
