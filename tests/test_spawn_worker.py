"""The lesson-03 worker on two real processes started by mp.spawn (engine="spawn").

The launch is ``tests/scripts/threads_at_exit.py spawn``: the worker's ``main`` on each spawned
rank, as the worker's own ``__main__`` spawns it (which notebook 03 runs), then each rank's
threads at exit, which test_exit_abort reads too (one launch for both).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from test_exit_abort import group_threads

import ddplab
from ddplab.lab.showcode import source
from ddplab.workers import spawn_ddp

pytestmark = pytest.mark.slow
THREADS = str(Path(__file__).parent / "scripts" / "threads_at_exit.py")


@pytest.fixture(scope="module")
def run():
    return ddplab.launch(THREADS, 2, engine="spawn", quiet=True, live=False, timeout=600,
                         args=["spawn", "--epochs", "1", "--batch-size", "32"])


def metric(run, name):
    return {e["rank"]: e for e in run.events_of("metric") if e["name"] == name}


def test_every_rank_ends_with_the_same_weights(run):
    assert run.ok, run.error
    assert run.engine == "spawn" and run.world_size == 2
    checksums = metric(run, "param_checksum")
    assert sorted(checksums) == [0, 1]
    assert checksums[0]["value"] == checksums[1]["value"]
    assert run.summary["param_checksums_per_rank"] == [checksums[0]["value"]] * 2


def test_ranks_exit_with_no_process_group_thread_left(run):
    """(test_exit_abort says why it matters, and checks the training worker's ranks.)"""
    assert run.ok, run.error
    assert group_threads(run) == {0: [], 1: []}


def test_ranks_see_different_data_but_share_the_averaged_gradient(run):
    first = metric(run, "first_step")
    assert first[0]["loss"] != first[1]["loss"]
    assert first[0]["grad_checksum"] == first[1]["grad_checksum"]
    own = [first[r]["own_grad_checksum"] for r in (0, 1)]           # before the all-reduce:
    assert own[0] != own[1]                                          # each rank's own, and the
    assert math.isclose(sum(own) / 2, first[0]["grad_checksum"], rel_tol=1e-6)   # shared = mean
    assert all("my loss" in run.log(r) and "averaged gradient checksum" in run.log(r)
               for r in (0, 1))                                  # the printed one: the averaged


def test_global_batch_and_shares(run):
    s = run.summary
    assert s["world_size"] == 2 and s["global_batch"] == 2 * s["batch_size"] == 64
    assert s["samples_seen_per_rank"] == [674, 674]          # 1347 samples, padded to 1348
    assert s["steps_per_epoch"] == 22 and s["final_accuracy"] > 0.5
    assert "[rank1] param checksum" not in run.log(1)        # the launcher strips the prefix
    assert "param checksum" in run.log(1)


def test_sections_shown_by_the_notebook_exist():
    for name in ("setup", "data", "model", "train", "checksum", "spawn"):
        assert source("ddplab/workers/spawn_ddp.py", name).strip()
    assert "python -m ddplab.workers.spawn_ddp --nprocs 2" in spawn_ddp.__doc__


def test_arguments_have_defaults_for_a_plain_run():
    args = spawn_ddp.parse_args([])
    assert (args.nprocs, args.epochs, args.batch_size, args.dataset) == (2, 2, 32, "digits")
    assert not args.seed_per_rank and not args.no_init_sync   # one start, broadcast by DDP
    tried = spawn_ddp.parse_args(["--seed-per-rank", "--no-init-sync"])   # notebook 03's Try it
    assert tried.seed_per_rank and tried.no_init_sync
