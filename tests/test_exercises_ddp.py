"""Coding exercises 03 (wrap in DDP), 04 (shard every epoch) and 05 (save on rank 0,
load with map_location): each skeleton runs and is judged wrong with a hint that names the fix,
each reference solution is judged right, and mistakes that cannot show on a CPU get their own
hint (edited facts); the classic mistakes run for real in tests/test_exercise_variants.py."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest

from test_exercises_hints import answer_named, changes_outside_todo

import ddplab
from ddplab.lab import judges
from ddplab.launcher.results import RunResult

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = ROOT / "tests" / "solutions"
KEYS = {"03": "ddp_wrap.py", "03b": "accumulate.py", "04": "sampler.py",
        "05": "checkpoint.py"}


@pytest.fixture(scope="module")
def run(shared_run):
    def ran(path: Path, nprocs: int = 2) -> RunResult:
        result = shared_run(path, nprocs)   # one launch, shared with the other exercise tests
        assert result.ok, result.error
        return result
    return ran


def with_events(result: RunResult, name: str, change) -> RunResult:
    """A copy of ``result`` whose ``name`` metric events are changed by ``change(rank, event)``."""
    fake = copy.deepcopy(result)
    for rank, events in fake.events.items():
        for event in events:
            if event.get("kind") == "metric" and event.get("name") == name:
                change(rank, event)
    return fake


@pytest.fixture(scope="module")
def solutions(run) -> dict[str, RunResult]:
    return {key: run(SOLUTIONS / name) for key, name in KEYS.items()}


# ----------------------------------------------------------------------------- all three


@pytest.mark.parametrize("key", sorted(KEYS))
def test_registered_with_its_skeleton_and_the_solution_only_fills_the_gaps(key):
    exercise = judges.load_all()[key]
    assert exercise.skeleton == KEYS[key]
    skeleton = judges.skeleton_path(key).read_text().splitlines()
    solution = (SOLUTIONS / KEYS[key]).read_text().splitlines()
    assert any("# TODO(exercise)" in line for line in skeleton)
    assert not any("# TODO(exercise)" in line for line in solution)
    assert changes_outside_todo(skeleton, solution) == [], key   # lines changed outside TODOs


@pytest.mark.parametrize("key", sorted(KEYS))
def test_solution_is_judged_right(key, solutions):
    assert ddplab.check(key, solutions[key])


@pytest.mark.parametrize("key, words", [
    ("03", ["never ran a forward pass", "TODO"]),
    ("03b", ["stepped the optimizer 0 times", "TODO"]),
    ("04", ["every rank read all 1347 samples", "a share of its own", "TODO 1"]),
    ("05", ["rank 0 wrote 0 checkpoint(s) for 2 saves", "TODO 1"]),
])
def test_untouched_skeleton_runs_and_is_judged_wrong_with_a_hint(key, words, run):
    verdict = ddplab.check(key, run(judges.skeleton_path(key)))
    assert not verdict
    for word in words:
        assert word in verdict.message
    assert not answer_named(key, verdict.message), verdict.message   # the run, not the code


# ----------------------------------------------------------------------------- 03


def test_03b_solution_all_reduces_once_per_step_and_equals_one_process(solutions):
    result = solutions["03b"]
    sent, size = judges.metric(result, "allreduce_bytes"), judges.metric(result, "gradient_bytes")
    steps = judges.metric(result, "steps")
    assert sorted(sent) == [0, 1] and all(sent[r] == steps[r] * size[r] > 0 for r in sent)
    assert max(judges.metric(result, "reference_error").values()) < 1e-9


def test_03_solution_facts(solutions):
    start, end = judges.metric(solutions["03"], "start"), judges.metric(solutions["03"], "end")
    assert sorted(start) == [0, 1] and start[0] != start[1]   # a seed per rank, on purpose
    assert end[0] == end[1] and end[0] not in start.values()
    forwards = judges.metric(solutions["03"], "forwards")
    assert all(f["direct"] == 0 and f["through_ddp"] > 0 for f in forwards.values())
    assert forwards[0]["first_checksum"] == forwards[1]["first_checksum"] == start[0]


# ----------------------------------------------------------------------------- 04


def test_04_solution_reads_each_sample_once_and_leaves_out_another_each_epoch(solutions):
    reads = judges.metrics(solutions["04"], "read")
    assert sorted(reads) == [0, 1] and all(len(values) == 3 for values in reads.values())
    shares = [[set(reads[rank][epoch]) for rank in (0, 1)] for epoch in range(3)]
    assert all(len(a) == len(b) == 673 and not a & b for a, b in shares)   # 1347 // 2, disjoint
    left_out = [set(range(1347)) - a - b for a, b in shares]
    assert all(len(out) == 1 for out in left_out) and len(set(map(min, left_out))) > 1


@pytest.mark.parametrize("share, words", [
    (lambda rank, epoch, read, first: list(range(rank, 1346, 2)),
     "index order: nothing shuffles"),
    (lambda rank, epoch, read, first: read if epoch < 2 else first,
     "same order in epochs 0 and 2"),
    (lambda rank, epoch, read, first: list(range(rank * 300, rank * 300 + 673)),
     "shares overlap"),
    (lambda rank, epoch, read, first: read[:-1] if rank else read, "the ranks read [673, 672]"),
    (lambda rank, epoch, read, first: read[:640], "read by nobody"),
], ids=["unshuffled", "epoch 2 repeats epoch 0", "a seed per rank", "unequal", "a batch dropped"])
def test_04_mistakes_shown_on_the_solution_s_reads(share, words, solutions):
    """Each mistake is the solution's run with its reads edited: in each epoch, rank r read
    ``share(r, epoch, what it read, what it read in epoch 0)``."""
    first = {rank: values[0] for rank, values in judges.metrics(solutions["04"], "read").items()}
    verdict = ddplab.check("04", with_events(solutions["04"], "read", lambda rank, e: e.update(
        value=share(rank, e["epoch"], e["value"], first[rank]))))
    assert not verdict and words in verdict.message, verdict.message


# ----------------------------------------------------------------------------- 05


def test_05_tensors_on_another_rank_s_gpu(solutions):
    def on_gpu0(rank, event):
        event.update(device=f"cuda:{rank}", devices=["cuda:0"])
    verdict = ddplab.check("05", with_events(solutions["05"], "loaded", on_gpu0))
    assert not verdict and "rank 1's tensors landed on cuda:0" in verdict.message


def test_05_solution_facts(solutions):
    result = solutions["05"]
    wrote = judges.metrics(result, "wrote")
    assert list(wrote) == [0] and len(wrote[0]) == 2          # rank 0, once per save
    loaded = judges.metrics(result, "loaded")
    assert sorted(loaded) == [0, 1] and all(len(values) == 2 for values in loaded.values())
    assert all(v == [{"devices": ["cpu"]}] * 2 for v in judges.metrics(result, "probe").values())
    resumed = judges.metrics(result, "resumed")
    assert [f["epoch"] for f in resumed[1]] == [0, 2] and resumed[1][1]["optimizer"] is True


def test_a_failed_run_is_explained_before_any_judging(solutions):
    failed = copy.deepcopy(solutions["03"])
    failed.status = "timeout"
    verdict = ddplab.check("03", failed)
    assert not verdict and "timeout ended it" in verdict.message


def load_solution(name: str):
    spec = importlib.util.spec_from_file_location(f"solution_{name}", SOLUTIONS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("gpus", [0, 2])
def test_05_probe_names_a_gpu_the_rank_does_not_have(gpus, monkeypatch, tmp_path):
    import torch

    solution = load_solution("checkpoint")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    path = tmp_path / "checkpoint.pt"
    torch.save({"model": {"w": torch.ones(2)}, "epoch": 1}, path)
    copy = tmp_path / "copy.pt"
    solution.saved_on(str(path), str(copy), f"cuda:{gpus}")
    with pytest.raises(RuntimeError):                         # no map_location: no such GPU
        torch.load(copy, weights_only=True)
    assert solution.probe(str(path), torch.device("cpu")) == {"devices": ["cpu"]}
    monkeypatch.setattr(solution, "load", lambda p, d: torch.load(p, weights_only=True))
    assert "error" in solution.probe(str(path), torch.device("cpu"))
