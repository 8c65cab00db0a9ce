"""Launches that cannot fork, in warm processes (``spares``): really warm, and still torchrun.

With ``DDPLAB_LAUNCH_PATH=subprocess`` (what macOS gets) torchrun and every rank run in spares,
processes started ahead of time that imported torch. These tests check that a launch really
uses them, that the hand-over from torchrun's stub to a spare keeps what torchrun would see
(exit codes, signals, tracebacks, environment, directory, stdin), that ``DDPLAB_SPARES``
(warm, once, off) does what it says, and that no spare outlives its launch or its caller.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_launch import PLAIN, processes, wait_gone

from ddplab import launch
from ddplab.env import spares_mode
from ddplab.launcher import fallback, spares

SCRIPTS = Path(__file__).parent / "scripts"
RANK = str(SCRIPTS / "spare_rank.py")
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or spares_mode() == "off",
                                reason="reads /proc; needs UNIX sockets")


@pytest.fixture(autouse=True)
def warm_path(monkeypatch):
    monkeypatch.setenv("DDPLAB_LAUNCH_PATH", "subprocess")
    monkeypatch.delenv("DDPLAB_SPARES", raising=False)


def torchrun_pids(monkeypatch) -> list[int]:
    """The pids of the spares that become a launch's torchrun, from now on."""
    seen: list[int] = []
    original = spares.Pool.torchrun

    def spy(self, *args, **kwargs):
        proc = original(self, *args, **kwargs)
        seen.append(proc.pid)
        return proc

    monkeypatch.setattr(spares.Pool, "torchrun", spy)
    return seen


def spare_children() -> list[int]:
    """This process's children that are spares (idle, or running a rank or a torchrun)."""
    return [pid for pid, ppid, argv, _environ in processes()
            if ppid == os.getpid() and b"ddplab.launcher.spares" in argv]


def when_held(folder: Path, ranks: list[int], action) -> threading.Thread:
    """Call ``action`` in a thread once ``ranks`` of a ``hold`` launch in ``folder`` hold."""
    def wait_then_act() -> None:
        end = time.monotonic() + 60
        while time.monotonic() < end and not all(
                (folder / f"held-{rank}").exists() for rank in ranks):
            time.sleep(0.05)
        action()

    thread = threading.Thread(target=wait_then_act)
    thread.start()
    return thread


def held_pids(folder: Path) -> list[int]:
    """The pids of ranks 0 and 1 of a ``hold`` launch in ``folder``."""
    return [int((folder / f"held-{rank}").read_text()) for rank in (0, 1)]


