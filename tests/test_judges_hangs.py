"""The verdict on a run that did not finish: a timeout read from every rank's stack dump
(``RunResult.stacks``, faulthandler's format), a timeout without stacks, a crash without a
traceback. No processes: the dumps below are what faulthandler printed for real deadlocks of
exercise 05 (a barrier inside ``if rank == 0:``) and 08 (a recv without its send)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from ddplab import RunResult, check
from ddplab.lab.judges import hangs

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT = ROOT / "tests" / "solutions" / "checkpoint.py"
SITE = "/home/learner/.venv/lib/python3.11/site-packages"
TAIL = f"""  File "<frozen runpy>", line 88 in _run_code
  File "<frozen runpy>", line 291 in run_path
  File "{ROOT}/ddplab/launcher/entry.py", line 58 in run_target
  File "{SITE}/torch/distributed/elastic/multiprocessing/api.py", line 706 in _wrap
  File "/usr/lib/python3.11/multiprocessing/process.py", line 108 in run
  File "<frozen runpy>", line 198 in _run_module_as_main
"""


def line_of(path: Path, text: str) -> int:
    """The number of the first line of ``path`` that contains ``text``."""
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


BARRIER = line_of(CHECKPOINT, "dist.barrier()  # nobody goes on")
SAVE_CALL = line_of(CHECKPOINT, "save(state, path, rank)")
BACKWARD = line_of(CHECKPOINT, ".backward()")

RANK0_IN_BARRIER = f"""Timeout (0:00:06)!
Thread 0x00007fd0c1a64b80 (most recent call first):
  File "{SITE}/torch/distributed/distributed_c10d.py", line 6371 in barrier
  File "{SITE}/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "{CHECKPOINT}", line {BARRIER} in save
  File "{CHECKPOINT}", line {SAVE_CALL} in main
  File "{CHECKPOINT}", line 138 in <module>
{TAIL}"""

RANK1_IN_BACKWARD = f"""Thread 0x00007f11aa7fc640 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 324 in wait
  File "/usr/lib/python3.11/threading.py", line 622 in wait
  File "{SITE}/tqdm/_monitor.py", line 60 in run

Current thread 0x00007fd0c1a64b80 (most recent call first):
  File "{SITE}/torch/autograd/graph.py", line 1072 in _engine_run_backward
  File "{SITE}/torch/autograd/__init__.py", line 395 in backward
  File "{SITE}/torch/_tensor.py", line 623 in backward
  File "{CHECKPOINT}", line {BACKWARD} in main
  File "{CHECKPOINT}", line 138 in <module>
{TAIL}"""


def timed_out(world_size: int = 2, stacks=None, exit_codes=None) -> RunResult:
    result = RunResult(status="timeout", returncode=1, wall_time=60.2, world_size=world_size,
                       exit_codes=exit_codes or {}, error="timed out after 60 s")
    if stacks is not None:
        result.stacks = stacks  # the field a launcher that keeps stacks fills on a timeout
    return result


def test_parse_stack_reads_the_main_thread_innermost_first():
    frames = hangs.parse_stack(RANK1_IN_BACKWARD)
    assert frames[0].path.endswith("torch/autograd/graph.py") and frames[0].line == 1072
    assert frames[0].function == "_engine_run_backward"
    assert (frames[3].path, frames[3].line, frames[3].function) == (str(CHECKPOINT), BACKWARD,
                                                                     "main")
    assert all("tqdm" not in f.path for f in frames)  # the helper thread is not the script


def test_a_rank_in_a_barrier_and_one_that_never_arrives():
    result = timed_out(stacks={0: RANK0_IN_BARRIER}, exit_codes={1: 0})
    verdict = check("05", result)
    assert not verdict
    assert (f"deadlock: rank 0 waits in barrier at line {BARRIER} of "
            "tests/solutions/checkpoint.py (in save: `dist.barrier()") in verdict.message
    assert "rank 1 never arrives (it had finished)" in verdict.message
    assert "traceback" not in verdict.message


def test_ranks_waiting_in_different_collectives():
    result = timed_out(stacks={0: RANK0_IN_BARRIER, 1: RANK1_IN_BACKWARD})
    message = hangs.explain_timeout(result)
    assert f"rank 0 waits in barrier at line {BARRIER}" in message
    assert f"rank 1 waits in backward() (DDP's gradient all-reduce) at line {BACKWARD}" in message
    assert "different places" in message and "same order" in message


def test_every_rank_in_the_same_recv(tmp_path):
    script = tmp_path / "ring.py"
    script.write_text("import torch.distributed as dist\n\ndef shift(t, r):\n"
                      "    dist.recv(r, src=0)\n    return r\n")
    dump = f"""Thread 0x00007f3b2c1e2b80 (most recent call first):
  File "{SITE}/torch/distributed/distributed_c10d.py", line 2541 in recv
  File "{SITE}/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "{script}", line 4 in shift
  File "{script}", line 9 in <module>
"""
    message = hangs.explain_timeout(timed_out(stacks={0: dump, 1: dump}))
    assert f"rank 0 waits in recv at line 4 of {script} (in shift: `dist.recv(r, src=0)`)" \
        in message and "rank 1 waits in recv at line 4" in message
    assert "matching send" in message


def test_every_rank_in_the_same_barrier_points_to_mismatched_calls():
    message = hangs.explain_timeout(timed_out(stacks={0: RANK0_IN_BARRIER, 1: RANK0_IN_BARRIER}))
    assert "rank 1 waits in barrier" in message and "do not match" in message
    assert "matching send" not in message


def test_a_wait_on_a_request_is_read_from_the_learner_s_line(tmp_path):
    script = tmp_path / "ring.py"
    script.write_text("def shift(requests):\n    for request in requests:\n"
                      "        request.wait()\n")
    dump = f"""Current thread 0x00007f3b2c1e2b80 (most recent call first):
  File "{script}", line 3 in shift
  File "{script}", line 7 in <module>
"""
    message = hangs.explain_timeout(timed_out(world_size=2, stacks={1: dump}))
    assert "rank 1 waits in wait() at line 3" in message and "rank 0 never arrives" in message


def test_without_stacks_the_verdict_names_the_ranks_still_running():
    message = check("05", timed_out(world_size=3, exit_codes={0: 0})).message
    assert "rank(s) 1, 2 still running" in message and "timeout ended it after 60 s" in message
    assert "deadlock" in message and "`if rank == 0:`" in message
    assert "traceback" not in message


@pytest.mark.parametrize("traceback, words", [
    ("Traceback (most recent call last):\n  File \"x.py\", line 3\nValueError: no",
     ["Read the traceback"]),
    ("", ["without a Python traceback", "killed by SIGKILL"]),
])
def test_a_crash_is_told_to_read_the_traceback_only_when_there_is_one(traceback, words):
    failure = SimpleNamespace(rank=1, exitcode=-9, signal="SIGKILL", message="",
                              traceback=traceback)  # a root cause, as the launcher reports it
    result = RunResult(status="failed", returncode=1, wall_time=3.0, world_size=2,
                       root_cause=failure)
    message = check("03", result).message
    assert all(word in message for word in words), message
    assert "rank 1" in message
