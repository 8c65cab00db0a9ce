"""The launcher on real processes (gloo): success, failures, timeouts, interrupts, clean-up.

Most tests run on the fork path (ranks forked by a warm helper). The subprocess path (a cold
torchrun, the path off Linux; ``DDPLAB_LAUNCH_PATH=subprocess`` or ``path="subprocess"``) runs
the same rank entry and the same output streams, and each of its launches starts three fresh
interpreters (seconds of CPU each), so it runs only where its code differs, each launch proving
all it can:

- how a rank's end is read there (torchrun's report and the ranks' own exit events):
  ``test_a_rank_that_ended_before_the_failure_keeps_its_exit_code``, two launches: rank 0 ends
  cleanly first, then rank 1 by SIGKILL (a signal, said by nothing but the report; not an
  abort at exit) or by ``sys.exit(-1)`` (255 in the report, -1 in the rank's words); an abort
  at exit: ``test_an_abort_while_exiting_is_told_apart_from_a_crash``; a restart by the cold
  torchrun's agent: ``test_max_restarts_...``;
- the job's environment, directory, arguments and threads, and a ``PYTHONWARNINGS`` of other
  warnings that reaches the cold torchrun as well as the ranks:
  ``test_a_rank_sees_the_jobs_environment_directory_and_arguments``; the job's filter making
  a rank's warning an error: ``test_the_jobs_pythonwarnings_...``;
- the stacks at a timeout (test_rank_behaviour), an interrupt and a caller's error (its ranks
  lead sessions of their own): ``test_an_interrupted_launch_ends_every_rank_on_both_paths``,
  ``test_an_exception_in_the_caller_ends_every_process_of_the_job``; a caller that returns:
  ``test_a_caller_that_returns_leaves_nothing_running_on_the_subprocess_path``; why that path
  is taken, said once: ``test_without_fork_the_launch_goes_through_torchrun_and_says_why_once``.

The other ways a rank ends (SIGSEGV, an interrupt, an uncaught exception's traceback), what a
rank prints and how its lines and events reach the caller (test_rank_behaviour's long lines run
under every engine and path; test_cli's streams of a real command on the subprocess path) and
``--local_rank`` (an environment variable the entry reads) are the entry's and the streams' on
both paths: tested on the fork path only."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from launch_path import cold, launch_timeout, needs_fork

import ddplab
from ddplab import LaunchError, launch
from ddplab import env as ddenv
from ddplab.torch_words import PEER_LOST

SCRIPTS = Path(__file__).parent / "scripts"
PLAIN = str(SCRIPTS / "plain.py")
FAULTY = str(SCRIPTS / "faulty.py")


def processes():
    """Every live process as ``(pid, ppid, argv, environ)``, argv and environ as lists of
    bytes (read from /proc; processes that end meanwhile are skipped)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        if stat[0] != "Z":
            yield int(entry), int(stat[1]), argv, environ


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pids: list[int], seconds: float = 15.0) -> list[int]:
    """Wait until every pid is gone; return those still alive after ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def until(condition, what: str, seconds: float = 60.0) -> bool:
    """Wait for ``condition()``; the time limit is a safety net (``what`` went wrong)."""
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, f"{what} (still so after {seconds:g} s)"
        time.sleep(0.02)
    return True


def printed_pids(text: str) -> list[int]:
    return [int(p) for p in re.findall(r"\bpid (\d+)", text)]


def end_once_said(*said: tuple[str, int], after: float = 2.0):
    """An ``on_event`` for a test whose point is a hang: once each ``(name, rank)`` of ``said``
    was emitted (the script emits it just before the call that hangs), the launch ends as a
    timeout ``after`` seconds later, stacks taken, instead of waiting out its clock. ``after``
    is the time a rank takes from its event into the call on a loaded machine, with room."""
    waiting = set(said)

    def on_event(event: dict):
        waiting.discard((event.get("name"), event.get("rank")))
        return after if not waiting else None
    return on_event


def test_plain_torchrun_script_runs_unchanged(capsys):
    result = launch(PLAIN, 2)
    assert result.ok, result.error
    assert result.exit_codes == {0: 0, 1: 0}
    assert result.logs[0] == ["rank 0 of 2: sum 3"]
    assert result.logs[1] == ["rank 1 of 2: sum 3"]
    out = capsys.readouterr().out
    assert "[rank0] rank 0 of 2: sum 3" in out and "[rank1] rank 1 of 2: sum 3" in out
    assert not wait_gone(list(result.pids.values()))


def test_module_target_and_events(tmp_path):
    (tmp_path / "evmod.py").write_text(
        "from ddplab import events\nevents.emit('metric', name='x', value=2.5)\nprint('hi')\n")
    result = launch("evmod", 2, cwd=tmp_path, quiet=True)
    assert result.ok, result.error
    metrics = result.events_of("metric")
    assert [e["rank"] for e in metrics] == [0, 1]
    assert all(e["value"] == 2.5 for e in metrics)
    assert result.log(1) == "hi"  # event lines are not part of the log


def test_installed_modules_resolve_from_any_directory(monkeypatch, tmp_path):
    from ddplab.launcher.spec import resolve_target as _resolve_target

    repo = str(Path(__file__).resolve().parent.parent)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", repo)])
    monkeypatch.chdir(tmp_path)  # as a notebook kernel in notebooks/ would be
    assert _resolve_target("ddplab.workers.train", str(tmp_path)) == "ddplab.workers.train"
    with pytest.raises(LaunchError):
        _resolve_target("ddplab.workers.no_such_worker", str(tmp_path))


def test_rank_raises_root_cause_is_that_rank():
    result = launch(FAULTY, 2, args=["raise"], quiet=True)
    assert not result.ok and result.status == "failed" and result.returncode != 0
    assert result.root_cause.rank == 1 and result.job_root_cause is result.root_cause
    assert "ValueError: boom on rank 1" in result.error
    assert 'faulty.py", line' in result.root_cause.traceback
    assert not PEER_LOST.search(result.error) and "agent.py" not in result.error


def test_exit_code_is_reported():
    result = launch(FAULTY, 2, args=["exit"], quiet=True)
    assert result.status == "failed"
    assert result.exit_codes[1] == 3
    assert result.root_cause.rank == 1 and result.root_cause.exitcode == 3
    assert "rank 1 exited with code 3" in result.error


def test_a_refusal_in_words_is_the_root_causes_message():
    """sys.exit("why") prints no traceback: its words, from the rank's stderr, are the cause."""
    result = launch(FAULTY, 2, args=["refuse"], quiet=True)
    assert result.status == "failed" and result.root_cause.rank == 1
    assert result.root_cause.exitcode == 1
    assert result.root_cause.message == "--size 3 does not divide by 2: pick an even size"
    assert "rank 1 exited with code 1: --size 3 does not divide" in result.error


