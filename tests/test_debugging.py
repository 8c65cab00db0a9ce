"""Lesson 10 on real gloo processes: every fault fails the way the notebook says, every fix
works, the exercise's skeleton is judged wrong with a useful hint and its solution right; and
the ``postmortem`` helpers on text they will meet."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_exercises_hints import answer_named
from test_launch import end_once_said

import ddplab
from ddplab import torch_words
from ddplab.lab import judges, postmortem
from ddplab.lab.judges import metric, metrics
from ddplab.launcher.results import RunResult

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = ROOT / "tests" / "solutions"
DESYNC, FAULTS = "ddplab.workers.desync", "ddplab.workers.faults"
# A short process-group timeout only where the fault is a collective that waits for a peer that
# never comes (the timeout is how it ends). A run that must succeed, or fails without waiting,
# keeps the workers' default (300 s): on a loaded machine a rank may reach a collective
# seconds after the other, and a correct run must not fail for it.
PG_TIMEOUT = ["--pg-timeout", "3"]
DETAIL = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}


def run(target, *args, env=None, **options) -> RunResult:
    return ddplab.launch(target, 2, args=[*args], backend="gloo", env=env, quiet=True,
                         timeout=options.pop("timeout", 120), **options)


def mismatch_report(result: RunResult, rank: int) -> dict[int, str]:
    lines = postmortem.mismatch_lines(result, rank)
    assert lines, f"rank {rank} reported no mismatch:\n{result.log(rank)[-2000:]}"
    return postmortem.fingerprints(lines[0])


# ------------------------------------------------------------------ postmortem, no processes

PYTHON_TRACEBACK = [
    "Traceback (most recent call last):",
    '  File "/srv/job/train.py", line 40, in <module>',
    "    main()",
    '  File "/srv/job/train.py", line 31, in main',
    "    dist.all_reduce(total)",
    '  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", '
    'line 3913, in all_reduce',
    "    work.wait()",
    "RuntimeError: the error of this stack",
]
FAULTHANDLER_DUMP = [
    "Fatal Python error: Aborted",
    "",
    "Thread 0x00007f22cddedb80 (most recent call first):",
    '  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", '
    'line 5055 in all_gather',
    '  File "/srv/job/eval.py", line 105 in main',
    '  File "/srv/job/eval.py", line 148 in <module>',
    '  File "<frozen runpy>", line 88 in _run_code',
]


def test_user_frames_skip_library_code_and_read_both_kinds_of_stack():
    frames = postmortem.user_frames(PYTHON_TRACEBACK)
    assert [(f.path, f.line, f.function) for f in frames] == [
        ("/srv/job/train.py", 40, "<module>"), ("/srv/job/train.py", 31, "main")]
    dumped = postmortem.user_frames(FAULTHANDLER_DUMP)  # printed innermost first
    assert [(f.line, f.function) for f in dumped] == [(148, "<module>"), (105, "main")]


def test_short_stack_keeps_the_user_frames_and_the_exception_and_cuts_long_lines():
    short = postmortem.short_stack("\n".join([*PYTHON_TRACEBACK, "  the message's second line"]))
    lines = short.splitlines()
    assert "(1 frame of torch and Python left out)" in lines[0] and "site-packages" not in short
    assert [line.split(" in ")[0] for line in lines[1:3]] == ["  train.py:40", "  train.py:31"]
    assert lines[3:] == ["RuntimeError: the error of this stack", "  the message's second line"]
    dumped = postmortem.short_stack("\n".join(FAULTHANDLER_DUMP)).splitlines()  # innermost first
    assert "(2 frames of" in dumped[0] and dumped[-1].startswith("  eval.py:105 in main")
    cut = postmortem.short_stack("\n".join([*PYTHON_TRACEBACK, "x" * 200]), width=50)
    assert max(map(len, cut.splitlines())) <= 50 and cut.endswith(" ...")


def test_stopped_at_reads_the_last_stack_of_a_rank_and_its_code(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("\n" * 30 + "    dist.all_reduce(total)  # the line\n")
    lines = [line.replace("/srv/job/train.py", str(script)) for line in PYTHON_TRACEBACK]
    result = RunResult("failed", 1, 0.0, 2, logs={0: ["hello", *lines], 1: []})
    frame = postmortem.stopped_at(result, 0, "job.py")
    assert (frame.line, frame.function) == (31, "main")
    assert frame.code == "dist.all_reduce(total)  # the line"
    assert str(frame).startswith("job.py:31 in main: dist.all_reduce")
    assert postmortem.stopped_at(result, 1) is None
    assert postmortem.stopped_at(result, 0, "other.py") is None
    # an abort while exiting, after the traceback: its dump shows only the exit's frames
    exit_dump = ["terminate called without an active exception", "Fatal Python error: Aborted",
                 "Thread 0x00007f00 (most recent call first):",
                 '  File "/usr/lib/python3.11/threading.py", line 1590 in _shutdown']
    result.logs[0] += exit_dump
    assert postmortem.stopped_at(result, 0, "job.py").line == 31
    assert postmortem.stopped_at(result, 0).line == 31


def test_fingerprints_name_each_ranks_collective():
    """On the DETAIL reports ddplab.torch_words was written from (the wording is read there)."""
    first, barrier = (line for _, line in torch_words.DETAIL_MISMATCH.seen)
    assert postmortem.fingerprints(first) == {0: "BROADCAST [1] Float",
                                              1: "ALLREDUCE [2] Double"}
    assert postmortem.fingerprints(barrier) == {1: "BARRIER", 0: "GATHER"}
    assert postmortem.fingerprints("RuntimeError: a different error") == {}


def test_survivors_sees_running_processes_only():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert postmortem.survivors([sleeper.pid]) == [sleeper.pid]
    finally:
        sleeper.kill()
        sleeper.wait()
    assert postmortem.survivors([sleeper.pid]) == []
    assert postmortem.survivors([]) == []


def test_uneven_hang_waits_until_a_finished_rank_leaves_another_in_an_extra_backward():
    def said(rank, name, value):
        return {"kind": "metric", "rank": rank, "name": name, "value": value}

    watch = postmortem.uneven_hang(2, grace=2.5)
    steps = [said(0, "backward", 1), said(1, "backward", 1), said(0, "backward", 2),
             said(1, "backward", 2), said(1, "steps", 2)]
    assert [watch(event) for event in steps] == [None] * 5   # rank 1 done, rank 0 not behind it
    assert watch(said(1, "checksum", 0.5)) is None           # finished, but nobody is past it
    assert watch({"kind": "exit", "rank": 1, "name": "backward", "value": 9}) is None  # not a metric
    assert watch(said(0, "backward", 3)) == 2.5              # an all-reduce nobody will join
    even = postmortem.uneven_hang(2)
    for event in (said(0, "backward", 1), said(1, "backward", 1), said(0, "steps", 1),
                  said(0, "checksum", 0.5), said(1, "steps", 1)):
        assert even(event) is None                            # equal shares: no hang


def _record(*entries):
    """One rank's Flight Recorder JSON, in the form torch 2.14.1 gives on gloo."""
    return {"entries": [{"collective_seq_id": seq, "profiling_name": f"gloo:{op}", "retired": done,
                         "is_p2p": False, "process_group": ["0", "default_pg"], "record_id": i,
                         "input_sizes": [[3]], "state": "scheduled"}
                        for i, (op, seq, done) in enumerate(entries)]}