def kill_quietly(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def test_a_warm_launch_runs_in_processes_started_before_it_and_they_are_replaced(monkeypatch):
    first = launch(PLAIN, 2, quiet=True, timeout=120)  # starts the spares (or finds them)
    assert first.ok, first.error
    pool = spares.Pool.current()
    assert pool is not None and pool.wait_ready(120)
    before = {spare.proc.pid for spare in pool.idle}
    alike = sum(1 for spare in pool.idle if spare.preload == pool.preload)
    assert alike >= 3  # one torchrun and two ranks
    leaders = torchrun_pids(monkeypatch)
    result = launch(PLAIN, 2, quiet=True, timeout=120)
    assert result.ok, result.error
    assert result.exit_codes == {0: 0, 1: 0}
    assert result.logs[0] == ["rank 0 of 2: sum 3"] and result.logs[1] == ["rank 1 of 2: sum 3"]
    used = [*leaders, *result.pids.values()]
    assert len(leaders) == 1 and sorted(result.pids) == [0, 1]
    assert set(used) <= before, (used, before)  # nobody started a python for this launch
    assert not wait_gone(used, 10)  # each served one launch
    # warm: the pool is back to one torchrun and the last launch's ranks, ready
    assert pool.wait_ready(120)
    again = [s for s in pool.idle if s.preload == pool.preload and s.proc.poll() is None]
    assert len(again) == max(3, alike - 3) and all(s.ready for s in again)
    assert not {s.proc.pid for s in again} & set(used)


@pytest.mark.parametrize("mode,signal_name", [("kill", "SIGKILL"), ("segv", "SIGSEGV"),
                                              ("interrupt", "SIGINT")])
def test_a_rank_killed_by_a_signal_is_reported_with_that_signal(mode, signal_name):
    """The stub dies of the signal its spare died of: torchrun reports what it would have."""
    result = launch(RANK, 2, args=[mode], quiet=True, timeout=120)
    assert result.status == "failed", result.error
    assert result.root_cause.rank == 1 and result.root_cause.signal == signal_name
    assert f"killed by {signal_name}" in result.error
    assert not wait_gone(list(result.pids.values()), 10)


def test_an_uncaught_exception_exits_1_with_the_scripts_traceback():
    result = launch(RANK, 2, args=["raise"], quiet=True, timeout=120)
    assert result.status == "failed"
    assert result.root_cause.rank == 1 and result.root_cause.exitcode == 1
    assert result.exit_codes[1] == 1
    trace = result.root_cause.traceback
    assert "ValueError: rank 1 fails on purpose" in trace and 'spare_rank.py", line' in trace
    assert "spares.py" not in trace and "entry.py" not in trace and "runpy" not in trace


def test_a_rank_that_ended_before_the_failure_keeps_its_exit_code(tmp_path):
    """torchrun's report names only the failed rank; a warm rank says how its script ended,
    so the rank that had already exited 0 is not left unknown (as on the fork path)."""
    result = launch(RANK, 2, args=["after0"], cwd=tmp_path, quiet=True, timeout=120)
    assert result.status == "failed" and result.root_cause.rank == 1, result.error
    assert result.exit_codes == {0: 0, 1: 1}


def test_a_negative_exit_code_is_an_exit_status_not_a_signal():
    """sys.exit(-1) is exit status 255 under python, and under the fork path."""
    result = launch(RANK, 2, args=["minus1"], quiet=True, timeout=120)
    assert result.status == "failed"
    assert result.root_cause.rank == 1 and result.root_cause.exitcode == 255
    assert result.root_cause.signal is None and "rank 1 exited with code 255" in result.error


def test_a_rank_sees_the_jobs_environment_directory_and_arguments_not_the_spares(
        monkeypatch, tmp_path):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    pool = spares.Pool.current()
    if pool is None or pool.closed or len(pool.idle) < 3:
        launch(PLAIN, 2, quiet=True, timeout=120)
        pool = spares.Pool.current()
    started = {spare.proc.pid for spare in pool.idle}  # before the variable below was set
    monkeypatch.setenv("DDPLAB_TEST_LATE", "set after the spares started")
    result = launch(RANK, 2, args=["report", "--flag"], env={"MY_VAR": "x"}, cwd=tmp_path,
                    threads=3, quiet=True, timeout=120)
    assert result.ok, result.error
    for rank in (0, 1):
        seen = json.loads(result.log(rank))
        assert seen["env"] == {"MY_VAR": "x", "DDPLAB_TEST_LATE": "set after the spares started",
                               "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                               "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "3",
                               "DDPLAB_SPARE_PRELOAD": None}
        assert seen["threads"] == 3  # torch was imported before: set again for the rank
        assert seen["cwd"] == str(tmp_path)
        assert seen["argv"] == [RANK, "report", "--flag"] and seen["name"] == "__main__"
        assert seen["path0"] == str(SCRIPTS)  # as `python spare_rank.py` puts it
        assert seen["stdin"] == ""  # torchrun's stdin (nothing), not the caller's
        assert seen["pid"] == result.pids[rank] and seen["pid"] in started


def test_a_killed_stub_takes_its_rank_down_and_torchrun_reports_it(monkeypatch, tmp_path):
    """torchrun ends a worker by killing its process: the stub. Its spare must end too, by
    the broker's doing (the job's own clean-up, ``end_job``, is turned off here)."""
    monkeypatch.setattr(spares.Pool, "end_job", lambda self, token, grace=2.0: None)
    mark = f"{os.getpid()}-{time.monotonic_ns()}"
    killed: list[int] = []

    def kill_stub_of_rank_1() -> None:
        for pid, _ppid, command, environ in processes():
            if spares.STUB.encode() in command and b"RANK=1" in environ \
                    and f"DDPLAB_TEST_MARK={mark}".encode() in environ:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)

    killer = when_held(tmp_path, [0, 1], kill_stub_of_rank_1)
    result = launch(RANK, 2, args=["hold"], env={"DDPLAB_TEST_MARK": mark}, cwd=tmp_path,
                    quiet=True, timeout=60)
    killer.join()
    held = held_pids(tmp_path)
    try:
        assert len(killed) == 1, "no stub of rank 1 found"
        assert result.status == "failed", result.error  # torchrun noticed, no timeout
        assert result.root_cause.rank == 1 and result.root_cause.signal == "SIGKILL"
        assert held == [result.pids[0], result.pids[1]]
        assert not wait_gone(held, 10)  # the rank of the killed stub, and the other one
    finally:
        kill_quietly(held)


