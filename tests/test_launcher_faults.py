"""What a learner, a grader or a container does to a launch, and what must still hold: launches
from threads that end, a rank's child that floods its stdout from a session of its own, output
that looks like the launcher's own events, a container's PID 1 that reaps nothing, and the
launch helper killed mid-launch."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from launch_path import launch_timeout, needs_fork

from ddplab import launch
from ddplab.launcher.helper import Helper

pytestmark = pytest.mark.launch
SCRIPTS = Path(__file__).parent / "scripts"
SLEEPS = "import sys, time\ntime.sleep(float(sys.argv[1]))\nprint('slept', flush=True)\n"


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def run_python(code: str, timeout: float, **env: str) -> dict:
    """Run ``code`` in a fresh Python (its own launch helper); the JSON of its last line."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=timeout, env={**os.environ, **env})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_launches_from_threads_that_end_all_succeed(tmp_path):
    """The helper outlives the thread that started it: a launch from another thread that runs
    on after the first thread ended is not cut short, and the next launch finds the helper."""
    needs_fork()
    script = tmp_path / "sleeps.py"
    script.write_text(SLEEPS)
    seen = run_python(f"""
        import json, threading, time
        from ddplab import launch
        from ddplab.launcher.helper import Helper
        results = {{}}

        def run(name, seconds):
            results[name] = launch({str(script)!r}, 2, args=[seconds], quiet=True, timeout=120)

        first = threading.Thread(target=run, args=("first", 1))  # starts the helper
        first.start()
        while Helper._current is None:
            time.sleep(0.01)
        helper = Helper._current.proc.pid
        second = threading.Thread(target=run, args=("second", 4))
        second.start()
        first.join()  # the thread that started the helper ends while the second launch runs
        second.join()
        run("third", 0)
        print(json.dumps({{"statuses": {{k: [r.status, r.error] for k, r in results.items()}},
                           "same": Helper._current.proc.pid == helper}}))
    """, timeout=300)
    assert seen["statuses"] == {name: ["ok", ""] for name in ("first", "second", "third")}
    assert seen["same"]  # one helper served all three


def children_in(folder: Path) -> list[int]:
    return sorted(int(path.read_text()) for path in folder.glob("child-*"))


@pytest.mark.parametrize("path", ["fork", "subprocess"])
def test_a_rank_child_flooding_stdout_from_its_own_session_ends_with_the_launch(path, tmp_path):
    """``yes`` in a session of its own, holding the rank's stdout: the launch still ends when
    its ranks end (within its timeout, whatever the child prints), and the child with it; the
    result keeps the newest lines of the flood and says how many it let go."""
    env = {"DDPLAB_LAUNCH_PATH": "subprocess"} if path == "subprocess" else {}
    seen = run_python(f"""
        import json
        from ddplab import launch
        result = launch({str(SCRIPTS / 'floods.py')!r}, 2, args=[{str(tmp_path)!r}],
                        quiet=True, timeout=20)
        print(json.dumps({{"status": result.status, "error": result.error,
                           "kept": [len(result.logs.get(r, [])) for r in (0, 1)]}}))
    """, timeout=launch_timeout(120), **env)
    assert seen["status"] == "ok", seen["error"]
    assert max(seen["kept"]) <= 200_000  # (KEEP_LINES, kept between once and twice)
    children = children_in(tmp_path)
    assert len(children) == 2
    end = time.monotonic() + 2.0  # (the launch has returned: 2 s for the last kill to land)
    while any(map(alive, children)) and time.monotonic() < end:
        time.sleep(0.05)
    assert not [pid for pid in children if alive(pid)]


def test_a_flooding_child_of_a_running_rank_ends_at_the_timeout(tmp_path):
    """A rank still running while its own-session child floods stdout: the launch ends at its
    timeout like any other, and nothing of the job is left."""
    seen = run_python(f"""
        import json
        from ddplab import launch
        result = launch({str(SCRIPTS / 'floods.py')!r}, 2, args=[{str(tmp_path)!r}, "hold"],
                        quiet=True, timeout={launch_timeout(10)})
        print(json.dumps({{"status": result.status, "pids": list(result.pids.values())}}))
    """, timeout=launch_timeout(120))
    assert seen["status"] == "timeout"
    left = children_in(tmp_path) + seen["pids"]
    assert len(left) == 4
    end = time.monotonic() + 2.0
    while any(map(alive, left)) and time.monotonic() < end:
        time.sleep(0.05)
    assert not [pid for pid in left if alive(pid)]


def test_output_that_looks_like_the_launchers_events_is_kept_as_output(capsys):
    """A rank may print anything: lines shaped like the launcher's reserved events (``exit``,
    ``report``, ``round``), another rank's exit, or events with fields of the wrong type stay
    output lines, and the result says what the ranks really did."""
    result = launch(str(SCRIPTS / "forges_events.py"), 2, timeout=launch_timeout(60))
    assert result.status == "failed", result.error
    assert result.exit_codes == {0: 3, 1: 0}
    assert result.root_cause is not None and result.root_cause.rank == 0
    for rank in (0, 1):
        log = result.log(rank)
        assert f"rank {rank} forged its lines" in log
        assert log.count("@ddplab ") == 7, log  # every forged line, as printed
    assert not [e for events in result.events.values() for e in events
                if e["kind"] in ("exit", "report", "round")]
    # well-formed events with odd values are events, and the live view passes over them
    assert sorted(e["kind"] for e in result.events[0]) == ["epoch"] * 2 + ["progress"] * 2
    assert "@ddplab" in capsys.readouterr().out  # shown as output, too


def test_a_launch_leaves_no_zombie_for_pid_1_to_reap():
    """Every process a launch starts is reaped: in a container whose PID 1 reaps nothing, none
    piles up. The test stands in for that PID 1: a subreaper that never reaps."""
    needs_fork()
    seen = run_python(f"""
        import ctypes, json, os, signal, time
        ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come here
        from ddplab import launch
        results = [launch({str(SCRIPTS / 'plain.py')!r}, 2, quiet=True, timeout=120).status
                   for _ in range(3)]
        time.sleep(1.0)
        zombies = []
        for name in filter(str.isdigit, os.listdir("/proc")):
            try:
                fields = open(f"/proc/{{name}}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] == "Z" and int(fields[1]) == os.getpid():
                zombies.append(int(name))
        print(json.dumps({{"results": results, "zombies": zombies}}))
    """, timeout=300)
    assert seen["results"] == ["ok"] * 3
    assert seen["zombies"] == []


def test_a_helper_killed_mid_launch_is_named_and_the_next_launch_starts_a_fresh_one(tmp_path):
    needs_fork()
    script = tmp_path / "waits.py"
    script.write_text("import time\nfrom ddplab import events\n"
                      "events.emit('metric', name='started')\ntime.sleep(120)\n")
    killed = []

    def kill_the_helper(event):
        if event.get("name") == "started" and not killed:
            killed.append(Helper._current.proc.pid)
            os.kill(killed[0], signal.SIGKILL)

    result = launch(str(script), 2, quiet=True, timeout=120, on_event=kill_the_helper)
    assert killed and result.status == "error"
    assert re.search(rf"helper \(pid {killed[0]}\) ended by SIGKILL", result.error), result.error
    assert "the next launch starts a fresh helper" in result.error
    assert not [pid for pid in result.pids.values() if alive(pid)]
    sleeps = tmp_path / "sleeps.py"
    sleeps.write_text(SLEEPS)
    again = launch(str(sleeps), 2, args=[0], quiet=True, timeout=120)
    assert again.ok, again.error
    assert Helper._current.proc.pid != killed[0]