def test_collective_waits_read_the_recorded_hang_of_the_one_rank_fault():
    """On the debug server's page recorded while desync's one_rank fault hung (torch 2.14.1)."""
    page = postmortem.recording("flight_recorder_one_rank")["page"]
    records = postmortem.debug_server_records(page)
    waits = postmortem.collective_waits(records)
    assert sorted(records) == [0, 1]
    assert {rank: (w.op, w.seq, w.shapes) for rank, w in waits.items()} == {
        0: ("all_reduce", 1, ((2,),)), 1: ("all_gather", 1, ((1,),))}
    lines = postmortem.describe_waits(waits)
    assert lines[:2] == ["rank 0 waits in all_reduce #1", "rank 1 waits in all_gather #1"]
    assert "out of step" in lines[2]


def test_collective_waits_skip_finished_collectives_and_name_who_is_behind():
    records = {0: _record(("all_reduce", 1, True), ("all_reduce", 2, True), ("barrier", 3, False)),
               1: _record(("all_reduce", 1, True), ("all_reduce", 2, False))}
    waits = postmortem.collective_waits(records)
    assert (str(waits[0]), str(waits[1])) == ("barrier #3", "all_reduce #2")
    assert "[1] are behind" in postmortem.describe_waits(waits)[-1]
    idle = postmortem.collective_waits({0: _record(("all_reduce", 4, False)),
                                        1: _record(("all_reduce", 3, True))})
    lines = postmortem.describe_waits(idle)
    assert idle[1] is None and lines[:2] == ["rank 0 waits in all_reduce #4", "rank 1 waits in no collective"]
    assert "[1] are not in a collective" in lines[2]
    same = postmortem.collective_waits({r: _record(("all_reduce", 5, False)) for r in (0, 1)})
    assert "every rank is in all_reduce #5" in postmortem.describe_waits(same)[-1]
    done = postmortem.collective_waits({r: _record(("all_reduce", 5, True)) for r in (0, 1)})
    assert postmortem.describe_waits(done) == ["rank 0 waits in no collective",
                                               "rank 1 waits in no collective"]


