"""Coding exercises 03 (wrap in DDP), 04 (DistributedSampler, set_epoch) and 05 (save on rank 0,
load with map_location): each skeleton runs and is judged wrong with a hint that names the fix,
each reference solution is judged right, and the typical half-fixed versions get their own hint
(real runs of edited solutions where the mistake shows on a CPU, edited facts elsewhere)."""

from __future__ import annotations

import copy
import difflib
from pathlib import Path

import pytest

import ddplab
from ddplab import judges
from ddplab.launcher.results import RunResult

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = ROOT / "tests" / "solutions"
KEYS = {"03": "ddp_wrap.py", "04": "sampler.py", "05": "checkpoint.py"}


def run(path: Path, nprocs: int = 2) -> RunResult:
    result = ddplab.launch(str(path), nprocs, quiet=True, live=False, timeout=300)
    assert result.ok, result.error
    return result


def edited(tmp_path: Path, name: str, old: str, new: str) -> Path:
    """A copy of solution ``name`` with ``old`` replaced by ``new`` (the learner's slip)."""
    text = (SOLUTIONS / name).read_text()
    assert old in text, f"{old!r} is not in the solution {name} any more"
    path = tmp_path / name
    path.write_text(text.replace(old, new))
    return path


def with_events(result: RunResult, name: str, change) -> RunResult:
    """A copy of ``result`` whose ``name`` metric events are changed by ``change(rank, event)``."""
    fake = copy.deepcopy(result)
    for rank, events in fake.events.items():
        for event in events:
            if event.get("kind") == "metric" and event.get("name") == name:
                change(rank, event)
    return fake


@pytest.fixture(scope="module")
def solutions() -> dict[str, RunResult]:
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
    matcher = difflib.SequenceMatcher(a=skeleton, b=solution, autojunk=False)
    for tag, i1, i2, _, _ in matcher.get_opcodes():
        if tag != "equal" and i1 > 0:  # the docstring's first line names the solution
            assert any("# TODO(exercise)" in line for line in skeleton[i1:i2]), (
                f"the solution of {key} changes lines {i1 + 1}-{i2} of the skeleton, "
                "outside its TODO(exercise) blocks")


@pytest.mark.parametrize("key", sorted(KEYS))
def test_solution_is_judged_right(key, solutions):
    assert ddplab.check(key, solutions[key])


@pytest.mark.parametrize("key, words", [
    ("03", ["different weights", "DDP(model"]),
    ("04", ["every rank read all 1347 samples", "DistributedSampler", "TODO 1"]),
    ("05", ["rank(s) 1 wrote the checkpoint too", "if rank == 0:", "TODO 1"]),
])
def test_untouched_skeleton_runs_and_is_judged_wrong_with_a_hint(key, words):
    verdict = ddplab.check(key, run(judges.skeleton_path(key)))
    assert not verdict
    for word in words:
        assert word in verdict.message


# ----------------------------------------------------------------------------- 03


def test_03_weights_copied_once_but_gradients_not_averaged(solutions):
    result = solutions["03"]
    equal_start = with_events(result, "start", lambda rank, e: e.update(value=1.0))
    drifted = with_events(equal_start, "end", lambda rank, e: e.update(value=2.0 + rank))
    verdict = ddplab.check("03", drifted)
    assert not verdict and "drifted apart" in verdict.message


def test_03_solution_facts(solutions):
    start, end = judges.metric(solutions["03"], "start"), judges.metric(solutions["03"], "end")
    assert sorted(start) == [0, 1] and start[0] == start[1] and end[0] == end[1] != start[0]


# ----------------------------------------------------------------------------- 04


def test_04_without_set_epoch_every_epoch_repeats_its_order(tmp_path):
    path = edited(tmp_path, "sampler.py", "        sampler.set_epoch(epoch)\n", "")
    verdict = ddplab.check("04", run(path))
    assert not verdict and "same order in every epoch" in verdict.message
    assert "set_epoch(epoch)" in verdict.message


def test_04_a_seed_per_rank_makes_shares_overlap(tmp_path):
    path = edited(tmp_path, "sampler.py", "DistributedSampler(train_set, seed=0)",
                  "DistributedSampler(train_set, seed=dist.get_rank())")
    verdict = ddplab.check("04", run(path))
    assert not verdict and "overlap" in verdict.message and "same seed" in verdict.message


def test_04_solution_shares_are_disjoint_halves(solutions):
    reads = judges.metrics(solutions["04"], "read")
    assert sorted(reads) == [0, 1] and all(len(values) == 2 for values in reads.values())
    first = [set(values[0]) for values in reads.values()]
    assert len(first[0]) == len(first[1]) == 674 and len(first[0] & first[1]) == 1  # padding
    unshuffled = with_events(solutions["04"], "read",
                             lambda rank, e: e.update(value=unshuffled_share(rank)))
    verdict = ddplab.check("04", unshuffled)
    assert not verdict and "does not shuffle" in verdict.message


def unshuffled_share(rank: int) -> list[int]:
    """What rank ``rank`` of 2 reads from 1347 samples with shuffle=False (padded with 0)."""
    return list(range(rank, 1347, 2)) + ([0] if rank == 1 else [])


# ----------------------------------------------------------------------------- 05


def test_05_without_the_barrier_a_rank_reads_too_early(tmp_path):
    path = edited(tmp_path, "checkpoint.py", "    dist.barrier()  # nobody goes on", "    # ")
    verdict = ddplab.check("05", run(path))
    assert not verdict and "read too early" in verdict.message
    assert "dist.barrier()" in verdict.message


def test_05_load_without_map_location_is_caught_on_a_cpu(tmp_path):
    path = edited(tmp_path, "checkpoint.py", "map_location=device, ", "")
    verdict = ddplab.check("05", run(path))
    assert not verdict and "ignores the device it is given" in verdict.message
    assert "map_location=device" in verdict.message


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


def test_a_failed_run_is_explained_before_any_judging(solutions):
    failed = copy.deepcopy(solutions["03"])
    failed.status = "timeout"
    verdict = ddplab.check("03", failed)
    assert not verdict and "did not finish: timeout" in verdict.message
