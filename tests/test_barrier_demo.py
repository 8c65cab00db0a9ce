"""The lesson-05 barrier demo on real processes: it fails without the barrier, works with it.

Without the barrier, rank 0 saves only once the other ranks have read (or failed): the outcome
is the same on a busy machine, never a matter of who is faster."""

from __future__ import annotations

import pytest

from ddplab import launch

pytestmark = pytest.mark.slow
TARGET = "ddplab.workers.barrier_demo"


def loaded(result) -> dict[int, dict]:
    return {e["rank"]: e for e in result.events_of("metric") if e["name"] == "loaded"}


def test_without_barrier_the_reader_finds_no_file(tmp_path):
    result = launch(TARGET, 2, args=["--checkpoint-dir", tmp_path, "--no-barrier", "--delay", "0"],
                    quiet=True, timeout=300)  # safety net: rank 1 fails as soon as it reads
    assert not result.ok and result.status == "failed"
    assert result.root_cause.rank == 1
    assert "FileNotFoundError" in result.error


def test_with_barrier_every_rank_loads_rank0_weights_and_the_file_is_removed(tmp_path):
    result = launch(TARGET, 3, args=["--checkpoint-dir", tmp_path, "--delay", "1"], quiet=True)
    assert result.ok, result.error
    got = loaded(result)
    assert sorted(got) == [0, 1, 2]
    assert {e["checksum"] for e in got.values()} == {got[0]["before"]}
    assert got[1]["before"] != got[0]["before"]
    assert not (tmp_path / "checkpoint.pt").exists()


def test_without_barrier_an_old_file_is_loaded_silently(tmp_path):
    first = launch(TARGET, 2, args=["--checkpoint-dir", tmp_path, "--keep", "--delay", "0"],
                   quiet=True)
    assert first.ok, first.error
    second = launch(TARGET, 2, args=["--checkpoint-dir", tmp_path, "--no-barrier", "--epoch",
                                     "2", "--delay", "0"], quiet=True)
    assert second.ok, second.error
    got = loaded(second)
    assert got[0]["epoch"] == 2 and got[1]["epoch"] == 1
    assert got[1]["checksum"] != got[0]["checksum"]
    assert list(tmp_path.iterdir()) == []   # the checkpoint and the readers' markers are gone
