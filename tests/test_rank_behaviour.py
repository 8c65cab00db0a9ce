"""Rank scripts nobody here wrote: the launch behaves as torchrun does, or better.

Each case once made a launch wait for its timeout, report a healthy rank as failed, lose what
it knew, or leave processes behind (issue: "sturdy under real rank behaviour"). torchrun is the
reference: a launch ends when its ranks end, whatever they left running or holding.

Where each rank waits when a job is ended: here for forked ranks and a torchrun subprocess's,
in test_spawn_engine for an mp.spawn script's (each through ``on_event``; the clock that ends a
job the same way is test_launch's).
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from test_launch import alive, end_once_said, processes, wait_gone

from ddplab import LaunchError, launch
from ddplab.lab import postmortem
from ddplab.launcher.spec import MAX_NPROCS

SCRIPTS = Path(__file__).parent / "scripts"
LEAVES = str(SCRIPTS / "leaves_children.py")
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def children_of(result, mode: str = "") -> list[int]:
    """The pids of the children the ranks said they started (``mode``: of that kind only)."""
    return [int(line.split()[1]) for rank in (0, 1) for line in result.logs.get(rank, [])
            if line.startswith("child ") and line.endswith(mode)]


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


MODES = ["session", "background", "fork"]


@pytest.fixture(scope="module")
def left_running():
    """Per path, one launch whose ranks each start a child of every kind and exit 0 at once:
    the tests below read what each kind became. (A launch that waited for any kind of child
    would time out, and every test here would say so.)"""
    results = {}
    with pytest.MonkeyPatch.context() as patch:
        for path in ("fork", "subprocess"):
            if path == "subprocess":
                patch.setenv("DDPLAB_LAUNCH_PATH", "subprocess")
            results[path] = launch(LEAVES, 2, args=[",".join(MODES), "120"], quiet=True,
                                   timeout=90)
    yield results
    for result in results.values():
        kill_all(children_of(result))


@pytest.mark.parametrize("path", ["fork", "subprocess"])
@pytest.mark.parametrize("mode", MODES)
def test_a_launch_ends_when_its_ranks_end_whatever_they_left_running(mode, path, left_running):
    result = left_running[path]
    assert result.status == "ok", result.error  # not "timeout": the ranks had exited 0
    assert result.exit_codes == {0: 0, 1: 0}
    assert [result.log(rank).splitlines()[-1] for rank in (0, 1)] == [
        "rank 0 done", "rank 1 done"]  # everything the ranks wrote was read
    children = children_of(result, mode)
    assert len(children) == 2
    # in the ranks' process group, ended with it as torchrun does; in a session of their own,
    # found by the job's mark (a subprocess) or come back to the agent, a subreaper (fork)
    assert not wait_gone(children, 2)


def test_a_rank_that_closes_its_stdout_is_no_failure():
    result = launch(str(SCRIPTS / "closes_stdout.py"), 2, quiet=True, timeout=90)
    assert result.ok, result.error
    assert result.exit_codes == {0: 0, 1: 0}
    assert "rank 1 sum 3" in result.log(1) and "rank 0 sum 3" in result.log(0)  # on stderr


def test_nprocs_above_the_limit_is_refused_before_anything_starts_and_up_to_it_works(tmp_path):
    with pytest.raises(LaunchError, match=f"from 1 to {MAX_NPROCS}"):
        launch(LEAVES, MAX_NPROCS + 1)
    with pytest.raises(LaunchError, match=f"from 1 to {MAX_NPROCS}"):
        launch(LEAVES, 10_000)
    script = tmp_path / "many.py"
    script.write_text("import os\nprint('rank', os.environ['RANK'], flush=True)\n")
    assert launch(script, 1, quiet=True).ok  # the launcher's helper runs (its pipes stay open)
    fds = len(os.listdir("/proc/self/fd"))
    result = launch(script, 128, quiet=True, timeout=600)
    assert result.ok, result.error
    assert sorted(result.exit_codes) == list(range(128)) and set(result.exit_codes.values()) == {0}
    assert all(result.log(rank) == f"rank {rank}" for rank in range(128))
    assert len(os.listdir("/proc/self/fd")) <= fds  # every pipe closed again


@pytest.mark.parametrize("timeout", [math.nan, -math.inf, 0, -5, "10", True])
def test_a_timeout_that_is_not_a_positive_number_is_refused(timeout):
    with pytest.raises(LaunchError, match="timeout must be a number of seconds > 0"):
        launch(LEAVES, 2, timeout=timeout)


def test_after_a_timeout_the_result_keeps_what_it_knew_and_names_where_each_rank_waits():
    """Ranks 1 and 2 say ``hang`` just before they wait: ``on_event`` ends the job as a
    timeout then, as the clock would (test_launch's timeout test is the real clock)."""
    result = launch(str(SCRIPTS / "missing_rank.py"), 3, quiet=True, timeout=300,
                    on_event=end_once_said(("hang", 1), ("hang", 2)))
    assert result.status == "timeout" and not result.ok
    assert result.exit_codes == {0: 0, 1: None, 2: None}  # rank 0 had exited; 1, 2 still ran
    assert result.still_running == [1, 2]
    assert "still running: rank 1, rank 2" in result.error
    assert sorted(result.stacks) == [1, 2]
    for rank in (1, 2):
        assert 'missing_rank.py", line 19' in result.stacks[rank], result.stacks[rank]
        assert "most recent call first" in result.stacks[rank]
    assert not wait_gone(list(result.pids.values()), 10)


def test_ranks_of_a_torchrun_subprocess_give_their_stack_on_a_timeout(monkeypatch):
    """They run ddplab's entry, as forked ranks do. Each rank says ``hang`` just before its
    sleep: ``on_event`` ends the job as a timeout then (the clock is test_launch's)."""
    monkeypatch.setenv("DDPLAB_LAUNCH_PATH", "subprocess")
    result = launch(LEAVES, 2, args=["hold", "120"], quiet=True, timeout=300,
                    on_event=end_once_said(("hang", 0), ("hang", 1)))
    try:
        assert result.status == "timeout" and result.still_running == [0, 1], result.error
        for rank in (0, 1):
            assert 'leaves_children.py", line 41' in result.stacks[rank], result.stacks[rank]
        assert result.exit_codes == {0: None, 1: None}
        # the ranks and what they started in their group ended with the job
        assert not wait_gone(list(result.pids.values()) + children_of(result, "background"), 10)
    finally:
        kill_all(children_of(result))


@pytest.mark.parametrize("path", ["fork", "subprocess"])
def test_a_rank_killed_by_a_fatal_signal_shows_the_line_it_died_on(monkeypatch, path):
    """Python's stack at SIGABRT (faulthandler) on both paths: forked ranks had it from torch's
    elastic wrapper, a torchrun subprocess's ranks had nothing (notebook 10's shape mismatch)."""
    if path == "subprocess":
        monkeypatch.setenv("DDPLAB_LAUNCH_PATH", "subprocess")
    result = launch(str(SCRIPTS / "aborts.py"), 2, quiet=True, timeout=120)
    assert result.root_cause.rank == 1 and result.root_cause.signal == "SIGABRT", result.error
    frame = postmortem.stopped_at(result, 1, "aborts.py")
    assert frame is not None and "os.abort()" in frame.code, result.log(1)


def marked(mark: str) -> list[int]:
    """The processes whose environment holds ``mark`` (``NAME=value``)."""
    return [pid for pid, _ppid, _argv, environ in processes() if mark.encode() in environ]


@pytest.mark.parametrize("path", ["fork", "subprocess"])
def test_the_callers_death_takes_every_rank_and_every_child_of_a_rank_with_it(path):
    """SIGKILL of the caller (a notebook kernel killed): its helper (or its torchrun
    subprocess), the agent, the ranks, and what the ranks started, in their group or in a
    session of their own, all end."""
    mark = f"DDPLAB_TEST_MARK={os.getpid()}-{path}"
    env = {**os.environ, mark.split("=")[0]: mark.split("=")[1]}
    if path == "subprocess":
        env["DDPLAB_LAUNCH_PATH"] = "subprocess"
    caller = subprocess.Popen([sys.executable, str(SCRIPTS / "caller.py"), LEAVES, "hold", "300"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True, env=env)
    pids: list[int] = []
    seen = ""
    try:
        while len(pids) < 6:  # per rank: its session child, its background child, itself
            line = caller.stdout.readline()
            assert line, f"the caller ended early:\n{seen}"
            seen += line
            words = line.split()
            if len(words) >= 3 and words[1] in ("child", "pid") and words[2].isdigit():
                pids.append(int(words[2]))
        assert all(alive(pid) for pid in pids)
        caller.send_signal(signal.SIGKILL)
        caller.wait()
        assert not wait_gone(pids, 20), seen
        assert not wait_gone(marked(mark), 10), seen  # nothing it started
    finally:
        caller.kill()
        kill_all(pids)


SCRIPT = "import os\nprint('ran as', __name__, 'rank', os.environ['RANK'], flush=True)\n"


def script_forms(folder: Path) -> dict[str, Path]:
    """The forms torchrun runs: a file without .py, a directory and a zip with __main__.py."""
    (folder / "noext").write_text(SCRIPT)
    (folder / "pkgdir").mkdir()
    (folder / "pkgdir" / "__main__.py").write_text(SCRIPT)
    with zipfile.ZipFile(folder / "app.zip", "w") as archive:
        archive.writestr("__main__.py", SCRIPT)
    (folder / "modpkg").mkdir()
    (folder / "modpkg" / "__init__.py").write_text("")
    (folder / "modpkg" / "job.py").write_text(SCRIPT)
    return {"noext": folder / "noext", "pkgdir": folder / "pkgdir", "app.zip": folder / "app.zip"}


@pytest.mark.parametrize("form", ["noext", "pkgdir", "app.zip", "-m modpkg.job"])
@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_torchruns_script_forms_run_from_the_api(tmp_path, monkeypatch, form, where):
    paths = script_forms(tmp_path)
    monkeypatch.chdir(tmp_path)
    if form.startswith("-m "):
        target = form[3:]
    else:
        target = form if where == "relative" else str(paths[form])
    result = launch(target, 2, quiet=True, timeout=120)
    assert result.ok, result.error
    assert [result.log(rank) for rank in (0, 1)] == ["ran as __main__ rank 0",
                                                     "ran as __main__ rank 1"]


@pytest.mark.parametrize("form", ["noext", "pkgdir", "app.zip", "-m modpkg.job"])
def test_torchruns_script_forms_run_from_the_cli(tmp_path, monkeypatch, form, cli):
    """The command's parser hands each form to the launch as given (run in this process)."""
    paths = script_forms(tmp_path)
    monkeypatch.chdir(tmp_path)
    target = form.split() if form.startswith("-m ") else [str(paths[form].name)]
    done = cli("launch", "--nproc-per-node", "2", *target)
    assert done.returncode == 0, done.stderr
    assert "[rank1] ran as __main__ rank 1" in done.stdout


def test_a_directory_without_main_is_refused_with_what_to_do(tmp_path):
    (tmp_path / "plain_dir").mkdir()
    with pytest.raises(LaunchError, match="directory without __main__.py"):
        launch(tmp_path / "plain_dir", 2)


@pytest.mark.parametrize("engine", ["torchrun", "subprocess", "spawn", "spawn-not-linux"])
def test_every_ranks_long_lines_arrive_whole_and_attributed_under_every_engine(
        engine, monkeypatch):
    """Both engines, and the torchrun subprocess (the path off Linux): each rank's streams are
    connections of its own, so a line a rank has not finished yet (``print`` writes the text,
    then the newline) is never cut by another's. Off Linux the ranks connect to a socket with
    a path (there is no abstract namespace). Four ranks where they are forked or start without
    torch; two under mp.spawn, where each is a fresh interpreter importing torch (two writers
    are what a cut line needs)."""
    if engine == "subprocess":
        monkeypatch.setenv("DDPLAB_LAUNCH_PATH", "subprocess")
    if engine == "spawn-not-linux":
        from ddplab.launcher import fallback

        monkeypatch.setattr(fallback.sys, "platform", "darwin")
        engine = "spawn"
    sys.path.insert(0, str(SCRIPTS))
    try:
        from long_lines import LINES, line
    finally:
        sys.path.pop(0)
    ranks = 2 if engine == "spawn" else 4
    args = ["spawn", str(ranks)] if engine == "spawn" else []
    result = launch(str(SCRIPTS / "long_lines.py"), ranks, args=args, quiet=True, timeout=300,
                    engine="spawn" if engine == "spawn" else "torchrun")
    assert result.ok, result.error
    for rank in range(ranks):
        lines = result.logs.get(rank, [])
        for stream in ("out", "err"):
            mine = [text for text in lines if text.startswith(f"{stream} rank {rank} ")]
            assert mine == [line(rank, index, stream) for index in range(LINES)], \
                (rank, stream, [len(t) for t in mine])
        strays = [t[:60] for t in lines if not t.startswith(("out rank", "err rank"))]
        assert strays == [], strays
    assert not [t[:60] for t in result.logs.get("launcher", []) if " rank " in t]


def test_no_launcher_descriptor_but_stdin_stdout_stderr_reaches_what_a_rank_starts(tmp_path):
    """A program a rank starts, even one told to keep every descriptor (close_fds=False), gets
    0, 1 and 2 only: nothing it keeps open can hold the launch's pipes or sockets."""
    script = tmp_path / "fds.py"
    script.write_text(
        "import subprocess, sys\n"
        "code = 'import os; print(\"fds\", sorted(map(int, os.listdir(\"/proc/self/fd\"))))'\n"
        "subprocess.run([sys.executable, '-c', code], close_fds=False, check=True)\n")
    result = launch(script, 2, quiet=True, timeout=120)
    assert result.ok, result.error
    for rank in (0, 1):
        # (3 is the directory listing /proc/self/fd itself)
        assert result.log(rank) == "fds [0, 1, 2, 3]", result.log(rank)


@pytest.mark.parametrize("path", ["fork", "subprocess"])
def test_a_ranks_pythonpath_is_the_jobs_as_in_a_fresh_python(tmp_path, monkeypatch, path):
    """A forked rank started before the job's environment was set; the job's PYTHONPATH
    still reaches ``sys.path``, ahead of what was there, on both paths."""
    if path == "subprocess":
        monkeypatch.setenv("DDPLAB_LAUNCH_PATH", "subprocess")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "job_only_module.py").write_text("WHERE = 'lib'\n")
    script = tmp_path / "uses_lib.py"
    script.write_text("import os, job_only_module\n"
                      "print('found', job_only_module.WHERE, os.environ['RANK'])\n")
    paths = os.pathsep.join([str(tmp_path / "lib"), os.environ.get("PYTHONPATH", "")])
    result = launch(str(script), 2, env={"PYTHONPATH": paths}, quiet=True, timeout=120)
    assert result.ok, result.error
    assert [result.log(rank) for rank in (0, 1)] == ["found lib 0", "found lib 1"]
