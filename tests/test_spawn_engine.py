"""engine="spawn": real mp.spawn scripts run unchanged, and the result says only what is known.

Includes unedited scripts from pytorch/examples (tests/scripts/pytorch_examples, BSD-3-Clause).
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from pathlib import Path

import pytest
from test_launch import end_once_said

from ddplab import env as ddenv
from ddplab import launch, torch_words
from ddplab.failures import EXIT_ABORT, hint_for
from ddplab.workers import spawn_ddp

SCRIPTS = Path(__file__).parent / "scripts"
PLAIN_SPAWN = str(SCRIPTS / "spawn_plain.py")
EXAMPLES = SCRIPTS / "pytorch_examples"


def spawn(target, nprocs=2, **kwargs):
    return launch(str(target), nprocs, engine="spawn", quiet=True, live=False, timeout=300,
                  **kwargs)


def gone(pids, seconds: float = 60.0) -> bool:
    """True once none of ``pids`` runs any more (zombies count as gone).

    The launcher has ended them already; ``seconds`` is a safety net for a loaded machine.
    """
    def running(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    end = time.monotonic() + seconds
    while time.monotonic() < end and any(running(p) for p in pids):
        time.sleep(0.05)
    return not any(running(p) for p in pids)


def test_a_plain_script_gets_no_arguments_and_the_count_in_the_environment():
    # (it runs a program of its own before mp.spawn, which is not taken for a rank: see below)
    result = spawn(PLAIN_SPAWN, 3, env={"SPAWN_PLAIN_RUNS_A_PROGRAM": "1"})
    assert result.ok, result.error
    lines = result.logs["launcher"]
    assert lines[0] == "argv []"                       # nothing added to its command line
    host, port = lines[1].split()[1].split(":")
    assert host == "127.0.0.1" and 0 < int(port) < 65536
    # DDPLAB_NPROCS=3 was offered. (The ranks share one pipe and, unbuffered as the launcher
    # runs them, print a line's text and its newline in two writes: lines may interleave.)
    assert "".join(lines[2:]).count("a rank's sum: 6") == 3
    # Its ranks share the parent's stdout and print plain lines: no per-rank log is invented,
    # but the launcher saw the three processes mp.spawn started (and not the program the
    # script ran first), and mp.spawn returned.
    assert [key for key in result.logs if key != "launcher"] == []
    assert result.world_size == 3 and sorted(result.pids) == [0, 1, 2]
    assert result.exit_codes == {0: 0, 1: 0, 2: 0}
    assert gone(result.pids.values())


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_ranks_started_by_fork_or_a_forkserver_are_seen_and_a_program_is_not(start):
    """``mp.start_processes(start_method="fork")``: the ranks run the script's own command line
    (no ``spawn_main``); with ``"forkserver"`` they are the forkserver's children. (The ranks
    are seen by looking at /proc every 0.2 s: they sleep 0.5 s, as a rank that trains would
    run for a while; a fork-started rank gone within one look may go unseen.)"""
    result = spawn(PLAIN_SPAWN, 2, args=["--sleep", "0.5"],
                   env={"SPAWN_PLAIN_RUNS_A_PROGRAM": "1", "SPAWN_PLAIN_START": start})
    assert result.ok, result.error
    assert "".join(result.logs["launcher"]).count("a rank's sum: 3") == 2
    assert result.world_size == 2 and sorted(result.pids) == [0, 1]
    assert result.exit_codes == {0: 0, 1: 0}
    assert gone(result.pids.values())


def test_a_failed_rank_is_named_and_unknown_exit_codes_stay_none():
    result = spawn(PLAIN_SPAWN, args=["--fail-rank", "1"])
    assert result.status == "failed" and result.root_cause.rank == 1
    assert result.exit_codes == {0: None, 1: 3}  # rank 0 was ended by mp.spawn: unknown code
    assert "rank 1 exited with code 3" in result.error
    assert gone(result.pids.values())


def test_the_launching_process_failing_before_any_rank_is_said_so():
    result = spawn(PLAIN_SPAWN, args=["--no-such-option"])
    assert result.status == "failed" and result.root_cause.rank is None
    assert result.exit_codes == {} and result.world_size == 0
    assert result.error.startswith(
        "the launching process exited with code 2 before starting any rank: ")
    assert "--no-such-option" in result.root_cause.message  # its last words on stderr, the cause
    assert "rank 0" not in result.error


def test_a_torchrun_style_script_given_to_spawn_gets_a_hint():
    result = spawn(SCRIPTS / "plain.py")
    assert result.status == "failed" and result.root_cause.rank is None
    assert "hint: this is a torchrun-style script" in result.error
    assert "engine='torchrun'" in result.root_cause.hint


NCCL_HINT = hint_for(torch_words.NCCL_WITHOUT_GPU.seen[0][1], "torchrun")


@pytest.mark.parametrize("line", [line for _, line in torch_words.NCCL_WITHOUT_GPU.seen])
def test_nccl_without_a_gpu_gets_the_same_hint_on_every_known_wording(line):
    assert "no usable GPU" in NCCL_HINT
    for engine in ("spawn", "torchrun"):
        assert hint_for(line, engine) == NCCL_HINT
    for _, lost in torch_words.PEER_LOST.seen:  # a lost peer is not a missing GPU
        assert hint_for(lost, "torchrun") == ""


def test_nccl_without_gpus_gets_a_hint():
    """The real fault (one rank: each rank meets it alone, in its own init_process_group)."""
    if ddenv.gpu_count():
        pytest.skip("this machine has GPUs: nccl works here")
    result = spawn(PLAIN_SPAWN, 1, args=["--backend", "nccl"])
    assert result.status == "failed" and result.root_cause.rank == 0
    assert f"rank {result.root_cause.rank}" in result.error
    assert result.root_cause.hint == NCCL_HINT and "gloo" in result.root_cause.hint
    assert result.root_cause.hint in result.error


def test_pytorch_examples_multigpu_runs_unchanged_and_says_why_nothing_ran():
    """The tutorial's script takes `3 1` (its own argparse), counts GPUs, and uses nccl."""
    script = EXAMPLES / "ddp_tutorial_series" / "multigpu.py"
    result = spawn(script, args=["3", "1"], cwd=script.parent)
    if ddenv.gpu_count():
        assert result.ok, result.error
    else:
        no_gpu_run_says_why_nothing_ran(result)