def test_signal_is_reported():
    result = launch(FAULTY, 2, args=["signal"], quiet=True)
    assert result.status == "failed"
    assert result.root_cause.rank == 1
    assert result.root_cause.signal == "SIGKILL"
    assert "killed by SIGKILL" in result.error


def test_sys_exit_zero_is_success():
    result = launch(FAULTY, 2, args=["sysexit0"], quiet=True, timeout=60)
    assert result.ok, result.error
    assert result.exit_codes == {0: 0, 1: 0}


def test_workers_leaving_through_os_exit_do_not_hang_the_launch():
    needs_fork()  # (torch's agent waits for a forked worker's return value; torchrun does not)
    result = launch(FAULTY, 2, args=["osexit0"], quiet=True, timeout=60)
    assert result.status == "failed"  # not "timeout": the launcher noticed in seconds
    assert "os._exit" in result.error


def test_timeout_ends_the_whole_group():
    # (long enough for both ranks to print their pid on a loaded machine)
    # The clock itself is the point: this is the forked path's one test of a real timeout
    # (the subprocess path's and the spawn engine's are in test_rank_behaviour); the other
    # hangs of the suite end through ``on_event`` (``end_once_said``).
    needs_fork()  # (20 s is sized for forked ranks: cold ones were still importing torch then)
    result = launch(FAULTY, 2, args=["hang"], timeout=20, quiet=True)
    assert result.status == "timeout" and not result.ok
    assert "timed out after 20 s" in result.error and result.still_running == [0, 1]
    assert 'faulty.py", line 50' in result.stacks[0], result.stacks  # dist.all_reduce(value)
    assert 'faulty.py", line 43' in result.stacks[1], result.stacks  # time.sleep(600)
    pids = printed_pids(result.log(0) + "\n" + result.log(1))
    assert len(pids) == 2
    assert not wait_gone(pids, 5)


def _start_caller() -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(SCRIPTS / "caller.py"), FAULTY], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _read_until_pids(proc: subprocess.Popen, count: int = 2) -> tuple[list[int], str]:
    seen = ""
    while len(printed_pids(seen)) < count:
        line = proc.stdout.readline()
        assert line, f"caller ended early:\n{seen}"
        seen += line
    return printed_pids(seen), seen


def test_sigint_to_callers_group_ends_the_job_then_raises_keyboardinterrupt_again(exit_within):
    proc = _start_caller()
    try:
        pids, _ = _read_until_pids(proc)
        os.killpg(proc.pid, signal.SIGINT)  # what a Jupyter interrupt does
        out, _ = exit_within(proc, 60)
    finally:
        proc.kill()
    said = out.split("INTERRUPTED ", 1)[1].splitlines()[0]
    assert said == "ddplab.launch: interrupted: every process of the job was ended."
    result = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    assert result == {"status": "interrupted", "ok": False}
    assert "KeyboardInterrupt" in out  # raised again: the caller ends as an interrupted program
    assert proc.returncode == -signal.SIGINT
    assert not [p for p in pids if alive(p)]  # ended before the interrupt was raised again


def test_killed_caller_takes_the_workers_down():
    proc = _start_caller()
    try:
        pids, _ = _read_until_pids(proc)
        proc.kill()
        proc.wait()
    finally:
        proc.kill()
    assert not wait_gone(pids, 15)


def test_large_output_is_not_lost_or_deadlocked():
    result = launch(str(SCRIPTS / "chatty.py"), 2, quiet=True, timeout=120)
    assert result.ok, result.error
    for rank in (0, 1):
        lines = result.logs[rank]
        assert len(lines) == 3001 and lines[-1] == "last line"
        assert lines[2999] == "02999 " + str(rank) * 94
        assert sum(len(line) + 1 for line in lines) > 300_000


def test_concurrent_launches_both_succeed():
    results: dict[int, ddplab.RunResult] = {}

    def run(i: int) -> None:
        results[i] = launch(PLAIN, 2, quiet=True, timeout=120)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(results[i].ok for i in range(2)), [results[i].error for i in range(2)]


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def sockets_of(pid: int) -> int:
    """How many sockets ``pid`` holds open (one that closes while we look does not count)."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except FileNotFoundError:
            pass
    return count


def test_ten_launches_leave_nothing_behind():
    from ddplab.launcher.helper import Helper

    needs_fork()
    launch(PLAIN, 2, quiet=True)  # make sure the helper process exists before counting
    helper = Helper.get(dict(os.environ)).request({"op": "ping"})["pid"]
    assert helper == Helper.get(dict(os.environ)).proc.pid  # (the answer names its request)

    def helper_idle() -> bool:  # no agent left, and only the caller's socket
        return not [p for p in _children(helper) if alive(p)] and sockets_of(helper) == 1

    assert until(helper_idle, "the last launch's agent outlived it")
    fds_before = len(os.listdir("/proc/self/fd"))
    pids: list[int] = []
    for _ in range(10):
        result = launch(PLAIN, 2, quiet=True)
        assert result.ok, result.error
        pids += result.pids.values()
    assert not wait_gone(pids, 5)
    assert len(os.listdir("/proc/self/fd")) <= fds_before  # no pipe or socket leaked
    assert Helper.get(dict(os.environ)).proc.pid == helper  # it serves the next
    assert until(helper_idle, "agents or connections kept after their launches ended")


def test_spawn_engine_runs_and_reports_the_failed_rank(capsys):
    """Also the spawn engine's streams: mp.spawn's own report goes to stderr, not stdout (the
    torchrun engine's: test_stderr_of_the_ranks_goes_to_stderr_and_stdout_to_stdout)."""
    ok = launch(str(SCRIPTS / "spawn_min.py"), 2, engine="spawn", quiet=True)
    assert ok.ok, ok.error
    assert ok.logs[0] == ["sum=3.0"] and ok.logs[1] == ["sum=3.0"]
    capsys.readouterr()
    bad = launch(str(SCRIPTS / "spawn_min.py"), 2, engine="spawn", timeout=120,
                 args=["--fail-rank", "1"])
    assert bad.status == "failed" and bad.root_cause.rank == 1
    assert "spawned rank 1 fails on purpose" in bad.error
    shown = capsys.readouterr()
    assert "[launcher] Traceback (most recent call last):" in shown.err  # mp.spawn's report
    assert "Traceback" not in shown.out


def test_without_fork_the_launch_goes_through_torchrun_and_says_why_once(monkeypatch, capsys):
    """Said once, in one line; the ranks are those of a ``torch.distributed.run`` subprocess."""
    from ddplab import env
    from ddplab.launcher import fallback

    monkeypatch.delenv("DDPLAB_LAUNCH_PATH", raising=False)  # (the reason said is the platform)
    monkeypatch.setattr(env.sys, "platform", "win32")
    monkeypatch.setattr(fallback, "_NOTICE_SHOWN", set())
    assert "needs Linux" in env.no_fork_reason()
    first = launch(PLAIN, 2, quiet=True)
    second = launch(PLAIN, 2, quiet=True)
    assert first.ok and second.ok, (first.error, second.error)
    assert second.logs[1] == ["rank 1 of 2: sum 3"]
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "launching through" in line]
    assert len(said) == 1 and "torchrun subprocess" in said[0] and "needs Linux" in said[0]
    torchruns = [argv for _pid, ppid, argv, _env in processes() if ppid == os.getpid()
                 and b"ddplab.launcher.fallback" in argv]
    assert torchruns == []  # ended with its job