def test_an_interrupted_warm_launch_ends_torchrun_and_every_rank(monkeypatch, tmp_path):
    """A Jupyter interrupt: the spares lead sessions of their own, out of reach of the
    kernel's SIGINT; the launch ends them itself, then raises the interrupt again."""
    leaders = torchrun_pids(monkeypatch)
    interrupter = when_held(tmp_path, [0, 1], lambda: os.kill(os.getpid(), signal.SIGINT))
    with pytest.raises(KeyboardInterrupt) as caught:
        launch(RANK, 2, args=["hold"], cwd=tmp_path, quiet=True, timeout=60)
    interrupter.join()
    held = held_pids(tmp_path)
    try:
        assert caught.value.result.status == "interrupted"
        assert sorted(caught.value.result.pids.values()) == sorted(held)
        assert not wait_gone([*leaders, *held], 10)
    finally:
        kill_quietly(held)


def test_once_starts_what_the_launch_needs_and_leaves_no_spare(monkeypatch):
    old = spares.Pool.current()
    if old is not None:
        old.close()  # a fresh pool: what the CLI has
    assert not wait_gone(spare_children(), 10)
    monkeypatch.setenv("DDPLAB_SPARES", "once")
    leaders = torchrun_pids(monkeypatch)
    result = launch(PLAIN, 2, quiet=True, timeout=120)
    assert result.ok, result.error
    assert result.logs[1] == ["rank 1 of 2: sum 3"]
    pool = spares.Pool.current()
    assert pool is not old and pool.idle == [] and pool.ranks == {}
    assert len(leaders) == 1
    assert not wait_gone([*leaders, *result.pids.values()], 10)
    assert not wait_gone(spare_children(), 10)  # nothing started for a next launch


def test_off_launches_a_cold_torchrun_and_says_so(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("DDPLAB_SPARES", "off")
    monkeypatch.setattr(fallback, "_NOTICE_SHOWN", set())
    leaders = torchrun_pids(monkeypatch)
    pool = spares.Pool.current()
    idle = [] if pool is None else [s.proc.pid for s in pool.idle]
    script = tmp_path / "legacy.py"  # a torch.distributed.launch script: through entry.py
    script.write_text("import argparse\np = argparse.ArgumentParser()\n"
                      "p.add_argument('--local_rank', type=int, default=-1)\n"
                      "print('local_rank', p.parse_args().local_rank)\n")
    result = launch(script, 2, local_rank_arg=True, quiet=True, timeout=120)
    assert result.ok, result.error
    assert result.logs[0] == ["local_rank 0"] and result.logs[1] == ["local_rank 1"]
    assert leaders == []  # no spare became its torchrun
    assert "ddplab: launching through torchrun in a cold subprocess (slower)" in \
        capsys.readouterr().err
    pool = spares.Pool.current()
    assert idle == ([] if pool is None else [s.proc.pid for s in pool.idle])  # none taken


def test_a_caller_that_returns_leaves_none_of_its_spares_running():
    code = (f"import json, ddplab\n"
            f"from ddplab.launcher.spares import Pool\n"
            f"result = ddplab.launch({PLAIN!r}, 2, quiet=True, timeout=120)\n"
            f"pool = Pool.current()\n"
            f"print(json.dumps({{'ok': result.ok, 'ranks': list(result.pids.values()),\n"
            f"    'idle': [s.proc.pid for s in pool.idle], 'home': pool.home}}), flush=True)\n")
    env = {**os.environ, "DDPLAB_LAUNCH_PATH": "subprocess"}
    env.pop("DDPLAB_SPARES", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["ok"] and len(seen["ranks"]) == 2
    assert len(seen["idle"]) == 3  # warm: replacements were starting when it returned
    assert not wait_gone(seen["ranks"] + seen["idle"], 10)
    assert not os.path.exists(seen["home"])  # the broker's socket directory too


def test_the_stub_run_by_hand_says_what_it_is_for(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "DDPLAB_SPARES_SOCKET"}
    alone = subprocess.run([sys.executable, spares.STUB, PLAIN], env=env, capture_output=True,
                           text=True, timeout=60)
    assert alone.returncode != 0 and "started by a ddplab launch" in alone.stderr
    nobody = str(tmp_path / "broker")
    lost = subprocess.run([sys.executable, spares.STUB, PLAIN], capture_output=True, text=True,
                          env={**env, "DDPLAB_SPARES_SOCKET": nobody}, timeout=60)
    assert lost.returncode != 0
    assert f"the launcher's warm processes cannot be reached at {nobody}" in lost.stderr


def test_a_long_temporary_folder_still_gives_a_socket_path_that_fits(tmp_path, monkeypatch):
    """macOS's per-user TMPDIR is long, and a UNIX socket's path has at most 104 bytes there:
    the broker's socket goes to /tmp then, and the warm processes are still reached."""
    import tempfile

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    pool = spares.Pool()
    try:
        assert len(pool.address) < 104 and os.path.exists(pool.address)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(pool.address)  # the broker listens there
        conn.close()
    finally:
        pool.close()
    assert not os.path.exists(pool.home)
