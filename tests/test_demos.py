"""The in-kernel demonstrations show what lessons 02 and 03 claim."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ddplab import demos
from ddplab.showcode import source


@pytest.mark.parametrize("batch,gpus,sizes", [(32, 4, [8, 8, 8, 8]), (10, 4, [3, 3, 3, 1]),
                                              (6, 4, [2, 2, 2]), (5, 1, [5])])
def test_scatter_sizes_follow_tensor_chunk(batch, gpus, sizes):
    assert demos.scatter_sizes(batch, gpus) == sizes


@pytest.mark.parametrize("devices", [2, 3, 4])
def test_data_parallel_by_hand_equals_the_full_batch_without_batchnorm(devices):
    result = demos.dp_by_hand("cnn", batch_size=30, devices=devices)
    assert result.equal and result.max_rel_diff < 1e-5
    assert sum(result.chunk_sizes) == 30


def test_batchnorm_breaks_the_equality():
    result = demos.dp_by_hand("cnn_bn", devices=2)
    assert not result.equal and result.max_rel_diff > 1e-2


def test_by_hand_matches_a_sum_of_per_chunk_gradients():
    """The reduce step is a sum: each replica's loss share is its chunk's part of the mean."""
    torch.manual_seed(1)
    model = torch.nn.Linear(3, 4)
    x, y = torch.randn(8, 3), torch.randint(0, 4, (8,))
    dp = demos.data_parallel_gradient(model, x, y, 2)
    by_chunk = [demos.full_batch_gradient(model, xc, yc) for xc, yc in zip(x.chunk(2), y.chunk(2))]
    for name in dp:
        assert torch.allclose(dp[name], sum(g[name] for g in by_chunk) / 2, atol=1e-6)
    assert model.weight.grad is None        # the caller's model is never touched


@pytest.mark.parametrize("use_data_parallel", [True, False])
def test_module_prefix_error_and_both_fixes(use_data_parallel):
    demo = demos.module_prefix_demo(use_data_parallel=use_data_parallel)
    assert demo.wrapper == ("DataParallel" if use_data_parallel else "Wrapper")
    assert all(k.startswith("module.") for k in demo.wrapped_keys)
    assert not any(k.startswith("module.") for k in demo.plain_keys)
    assert "Unexpected key(s)" in demo.error and "Missing key(s)" in demo.error
    assert list(demo.fixes.values()) == [True, True]


def test_strip_prefix_leaves_other_keys():
    assert demos.strip_prefix({"module.a": 1, "b": 2}) == {"a": 1, "b": 2}


def test_sections_of_the_by_hand_code_can_be_shown():
    for name in ("scatter", "replicate", "parallel_apply", "gather", "reduce"):
        assert source("ddplab/demos.py", name).strip()


def _spawn_script(body: str) -> str:
    return textwrap.dedent("""
        import ddplab.demos as demos

        def hello(rank, world_size):
            print("hello from", rank)

    """) + textwrap.dedent(body)


@pytest.mark.slow
def test_spawn_of_a_function_from_main_fails_and_leaves_no_process():
    """Like a notebook cell: `python -c` code lives in a __main__ that children cannot import."""
    code = _spawn_script("""
        import os
        attempt = demos.spawn_from_notebook(hello, args=(2,), nprocs=2, timeout=120)
        print("OK" if attempt.ok else "FAILED", attempt.exit_codes)
        print("MESSAGE", attempt.message)
        print("EXCEPTION", attempt.exception)
        print("ALIVE", any(os.path.exists(f"/proc/{p}") for p in attempt.pids))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    assert "FAILED" in out.stdout
    assert "Can't get attribute 'hello' on <module '__main__'" in out.stdout
    assert "ProcessExitedException" in out.stdout
    assert "ALIVE False" in out.stdout


@pytest.mark.slow
def test_spawn_of_an_importable_function_succeeds():
    attempt = demos.spawn_from_notebook(demos.scatter_sizes, args=(4,), nprocs=2, timeout=120)
    assert attempt.ok, attempt.stderr
    assert attempt.exit_codes == [0, 0] and attempt.message == ""


@pytest.mark.slow
def test_spawn_timeout_kills_the_children():
    attempt = demos.spawn_from_notebook(_sleep, args=(60,), nprocs=1, timeout=15)
    assert not attempt.ok and attempt.exception.startswith("timeout")
    assert all(code is not None for code in attempt.exit_codes)   # ended and reaped


def _sleep(rank: int, seconds: float) -> None:
    import time

    time.sleep(seconds)