def test_a_variable_read_once_at_start_reaches_the_ranks_and_says_how(
        tmp_path, capsys, monkeypatch):
    """TORCH_LOGS is read when torch is imported, PYTHONOPTIMIZE when Python starts: a rank
    forked from the helper kept the helper's, so a launch that sets another runs as a cold
    torchrun, and says why once."""
    from ddplab.launcher import fallback

    monkeypatch.setattr(fallback, "_NOTICE_SHOWN", set())
    script = tmp_path / "logs.py"
    script.write_text("import logging, os, sys, torch\n"
                      "print(logging.getLogger('torch._dynamo').getEffectiveLevel(),\n"
                      "      sys.flags.optimize,\n"
                      "      b'ddplab.launcher.helper' in open(f'/proc/{os.getppid()}/cmdline',"
                      " 'rb').read())\n")
    logs = {"TORCH_LOGS": "+dynamo"}
    first, second = (launch(str(script), 1, quiet=True, timeout=launch_timeout(120), env=logs)
                     for _ in range(2))
    assert first.logs[0][-1] == second.logs[0][-1] == "10 0 False", first.logs  # (DEBUG)
    optimized = launch(str(script), 1, quiet=True, timeout=launch_timeout(120),
                       env={"PYTHONOPTIMIZE": "1"})  # (Python reads it when it starts)
    assert optimized.logs[0][-1] == "30 1 False", optimized.logs
    said = [line for line in capsys.readouterr().err.splitlines()
            if "sets TORCH_LOGS otherwise than the launch helper" in line]
    assert len(said) == (0 if cold() else 1), said  # (off the fork path: the reason is another)
    plain = launch(str(script), 1, quiet=True, timeout=launch_timeout(120))
    assert plain.ok and plain.logs[0][-1] == ("30 0 False" if cold() else "30 0 True")