def test_flight_recorder_readers_refuse_what_is_not_a_record_with_a_way_out():
    with pytest.raises(ValueError, match="/fr_trace_json"):
        postmortem.debug_server_records("<html>Error code: 500</html>")
    with pytest.raises(ValueError, match="entries"):
        postmortem.collective_waits({0: {"version": "2.10"}})
    with pytest.raises(FileNotFoundError, match="flight_recorder_one_rank"):
        postmortem.recording("no_such_recording")


# ------------------------------------------------------------------ collectives out of step



@pytest.mark.slow
def test_desync_reference_passes_the_detail_checks():
    result = run(DESYNC, env=DETAIL)
    assert result.ok, result.error
    shards = metric(result, "shard")
    assert shards == {0: 51, 1: 50}
    assert set(metric(result, "debug_level").values()) == {"DETAIL"}
    assert all(g == [51, 50] for g in metric(result, "gathered").values())
    assert len(set(metric(result, "accuracy").values())) == 1


@pytest.mark.slow
def test_one_rank_collective_hangs_until_the_launcher_ends_it_and_nothing_survives():
    # Each rank emits ``shard`` just before the collective it waits in: the job is ended as a
    # timeout once both have, not by a clock (a cold launch's ranks start seconds later).
    result = run(DESYNC, "--fault", "one_rank", timeout=300,
                 on_event=end_once_said(("shard", 0), ("shard", 1)))
    assert result.status == "timeout" and result.root_cause is None
    assert len(result.pids) == 2
    assert postmortem.survivors(result.pids.values()) == []


@pytest.mark.slow
def test_one_rank_collective_with_a_pg_timeout_names_where_each_rank_waited():
    result = run(DESYNC, "--fault", "one_rank", *PG_TIMEOUT)
    assert result.status == "failed" and postmortem.timed_out(result.root_cause), result.error
    assert "all_reduce(total)" in postmortem.stopped_at(result, 0, "desync.py").code
    assert "all_gather" in postmortem.stopped_at(result, 1, "desync.py").code
    assert postmortem.survivors(result.pids.values()) == []


@pytest.mark.slow
def test_one_rank_collective_under_detail_fails_at_once_naming_both_collectives():
    result = run(DESYNC, "--fault", "one_rank", env=DETAIL)
    assert not result.ok
    # the rank that failed first names both; its peer may be ended before it says anything
    seen = mismatch_report(result, result.root_cause.rank)
    assert seen[0].startswith("ALLREDUCE") and seen[1].startswith("ALLGATHER")


@pytest.mark.slow
def test_shape_mismatch_fails_inside_the_all_gather_and_detail_names_the_shapes():
    # How gloo fails (an abort on torch 2.6-2.14, perhaps an exception later) is torch's
    # business; ddplab's is to name the rank and the line, from a traceback or a stack dump.
    plain = run(DESYNC, "--fault", "shape")
    assert plain.status == "failed" and plain.root_cause.rank in (0, 1), plain.error
    assert "all_gather(gathered" in postmortem.stopped_at(plain, plain.root_cause.rank,
                                                          "desync.py").code
    detail = run(DESYNC, "--fault", "shape", env=DETAIL)
    assert not detail.ok
    assert mismatch_report(detail, detail.root_cause.rank) == {0: "ALLGATHER [51] Long",
                                                               1: "ALLGATHER [50] Long"}


@pytest.mark.slow
def test_order_mismatch_times_out_plain_and_detail_names_both_orders():
    plain = run(DESYNC, "--fault", "order", *PG_TIMEOUT)
    assert plain.status == "failed" and postmortem.timed_out(plain.root_cause), plain.error
    detail = run(DESYNC, "--fault", "order", env=DETAIL)
    seen = mismatch_report(detail, detail.root_cause.rank)
    assert seen[0].startswith("BROADCAST") and seen[1].startswith("ALLREDUCE")


