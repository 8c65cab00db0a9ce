"""The process that forks the ranks runs no other thread, least of all the store's server.

A worker forked while the agent's TCPStore server thread was inside ``getnameinfo`` (it
accepts each peer that way) inherited libc's resolver lock held and hung on its own first
connection: about one 4-rank launch in 200 on torch 2.14, one in 15 on torch 2.6. The store
now lives in a keeper process of its own (``ddplab.agent._store_in_keeper``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import ddplab
from ddplab import jobs, launch

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

PROBE = str(Path(__file__).parent / "scripts" / "forker_probe.py")


def forkers(results: list) -> dict[int, list[str]]:
    found = {}
    for result in results:
        assert result.ok, result.error
        for rank, lines in result.logs.items():
            for line in lines:
                if line.startswith("forker "):
                    info = json.loads(line[len("forker "):])
                    found[info["rank"]] = info["threads"]
    return found


def test_one_node_the_agent_forks_with_no_other_thread():
    for _ in range(2):  # a cold helper, then a warm one
        threads = forkers([launch(PROBE, 4, quiet=True, timeout=120)])
        assert sorted(threads) == [0, 1, 2, 3]
        assert all(len(names) == 1 for names in threads.values()), threads


@pytest.mark.parametrize("how", ["two nodes", "restarts"])
def test_with_the_c10d_rendezvous_no_store_server_runs_in_the_agent(how):
    if how == "two nodes":
        results = ddplab.launch_multinode(PROBE, nnodes=2, nproc_per_node=2, quiet=True,
                                          timeout=120)
    else:
        results = [launch(PROBE, 2, max_restarts=1, quiet=True, timeout=120)]
    threads = forkers(results)
    assert sorted(threads) == list(range(len(threads))) and len(threads) >= 2
    assert not [name for names in threads.values() for name in names
                if name.startswith("pt_tcpstore")], threads


def test_nothing_of_the_job_outlives_it_store_keeper_included():
    result = launch(PROBE, 2, quiet=True, timeout=120)
    assert result.ok, result.error
    groups = {json.loads(line[len("forker "):])["group"] for rank in (0, 1)
              for line in result.logs[rank] if line.startswith("forker ")}
    assert len(groups) == 1
    assert jobs._process_table(groups.pop()) == {}  # agent, keeper and ranks: all gone
