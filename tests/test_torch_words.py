"""ddplab.torch_words against the real faults: each pattern recognises what the installed torch
says (``make test-compat`` runs this file on the floor and the newest release too).

Three cheap jobs: one process asking for nccl; two gloo ranks (TORCH_DISTRIBUTED_DEBUG=INFO)
that go through DDP's two unused-parameter faults, a collective timeout and a lost peer, one
after the other, each rank waiting for the other's file where order matters; two ranks under
DETAIL calling different collectives. Every rank reports what it caught as events (exception
type and text); the assertions are on ddplab's patterns, never on a phrase written here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import ddplab
from ddplab import env as ddenv
from ddplab import torch_words
from ddplab.lab import postmortem
from ddplab import failures as causes

ROOT = Path(__file__).resolve().parent.parent

# What each rank of the gloo jobs runs. Waits are on files the other rank writes; the 120 s are
# a safety net (a rank that never writes its file is a failure to report, not to wait for).
JOB = textwrap.dedent('''
    import os, sys, time
    from datetime import timedelta
    from pathlib import Path
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from ddplab import events

    folder, part = Path(sys.argv[1]), sys.argv[2]
    dist.set_debug_level_from_env()
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()

    def wait_for(name):
        end = time.monotonic() + 120
        while not (folder / name).exists():
            if time.monotonic() > end:
                raise SystemExit(f"rank {rank}: no {name} from the other rank within 120 s")
            time.sleep(0.02)

    def leave():   # at once: a group whose collectives failed may hang its destructor
        sys.stdout.flush()
        os._exit(0)

    def caught(fault, fn):
        try:
            fn()
        except Exception as exc:
            events.emit("metric", name=fault, value={"type": type(exc).__name__, "text": str(exc)})
        else:
            events.emit("metric", name=fault, value=None)

    if part == "detail":   # rank 0 broadcasts one float, rank 1 all-reduces two doubles
        if rank == 0:
            caught("mismatch", lambda: dist.broadcast(torch.zeros(1), src=0))
        else:
            caught("mismatch", lambda: dist.all_reduce(torch.zeros(2, dtype=torch.float64)))
        leave()

    class Two(nn.Module):
        def __init__(self, use_aux):
            super().__init__()
            self.body, self.aux, self.use_aux = nn.Linear(4, 2), nn.Linear(4, 2), use_aux

        def forward(self, x):
            return self.body(x) + (self.aux(x) if self.use_aux else 0)

    def steps(model, n):
        for _ in range(n):
            model(torch.ones(3, 4)).sum().backward()

    torch.manual_seed(0)
    steps(DDP(Two(True), find_unused_parameters=True), 2)   # nothing unused: DDP warns
    print("find-unused done", flush=True)
    caught("unused", lambda: steps(DDP(Two(False)), 2))      # fails at the second step

    short = dist.new_group([0, 1], timeout=timedelta(seconds=2))
    if rank == 0:          # alone in a collective: it times out while rank 1 waits, alive
        caught("timeout", lambda: dist.all_reduce(torch.ones(1), group=short))
        (folder / "timed-out").touch()
        # rank 1 leaves without joining this one: its connection closes under it
        caught("peer_lost", lambda: dist.all_reduce(torch.ones(1)))
    else:
        wait_for("timed-out")
    leave()
''')


def run_job(tmp_path: Path, part: str, debug: str) -> ddplab.RunResult:
    script = tmp_path / f"words_{part}.py"
    script.write_text(JOB)
    result = ddplab.launch(script, 2, args=[tmp_path, part], backend="gloo", quiet=True,
                           live=False, env={"TORCH_DISTRIBUTED_DEBUG": debug},
                           timeout=300)  # safety net: every wait in JOB ends within 120 s
    assert result.status in ("ok", "failed"), result.error
    return result


def caught(result: ddplab.RunResult, fault: str) -> dict[int, dict]:
    found = {}
    for event in result.events_of("metric"):
        if event["name"] == fault:
            assert event["value"] is not None, f"rank {event['rank']}: no {fault} happened"
            found[event["rank"]] = event["value"]
    return found


@pytest.mark.parametrize("words", torch_words.ALL, ids=lambda w: w.name)
def test_every_pattern_matches_the_lines_it_was_written_from(words):
    assert words.seen and words.fault
    for releases, line in words.seen:
        assert releases and words.search(line), (words.name, releases, line)


def test_patterns_do_not_recognise_each_others_faults():
    """A lost peer is not a timeout, a timeout is not nccl: each pattern says one thing."""
    for words in (torch_words.PEER_LOST, torch_words.COLLECTIVE_TIMEOUT,
                  torch_words.NCCL_WITHOUT_GPU, torch_words.DETAIL_MISMATCH):
        for other in torch_words.ALL:
            if other is not words:
                assert not any(words.search(line) for _, line in other.seen), \
                    (words.name, other.name)


def test_a_rank_ended_by_sigterm_after_its_own_error_is_the_root_cause_not_the_peer_it_lost():
    """Rank 0's collective timed out; rank 1 lost it and exited first; the agent then ended rank
    0 by SIGTERM while it was still on its way out (a torchrun subprocess under load)."""
    timed_out = torch_words.COLLECTIVE_TIMEOUT.seen[-1][1]
    lost = torch_words.PEER_LOST.seen[0][1]
    ended = causes.RankFailure(rank=0, exitcode=-15, signal="SIGTERM", message=timed_out)
    peer = causes.RankFailure(rank=1, exitcode=1, message=lost)
    exits = {1: (1, 100.0), 0: (-15, 100.5)}
    assert causes.root_cause([peer, ended], exits) is ended
    # a SIGTERM with no error of its own is still only the agent ending a healthy rank
    quiet = causes.RankFailure(rank=0, exitcode=-15, signal="SIGTERM")
    failed = causes.RankFailure(rank=1, exitcode=1, message="ValueError: the script's own")
    assert causes.root_cause([quiet, failed], exits) is failed
    # nor does the launching process's report (torchrun's) become the words of a rank it ended
    found = causes.failures_of({0: -15, 1: 1}, {1: ["ValueError: rank 1 crashed"]},
                    ["SomeError: the launching process's report of rank 1"])
    assert causes.root_cause(found, {1: (1, 100.0)}).rank == 1  # (rank 0 said no exit)


def test_a_killed_rank_torch_did_not_report_is_the_root_cause_not_the_peer_that_lost_it():
    """Rank 1 is SIGKILLed; rank 0 loses it and exits. Under load the agent looks only after
    both ended, and torch reports the first one it finds, rank 0: rank 1's exit is unknown."""
    from ddplab.launcher.jobs import Job
    from ddplab.launcher.results import job_outcome

    lost = torch_words.PEER_LOST.seen[0][1]

    def outcome(world_size, said_exit, logs):
        job = Job(world_size=world_size, engine="torchrun", pgid=0, sources={},
                  pids={rank: 100 + rank for rank in range(world_size)},
                  report={"status": "failed", "exits": {"0": (1, 10.0)}}, said_exit=said_exit)
        return job_outcome(job, {"logs": logs, "stderr": {}, "events": {}}, "done", 1.0, "", [],
                           {})

    failed = outcome(2, {0: (1, 9.5)}, {0: ["step 24", lost], 1: ["step 24"]})
    assert failed.exit_codes == {0: 1, 1: None}  # (unknown: nothing claimed)
    assert failed.root_cause.rank == 1 and failed.root_cause.when == causes.SILENT
    assert failed.error.startswith("rank 1 ended with its exit unreported")
    # two ranks said nothing (one killed, one ended by the agent): which one is not known
    unsure = outcome(3, {0: (1, 9.5)}, {0: [lost]})
    assert unsure.root_cause.rank == 0 and unsure.exit_codes == {0: 1, 1: None, 2: None}
    # a peer that failed of its own is the root cause, whoever said nothing
    own = outcome(2, {0: (1, 9.5)}, {0: ["ValueError: rank 0's own"]})
    assert own.root_cause.rank == 0 and own.root_cause.message == "ValueError: rank 0's own"