# ------------------------------------------------------------------ DDP training faults

@pytest.mark.slow
def test_uneven_inputs_hang_in_the_extra_backward():
    # The hang is the fault: no process-group timeout (two equal ones race, and the rank that
    # loses is stopped before it can say where it was); the launch ends the job as a timeout
    # and every rank's stack says where it waited. Rank 1 emits ``steps`` when its loop is
    # done, as rank 0 starts its extra step: ``on_event`` ends the job a few seconds later
    # instead of a clock (the launch's timeout is a safety net); the events checked first
    # prove the ranks got there.
    result = run(FAULTS, "--fault", "uneven", timeout=300,
                 on_event=end_once_said(("steps", 1), after=3.0))
    assert result.status == "timeout" and sorted(result.still_running) == [0, 1], result.error
    assert metric(result, "batches") == {0: 3, 1: 2}
    assert metric(result, "steps") == {1: 2}  # rank 0 never finished its loop
    waited = {rank: [f for f in postmortem.user_frames(result.stacks[rank].splitlines())
                     if f.path.endswith("faults.py")][-1] for rank in (0, 1)}
    assert "backward()" in waited[0].code, waited
    assert "barrier()" in waited[1].code, waited
    assert postmortem.survivors(result.pids.values()) == []


@pytest.mark.slow
def test_join_lets_uneven_ranks_finish_with_the_same_weights():
    result = run(FAULTS, "--fault", "uneven", "--join")
    assert result.ok, result.error
    assert metric(result, "steps") == metric(result, "batches") == {0: 3, 1: 2}
    assert metric(result, "samples") == {0: 95, 1: 64}  # three files and two
    assert len(set(metric(result, "checksum").values())) == 1


@pytest.mark.slow
@pytest.mark.parametrize("drop_last, samples", [(False, 80), (True, 79)])
def test_distributed_sampler_gives_every_rank_the_same_number_of_batches(drop_last, samples):
    extra = ["--drop-last"] if drop_last else []
    result = run(FAULTS, "--fault", "uneven", "--sampler", *extra)
    assert result.ok, result.error
    assert metric(result, "batches") == metric(result, "steps") == {0: 3, 1: 3}
    assert metric(result, "samples") == {0: samples, 1: samples}  # 159 padded or trimmed


@pytest.mark.slow
def test_unused_parameters_fail_at_the_next_step_and_info_names_them():
    result = run(FAULTS, "--fault", "unused", env={"TORCH_DISTRIBUTED_DEBUG": "INFO"})
    assert result.status == "failed" and result.root_cause.rank in (0, 1), result.error
    rank = result.root_cause.rank
    assert torch_words.unused_parameters(result.logs[rank]) == {rank: {"aux.weight", "aux.bias"}}
    assert metric(result, "steps") == {}


@pytest.mark.slow
def test_find_unused_and_static_graph_both_fix_the_unused_branch_with_the_same_weights():
    found = run(FAULTS, "--fault", "unused", "--find-unused")
    static = run(FAULTS, "--fault", "unused", "--static-graph")
    assert found.ok and static.ok, (found.error, static.error)
    sums = {*metric(found, "checksum").values(), *metric(static, "checksum").values()}
    assert len(sums) == 1


@pytest.mark.slow
def test_find_unused_without_unused_parameters_warns_about_its_cost():
    result = run(FAULTS, "--find-unused")
    assert result.ok, result.error
    assert all(torch_words.FIND_UNUSED_COST.lines(result.logs[rank]) for rank in (0, 1))


@pytest.mark.slow
@pytest.mark.skipif(tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
                    <= (2, 6), reason="DDP builds on the DETAIL wrapper on torch 2.6")
def test_faults_refuses_detail_with_a_message_instead_of_a_segfault():
    result = run(FAULTS, env=DETAIL)
    assert not result.ok and result.root_cause.signal is None
    assert "TORCH_DISTRIBUTED_DEBUG=INFO" in result.root_cause.message


