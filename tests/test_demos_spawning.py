"""ddplab.lab.demos.spawning: mp.spawn of a function from a cell fails (lesson 03), leaving nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import traceback

import pytest

from ddplab.lab.demos import dataparallel, spawning


def _spawn_script(body: str) -> str:
    return textwrap.dedent("""
        from ddplab.lab.demos import spawning

        def hello(rank, world_size):
            print("hello from", rank)

    """) + textwrap.dedent(body)


@pytest.mark.slow
def test_spawn_of_a_function_from_main_fails_and_leaves_no_process():
    """Like a notebook cell: `python -c` code lives in a __main__ that children cannot import."""
    code = _spawn_script("""
        import os
        attempt = spawning.spawn_from_notebook(hello, args=(2,), nprocs=2, timeout=120)
        print("OK" if attempt.ok else "FAILED", attempt.exit_codes)
        print("RAISED", attempt.message.split(":")[0])   # the children's exception type
        print("EXCEPTION", attempt.exception.split(":")[0])   # the parent's
        print("ALIVE", any(os.path.exists(f"/proc/{p}") for p in attempt.pids))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    assert "FAILED" in out.stdout and "ALIVE False" in out.stdout
    # The children fail while unpickling `hello` (it lives in a __main__ they cannot import),
    # before it runs: an AttributeError, and hello never printed.
    assert "RAISED AttributeError" in out.stdout
    assert "EXCEPTION ProcessExitedException" in out.stdout
    assert "hello from" not in out.stdout + out.stderr


@pytest.mark.slow
def test_spawn_of_an_importable_function_succeeds():
    attempt = spawning.spawn_from_notebook(dataparallel.scatter_sizes, args=(4,), nprocs=2,
                                           timeout=120)
    assert attempt.ok, attempt.stderr
    assert attempt.exit_codes == [0, 0] and attempt.message == ""


@pytest.mark.slow
def test_spawn_timeout_kills_the_children():
    attempt = spawning.spawn_from_notebook(_sleep, args=(60,), nprocs=1, timeout=15)
    assert not attempt.ok and attempt.exception.startswith("timeout")
    assert all(code is not None for code in attempt.exit_codes)   # ended and reaped


def _sleep(rank: int, seconds: float) -> None:
    import time

    time.sleep(seconds)


def test_child_error_is_the_first_exception_line_and_the_lines_after_it():
    stderr = "\n".join([
        "Traceback (most recent call last):",
        '  File "hello.py", line 9, in <module>',
        "    raise RuntimeError('''",
        "RuntimeError: ",
        "        An attempt has been made to start a new process before the",
        "        current process has finished its bootstrapping phase.",
        "Traceback (most recent call last):",
        "RuntimeError: the second child's"])
    said = spawning.child_error(stderr, lines=2)
    assert said.splitlines() == stderr.splitlines()[3:6]   # the first child's, not the raise line
    assert spawning.child_error("no exception here\n  at all") == ""


def test_child_error_keeps_the_bootstrapping_error_through_its_idiom():
    """What a child without the guard raises (notebook 03's Your turn), the idiom included."""
    from multiprocessing import process, spawn

    current = process.current_process()
    current._inheriting = True                    # as in a child still importing __main__
    try:
        spawn._check_not_importing_main()
        raised = ""
    except RuntimeError as error:
        raised = "".join(traceback.format_exception_only(error))
    finally:
        del current._inheriting
    said = spawning.child_error("Traceback (most recent call last):\n" + raised)
    assert said.startswith("RuntimeError") and "if __name__ == '__main__':" in said


class _Tried:
    """What ``verdict`` reads of a launch: its status, rank 0's metrics, the ranks' log lines."""

    def __init__(self, status, grads, weights, logs=None):
        self.status, self.logs = status, logs or {}
        self._metrics = ([{"rank": r, "name": "first_step", "grad_checksum": g}
                          for r, g in enumerate(grads)]
                         + [{"rank": r, "name": "param_checksum", "value": w}
                            for r, w in enumerate(weights)])

    def events_of(self, kind):
        return self._metrics if kind == "metric" else []


def test_verdict_names_the_refusal_and_why_equal_steps_kept_the_weights_apart():
    apart = _Tried("failed", [1.5, 1.5], [2.0, 3.0],
                   {0: ["RuntimeError: ranks disagree on the weights: [2.0, 3.0]"], 1: []})
    said = spawning.verdict(apart, ["--seed-per-rank", "--no-init-sync"])
    assert said.startswith("--seed-per-rank --no-init-sync: status 'failed': RuntimeError: ranks")
    assert "equal steps from unequal starting weights" in said
    equal = spawning.verdict(_Tried("ok", [1.5, 1.5], [2.0, 2.0]), ["--seed-per-rank"])
    assert equal == "--seed-per-rank: status 'ok', every rank ended with the same weights"
    other_grads = spawning.verdict(_Tried("failed", [1.0, 2.0], [2.0, 3.0]), ["--x"])
    assert "equal steps" not in other_grads          # unequal gradients: not that explanation
