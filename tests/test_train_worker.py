"""The training worker end to end: in this process (world of one) and on real gloo processes.

Multi-process runs go through ``run_train`` (``ddplab.launch``). The runs are tiny (digits,
3 epochs) and the module shares one uninterrupted 2-process run between tests.
"""

from __future__ import annotations

import contextlib
import io
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

import ddplab
from ddplab import events, train
from ddplab.workers import train as worker

REPO = Path(__file__).resolve().parents[1]
TINY = ("--dataset", "digits", "--epochs", "3", "--batch-size", "32", "--seed", "0")


@dataclass
class Run:
    """What a test needs from a finished run (a subset of ddplab.launch's RunResult)."""

    ok: bool
    returncode: int
    summary: Optional[dict[str, Any]]
    exit_codes: dict[int, Optional[int]]
    events: list[dict[str, Any]] = field(default_factory=list)
    output: str = ""


def run_train(nprocs: int, *args: str, cwd: Path, timeout: float = 180) -> Run:
    """Run ``ddplab.workers.train`` on ``nprocs`` real processes through ``ddplab.launch``.

    Args:
        nprocs: processes to start.
        *args: worker arguments.
        cwd: working directory of the run (a tmp_path).
        timeout: seconds before the launcher ends the run (the test then fails).

    Returns:
        A ``Run`` with rank 0's events, the summary event (None if missing) and the exit codes.
    """
    result = ddplab.launch("ddplab.workers.train", nprocs, args=args, cwd=cwd, timeout=timeout,
                           quiet=True, live=False)
    output = "\n".join(f"[{rank}] {line}" for rank, lines in result.logs.items()
                       for line in lines) + "\n" + result.error
    return Run(result.ok, result.returncode, result.summary, result.exit_codes,
               result.events.get(0, []), output)


def run_here(*args: str) -> dict[str, Any]:
    """Run the worker in this process (a world of one) and return its summary event.

    One torch thread, as in the ``OMP_NUM_THREADS=1`` processes of ``run_train``, so both
    compute the same way (and the run does not fight the other processes for the two cores).
    """
    out, threads = io.StringIO(), torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(out):
            returned = worker.main([*args, "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    (summary,) = [e for e in map(events.parse, out.getvalue().splitlines())
                  if e and e["kind"] == "summary"]
    assert summary["param_checksum"] == returned["param_checksum"]
    return summary


def _metrics(history: list[dict]) -> list[tuple[float, float]]:
    return [(h["loss"], h["accuracy"]) for h in history]


# ---------------------------------------------------------------------- one process, in here


def test_digits_defaults_reach_90_percent() -> None:
    summary = run_here()
    assert summary["final_accuracy"] >= 0.90, summary["history"]
    assert summary["epochs"] == 3 and summary["world_size"] == 1
    assert summary["samples_seen_per_rank"] == [3 * 1347]
    for key in ("param_checksum", "final_loss", "global_batch", "lr", "history", "mode", "amp",
                "device", "backend"):
        assert key in summary
    assert set(summary["history"][0]) >= {"loss", "accuracy", "epoch_time", "samples_per_s"}


def test_both_loaders_and_dataparallel_train_identically() -> None:
    one_epoch = ("--epochs", "1", "--mode", "single")
    tensor = run_here(*one_epoch)
    per_sample = run_here(*one_epoch, "--loader", "dataloader")
    dataparallel = run_here("--epochs", "1", "--mode", "dp")
    assert per_sample["param_checksum"] == tensor["param_checksum"]
    assert dataparallel["param_checksum"] == tensor["param_checksum"]  # CPU: DP runs the module


def test_no_set_epoch_repeats_the_first_epochs_order() -> None:
    default = run_here("--epochs", "2", "--mode", "single")
    repeated = run_here("--epochs", "2", "--mode", "single", "--no-set-epoch")
    assert repeated["set_epoch"] is False
    assert _metrics(repeated["history"][:1]) == _metrics(default["history"][:1])
    assert repeated["param_checksum"] != default["param_checksum"]


def test_bf16_autocast_trains_on_cpu() -> None:
    summary = run_here("--epochs", "1", "--amp", "bf16", "--scale-lr", "--grad-accum", "2",
                       "--warmup-epochs", "0.5")
    assert summary["amp_dtype"] == "bfloat16" and summary["lr"] == pytest.approx(0.1)
    assert summary["global_batch"] == 64 and summary["final_accuracy"] > 0.5


# ---------------------------------------------------------------------- real processes


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """One uninterrupted DDP run on 2 processes, shared by the tests below."""
    cwd = tmp_path_factory.mktemp("reference")
    run = run_train(2, *TINY, "--checkpoint-dir", "ckpt", cwd=cwd)
    assert run.ok and run.summary, run.output[-3000:]
    return run


@pytest.mark.slow
def test_ddp_ranks_agree_and_split_the_data(reference: Run) -> None:
    summary = reference.summary
    assert summary["world_size"] == 2 and summary["backend"] == "gloo"
    assert len(set(summary["param_checksums_per_rank"])) == 1
    # 1347 training images padded to 1348: 674 per rank per epoch
    assert summary["samples_seen_per_rank"] == [3 * 674, 3 * 674]
    assert summary["global_batch"] == 64
    assert [e["epoch"] for e in reference.events if e["kind"] == "epoch"] == [1, 2, 3]


@pytest.mark.slow
def test_ddp_equals_one_process_accumulating(reference: Run, tmp_path: Path) -> None:
    single = run_here(*TINY, "--mode", "single", "--grad-accum", "2")
    ddp, one = reference.summary["param_checksum"], single["param_checksum"]
    assert abs(ddp - one) <= 1e-5 * abs(ddp), (ddp, one)
    assert single["global_batch"] == reference.summary["global_batch"]
    assert single["samples_seen_per_rank"] == [2 * 3 * 674]


@pytest.mark.slow
def test_resume_is_exact_and_works_on_another_world_size(reference: Run, tmp_path: Path
                                                         ) -> None:
    stopped = run_train(2, *TINY, "--checkpoint-dir", "ckpt", "--stop-after-epoch", "2",
                        cwd=tmp_path)
    assert not stopped.ok and stopped.summary is None, stopped.output[-3000:]
    # The injected fault, on every rank whose code is known: a rank that left at the same moment
    # as its peer may have been reaped by torch's agent before ddplab read its status (None).
    assert set(stopped.exit_codes.values()) - {None} == {train.STOP_EXIT_CODE}
    assert [e["epoch"] for e in stopped.events if e["kind"] == "epoch"] == [1, 2]
    saved = torch.load(tmp_path / "ckpt" / "checkpoint.pt", weights_only=True)
    assert saved["epoch"] == 2
    shutil.copytree(tmp_path / "ckpt", tmp_path / "ckpt_copy")

    resumed = run_train(2, *TINY, "--checkpoint-dir", "ckpt", "--resume", cwd=tmp_path)
    assert resumed.ok, resumed.output[-3000:]
    assert resumed.summary["start_epoch"] == 2
    assert resumed.summary["param_checksum"] == reference.summary["param_checksum"]
    assert _metrics(resumed.summary["history"]) == _metrics(reference.summary["history"])

    alone = run_here(*TINY, "--checkpoint-dir", str(tmp_path / "ckpt_copy"), "--resume")
    assert alone["world_size"] == 1 and alone["start_epoch"] == 2 and alone["epochs"] == 3
    history = reference.summary["history"]
    assert _metrics(alone["history"][:2]) == _metrics(history[:2])
    assert alone["final_accuracy"] >= history[1]["accuracy"] - 0.05
