"""The process that forks the ranks runs no other thread when it forks, least of all the
store's server.

A worker forked while the agent's TCPStore server thread was inside ``getnameinfo`` (it
accepts each peer that way) inherited libc's resolver lock held and hung on its own first
connection: about one 4-rank launch in 200 on torch 2.14, one in 15 on torch 2.6. Now the
agent's own store is an in-process ``HashStore``, and the workers' store is served by the agent
only once the ranks are forked (their connections wait in the socket's backlog), and dropped,
its thread joined, before a restart forks them again; on the loopback address and on any other
(tested on this machine's own address where it has one). Several nodes run as a cold torchrun,
whose ranks execute a fresh program after the fork. The threads are read at each fork
(``tests/scripts/fork_watch.py``, preloaded by the helper these tests launch with).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from launch_path import needs_fork

import ddplab
from ddplab import env, launch
from ddplab.env import process_table

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

SCRIPTS = Path(__file__).parent / "scripts"
PROBE = str(SCRIPTS / "forker_probe.py")


@pytest.fixture(scope="module", autouse=True)
def _forks_watched():
    """This module's launches run on a helper that preloaded ``fork_watch`` (a fresh one,
    ended after: later tests get a helper without it)."""
    import os

    from ddplab.launcher.helper import Helper

    def fresh() -> None:
        if Helper._current is not None:
            Helper._current.end()
    fresh()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DDPLAB_PRELOAD", "fork_watch")
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [
            str(SCRIPTS), os.environ.get("PYTHONPATH", "")])))
        yield
    fresh()


def forkers(results: list, what: str = "threads") -> dict[int, Any]:
    found = {}
    for result in results:
        assert result.ok, result.error
        for rank, lines in result.logs.items():
            for line in lines:
                if line.startswith("forker "):
                    info = json.loads(line[len("forker "):])
                    found[info["rank"]] = info[what]
    return found


def test_one_node_the_agent_forks_with_no_other_thread_and_nothing_outlives_the_job():
    needs_fork()  # (a cold torchrun's agent runs threads of its own: its ranks exec: store_threads)
    result = launch(PROBE, 4, quiet=True, timeout=120)
    threads = forkers([result])
    assert sorted(threads) == [0, 1, 2, 3]
    assert all(len(names) == 1 for names in threads.values()), threads
    groups = set(forkers([result], "group").values())
    assert len(groups) == 1
    assert process_table(groups.pop()) == {}  # agent and ranks: all gone


@pytest.mark.parametrize("how", ["two nodes", "restarts"])
def test_with_the_c10d_rendezvous_no_store_server_runs_in_the_agent(how):
    if how == "two nodes":
        results = ddplab.launch_multinode(PROBE, nnodes=2, nproc_per_node=2, quiet=True,
                                          timeout=120)
    else:
        results = [launch(PROBE, 2, max_restarts=1, quiet=True, timeout=120)]
    threads = forkers(results)
    assert sorted(threads) == list(range(len(threads))) and len(threads) >= 2
    assert not store_threads(results), threads


def store_threads(results: list) -> list:
    """The store server threads of the processes that forked a rank that did not then
    execute a program of its own (a torchrun subprocess's ranks do)."""
    execed = forkers(results, "execed")
    return [name for rank, names in forkers(results).items() for name in names
            if name.startswith("pt_tcpstore") and not execed[rank]]


def own_address() -> str:
    """An address of this machine that is not loopback (a real multi-node job's kind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: it only picks a route
            address = probe.getsockname()[0]
        except OSError:
            address = ""
    if not address or address.startswith("127.") or address == "0.0.0.0":
        pytest.skip("this machine has no address but loopback")
    return address


@pytest.mark.parametrize("restarts", [0, 1], ids=["static", "c10d"])
def test_on_an_address_that_is_not_loopback_the_store_is_kept_out_of_the_agent_too(restarts):
    needs_fork()  # (a cold torchrun's agent serves its own store: its ranks exec: store_threads)
    address = own_address()
    result = launch(PROBE, 2, master_addr=address, max_restarts=restarts, quiet=True,
                    timeout=120)
    threads = forkers([result])
    assert sorted(threads) == [0, 1]
    assert all(len(names) == 1 for names in threads.values()), threads


def test_two_nodes_meeting_on_an_address_that_is_not_loopback_keep_the_store_out_too():
    address = own_address()
    port = env.free_port(address)
    nodes = [subprocess.Popen([sys.executable, "-m", "ddplab", "launch", "--nnodes", "2",
                               "--node-rank", str(node), "--rdzv-endpoint", f"{address}:{port}",
                               "--nproc-per-node", "1", PROBE],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for node in (0, 1)]
    try:
        outputs = [node.communicate(timeout=120)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], outputs
    infos = [json.loads(line.split("forker ", 1)[1])
             for line in "".join(outputs).splitlines() if "forker " in line]
    assert sorted(info["rank"] for info in infos) == [0, 1], outputs
    assert not [name for info in infos if not info["execed"] for name in info["threads"]
                if name.startswith("pt_tcpstore")], infos


def test_a_lone_node_on_an_address_its_hostname_does_not_name_hosts_its_own_store(monkeypatch):
    address = own_address()   # torch guesses the store's host from the hostname: no guessing
    monkeypatch.setenv("DDPLAB_LAUNCH_PATH", "subprocess")
    result = launch(PROBE, 2, master_addr=address, max_restarts=1, quiet=True, timeout=120)
    assert result.ok, result.error


def test_the_store_is_served_after_the_fork_in_every_round_and_serves(tmp_path):
    """Two rounds (rank 0 fails the first): at every fork of a rank the agent ran one thread,
    and the ranks met at the store both times."""
    needs_fork()
    script = tmp_path / "rounds.py"
    script.write_text(
        "import json, os, sys\nfrom pathlib import Path\nimport torch.distributed as dist\n"
        "watch = sys.modules.get('fork_watch')\n"
        "print('forker ' + json.dumps({'rank': int(os.environ['RANK']), 'threads': "
        "watch.THREADS if watch else None, 'round': os.environ['TORCHELASTIC_RESTART_COUNT']}),"
        " flush=True)\n"
        "dist.init_process_group('gloo')\ndist.barrier()\n"
        "failed = Path(sys.argv[1], 'failed')\n"
        "if os.environ['RANK'] == '0' and not failed.exists():\n"
        "    failed.write_text('once')\n    sys.exit(1)\n"
        "dist.destroy_process_group()\n")
    result = launch(str(script), 2, args=[tmp_path], max_restarts=1, quiet=True, timeout=120)
    assert result.ok, result.error
    seen = [json.loads(line[len("forker "):]) for lines in result.logs.values() for line in lines
            if line.startswith("forker ")]
    assert sorted((info["round"], info["rank"]) for info in seen) == [
        ("0", 0), ("0", 1), ("1", 0), ("1", 1)]
    assert all(info["threads"] is not None and len(info["threads"]) == 1 for info in seen), seen
