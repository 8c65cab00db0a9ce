"""SyncBatchNorm's arithmetic by hand on real gloo ranks: the all-reduced statistics normalise
every rank's share exactly as BatchNorm over the whole batch in one process; its own do not.
DDP's next forward broadcasts the buffers after a forward with gradients that syncs, not after
a no_grad() or a no_sync() forward."""

from __future__ import annotations

import pytest

from ddplab import launch

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("nprocs", [2, 4])
def test_global_statistics_equal_one_process_batchnorm(nprocs):
    result = launch("ddplab.workers.sync_batchnorm", nprocs, quiet=True)
    assert result.ok, result.error
    found = {e["rank"]: e for e in result.events_of("batchnorm")}
    assert sorted(found) == list(range(nprocs))
    assert all(e["samples"] == 8 // nprocs for e in found.values())
    for e in found.values():
        assert e["global_mean"] == found[0]["global_mean"]          # one answer on every rank
        assert e["sync_error"] < 1e-5 and e["running_mean_error"] < 1e-6
        assert e["running_var_error"] < 1e-5
        assert e["local_error"] > 100 * e["sync_error"]             # its own statistics differ
    assert found[0]["local_mean"] != found[1]["local_mean"]
    rows = {e["rank"]: [row["broadcasts"] for row in e["rows"]]
            for e in result.events_of("buffers")}
    assert rows == {rank: [True, True, False, True, False] for rank in range(nprocs)}


def test_a_batch_that_does_not_divide_is_refused():
    result = launch("ddplab.workers.sync_batchnorm", 3, quiet=True)
    assert not result.ok and "--batch-size 8" in result.error
