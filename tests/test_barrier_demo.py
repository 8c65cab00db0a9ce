"""The lesson-05 barrier demo on real processes: it fails without the barrier, works with it."""

from __future__ import annotations

import pytest

from ddplab import launch

pytestmark = pytest.mark.slow
TARGET = "ddplab.workers.barrier_demo"


def loaded(result) -> dict[int, dict]:
    return {e["rank"]: e for e in result.events_of("metric") if e["name"] == "loaded"}


def test_without_barrier_the_reader_finds_no_file(tmp_path):
    result = launch(TARGET, 2, args=["--checkpoint-dir", tmp_path, "--no-barrier"], quiet=True)
    assert not result.ok
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
                                     "2"], quiet=True)
    assert second.ok, second.error
    got = loaded(second)
    assert got[0]["epoch"] == 2 and got[1]["epoch"] == 1
    assert got[1]["checksum"] != got[0]["checksum"]