def test_a_rank_a_signal_killed_is_named_with_it_though_torch_reported_only_a_peer():
    """Rank 1 aborts (SIGABRT, inside gloo say) and rank 0 loses it; torch reports rank 0 only.
    Rank 1's faulthandler report on its stderr says which signal: its exit code, the root cause
    (notebook 10 asserts SIGABRT)."""
    from ddplab.launcher.jobs import Job
    from ddplab.launcher.results import job_outcome

    lost = torch_words.PEER_LOST.seen[0][1]
    dump = ["Fatal Python error: Aborted", "", "Current thread 0x00007f00 (most recent call first):",
            '  File "/work/desync.py", line 40 in main']
    for world_size in (2, 3):  # (with 3, two ranks said nothing: one of them said how it died)
        job = Job(world_size=world_size, engine="torchrun", pgid=0, sources={},
                  pids={rank: 100 + rank for rank in range(world_size)},
                  report={"status": "failed", "exits": {"0": (1, 10.0)}}, said_exit={0: (1, 9.5)})
        read = {"logs": {0: [lost], 1: ["step 3", *dump]}, "stderr": {1: dump}, "events": {}}
        failed = job_outcome(job, read, "done", 1.0, "", [], {})
        assert failed.exit_codes[1] == -6 and failed.exit_codes.get(2) is None
        assert failed.root_cause.rank == 1 and failed.root_cause.signal == "SIGABRT", failed.error
    # a peer's error of its own, reported with its time, came first: the abort may be later
    read = {"logs": {0: ["ValueError: rank 0's own"], 1: dump}, "stderr": {1: dump}, "events": {}}
    failed = job_outcome(job, read, "done", 1.0, "", [], {})
    assert failed.root_cause.rank == 0 and failed.exit_codes[1] == -6, failed.error
    assert causes.fatal_signal(["Fatal Python error: Segmentation fault", "..."]) == -11
    assert causes.fatal_signal(["RuntimeError: Fatal Python error: Aborted"]) is None


