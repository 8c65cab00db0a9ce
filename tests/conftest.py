"""What sorts the suite: tests that start processes carry the ``launch`` mark (or ``slow``), and
``make test-fast`` runs the others; tests that need the whole machine carry ``serial``, and
``make test`` runs them alone after its parallel run.

A file whose tests start processes (a launch, torchrun, mp.spawn, a Python subprocess) is marked
whole by naming it in ``LAUNCHING``, or by ``pytestmark = pytest.mark.launch`` in the file. Under
``make test-fast`` (``-m "not slow and not launch ..."``) an audit hook fails any remaining test
that starts a Python process or forks, and says how to mark it, so the fast set stays fast.

Which way this run's launches start (forked from a warm helper, or a cold torchrun subprocess
each, as on macOS and under ``make test-cold``), and what a test does about it:
``tests/launch_path.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

#: Tests that start processes, as paths below tests/: a whole file, or ``file::test``.
LAUNCHING = {
    "gpu/test_run.py", "test_barrier_demo.py", "test_buckets.py", "test_check.py",
    "test_check_interrupt.py", "test_pyspy.py",
    "test_cifar10_workload.py", "test_cli.py", "test_collectives.py", "test_comm_hooks.py",
    "test_compile_ddp.py", "test_course_build.py", "test_cuda_clean.py", "test_debugging.py",
    "test_demos_spawning.py",
    "test_dist.py", "test_distributed_checkpoint.py", "test_docstring_examples.py",
    "test_env.py", "test_exercise_variants.py", "test_exercises_06_08.py",
    "test_exercises_ddp.py", "test_exit_abort.py", "test_fork_safety.py",
    "test_init_methods.py", "test_kernel_interrupt.py", "test_launch.py", "test_loops.py",
    "test_plain_ddp.py", "test_rank_behaviour.py", "test_sharding.py",
    "test_spawn_engine.py", "test_spawn_worker.py", "test_sync_batchnorm.py",
    "test_tensor_parallel.py", "test_torch_words.py", "test_train_worker.py", "test_wheel.py",
    "test_workers_02_07_09.py",
    "test_capstone.py::test_the_skeleton_is_told_to_write_the_job",
    "test_checkpoint.py::test_a_killed_save_leaves_nothing_the_next_save_does_not_reclaim",
    "test_pinning.py::test_a_cpu_rank_is_pinned_with_all_its_threads",
    "test_public_torch_api.py::test_the_rendezvous_handler_comes_from_torchs_public_registry",
    "test_copies.py::test_a_class_s_copies_get_their_own_verdict_in_every_report",
}
#: Tests that need the whole machine: ``make test`` runs them after the parallel run, alone.
SERIAL = {
    "test_rank_behaviour.py::"
    "test_nprocs_above_the_limit_is_refused_before_anything_starts_and_up_to_it_works",
}
TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(str(item.fspath)).resolve()
        if TESTS not in path.parents:
            continue
        name = path.relative_to(TESTS).as_posix()
        if name in LAUNCHING or f"{name}::{item.originalname}" in LAUNCHING:
            item.add_marker(pytest.mark.launch)
        if f"{name}::{item.originalname}" in SERIAL:
            item.add_marker(pytest.mark.serial)


def _fast_run(config) -> bool:
    expr = config.getoption("-m") or ""
    return "not launch" in expr and "not slow" in expr


def _starts_a_process(event: str, args: tuple) -> bool:
    if event in ("os.fork", "os.forkpty", "os.posix_spawn"):
        return True
    if event == "subprocess.Popen":
        program = os.path.basename(str(args[0] or (args[1][0] if args[1] else "")))
        return program.startswith("python") or program == "torchrun" or \
            str(args[0]) == sys.executable
    return False


class _Guard:
    current = ""

    def __call__(self, event: str, args: tuple) -> None:
        if self.current and _starts_a_process(event, args):
            name, self.current = self.current, ""  # one report per test
            raise RuntimeError(
                f"{name} starts a process ({event}) but runs in make test-fast: mark its file "
                f"with `pytestmark = pytest.mark.launch` (or add it to LAUNCHING in "
                f"tests/conftest.py)")


_GUARD = _Guard()


def pytest_configure(config):
    if _fast_run(config):
        sys.addaudithook(_GUARD)


def _guarded(item):
    if _fast_run(item.config):
        _GUARD.current = item.nodeid
    yield
    _GUARD.current = ""


# The set-up too: a fixture may be what starts the process.
pytest_runtest_setup = pytest.hookimpl(hookwrapper=True)(_guarded)
pytest_runtest_call = pytest.hookimpl(hookwrapper=True)(_guarded)


@pytest.fixture
def cli(capsys, monkeypatch):
    """``cli("launch", ...)``: ``python -m ddplab ...`` as this process's ``ddplab.cli.main``,
    its exit code and what it printed (the rank lines the launcher prints included): the
    command's parser, launch and report, through the session's warm launch helper. For a test
    whose point is what the command's options reach, not the cold command itself."""
    from types import SimpleNamespace

    from ddplab.cli import main

    # (the command sets it for its one launch: undone after the test)
    monkeypatch.setenv("DDPLAB_PRELOAD_TRAINING", os.environ.get("DDPLAB_PRELOAD_TRAINING", "auto"))

    def run(*args: str) -> SimpleNamespace:
        capsys.readouterr()
        code = main(list(args))
        shown = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=shown.out, stderr=shown.err)
    return run