def no_gpu_run_says_why_nothing_ran(result):
    # Without GPUs, world_size = torch.cuda.device_count() is 0: mp.spawn starts nothing and
    # the script exits 0 (its own argparse took `3 1`: a refusal would exit 2). Not a success
    # for a launch that asked for 2 processes.
    assert result.status == "failed" and result.root_cause.exitcode == 0
    assert result.error.startswith("the launching process exited with code 0 without starting "
                                   "any rank")
    assert "torch.cuda.device_count()" in result.root_cause.hint
    assert result.world_size == 0 and result.exit_codes == {}


@pytest.mark.slow
def test_pytorch_examples_rpc_rnn_runs_unchanged_on_cpu():
    """Two ranks of an unedited pytorch/examples script that runs on CPU (RPC over gloo)."""
    script = EXAMPLES / "rpc_rnn" / "main.py"
    result = spawn(script, cwd=script.parent)
    assert result.ok, result.error
    assert "Training epoch 9" in result.logs["launcher"]
    assert result.world_size == 2 and result.exit_codes == {0: 0, 1: 0}
    assert gone(result.pids.values())


def test_ddplab_spawn_worker_reads_the_offered_count_and_nprocs_overrides_it(monkeypatch):
    monkeypatch.setenv("DDPLAB_NPROCS", "3")
    assert spawn_ddp.parse_args([]).nprocs == 3
    assert spawn_ddp.parse_args(["--nprocs", "1"]).nprocs == 1
    monkeypatch.delenv("DDPLAB_NPROCS")
    assert spawn_ddp.parse_args([]).nprocs == 2


def test_spawn_engine_takes_no_torchrun_only_options():
    from ddplab import LaunchError

    with pytest.raises(LaunchError, match="local_rank_arg needs engine='torchrun'"):
        launch(PLAIN_SPAWN, 2, engine="spawn", local_rank_arg=True)


def test_a_rank_aborting_while_exiting_is_said_so():
    result = spawn(PLAIN_SPAWN, args=["--abort-at-exit", "1"])
    assert result.status == "failed" and result.exit_codes == {0: None, 1: -6}
    assert result.root_cause.rank == 1 and result.root_cause.at_exit
    assert result.error.startswith(f"rank 1 was killed by SIGABRT while exiting: {EXIT_ABORT}")