@pytest.mark.slow
def test_a_crash_is_pinned_on_its_rank_and_a_restart_resumes_to_the_same_weights(tmp_path):
    crashed = run(FAULTS, "--fault", "crash", "--epochs", "3", "--checkpoint-dir",
                  tmp_path / "crash")
    assert not crashed.ok and crashed.root_cause.rank == 1
    assert "crashed in epoch 2" in crashed.root_cause.message
    assert crashed.exit_codes[0] != 0
    assert (tmp_path / "crash" / "checkpoint.pt").exists()

    restarted = run(FAULTS, "--fault", "crash", "--epochs", "3", "--checkpoint-dir",
                    tmp_path / "restart", max_restarts=1)
    plain = run(FAULTS, "--epochs", "3", "--checkpoint-dir", tmp_path / "plain")
    assert restarted.ok and plain.ok, (restarted.error, plain.error)
    assert metrics(restarted, "restart") == {0: [0, 1], 1: [0, 1]}
    assert metrics(restarted, "start_epoch") == {0: [0, 1], 1: [0, 1]}
    assert metric(restarted, "checksum") == metric(plain, "checksum")


# ------------------------------------------------------------------ the exercise

def test_the_exercise_is_registered_with_its_skeleton_and_solution():
    exercise = judges.load_all()["10"]
    skeleton = judges.skeleton_path("10")
    assert exercise.skeleton == "uneven_join.py" and "# TODO(exercise)" in skeleton.read_text()
    solution = SOLUTIONS / skeleton.name
    assert solution.is_file() and "# TODO(exercise)" not in solution.read_text()


def exercise_with(tmp_path, *edits: tuple[str, str]) -> Path:
    """The skeleton with ``edits`` made, as a learner would hand it in."""
    text = judges.skeleton_path("10").read_text()
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new)
    script = tmp_path / "uneven_join.py"
    script.write_text(text)
    return script


# The skeleton and Join([model]) alone hang: the notebook's 3 s process-group timeout ends
# them, as it does the learner's runs, and the judge reads the line each rank was on.
@pytest.mark.slow
def test_untouched_skeleton_times_out_and_the_hint_names_the_ranks_that_left():
    result = run(judges.skeleton_path("10"), *PG_TIMEOUT)
    assert result.ok, result.error  # the skeleton reports the timeout instead of crashing
    verdict = ddplab.check("10", result)
    assert not verdict and "timed out" in verdict.message
    assert "rank 0 at line" in verdict.message and "`loss.backward()`" in verdict.message
    assert "left the loop" in verdict.message and "shadows only" not in verdict.message
    assert not answer_named("10", verdict.message), verdict.message   # the run, not the code
    section = re.search(r"notebook 10, section (\d+)", verdict.message)[1]   # the one it names
    cells = json.loads((ROOT / "notebooks" / "10_debugging.ipynb").read_text())["cells"]
    assert any(f"\n## {section}. Uneven inputs" in "\n" + "".join(cell["source"])
               for cell in cells if cell["cell_type"] == "markdown")


@pytest.mark.slow
def test_join_around_the_model_alone_still_hangs_in_the_loss_all_reduce(tmp_path):
    loop = judges.skeleton_path("10").read_text().split("    for inputs, targets in batches:")[1]
    loop = loop.split("    return losses")[0]
    joined = exercise_with(tmp_path, (
        "from torch.nn.parallel", "from torch.distributed.algorithms.join import Join\n"
                                  "from torch.nn.parallel"), (
        "    for inputs, targets in batches:" + loop,
        "    with Join([model]):\n        for inputs, targets in batches:"
        + loop.replace("\n        ", "\n            ")))
    verdict = ddplab.check("10", run(joined, *PG_TIMEOUT))
    assert not verdict and "Join([model]) shadows only DDP's collectives" in verdict.message
    assert "`torch_dist.all_reduce(both)`" in verdict.message          # rank 0's line
    assert "`with Join([model]):`" in verdict.message                  # rank 1's


@pytest.mark.slow
def test_solution_is_judged_right():
    result = run(SOLUTIONS / "uneven_join.py")
    assert ddplab.check("10", result), result.error
    losses = metric(result, "losses")
    assert {rank: len(mine) for rank, mine in losses.items()} == metric(result, "batches")
    assert metric(result, "inputs") == {0: [0, 1, 2, 3, 4], 1: [0, 1, 2, 3]}  # each batch once


def fake_run(**per_rank: dict[int, object]) -> RunResult:
    """A finished 2-rank run whose ranks reported the given metrics."""
    events = {rank: [{"kind": "metric", "rank": rank, "name": name, "value": values[rank]}
                     for name, values in per_rank.items() if rank in values] for rank in (0, 1)}
    return RunResult("ok", 0, 1.0, 2, events=events)