# ------------------------------------------------------------------------ shared reference runs

#: The environment of every shared run: a warning raised by a line of the exercise file (the
#: ranks run it as ``__main__``) becomes an error (``test_exercise_warnings``); a run that warns
#: nowhere in that file is the same run as without it.
WARNINGS_ARE_ERRORS = {"PYTHONWARNINGS": "error::Warning:__main__"}


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory):
    """``shared_run(target, nprocs, args=...)``: the RunResult of one real launch of ``target``
    (quiet, a fresh working folder, ``WARNINGS_ARE_ERRORS``), made once per (file content,
    nprocs, args, env, backend) for the whole test run and read by every test that names the
    same launch, in whichever pytest-xdist worker it runs. ``"{tmp}"`` in an argument is a fresh
    folder of that run. Each caller gets its own copy of the result (unpickled), so a test that
    edits one changes nothing for the others. The timeout is a safety net only.
    ``with_load=True``: ``(result, the load average when the run ended)``."""
    import fcntl
    import hashlib
    import pickle

    import ddplab

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # one folder for all the workers of this run
    root = base / "shared-runs"
    root.mkdir(exist_ok=True)

    def run(target, nprocs: int = 2, *, args=(), env=None, backend=None, timeout=600,
            with_load=False):
        target = Path(target).resolve()
        env = {**WARNINGS_ARE_ERRORS, **(env or {})}
        spec = repr((str(target), nprocs, tuple(map(str, args)), sorted(env.items()), backend))
        key = hashlib.sha256(target.read_bytes() + spec.encode()).hexdigest()[:16]
        folder, saved = root / key, root / f"{key}.pickle"
        with open(root / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one launch; the others wait for its result
            if not saved.exists():
                for made in ("cwd", "tmp"):
                    (folder / made).mkdir(parents=True)
                result = ddplab.launch(
                    str(target), nprocs, quiet=True, live=False, timeout=timeout,
                    env=env, backend=backend, cwd=str(folder / "cwd"),
                    args=[str(a).replace("{tmp}", str(folder / "tmp")) for a in args])
                (folder / "spec.txt").write_text(spec)
                saved.write_bytes(pickle.dumps((result, os.getloadavg()[0])))
        result, load = pickle.loads(saved.read_bytes())
        return (result, load) if with_load else result

    return run


@pytest.fixture
def exit_within():
    """``exit_within(proc, seconds)``: ``proc.communicate`` with a safety net; when it runs out,
    the test fails with what would explain it: the processes of the launch then (ddplab's
    helper, agents and ranks, each in a session of its own) and the caller's output."""

    def wait(proc: subprocess.Popen, seconds: float = 60):
        try:
            return proc.communicate(timeout=seconds)
        except subprocess.TimeoutExpired:
            tree = subprocess.run(["ps", "-eo", "pid,ppid,pgid,sid,stat,etime,time,args",
                                   "--forest"], capture_output=True, text=True).stdout
            ours = "\n".join(line[:200] for line in tree.splitlines()
                             if "ddplab" in line or "scripts/" in line or str(proc.pid) in line)
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"no exit within {seconds} s (load {os.getloadavg()[0]:.0f}); "
                        f"processes then:\n{ours}\noutput:\n{(out or '')[-3000:]}\n"
                        f"{(err or '')[-3000:]}")

    return wait
