"""What sorts the suite: tests that start processes carry the ``launch`` mark (or ``slow``), and
``make test-fast`` runs the others; tests that need the whole machine carry ``serial``, and
``make test`` runs them alone after its parallel run.

A file whose tests start processes (a launch, torchrun, mp.spawn, a Python subprocess) is marked
whole by naming it in ``LAUNCHING``, or by ``pytestmark = pytest.mark.launch`` in the file. Under
``make test-fast`` (``-m "not slow and not launch ..."``) an audit hook fails any remaining test
that starts a Python process or forks, and says how to mark it, so the fast set stays fast.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

#: Tests that start processes, as paths below tests/: a whole file, or ``file::test``.
LAUNCHING = {
    "gpu/test_run.py", "test_barrier_demo.py", "test_buckets.py", "test_check.py", "test_cifar10_workload.py",
    "test_cli.py", "test_collectives.py", "test_comm_hooks.py",
    "test_compile_ddp.py", "test_course_build.py", "test_cuda_clean.py", "test_debugging.py", "test_demos_spawning.py",
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
    "test_public_torch_api.py::test_the_rendezvous_handlers_come_from_torchs_public_registry",
    "test_public_torch_api.py::"
    "test_the_agents_exit_accounting_reads_every_status_and_reaps_nothing",
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