def test_judge_rejects_even_shards_skipped_batches_different_weights_and_a_wrong_mean():
    judge = judges.load_all()["10"].judge
    right = dict(batches={0: 3, 1: 2}, losses={0: [1.0, 2.0, 3.0], 1: [4.0, 5.0]},
                 mean_loss={0: 3.0, 1: 3.0}, checksum={0: 1.0, 1: 1.0})
    assert judge(fake_run(**right)) is None
    even = {**right, "batches": {0: 2, 1: 2}, "losses": {0: [1.0, 2.0], 1: [4.0, 5.0]}}
    assert "same number of batches" in judge(fake_run(**even))
    short = {**right, "losses": {0: [1.0, 2.0], 1: [4.0, 5.0]}}
    assert "rank 0 trained on 2 batches but has 3" in judge(fake_run(**short))
    apart = {**right, "checksum": {0: 1.0, 1: 2.0}}
    assert "different weights" in judge(fake_run(**apart))
    own = {**right, "mean_loss": {0: 3.0, 1: 4.5}}   # rank 1's mean of its own batches only
    assert "rank 1: 4.500000" in judge(fake_run(**own)) and "is 3.000000" in judge(fake_run(**own))
    silent = fake_run(batches={0: 3, 1: 2})
    assert "did not report 'losses'" in judge(silent)
    timeout = a_timeout_message()
    hung = fake_run(error={0: {"line": 9, "function": "f", "code": "dist.all_reduce(t)",
                               "message": timeout},
                           1: {"line": 4, "function": "g", "code": "dist.barrier()",
                               "message": timeout}})
    assert "timed out (rank 0 at line 9 (in f: `dist.all_reduce(t)`)" in judge(hung)
    raised = fake_run(error={0: {"line": 7, "function": "train", "code": "model(inputs)",
                                 "message": "RuntimeError: stopped early"}})
    assert "raised on some ranks (rank 0 at line 7" in judge(raised)
    assert "stopped early" in judge(raised) and "timed out" not in judge(raised)


def test_judge_names_a_repeated_batch_where_a_rank_trained_more_steps_than_it_has_batches():
    judge = judges.load_all()["10"].judge
    padded = dict(batches={0: 3, 1: 2}, losses={0: [1.0, 2.0, 3.0], 1: [4.0, 5.0, 6.0]},
                  inputs={0: [0, 1, 2], 1: [0, 1, 1]}, mean_loss={0: 3.5, 1: 3.5},
                  checksum={0: 1.0, 1: 1.0})
    said = judge(fake_run(**padded))
    assert "rank 1 trained on its batch 2 twice (3 steps for its 2 batches)" in said, said
    assert "each of its own batches once" in said and "skip" not in said
    made_up = {**padded, "inputs": {0: [0, 1, 2], 1: [0, 1, -1]}}
    said = judge(fake_run(**made_up))
    assert "1 of its forwards on inputs that are none of its batches" in said, said
    assert "twice" not in said and "skip" not in said


def a_timeout_message() -> str:
    """A collective's timeout as a rank reports it (the words torch_words recognises)."""
    return next(line for _, line in torch_words.COLLECTIVE_TIMEOUT.seen)


def test_dump_files_are_what_torchfrtrace_reads_and_it_flags_the_hung_collective(tmp_path):
    """The recorded hang, written as NCCL's watchdog would, and torch's own analyser run on it."""
    import pickle

    from ddplab import flight_recorder

    page = postmortem.recording("flight_recorder_one_rank")["page"]
    records = postmortem.debug_server_records(page)
    paths = flight_recorder.dump_files(records, str(tmp_path / "fr"))
    assert sorted(os.path.basename(p) for p in paths) == ["rank_0", "rank_1"]
    dumped = pickle.loads((tmp_path / "fr" / "rank_0").read_bytes())
    group = records[0]["entries"][0]["process_group"][0]
    assert list(dumped["pg_config"]) == [group] and dumped["entries"] == records[0]["entries"]
    analyse = flight_recorder.torchfrtrace()
    if analyse is None:
        pytest.skip("this torch has no torchfrtrace command")
    analyse([str(tmp_path / "fr"), "-o", str(tmp_path / "db.pkl")])
    db = pickle.loads((tmp_path / "db.pkl").read_bytes())[-1]
    assert [c.collective_seq_id for c in db.collectives if not c.pass_check] == [1]
