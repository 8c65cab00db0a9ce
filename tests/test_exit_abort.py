"""Ranks leave no thread of their process group behind, so their exit never aborts.

A gloo process group that outlives ``destroy_process_group()`` keeps its threads
(``pt_gloo_runloop``, ``gloo_tcp_loop``, the store's ``pt_tcpstore_uv``) running into the
interpreter's exit, which then aborts now and then with "terminate called without an active
exception" (SIGABRT). The group outlives it when ``torch.distributed.nn`` is imported after
``init_process_group`` (DDP's constructor imports it): its functions keep ``group.WORLD`` as a
default argument. See ``tests/scripts/threads_at_exit.py``. The spawn worker's ranks
(``ddplab.workers.spawn_ddp``) are checked by test_spawn_worker, on its one launch.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ddplab import launch

SCRIPTS = Path(__file__).parent / "scripts"
THREADS = str(SCRIPTS / "threads_at_exit.py")


def group_threads(result) -> dict[int, list[str]]:
    """Per rank, the threads of a process group still running when the rank was done."""
    return {e["rank"]: [t for t in e["value"] if "gloo" in t or "tcpstore" in t]
            for e in result.events_of("metric") if e["name"] == "threads_at_exit"}


def test_training_worker_ranks_exit_with_no_process_group_thread_left(monkeypatch):
    monkeypatch.setenv("DDPLAB_LAUNCH_PATH", "subprocess")  # a real interpreter exit per rank
    result = launch(THREADS, 2, args=["train", "--epochs", "1"], quiet=True, live=False,
                    timeout=300)
    assert result.ok, result.error
    assert group_threads(result) == {0: [], 1: []}


@pytest.mark.soak
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("worker", ["spawn", "train"])
def test_thirty_launches_in_a_row_none_aborting(monkeypatch, worker):
    if worker == "train":
        monkeypatch.setenv("DDPLAB_LAUNCH_PATH", "subprocess")  # ranks exit as python does
        target, engine, args = "ddplab.workers.train", "torchrun", ["--epochs", "1"]
    else:
        target, engine, args = "ddplab.workers.spawn_ddp", "spawn", ["--epochs", "1"]
    statuses, errors = [], []
    for _ in range(30):
        result = launch(target, 2, engine=engine, args=args, quiet=True, live=False,
                        timeout=300)
        text = "\n".join(line for lines in result.logs.values() for line in lines)
        statuses.append((result.status, "terminate called" in text,
                         result.root_cause.signal if result.root_cause else None))
        errors += [result.error] if not result.ok else []
    assert statuses == [("ok", False, None)] * 30, errors
