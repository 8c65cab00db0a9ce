"""Collectives and the from-scratch ring all-reduce on real processes (gloo)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ddplab import launch
from ddplab.workers.collectives import GLOO_REDUCE_SCATTER_SINCE, torch_release
from ddplab.workers.ring_allreduce import sweep_sizes

pytestmark = pytest.mark.slow


def test_collectives_give_the_textbook_results():
    n = 3
    result = launch("ddplab.workers.collectives", n, quiet=True,
                    args=["--stagger", "0.2", "--naive-numel", "1000", "--naive-timeout", "1"])
    assert result.ok, result.error
    got = {(e["name"], e["rank"]): e for e in result.events_of("collective")}
    x = [[10.0 * r + i for i in range(n)] for r in range(n)]
    total = [sum(col) for col in zip(*x)]
    for rank in range(n):
        assert got["broadcast", rank]["before"] == x[rank]
        assert got["broadcast", rank]["after"] == x[0]
        assert got["all_reduce", rank]["after"] == total
        assert got["all_gather", rank]["after"] == sum(x, [])
        assert got["reduce_scatter", rank]["after"] == [total[rank]]
        assert got["reduce_scatter", rank]["via"] == (
            "reduce_scatter" if torch_release() >= GLOO_REDUCE_SCATTER_SINCE
            else "reduce_scatter_tensor")
    arrived = [got["barrier", r]["arrived"] for r in range(n)]
    left = [got["barrier", r]["left"] for r in range(n)]
    assert arrived[-1] - arrived[0] > 0.3
    assert min(left) >= max(arrived) - 0.05
    p2p = {e["rank"]: e for e in result.events_of("p2p")}
    assert sorted(p2p) == [0, n - 1]                     # one sender, one receiver
    assert p2p[n - 1]["message"] == [3.0, 1.0, 4.0] and p2p[0]["reply"] == [6.0, 2.0, 8.0]
    assert {e["backend"] for e in p2p.values()} == {"gloo"}   # CPU clocks time gloo's waits
    # causal, not speed: recv returned after the sender's 0.2 s of work; rank 0's wait() after
    # the reply, which the receiver sent another 0.2 s later; irecv returned before that reply
    assert p2p[n - 1]["received"] > 0.18 and p2p[0]["done"] > 0.36
    assert p2p[0]["sent"] <= p2p[0]["posted"] < p2p[n - 1]["received"] + 0.18
    # every rank sending first with the blocking send times out (gloo: a send waits for its
    # receiver, whatever the size); the batched step then delivers the left neighbour's rank
    naive = {e["rank"]: e for e in result.events_of("naive")}
    assert sorted(naive) == list(range(n))
    for rank, e in naive.items():
        assert e["timed_out"] and e["waited"] >= 0.9 and e["numel"] == 1000
        assert e["received"] == (rank - 1) % n


def test_gloo_has_the_list_reduce_scatter_exactly_where_the_gate_says():
    probe = Path(__file__).parent / "compat" / "gloo_reduce_scatter.py"
    result = launch(str(probe), 2, quiet=True)
    assert result.ok, result.error
    said = result.events_of("probe")
    assert len(said) == 2
    has_it = torch_release() >= GLOO_REDUCE_SCATTER_SINCE
    for event in said:
        assert event["works"] == has_it, (
            f"torch {torch.__version__}: gloo reduce_scatter works={event['works']} "
            f"({event['error'] or 'no error'}), but GLOO_REDUCE_SCATTER_SINCE says {has_it}")
        if not has_it:
            assert event["error"]  # it failed in words, not by hanging or crashing


def test_ring_and_parameter_server_equal_all_reduce_on_awkward_sizes():
    n = 3
    sizes = [1, 2, 4, 7, 100, 1001]
    result = launch("ddplab.workers.ring_allreduce", n, quiet=True,
                    args=["--sizes", *sizes, "--traffic-numel", 3 * 512])
    assert result.ok, result.error
    compare = result.events_of("compare")
    assert sorted({e["numel"] for e in compare}) == sizes
    assert len(compare) == n * len(sizes)
    assert max(max(e["ring_error"], e["ps_error"]) for e in compare) < 1e-5
    traffic = {(e["algorithm"], e["rank"]): e for e in result.events_of("traffic")}
    message = 3 * 512 * 4
    for rank in range(n):
        ring = traffic["ring", rank]
        assert ring["bytes_sent"] == ring["bytes_received"] == 2 * (n - 1) * message // n
        assert set(ring["peers"]) == {(rank + 1) % n, (rank - 1) % n}
        ps = traffic["parameter_server", rank]
        assert ps["bytes_sent"] == ((n - 1) * message if rank == 0 else message)
        assert set(ps["peers"]) == (set(range(1, n)) if rank == 0 else {0})
    # every rank started with ones: a chunk's value counts the ranks whose numbers it holds
    held = {e["rank"]: e["held"] for e in result.events_of("ring_steps")}
    for rank in range(n):
        assert len(held[rank]) == 2 * (n - 1)
        assert held[rank][0][(rank - 1) % n] == 2            # step 1: the left one's added
        assert held[rank][n - 2][(rank + 1) % n] == n        # reduce-scatter: one chunk complete
        assert sorted(held[rank][n - 2]) != [n] * n          # ... and only that one
        assert held[rank][-1] == [n] * n                     # all-gather: every chunk complete


def test_bandwidth_sweep_reports_positive_numbers_for_both_algorithms():
    result = launch("ddplab.workers.ring_allreduce", 2, quiet=True,
                    args=["--bench", "--sizes", 1, "--max-bytes", 1 << 14, "--repeats", 2])
    assert result.ok, result.error
    rows = result.events_of("bandwidth")
    sizes = sweep_sizes(1 << 10, 1 << 14, 4)
    assert {(r["algorithm"], r["bytes"]) for r in rows} == \
        {(a, s) for a in ("all_reduce", "ring") for s in sizes}
    for r in rows:
        assert math.isfinite(r["busbw"]) and r["busbw"] > 0
        assert r["busbw"] == pytest.approx(r["bytes"] / r["seconds"] * 2 * (2 - 1) / 2)
        assert len(r["times"]) == 2 and r["best"] == min(r["times"]) <= r["seconds"]


def test_sweep_sizes_grow_by_the_factor():
    assert sweep_sizes(1024, 16384, 4) == [1024, 4096, 16384]
    assert sweep_sizes(1, 8, 2) == [4, 8]