def test_helper_with_cuda_initialised_raises_an_error_that_says_what_to_do():
    needs_fork()
    code = (f"import ddplab\n"
            f"for _ in range(2):\n"
            f"    try:\n"
            f"        print(ddplab.launch({PLAIN!r}, 2, quiet=True).logs)\n"
            f"    except RuntimeError as exc:\n"
            f"        print('raised:', str(exc).replace(chr(10), ' '))\n")
    env = {**os.environ, "DDPLAB_PRELOAD": "cuda_claimed",
           "PYTHONPATH": os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    said = out.stdout.splitlines()  # each launch raises (none runs a rank), the second too
    assert len(said) == 2 and all(line.startswith("raised: CUDA is initialised") and
                                  "DDPLAB_LAUNCH_PATH=subprocess" in line for line in said), said


def test_bad_input_is_refused_before_anything_starts(monkeypatch, tmp_path):
    with pytest.raises(LaunchError, match="no script or module"):
        launch(tmp_path / "missing.py", 2)
    with pytest.raises(LaunchError, match="no script or module"):
        launch("no_such_module_here", 2)
    with pytest.raises(LaunchError, match="nprocs must be"):
        launch(PLAIN, 0)
    with pytest.raises(LaunchError, match="unknown engine"):
        launch(PLAIN, 2, engine="mpirun")
    monkeypatch.setattr(ddenv, "gpu_count", lambda: 0)
    with pytest.raises(LaunchError, match="needs CUDA GPUs"):
        launch(PLAIN, 2, backend="nccl")
    monkeypatch.setattr(ddenv, "gpu_count", lambda: 1)
    with pytest.raises(LaunchError, match="only 1 GPU"):
        launch(PLAIN, 2, backend="nccl")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(LaunchError, match="is busy"):
            launch(PLAIN, 2, master_port=busy.getsockname()[1])


def test_cli_exit_codes_name_the_failed_rank(cli):
    """The command's code is its ``main``'s (the launches run in this process: ``cli``); the
    last one, refused before any launch, is a real process's exit status."""
    ok = cli("launch", "--nproc-per-node", "2", PLAIN)
    assert ok.returncode == 0, ok.stderr
    assert "[rank1] rank 1 of 2: sum 3" in ok.stdout
    bad = cli("launch", "--nproc-per-node", "2", FAULTY, "exit")
    assert bad.returncode != 0 and "rank 1 exited with code 3" in bad.stderr
    usage = subprocess.run([sys.executable, "-m", "ddplab", "launch", "--nproc-per-node", "0",
                            PLAIN], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "nprocs must be" in usage.stderr


def test_two_nodes_meet_at_one_rendezvous():
    results = ddplab.launch_multinode(PLAIN, nnodes=2, nproc_per_node=1, quiet=True, timeout=120)
    assert [r.ok for r in results] == [True, True], [r.error for r in results]
    lines = sorted(line for r in results for rank in r.logs if rank != "launcher"
                   for line in r.logs[rank])
    assert lines == ["rank 0 of 2: sum 3", "rank 1 of 2: sum 3"]


def test_workers_leave_as_python_would_atexit_handlers_and_all(tmp_path):
    script = tmp_path / "goodbye.py"
    script.write_text(
        "import atexit, os, sys\n"
        "atexit.register(lambda: print('goodbye from rank', os.environ['RANK'], flush=True))\n"
        "if sys.argv[1:] == ['fail'] and os.environ['RANK'] == '1':\n"
        "    raise SystemExit(4)\n")
    ok = launch(script, 2, quiet=True)
    assert ok.ok and ok.logs[0] == ["goodbye from rank 0"] and ok.logs[1] == ["goodbye from rank 1"]
    bad = launch(script, 2, args=["fail"], quiet=True)
    assert bad.root_cause.rank == 1 and bad.root_cause.exitcode == 4
    assert "goodbye from rank 1" in bad.logs[1]  # python runs them on a failed exit too


def test_two_nodes_name_the_first_failure_of_the_whole_job():
    results = ddplab.launch_multinode(FAULTY, nnodes=2, nproc_per_node=1, args=["raise"],
                                      quiet=True, timeout=120)
    assert [r.ok for r in results] == [False, False]
    causes = [r.job_root_cause for r in results]
    assert all(c is not None and c.rank == 1 for c in causes), [r.error for r in results]
    assert "boom on rank 1" in str(causes[0])
    assert results[1].root_cause is causes[1]  # node 1 holds rank 1
    assert "first failure of the whole job, on node 1" in results[0].error


def test_a_job_listens_on_loopback_only():
    needs_fork()  # (a cold torchrun's own rendezvous store listens on every interface)
    result = launch(str(SCRIPTS / "listeners.py"), 2, quiet=True)
    assert result.ok, result.error
    addresses = [line.split()[1] for line in result.logs[0] if line.startswith("listen ")]
    assert len(addresses) >= 2  # the rendezvous store, the workers' store, gloo's sockets
    assert set(addresses) == {"0100007F"}, addresses  # 127.0.0.1 in /proc/net/tcp's hex


@pytest.mark.parametrize("path", ["fast", "subprocess"])
def test_max_restarts_restarts_every_worker_after_a_failure(monkeypatch, path):
    if path == "subprocess":
        monkeypatch.setenv("DDPLAB_LAUNCH_PATH", "subprocess")
    script = str(SCRIPTS / "restart_once.py")  # rank 1 fails on attempt 0 only
    if path == "fast":  # (a failure's report on the subprocess path: test_a_rank_exits_...)
        once = launch(script, 2, quiet=True, timeout=120)
        assert once.status == "failed" and once.root_cause.rank == 1
        assert once.root_cause.exitcode == 5
    again = launch(script, 2, quiet=True, timeout=120, max_restarts=1)
    assert again.ok, again.error
    assert again.exit_codes == {0: 0, 1: 0}
    assert "rank 1 fails on attempt 0" in again.logs[1]
    assert again.logs[0][-1] == "attempt 1: rank 0 sum 3"
    assert again.logs[1][-1] == "attempt 1: rank 1 sum 3"


def test_max_restarts_is_checked(tmp_path):
    with pytest.raises(LaunchError, match="max_restarts must be"):
        launch(PLAIN, 2, max_restarts=-1)
    with pytest.raises(LaunchError, match="needs engine='torchrun'"):
        launch(str(SCRIPTS / "spawn_min.py"), 2, engine="spawn", max_restarts=1)


@pytest.mark.parametrize("then", ["exit", "event"])
def test_a_last_line_without_newline_is_kept_and_the_protocol_never_shows(capsys, then):
    args = ["event"] if then == "event" else []  # else the launcher's exit marker follows
    result = launch(str(SCRIPTS / "streams.py"), 2, args=args, timeout=120)
    assert result.ok, result.error
    shown = capsys.readouterr()
    for rank in (0, 1):
        stdout = [line for line in result.logs[rank] if not line.startswith("err line")]
        assert stdout[-1] == "progress 99%"  # (stderr's pipe may be read before or after)
        assert f"[rank{rank}] progress 99%\n" in shown.out
    everything = shown.out + shown.err + "\n".join(
        line for lines in result.logs.values() for line in lines)
    assert "@ddplab" not in everything
    metrics = result.events_of("metric")
    assert [(e["rank"], e["value"]) for e in metrics] == ([(0, 0), (1, 1)] if args else [])
    assert result.exit_codes == {0: 0, 1: 0}


def test_stderr_of_the_ranks_goes_to_stderr_and_stdout_to_stdout(capsys):
    """(The spawn engine's: test_spawn_engine_runs_and_reports_the_failed_rank.)"""
    result = launch(str(SCRIPTS / "streams.py"), 2, timeout=120)
    assert result.ok, result.error
    shown = capsys.readouterr()
    for rank in (0, 1):
        assert f"[rank{rank}] out line of rank {rank}\n" in shown.out
        assert f"[rank{rank}] err line of rank {rank}\n" in shown.err
        assert f"err line of rank {rank}" in result.logs[rank]  # the log keeps both
    assert "err line" not in shown.out and "out line" not in shown.err


LEGACY = ("import argparse\np = argparse.ArgumentParser()\n"
          "p.add_argument('{option}', type=int, default=-1)\n"
          "p.add_argument('--lr', type=float)\n"
          "a = p.parse_args()\nprint('local_rank', vars(a)['local_rank'], 'lr', a.lr)\n")


@pytest.mark.parametrize("style,option", [(True, "--local_rank"), ("dash", "--local-rank")])
def test_local_rank_arg_runs_torch_distributed_launch_scripts_unchanged(
        tmp_path, style, option):
    script = tmp_path / "legacy.py"
    script.write_text(LEGACY.format(option=option))
    result = launch(script, 2, args=["--lr", "0.5"], local_rank_arg=style, quiet=True)
    assert result.ok, result.error
    assert result.logs[0] == ["local_rank 0 lr 0.5"]
    assert result.logs[1] == ["local_rank 1 lr 0.5"]


def test_a_script_declaring_local_rank_without_the_flag_keeps_its_default(tmp_path):
    script = tmp_path / "legacy.py"
    script.write_text(LEGACY.format(option="--local_rank"))
    result = launch(script, 2, quiet=True)
    assert result.ok and result.logs[1] == ["local_rank -1 lr None"]  # the default, on each
    with pytest.raises(LaunchError, match="local_rank_arg must be"):
        launch(script, 2, local_rank_arg="camel")


@pytest.mark.parametrize("path", ["fast", "subprocess"])
def test_an_abort_while_exiting_is_told_apart_from_a_crash(monkeypatch, path):
    if path == "subprocess":
        monkeypatch.setenv("DDPLAB_LAUNCH_PATH", "subprocess")
    result = launch(str(SCRIPTS / "exit_abort.py"), 2, quiet=True, timeout=120)
    assert result.status == "failed"  # the process did not end cleanly
    cause = result.root_cause
    assert cause.rank == 1 and cause.signal == "SIGABRT" and cause.at_exit
    assert result.error.startswith("rank 1 was killed by SIGABRT while exiting, after its "
                                   "script had finished: terminate called without an active "
                                   "exception")
    assert "destroy_process_group" in cause.hint
    assert [e["value"] for e in result.events_of("metric")] == [2.0, 2.0]  # reported in full
    if path == "fast":  # (the subprocess path's: test_a_rank_that_ended_before_the_failure_...)
        crashed = launch(FAULTY, 2, args=["signal"], quiet=True)  # killed during the run: no
        assert not crashed.root_cause.at_exit and "while exiting" not in crashed.error


def test_a_job_whose_processes_are_all_zombies_counts_as_ended():
    """Orphans of a job (multiprocessing's resource tracker) wait as zombies until PID 1 reaps
    them, a second in some containers; the launch must not wait for that."""
    from ddplab.launcher.procs import group_running as _group_running

    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    try:
        end = time.monotonic() + 30
        while alive(proc.pid) and time.monotonic() < end:
            time.sleep(0.02)  # not reaped: it stays a zombie in its own process group
        os.killpg(proc.pid, 0)  # the group still exists...
        assert not _group_running(proc.pid)  # ...but nothing in it runs
    finally:
        proc.wait()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                               start_new_session=True)
    try:
        assert _group_running(sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_job_sees_the_debug_level_its_environment_asks_for(tmp_path):
    """torch reads TORCH_DISTRIBUTED_DEBUG at import, in the helper: a worker must read it
    anew, and see what a fresh ``python`` with the job's environment sees."""
    script = tmp_path / "level.py"
    script.write_text("import torch.distributed as dist\n"
                      "print('debug', dist.get_debug_level(), flush=True)\n")
    seen = set()
    for level in ("DETAIL", "OFF"):
        env = {"TORCH_DISTRIBUTED_DEBUG": level}
        fresh = subprocess.run([sys.executable, str(script)], env={**os.environ, **env},
                               capture_output=True, text=True, timeout=120)
        result = launch(script, 2, env=env, quiet=True, timeout=120)
        assert result.ok, result.error
        assert result.log(0) == result.log(1) == fresh.stdout.strip(), level
        seen.add(fresh.stdout)
    assert len(seen) == 2  # (the two levels are told apart)


# --------------------------------------------------------------------- interrupts at any moment

SLEEPER = ("import os, sys, time\nfrom pathlib import Path\n"
           "Path(sys.argv[1], 'pid-' + os.environ['RANK']).write_text(str(os.getpid()))\n"
           "print('pid', os.getpid(), flush=True)\ntime.sleep(300)\n")


def _sleeper(folder: Path) -> Path:
    """A rank script that writes its pid to ``folder/pid-RANK``, then sleeps."""
    script = folder / "sleeper.py"
    script.write_text(SLEEPER)
    return script


def _pids_in(folder: Path) -> list[int]:
    return sorted(int(p.read_text()) for p in folder.glob("pid-*") if p.read_text())


_WATCHERS: list[threading.Event] = []


@pytest.fixture(autouse=True)
def _no_interrupt_outlives_its_test():
    yield
    while _WATCHERS:
        _WATCHERS.pop().set()


def _interrupt_main_thread(when, times: int = 1, every: float = 0.02,
                           safety: float = 180.0) -> threading.Thread:
    """Send SIGINT to the main thread (what a Jupyter interrupt does) once ``when(frame)`` holds
    for its innermost frame, then ``times - 1`` more times while it still runs the launcher."""
    import linecache  # noqa: F401  (used by the conditions)

    main = threading.main_thread().ident
    stop = threading.Event()  # set after the test: no SIGINT may reach a later test
    _WATCHERS.append(stop)

    def in_launcher() -> bool:
        frame = sys._current_frames().get(main)
        while frame is not None:
            if f"{os.sep}launcher{os.sep}" in frame.f_code.co_filename:
                return True
            frame = frame.f_back
        return False

    def watch() -> None:
        end = time.monotonic() + safety
        while time.monotonic() < end and not stop.is_set() and \
                not when(sys._current_frames().get(main)):
            time.sleep(0.005)
        for _ in range(times):
            if stop.is_set() or not in_launcher():
                return
            signal.pthread_kill(main, signal.SIGINT)
            time.sleep(every)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _waits_for_the_helpers_reply(frame) -> bool:
    import linecache

    return (frame is not None and frame.f_code.co_name == "request"
            and frame.f_code.co_filename.endswith("helper.py")
            and "recv" in linecache.getline(frame.f_code.co_filename, frame.f_lineno))


@pytest.fixture
def real_sigint():
    """The process's SIGINT raises KeyboardInterrupt, as in a notebook kernel."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_an_interrupt_while_the_first_launch_waits_for_the_helper_costs_later_launches_nothing(
        tmp_path, monkeypatch, real_sigint):
    """The first launch of a kernel waits seconds for the helper's reply (it imports the
    training stack first). Interrupted there, nothing of that launch may run on, and every
    later launch must end exactly its own processes."""
    from ddplab.launcher.helper import Helper

    needs_fork()
    if Helper._current is not None:  # a fresh helper: the first launch of a kernel
        Helper._current.proc.kill()
        Helper._current.proc.wait()
    monkeypatch.delenv("DDPLAB_PRELOAD_TRAINING", raising=False)
    script = _sleeper(tmp_path)
    folders = {name: tmp_path / name for name in "ABC"}
    for folder in folders.values():
        folder.mkdir()
    fds = len(os.listdir("/proc/self/fd"))
    watcher = _interrupt_main_thread(_waits_for_the_helpers_reply)
    with pytest.raises(KeyboardInterrupt):
        launch(script, 2, args=[folders["A"]], quiet=True, timeout=120)
    watcher.join(timeout=60)
    assert len(os.listdir("/proc/self/fd")) <= fds  # no pipe of the half-started job kept
    monkeypatch.setenv("DDPLAB_PRELOAD_TRAINING", "0")
    for name in "BC":
        result = launch(script, 2, args=[folders[name]], quiet=True, timeout=5)
        assert result.status == "timeout", result.error
        own = _pids_in(folders[name])
        assert len(own) == 2 and sorted(result.pids.values()) == own  # its own ranks...
        assert not wait_gone(own, 10)  # ...ended by its own timeout
    assert not wait_gone(_pids_in(folders["A"]), 10)  # the interrupted launch ran on nowhere
    assert len(os.listdir("/proc/self/fd")) <= fds + 1  # (+1: the helper's socket)


def test_interrupts_during_the_clean_up_of_two_jobs_skip_nothing(tmp_path, real_sigint):
    """An impatient learner presses Ctrl-C again and again: every process of every job ends."""
    script = _sleeper(tmp_path)

    def both_jobs_run(_frame) -> bool:
        return len(_pids_in(tmp_path)) == 2

    watcher = _interrupt_main_thread(both_jobs_run, times=6)
    try:
        results = ddplab.launch_multinode(script, nnodes=2, nproc_per_node=1, args=[tmp_path],
                                          quiet=True, timeout=120)
    except KeyboardInterrupt:
        pass
    else:
        pytest.fail(f"the launch ended before it was interrupted: "
                    f"{[(r.status, r.error) for r in results]}")
    watcher.join(timeout=60)
    pids = _pids_in(tmp_path)
    assert len(pids) == 2 and not wait_gone(pids, 10)


def test_an_infinite_timeout_means_no_limit():
    result = launch(PLAIN, 2, quiet=True, timeout=math.inf)
    assert result.ok, result.error
    assert result.exit_codes == {0: 0, 1: 0}


# ------------------------------------------------------------------ processes and their traces

def test_nothing_is_run_between_fork_and_exec():
    """``preexec_fn`` can deadlock in a process with threads (a notebook kernel has several)."""
    import ast

    package = Path(ddplab.__file__).parent
    found = [f"{path.relative_to(package)}:{node.lineno}" for path in package.rglob("*.py")
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.keyword) and node.arg == "preexec_fn"]
    assert found == []


def test_a_pid_that_names_another_process_now_is_not_signalled():
    from ddplab.env import start_time
    from ddplab.launcher.procs import kill_group, signal_process

    sleeper = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        started = start_time(sleeper.pid)
        assert started is not None
        signal_process(sleeper.pid, signal.SIGKILL, started + 1)  # (as if the pid were reused)
        kill_group(sleeper.pid, signal.SIGKILL, started + 1)
        assert alive(sleeper.pid)
        kill_group(sleeper.pid, signal.SIGKILL, started)
        assert sleeper.wait(timeout=30) == -signal.SIGKILL
    finally:
        sleeper.kill()
        sleeper.wait()


def test_private_folders_go_at_exit_and_those_of_a_killed_owner_at_the_next_start(
        request, monkeypatch):
    import shutil
    import tempfile

    from ddplab.launcher.procs import private_folder

    code = ("import sys, time\nfrom ddplab.launcher.procs import private_folder\n"
            "print(private_folder('ddplab-test-'), flush=True)\n"
            "if sys.argv[1:] == ['hold']:\n    time.sleep(120)\n")
    short = tempfile.mkdtemp(prefix="dd", dir="/tmp")  # (a long one would be left for /tmp)
    request.addfinalizer(lambda: shutil.rmtree(short, ignore_errors=True))
    env = {**os.environ, "TMPDIR": short}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert not os.path.exists(done.stdout.strip())  # removed when its owner exited
    killed = subprocess.Popen([sys.executable, "-c", code, "hold"], env=env,
                              stdout=subprocess.PIPE, text=True)
    left = killed.stdout.readline().strip()
    killed.kill()
    killed.wait()
    assert os.path.isdir(left) and left.startswith(short)
    monkeypatch.setattr(tempfile, "tempdir", short)
    mine = private_folder("ddplab-test-")
    assert not os.path.exists(left) and os.path.isdir(mine)  # reclaimed; a new one made



# ------------------------------------- how ranks end, what they see (which path: docstring)

ENDINGS = str(SCRIPTS / "rank_endings.py")
PATHS = ["fork", "subprocess"]


def _on(path: str, monkeypatch) -> None:
    if path == "subprocess":  # the path macOS takes: a cold torchrun subprocess
        monkeypatch.setenv("DDPLAB_LAUNCH_PATH", "subprocess")


def test_a_rank_may_choose_its_start_method_and_has_default_signal_handlers(tmp_path):
    """A forked rank had its start method fixed to fork ("context has already been set" for a
    script's own set_start_method) and torch's agent's SIGHUP and SIGQUIT handlers."""
    script = tmp_path / "fresh.py"
    script.write_text("import signal, torch.multiprocessing as mp\n"
                      "print(mp.get_start_method(allow_none=True), [signal.getsignal(s) is "
                      "signal.SIG_DFL for s in (signal.SIGHUP, signal.SIGQUIT)])\n"
                      "mp.set_start_method('spawn')\nprint(mp.get_start_method())\n")
    result = launch(str(script), 2, quiet=True, timeout=launch_timeout(120))
    assert result.ok, result.error
    assert all(result.logs[rank] == ["None [True, True]", "spawn"] for rank in (0, 1)), \
        result.logs


def test_every_rank_of_every_launch_starts_with_generators_of_its_own(tmp_path):
    """A fresh process seeds torch and numpy from the OS; a forked rank had the helper's state,
    the same in every rank of every launch (unseeded scripts all drew the same numbers)."""
    script = tmp_path / "draws.py"
    script.write_text("import random, numpy, torch\n"
                      "print(torch.initial_seed(), numpy.random.rand(), random.random())\n")
    draws = [tuple(result.logs[rank][-1].split()) for result in
             (launch(str(script), 2, quiet=True, timeout=launch_timeout(120)) for _ in range(2))
             for rank in (0, 1)]
    for kind in range(3):  # torch's seed, numpy's draw, random's draw: four of each
        assert len({draw[kind] for draw in draws}) == 4, draws


@pytest.mark.parametrize("path", PATHS)
def test_ranks_use_their_job_s_tmpdir_and_tz_and_a_launch_leaves_nothing_there(
        monkeypatch, tmp_path, path):
    """A forked rank's tempfile and time read the helper's TMPDIR and TZ, not its job's;
    torch's agent made a log folder in TMPDIR every launch (torchelastic_*) and left it."""
    if path == "fork":
        needs_fork()
    _on(path, monkeypatch)
    script, job_tmp = tmp_path / "tmp.py", tmp_path / "job"
    script.write_text("import tempfile, time\n"
                      "print('tmp', tempfile.gettempdir(), time.strftime('%Z'))\n")
    job_tmp.mkdir()
    result = launch(str(script), 2, quiet=True, timeout=launch_timeout(120),
                    env={"TMPDIR": str(job_tmp), "TZ": "XYZ-3"})  # (a zone 3 h east)
    assert result.ok, result.error
    assert [result.logs[rank] for rank in (0, 1)] == [[f"tmp {job_tmp} XYZ"]] * 2
    assert sorted(os.listdir(job_tmp)) == []


@pytest.mark.parametrize("mode,signal_name", [("kill", "SIGKILL"), ("segv", "SIGSEGV"),
                                              ("interrupt", "SIGINT")])
def test_a_rank_killed_by_a_signal_is_reported_with_that_signal(mode, signal_name):
    """(The subprocess path's reading of a signal: test_a_rank_that_ended_before_...)"""
    result = launch(ENDINGS, 2, args=[mode], quiet=True, timeout=120)
    assert result.status == "failed", result.error
    assert result.root_cause.rank == 1 and result.root_cause.signal == signal_name
    assert f"killed by {signal_name}" in result.error
    assert not wait_gone(list(result.pids.values()), 10)


@pytest.mark.parametrize("mode,code", [("raise", 1), ("minus1", 255)])
def test_a_rank_exits_with_the_status_python_gives(mode, code):
    """An uncaught exception is 1, with the script's traceback; sys.exit(-1) is 255, not a
    signal. (The subprocess path's: test_a_rank_that_ended_before_the_failure_...)"""
    result = launch(ENDINGS, 2, args=[mode], quiet=True, timeout=120)
    assert result.status == "failed"
    assert result.root_cause.rank == 1 and result.root_cause.exitcode == code
    assert result.exit_codes[1] == code and result.root_cause.signal is None
    assert f"rank 1 exited with code {code}" in result.error
    trace = result.root_cause.traceback
    if mode == "raise":
        assert "ValueError: rank 1 fails on purpose" in trace
        assert 'rank_endings.py", line' in trace
        assert "entry.py" not in trace and "runpy" not in trace


@pytest.mark.parametrize("way,code,signal_name", [("kill", -9, "SIGKILL"),
                                                   ("minus1", 255, None)])
def test_a_rank_that_ended_before_the_failure_keeps_its_exit_code(
        monkeypatch, tmp_path, way, code, signal_name):
    """torchrun's report names only the failed rank; each rank says how its script ended.
    (A subprocess's ranks end apart; a forked rank's process waits for its peers.) Each launch
    is also the subprocess path's reading of how the failed rank ended, from torchrun's report:
    a signal (SIGKILL: the rank says nothing; also not an abort at exit), and sys.exit(-1)'s
    255 (the rank itself said -1)."""
    _on("subprocess", monkeypatch)
    result = launch(ENDINGS, 2, args=["after0", way], cwd=tmp_path, quiet=True, timeout=120)
    assert result.status == "failed" and result.root_cause.rank == 1, result.error
    assert result.exit_codes == {0: 0, 1: code}
    assert result.root_cause.signal == signal_name and not result.root_cause.at_exit
    if signal_name:
        assert f"killed by {signal_name}" in result.error and "while exiting" not in result.error
    else:
        assert result.root_cause.exitcode == code and f"rank 1 exited with code {code}" in \
            result.error
    assert not wait_gone(list(result.pids.values()), 10)


@pytest.mark.parametrize("path", PATHS)
def test_a_rank_sees_the_jobs_environment_directory_and_arguments(monkeypatch, path, tmp_path):
    _on(path, monkeypatch)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("DDPLAB_TEST_LATE", "set in the caller")
    warnings = "error::DeprecationWarning,error::UserWarning:elsewhere"  # (none of theirs)
    result = launch(ENDINGS, 2, args=["report", "--flag"], cwd=tmp_path, threads=3,
                    env={"MY_VAR": "x", "PYTHONWARNINGS": warnings}, quiet=True, timeout=120)
    assert result.ok, result.error
    forked = path == "fork" and not os.environ.get("DDPLAB_LAUNCH_PATH")
    fresh_threads = 3 if forked else int(subprocess.run(  # what torch makes of it here
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        env={**os.environ, "OMP_NUM_THREADS": "3"}, capture_output=True, text=True,
        timeout=120).stdout)
    for rank in (0, 1):
        seen = json.loads(result.log(rank))
        assert seen["env"] == {"MY_VAR": "x", "DDPLAB_TEST_LATE": "set in the caller",
                               "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                               "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "3",
                               "PYTHONWARNINGS": warnings}
        assert seen["threads"] == fresh_threads
        assert seen["cwd"] == str(tmp_path)
        assert seen["argv"] == [ENDINGS, "report", "--flag"] and seen["name"] == "__main__"
        assert seen["path0"] == str(SCRIPTS)  # as `python rank_endings.py` puts it
        assert seen["stdin"] == ""  # not the caller's
        assert seen["inherited"] == []  # no descriptor of the launcher's reaches its programs
        assert seen["pid"] == result.pids[rank]


def test_a_later_launch_sees_the_callers_environment_and_path_of_then_not_the_first_ones(
        tmp_path):
    """The helper starts with the caller's directory and environment of the first launch; a
    variable removed since, or a module only in that first directory, is not a later rank's."""
    needs_fork()
    for folder in ("first", "second"):
        (tmp_path / folder).mkdir()
    (tmp_path / "first" / "only_first.py").write_text("")
    finds = tmp_path / "finds.py"
    finds.write_text("import importlib.util\nprint(importlib.util.find_spec('only_first') "
                     "is not None)\n")
    code = (f"import json, os, ddplab\n"
            f"os.environ['DDPLAB_TEST_LATE'] = 'first'\n"
            f"runs = [ddplab.launch({ENDINGS!r}, 2, args=['report'], quiet=True, timeout=120)]\n"
            f"del os.environ['DDPLAB_TEST_LATE']\n"
            f"os.chdir({str(tmp_path / 'second')!r})\n"
            f"runs.append(ddplab.launch({ENDINGS!r}, 2, args=['report'], quiet=True, "
            f"timeout=120))\n"
            f"found = ddplab.launch({str(finds)!r}, 2, quiet=True, timeout=120).log(1)\n"
            f"print(json.dumps([json.loads(r.log(1))['env']['DDPLAB_TEST_LATE'] for r in runs]"
            f" + [found]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path / "first")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["first", None, "False"]


@pytest.mark.parametrize("path", PATHS)
def test_an_interrupted_launch_ends_every_rank_on_both_paths(monkeypatch, path, tmp_path,
                                                              real_sigint):
    """The ranks of a torchrun subprocess lead sessions of their own, out of reach of the
    kernel's SIGINT: the launch ends them itself, then raises the interrupt again."""
    _on(path, monkeypatch)
    script = _sleeper(tmp_path)
    watcher = _interrupt_main_thread(lambda _frame: len(_pids_in(tmp_path)) == 2)
    with pytest.raises(KeyboardInterrupt) as caught:
        launch(script, 2, args=[tmp_path], quiet=True, timeout=120)
    watcher.join(timeout=60)
    held = _pids_in(tmp_path)
    assert caught.value.result.status == "interrupted"
    assert set(caught.value.result.pids.values()) <= set(held)  # (those it had heard of)
    assert len(held) == 2 and not wait_gone(held, 10)


def test_a_caller_that_returns_leaves_nothing_running_on_the_subprocess_path():
    code = (f"import json, ddplab\n"
            f"result = ddplab.launch({PLAIN!r}, 2, quiet=True, timeout=120)\n"
            f"print(json.dumps({{'ok': result.ok, 'ranks': list(result.pids.values())}}))\n")
    env = {**os.environ, "DDPLAB_LAUNCH_PATH": "subprocess", "DDPLAB_TEST_MARK": str(os.getpid())}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["ok"] and len(seen["ranks"]) == 2
    mark = f"DDPLAB_TEST_MARK={os.getpid()}".encode()
    assert not wait_gone([pid for pid, _ppid, _argv, environ in processes() if mark in environ],
                         10)


# ------------------------------------------------------------------------------- on_event

EMITS = ("import os, sys, time\nfrom pathlib import Path\nfrom ddplab import events\n"
         "Path(sys.argv[1], 'pid-' + os.environ['RANK']).write_text(str(os.getpid()))\n"
         "for step in range(3):\n    events.emit('metric', name='step', value=step)\n"
         "while sys.argv[2:] == ['hold']:  # (an event a second until ended)\n"
         "    events.emit('metric', name='tick', value=0)\n    time.sleep(1)\n")


def test_on_event_receives_every_event_as_the_result_keeps_them(tmp_path):
    script = tmp_path / "emits.py"
    script.write_text(EMITS)
    seen: list[dict] = []
    result = launch(script, 2, args=[tmp_path], quiet=True, timeout=120, on_event=seen.append)
    assert result.ok, result.error
    kept = [event for rank in sorted(result.events) for event in result.events[rank]]
    assert len(kept) == 6 and sorted(map(json.dumps, seen)) == sorted(map(json.dumps, kept))
    for rank in (0, 1):  # each rank's in the order it sent them
        assert [e["value"] for e in seen if e["rank"] == rank] == [0, 1, 2]


def test_on_event_returning_seconds_ends_the_job_as_a_timeout_with_each_ranks_stack(tmp_path):
    """A hang seen through the ranks' events need not wait out its timeout: ``on_event``
    returning N ends the job N seconds later exactly as a timeout does (stacks, nothing left)."""
    script = tmp_path / "emits.py"
    script.write_text(EMITS)
    result = launch(script, 2, args=[tmp_path, "hold"], quiet=True, timeout=600,
                    on_event=end_once_said(("tick", 0), ("tick", 1), after=0.5))
    assert result.status == "timeout" and result.returncode == 124, result.error
    assert "on_event" in result.error
    assert result.still_running == [0, 1]
    for rank in (0, 1):  # each stack names the script's line the rank was on
        assert "emits.py" in result.stacks[rank], result.stacks
    pids = _pids_in(tmp_path)
    assert len(pids) == 2 and not wait_gone(pids, 10)


@pytest.mark.parametrize("path", PATHS)
def test_an_exception_in_the_caller_ends_every_process_of_the_job(monkeypatch, path, tmp_path):
    """A callback that raises (or any error in the calling process) ends the job, then the
    error reaches the caller unchanged."""
    _on(path, monkeypatch)
    script = tmp_path / "emits.py"
    script.write_text(EMITS)

    def broken(event: dict) -> None:
        if len(_pids_in(tmp_path)) == 2:  # (both ranks run)
            raise RuntimeError("a broken callback")

    with pytest.raises(RuntimeError, match="a broken callback"):
        launch(script, 2, args=[tmp_path, "hold"], quiet=True, timeout=120, on_event=broken)
    pids = _pids_in(tmp_path)
    assert len(pids) == 2 and not wait_gone(pids, 10)


@pytest.mark.parametrize("path", ["fast", "subprocess"])
def test_the_jobs_pythonwarnings_filter_the_ranks_warnings_as_in_a_fresh_python(
        tmp_path, monkeypatch, path):
    if path == "subprocess":
        monkeypatch.setenv("DDPLAB_LAUNCH_PATH", "subprocess")
    script = tmp_path / "warns.py"
    script.write_text("import warnings\nwarnings.warn('from the script', UserWarning)\n"
                      "print('after the warning', flush=True)\n")
    if path == "fast":  # (the subprocess path's ranks are fresh pythons: the strict run only;
        # a filter of other warnings on that path, torchrun's too: test_a_rank_sees_the_jobs_...)
        plain = launch(str(script), 2, quiet=True, timeout=120)
        assert plain.ok, plain.error
        assert all("after the warning" in plain.log(rank) for rank in (0, 1))
    strict = launch(str(script), 2, quiet=True, timeout=120,
                    env={"PYTHONWARNINGS": "error::UserWarning:__main__"})
    assert not strict.ok and strict.root_cause.rank in (0, 1)
    assert "UserWarning" in strict.root_cause.traceback + strict.root_cause.message
    assert not any("after the warning" in strict.log(rank) for rank in (0, 1))
    if path == "fast":
        other = launch(str(script), 2, quiet=True, timeout=120, env={
            "PYTHONWARNINGS": "error::DeprecationWarning,error::UserWarning:elsewhere"})
        assert other.ok, other.error  # another category, another module: not this warning


def test_a_stderr_connection_s_number_given_again_to_a_stdout_one_carries_stdout():
    """A restart closes a rank's connections and accepts new ones; the operating system gives
    a closed stderr connection's number to the next one, which may be a rank's stdout."""
    import selectors
    from types import SimpleNamespace

    from ddplab.launcher.jobs import Job
    from ddplab.launcher.output import Streams

    job = Job(world_size=1, engine="torchrun", pgid=os.getpid(), sources={})
    view = SimpleNamespace(quiet=True, line=lambda *a: None, event=lambda e: None)
    streams = Streams([job], view)
    numbers = []
    for stream, text in (("err", b"boom\n"), ("out", b"attempt 1\n")):
        read_end, write_end = os.pipe()
        numbers.append(read_end)
        os.set_blocking(read_end, False)
        streams.sel.register(read_end, selectors.EVENT_READ, (0, job, "hello"))
        os.write(write_end, b"rank 1 %s %d\n" % (stream.encode(), os.getpid()) + text)
        os.close(write_end)
        while read_end in streams.sel.get_map():
            streams._read(read_end, *streams.sel.get_key(read_end).data)
    streams.close()
    assert numbers[0] == numbers[1], "the test needs the number given again"
    assert streams.read[0]["stderr"] == {1: ["boom"]}
    assert streams.read[0]["logs"] == {1: ["boom", "attempt 1"]}