def test_a_timeout_ends_the_script_and_every_rank_it_started():
    """Each rank of ``spawn_hang.py`` emits ``hang`` just before it hangs: the events of ranks
    that share the script's stdout reach ``on_event``, which ends the job as a timeout once
    both said so, with each rank's stack (the clock that does the same without on_event is
    one for every engine: test_launch's timeout test)."""
    result = spawn(SCRIPTS / "spawn_hang.py", on_event=end_once_said(("hang", 0), ("hang", 1)))
    assert result.status == "timeout" and not result.ok, (result.error, result.logs)
    assert "as on_event asked" in result.error and result.still_running == [0, 1]
    assert sorted(result.pids) == [0, 1]  # the ranks it saw mp.spawn start, by rank
    assert result.exit_codes == {0: None, 1: None}
    assert 'spawn_hang.py", line 20' in result.stacks[0], result.stacks  # time.sleep(600)
    assert 'spawn_hang.py", line 21' in result.stacks[1], result.stacks  # dist.barrier()
    assert gone(result.pids.values())


def test_where_processes_cannot_be_watched_nothing_is_claimed_about_ranks(monkeypatch):
    from ddplab.launcher.jobs import Job
    from ddplab.launcher.results import job_outcome

    def outcome(code):
        job = Job(world_size=2, engine="spawn", pgid=0, sources={},
                  popen=SimpleNamespace(returncode=code))
        monkeypatch.setattr(job, "spawned_ranks", lambda: None)  # no /proc (not Linux)
        read = {"logs": {"launcher": ["hi"]}, "stderr": {"launcher": ["boom"]}, "events": {}}
        return job_outcome(job, read, "done", 1.0, 60.0, [], {})

    assert outcome(0).ok and outcome(0).exit_codes == {} and outcome(0).world_size == 2
    failed = outcome(2)
    assert failed.status == "failed" and failed.root_cause.rank is None
    assert failed.error == "the launching process exited with code 2: boom"


SCRIPT = "python spawn_plain.py"  # (the command line of pid 10, the script, below)


def watched(monkeypatch, looks, now=100_000):
    """A spawn-engine job whose script is pid 10 after ``looks`` at /proc, each one
    pid -> (ppid, start time, command line); times are clock ticks (100 a second), ``now``
    the clock at every look."""
    from ddplab.launcher import jobs

    seen: dict = {}
    monkeypatch.setattr(jobs, "process_table",
                        lambda pgid: {pid: (ppid, start) for pid, (ppid, start, _) in seen.items()})
    monkeypatch.setattr(jobs, "cmdline", lambda pid: SCRIPT if pid == 10 else seen[pid][2])
    monkeypatch.setattr(jobs, "age", lambda start: (now - start) / 100)
    job = jobs.Job(world_size=2, engine="spawn", pgid=10, sources={},
                   popen=SimpleNamespace(pid=10, returncode=None))
    for look in looks:
        seen.clear()
        seen.update(look)
        job.watch_spawned(every=0.0)
    return job


def test_a_rank_seen_mid_exec_is_looked_at_again_not_taken_for_a_program(monkeypatch):
    """While a child execs, /proc shows its command line empty for a moment (a loaded machine
    catches that moment): it is a rank if it then runs ``spawn_main``."""
    job = watched(monkeypatch, [{11: (10, 5, "sleep 0.6"), 12: (10, 6, "")},
                                {11: (10, 5, "sleep 0.6"), 12: (10, 6, "python -c spawn_main()")}])
    assert job.spawned == {12: 6}  # (11 ran a program: no rank)


def test_a_fork_seen_once_as_the_script_is_a_rank_unless_it_then_runs_a_program(monkeypatch):
    """``start_method="fork"``: a rank runs the script's command line, and so, for a moment, does
    a child that forks and then runs a program. A fork seen as the script counts as a rank
    (a short rank may be seen only once before it ends) until it is seen running another."""
    job = watched(monkeypatch, [{11: (10, 16, SCRIPT), 12: (10, 17, SCRIPT)},
                                {12: (10, 17, "sleep 0.6")}, {}])
    assert job.spawned_ranks() == {0: 11}  # (11 ended after one look; 12 ran a program)


def test_a_young_copy_of_the_script_or_its_forkserver_is_no_rank(monkeypatch):
    """A child that is about to run a program (``import torch`` runs ``ldconfig -p``; the
    forkserver starts so) shows the script's command line for a moment. Seen so while younger
    than 0.1 s and gone by the next look, it is no rank; nor is one seen so, older, that then
    runs the forkserver, whose children are the ranks."""
    now, server = 100_000, "python -c from multiprocessing.forkserver import main; main(...)"
    job = watched(monkeypatch, [{11: (10, now, SCRIPT), 12: (10, now - 50, SCRIPT)},
                                {12: (10, now - 50, server), 13: (12, now, server)}, {}], now)
    assert job.spawned_ranks() == {0: 13}