def test_fingerprints_read_every_field_and_the_barrier_form():
    first, barrier = (line for _, line in torch_words.DETAIL_MISMATCH.seen)
    assert torch_words.fingerprints(first) == {
        0: {"op": "BROADCAST", "shape": "[1]", "dtype": "Float"},
        1: {"op": "ALLREDUCE", "shape": "[2]", "dtype": "Double"}}
    assert torch_words.fingerprints(barrier) == {1: {"op": "BARRIER"}, 0: {"op": "GATHER"}}
    assert postmortem.fingerprints(first) == {0: "BROADCAST [1] Float", 1: "ALLREDUCE [2] Double"}
    assert torch_words.fingerprints("RuntimeError: something else") == {}


def test_nccl_without_a_gpu_is_recognised_on_this_torch():
    if ddenv.gpu_count():
        pytest.skip("this machine has a GPU: nccl works here")
    code = ("import torch.distributed as dist\n"
            "dist.init_process_group('nccl', store=dist.HashStore(), rank=0, world_size=1)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode != 0, "nccl started without a GPU"
    assert torch_words.NCCL_WITHOUT_GPU.search(done.stderr), done.stderr[-2000:]
    assert causes.hint_for(done.stderr, "torchrun") == causes.hint_for(
        done.stderr, "spawn") != ""


# One process each: what the launcher's hints and the lesson-03/07 demos meet.
SMALL_FAULTS = {
    "torchrun's variables missing": (torch_words.TORCHRUN_VARIABLES_MISSING, {
        "RANK": None, "WORLD_SIZE": None, "LOCAL_RANK": None, "MASTER_ADDR": None,
        "MASTER_PORT": None},
        "import torch.distributed as dist\ndist.init_process_group('gloo')\n"),
    "function from __main__": (torch_words.UNPICKLABLE_MAIN, {},
                               "import pickle\npickle.loads(b'c__main__\\nhello\\n.')\n"),
    "unrecognized arguments": (torch_words.UNRECOGNIZED_ARGUMENTS, {},
                               "import argparse\n"
                               "argparse.ArgumentParser().parse_args(['--local-rank=1'])\n"),
}


@pytest.mark.parametrize("fault", sorted(SMALL_FAULTS))
def test_one_process_faults_are_recognised_on_this_python_and_torch(fault):
    words, unset, code = SMALL_FAULTS[fault]
    env = {k: v for k, v in os.environ.items() if k not in unset}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode != 0, done.stdout
    assert words.search(done.stderr), done.stderr[-2000:]


@pytest.mark.slow
def test_ddp_timeout_and_lost_peer_are_recognised_on_this_torch(tmp_path):
    result = run_job(tmp_path, "faults", "INFO")
    unused = caught(result, "unused")
    assert {e["type"] for e in unused.values()} == {"RuntimeError"}
    lines = [e["text"] for e in unused.values()] + [*result.logs.get(0, []),
                                                    *result.logs.get(1, [])]
    assert torch_words.unused_parameters(lines) == {0: {"aux.weight", "aux.bias"},
                                                    1: {"aux.weight", "aux.bias"}}
    for rank in (0, 1):
        assert torch_words.FIND_UNUSED_COST.lines(result.logs[rank]), result.log(rank)[-2000:]

    timeout = caught(result, "timeout")[0]
    assert torch_words.COLLECTIVE_TIMEOUT.search(timeout["text"]), timeout
    assert not torch_words.PEER_LOST.search(timeout["text"])
    peer = caught(result, "peer_lost")[0]
    assert torch_words.PEER_LOST.search(peer["text"]), peer
    assert not torch_words.COLLECTIVE_TIMEOUT.search(peer["text"])


@pytest.mark.slow
def test_detail_mismatch_and_its_fingerprints_are_recognised_on_this_torch(tmp_path):
    result = run_job(tmp_path, "detail", "DETAIL")
    mismatch = caught(result, "mismatch")
    assert sorted(mismatch) == [0, 1]
    for rank, seen in mismatch.items():
        assert torch_words.DETAIL_MISMATCH.search(seen["text"]), seen
        assert torch_words.fingerprints(seen["text"]) == {
            0: {"op": "BROADCAST", "shape": "[1]", "dtype": "Float"},
            1: {"op": "ALLREDUCE", "shape": "[2]", "dtype": "Double"}}, (rank, seen)
