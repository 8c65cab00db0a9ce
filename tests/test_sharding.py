"""Lesson 11 on real gloo processes: FSDP/ZeRO bytes and losses, the hand-written pipeline,
its timeline, the pipeline exercise (skeleton judged wrong, solution right, two of its hints),
and the FSDP2 + DCP exercise's skeleton and single-launch verdicts (the variants of both:
test_exercise_variants.py)."""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path

import pytest
import torch
from test_exercises_hints import answer_named

from ddplab import check, launch
from ddplab.lab import timeline
from ddplab.lab.judges import metric, skeleton_path

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
SOLUTION = ROOT / "tests" / "solutions" / "pipeline_forward.py"
# fully_shard runs on CPU streams from torch 2.7 on (the worker skips it on older CPUs).
FSDP_ON_CPU = torch.__version__ >= "2.7"


def by_mode_and_rank(result) -> dict[tuple[str, int], dict]:
    return {(e["mode"], e["rank"]): e for e in result.events_of("memory")}


def losses(result) -> dict[str, list[float]]:
    found: dict[str, list[float]] = {}
    for e in result.events_of("loss"):
        found.setdefault(e["mode"], []).append(e["loss"])
    return found


# ------------------------------------------------------------------------------ sharding


def test_the_library_step_shown_before_exercise_1_leaves_out_the_loss_weighting():
    from ddplab.lab.showcode import source

    shown = source("ddplab/workers/pipeline.py", "library")           # section 7 of notebook 11
    after = source("ddplab/workers/pipeline.py", "library-loss")      # after exercise 1's verdict
    assert "ScheduleGPipe(" in shown and "loss_fn=loss_fn" in shown
    assert "library_loss" not in shown and "loss_fn =" not in shown
    assert "micro_batches" not in shown.replace("n_microbatches=micro_batches", "")
    assert "/ micro_batches" in after and "scale_grads" in after


@pytest.mark.parametrize("nprocs", [2, 3])
def test_each_rank_holds_about_one_nth_under_fsdp_and_the_losses_equal_one_process(nprocs):
    result = launch("ddplab.workers.sharding", nprocs, args=["--steps", "4"], quiet=True)
    assert result.ok, result.error
    memory, found = by_mode_and_rank(result), losses(result)
    full = memory["ddp", 0]["full_params"]
    # the width the run was launched with (notebook 11 reads it): 64 inputs, 10 classes, float32
    hidden = memory["ddp", 0]["hidden"]
    assert hidden == 256 and full == 4 * ((64 + 1) * hidden + 2 * (hidden + 1) * hidden
                                          + (hidden + 1) * 10)
    for r in range(nprocs):
        assert memory["ddp", r]["params"] == memory["ddp", r]["grads"] == full
        assert memory["ddp", r]["optimizer"] > 2 * full
        assert memory["ddp", r]["collectives"] == {"allreduce": 1}
        assert memory["zero1", r]["collectives"]["broadcast"] == memory["ddp", r]["tensors"]
    zero1 = [memory["zero1", r]["optimizer"] for r in range(nprocs)]
    assert sum(zero1) == memory["ddp", 0]["optimizer"] and max(zero1) < sum(zero1)
    if not FSDP_ON_CPU:
        skipped = result.events_of("skipped")
        assert skipped and skipped[0]["modes"] == ["zero2", "zero3"]
        assert "2.7" in skipped[0]["reason"] and ("zero3", 0) not in memory
        pytest.skip(f"torch {torch.__version__}: {skipped[0]['reason']} (DDP and ZeRO-1 checked)")
    for r in range(nprocs):
        for key in ("params", "params_in_backward", "grads", "optimizer"):
            share = memory["zero3", r][key] / memory["ddp", r][key]
            assert share == pytest.approx(1 / nprocs, rel=0.05), (key, r, share)
        assert memory["zero2", r]["params_in_backward"] == full
        assert memory["zero2", r]["params"] == memory["zero3", r]["params"]  # sharded between steps
        assert memory["zero2", r]["grads"] == memory["zero3", r]["grads"]
    for key in ("params", "grads"):
        assert sum(memory["zero3", r][key] for r in range(nprocs)) == memory["ddp", 0][key]
    layers = memory["zero3", 0]["layers"]
    assert layers == memory["ddp", 0]["layers"] and memory["ddp", 0]["tensors"] == 2 * layers
    assert memory["zero3", 0]["collectives"] == {"allgather": 2 * layers, "reduce_scatter": layers}
    assert memory["zero2", 0]["collectives"] == {"allgather": layers, "reduce_scatter": layers}
    assert sorted(found) == ["ddp", "single", "zero1", "zero2", "zero3"]
    for mode, values in found.items():  # FSDP2 on gloo, checked against one process (#162338)
        assert values == pytest.approx(found["single"], abs=1e-5), mode
    assert found["single"][-1] < found["single"][0]


# ------------------------------------------------------------------------------ pipeline


def pipeline_events(result) -> dict[tuple[int, int], dict]:
    return {(e["micro_batches"], e["rank"]): e for e in result.events_of("pipeline")}


def test_two_stage_pipeline_equals_the_unsplit_model():
    result = launch("ddplab.workers.pipeline", 2, args=[
        "--micro-batches", "1", "4", "--hidden", "128", "--repeats", "1", "--library"],
        quiet=True)
    assert result.ok, result.error
    steps = pipeline_events(result)
    assert sorted(steps) == [(1, 0), (1, 1), (4, 0), (4, 1)]
    for (m, r), e in steps.items():
        assert e["grad_error"] < 1e-5, (m, r)
        assert (e["output_error"] is None) == (r == 0)
    assert steps[4, 1]["output_error"] < 1e-5
    held = steps[1, 0]["param_bytes"] + steps[1, 1]["param_bytes"]
    assert held == steps[1, 0]["full_param_bytes"]
    assert steps[1, 0]["bytes_sent"] == steps[4, 0]["bytes_sent"] == 256 * 128 * 4  # activations
    assert steps[1, 1]["bytes_sent"] == 256 * 128 * 4                               # their grads
    library = {e["rank"]: e for e in result.events_of("library")}
    assert library[0]["available"] and library[1]["output_error"] < 1e-5
    assert max(e["grad_error"] for e in library.values()) < 1e-5


def test_middle_stage_receives_and_sends_both_ways_and_its_timeline_is_whole():
    result = launch("ddplab.workers.pipeline", 3, args=[
        "--micro-batches", "2", "--depth", "3", "--hidden", "32", "--batch-size", "64",
        "--repeats", "1"], quiet=True)
    assert result.ok, result.error
    steps = pipeline_events(result)
    assert all(e["grad_error"] < 1e-5 for e in steps.values())
    assert steps[2, 2]["output_error"] < 1e-5
    assert steps[2, 1]["bytes_sent"] == 2 * 64 * 32 * 4      # activations on, gradients back
    runs = timeline.spans_by_run(result.events_of("span"))
    assert list(runs) == [2]
    for rank in range(3):
        mine = sorted((s for s in runs[2] if s["rank"] == rank), key=lambda s: s["start"])
        assert [(s["phase"], s["micro"]) for s in mine] == [
            ("forward", 0), ("forward", 1), ("backward", 1), ("backward", 0)]
        assert all(a["end"] <= b["start"] for a, b in zip(mine, mine[1:]))   # one at a time


@pytest.mark.parametrize("nprocs, args, advice", [
    (3, ["--depth", "4"], "multiple of the number of processes"),
    (2, ["--micro-batches", "3"], "pick divisors")])
def test_a_split_that_does_not_divide_is_refused_with_advice(nprocs, args, advice):
    result = launch("ddplab.workers.pipeline", nprocs, args=[*args, "--hidden", "16"],
                    quiet=True)
    assert not result.ok
    assert advice in result.error      # whichever rank refused first, its words are the cause


# ------------------------------------------------------------------------------ timeline


def spans(*rows: tuple[int, str, int, float, float], micro_batches: int = 1) -> list[dict]:
    return [{"rank": r, "phase": p, "micro": m, "start": a, "end": b,
             "micro_batches": micro_batches} for r, p, m, a, b in rows]


def test_bubble_of_a_step_taken_in_turns_is_one_half_and_of_a_full_pipeline_smaller():
    turns = spans((0, "forward", 0, 0, 1), (1, "forward", 0, 1, 2), (1, "backward", 0, 2, 4),
                  (0, "backward", 0, 4, 6))
    assert timeline.bubble(turns) == pytest.approx(0.5)
    overlapped = spans((0, "forward", 0, 0, 1), (0, "forward", 1, 1, 2),
                       (1, "forward", 0, 1, 2), (1, "forward", 1, 2, 3), micro_batches=2)
    assert timeline.bubble(overlapped) == pytest.approx(1 - 4 / 6)
    assert timeline.ideal_bubble(2, 1) == 0.5 and timeline.ideal_bubble(2, 4) == 0.2
    assert timeline.ideal_bubble(4, 8) == pytest.approx(3 / 11)
    runs = timeline.spans_by_run(overlapped + turns)
    assert list(runs) == [1, 2]
    fig = timeline.plot(runs, title="test")
    assert len(fig.axes) == 2 and "idle 50%" in fig.axes[0].get_title(loc="left")
    with pytest.raises(ValueError, match="no spans"):
        timeline.bubble([])


# ------------------------------------------------------------------------------ exercise


def test_solution_differs_from_the_skeleton_only_in_the_gaps():
    skeleton = skeleton_path("11").read_text().splitlines()
    solution = SOLUTION.read_text().splitlines()
    todo = [i for i, line in enumerate(skeleton) if line.strip().startswith("# TODO(exercise)")]
    assert len(todo) == 3
    hunks = [op for op in difflib.SequenceMatcher(None, skeleton[1:], solution[1:],
                                                  autojunk=False).get_opcodes()
             if op[0] != "equal"]
    assert [(i1 + 1, i2 + 1) for _, i1, i2, _, _ in hunks] == [(i, i + 1) for i in todo]


def test_untouched_skeleton_is_judged_wrong_with_a_hint(capsys):
    result = launch(skeleton_path("11"), 2, quiet=True, timeout=120)
    assert result.ok, result.error          # it runs; the judge, not a traceback, explains
    verdict = check("11", result)
    assert not verdict and "zeros" in verdict.message and "no message" in verdict.message
    assert "send" not in verdict.message and "recv" not in verdict.message   # no calls named
    assert not answer_named("11", verdict.message), verdict.message


def test_messages_that_miss_rank_1s_input_get_the_named_hint(tmp_path):
    """An attempt that sends and receives, but not into the tensor rank 1's stage runs on."""
    text = SOLUTION.read_text()
    assert text.count("torch_dist.recv(x, src=0)") == 1
    (tmp_path / "recv_elsewhere.py").write_text(
        text.replace("torch_dist.recv(x, src=0)", "torch_dist.recv(torch.zeros_like(x), src=0)"))
    result = launch(tmp_path / "recv_elsewhere.py", 2, quiet=True, timeout=120)
    verdict = check("11", result)
    assert not verdict and "messages went" in verdict.message, verdict.message


def test_solution_is_judged_right():
    result = launch(SOLUTION, 2, quiet=True, timeout=120)
    assert check("11", result), result.error


def test_forward_alone_is_judged_by_its_missing_backward(tmp_path):
    """The forward blocks of the solution, the backward left as the skeleton has it."""
    solution = SOLUTION.read_text()
    half = solution[:solution.index("        if rank == 1:   # each micro-batch's")] + (
        "        # TODO(exercise): this micro-batch's backward on this rank, and its message.\n"
        + solution[solution.index("# [/exercise]"):])
    (tmp_path / "half_done.py").write_text(half)
    result = launch(tmp_path / "half_done.py", 2, quiet=True, timeout=120)
    verdict = check("11", result)
    assert not verdict and "no gradient after backward_stage" in verdict.message, verdict.message


def test_a_recv_without_its_send_is_named_after_the_process_group_timeout(tmp_path):
    text = SOLUTION.read_text().replace("            torch_dist.send(inputs[micro].grad, dst=0)\n",
                                        "")
    (tmp_path / "no_gradient_sent.py").write_text(text)
    result = launch(tmp_path / "no_gradient_sent.py", 2, quiet=True, timeout=120,
                    args=["--pg-timeout", "3"])
    verdict = check("11", result)
    assert not verdict and "rank 0 waited in recv, in backward, for a gradient" in \
        verdict.message, verdict.message


# ------------------------------------------------------------------- exercise 11b: FSDP2 + DCP

FSDP2_SOLUTION = ROOT / "tests" / "solutions" / "fsdp2.py"


def test_fsdp2_solution_differs_from_the_skeleton_only_in_the_four_functions():
    skeleton, solution = skeleton_path("11b").read_text(), FSDP2_SOLUTION.read_text()
    assert skeleton.split("# [/exercise]")[1] == solution.split("# [/exercise]")[1]
    gaps = skeleton.split("# [exercise]")[1].split("# [/exercise]")[0]
    assert gaps.count("TODO(exercise)") == 4 and "fully_shard(" not in gaps


@pytest.mark.skipif(not FSDP_ON_CPU, reason="fully_shard on the CPU needs torch >= 2.7")
def test_untouched_fsdp2_skeleton_is_judged_wrong_with_a_hint(tmp_path):
    result = launch(skeleton_path("11b"), 2, quiet=True, timeout=300,   # a safety net
                    args=["--save", str(tmp_path / "dcp")])
    assert result.ok, result.error          # it runs; the judge, not a traceback, explains
    verdict = check("11b", {"save": result})
    assert not verdict and "sharded nothing" in verdict.message, verdict.message
    assert not answer_named("11b", verdict.message), verdict.message   # the run, not the code


@pytest.fixture(scope="module")
def fsdp2_saved(tmp_path_factory):
    """The solution's save launch (2 ranks), shared by the tests below."""
    if not FSDP_ON_CPU:
        pytest.skip("fully_shard on the CPU needs torch >= 2.7")
    folder = tmp_path_factory.mktemp("fsdp2")
    return launch(FSDP2_SOLUTION, 2, quiet=True, timeout=300, args=["--save", str(folder)])


def test_fsdp2_save_alone_asks_for_the_loads(fsdp2_saved):
    verdict = check("11b", fsdp2_saved)
    assert not verdict and "all three launches" in verdict.message, verdict.message


def with_metrics(result, world_size: int = 2, **values):
    """``result`` with rank 0's metrics ``values`` in place of its own (a fake run, no launch)."""
    events = {rank: [e for e in found if rank or e.get("name") not in values]
              for rank, found in result.events.items()}
    events.setdefault(0, []).extend({"kind": "metric", "rank": 0, "name": name, "value": value}
                                    for name, value in values.items())
    return dataclasses.replace(result, events=events, world_size=world_size)


def test_fsdp2_run_reports_float32_averages_and_the_judge_names_a_16_bit_one(fsdp2_saved):
    forward = metric(fsdp2_saved, "forward")
    assert {rank: f["averaged"] for rank, f in forward.items()} == {0: "float32", 1: "float32"}
    for dtype in ("bfloat16", "float16"):
        run = with_metrics(fsdp2_saved, forward={**forward[0], "averaged": dtype})
        verdict = check("11b", {"save": run})
        assert not verdict and f"averaged over the ranks in {dtype}" in verdict.message
        assert "Point 2 wants the average in float32" in verdict.message
        assert "reduce_dtype=" not in verdict.message   # the requirement, not the argument


def test_fsdp2_load_without_adams_state_is_told_why_from_the_checkpoints_keys(fsdp2_saved):
    keys, saved = metric(fsdp2_saved, "keys")[0], metric(fsdp2_saved, "saved")[0]
    assert "optim.state.blocks.0.qkv.weight.exp_avg" in keys      # by name: get_state_dict's
    weights_only = {k: v for k, v in saved.items() if k.endswith(":weight")}

    def judged(keys: list[str]) -> str:
        loads = {f"load{n}": with_metrics(fsdp2_saved, n, loaded=weights_only,
                                          layout={"world_size": n}) for n in (4, 1)}
        verdict = check("11b", {"save": with_metrics(fsdp2_saved, keys=keys), **loads})
        assert not verdict
        return verdict.message

    by_name = judged(keys)
    assert "after the load on 4 ranks the optimizer has none" in by_name
    assert "get_state_dict" in by_name and "set_state_dict" in by_name
    assert "keyed by parameter number" not in by_name
    numbered = judged([k.replace("optim.state.blocks.0.qkv.weight.", "optim.state.0.")
                       for k in keys if not k.startswith("optim.state.") or ".qkv.weight." in k])
    assert "keyed by parameter number" in numbered and "optim.state.0.exp_avg" in numbered
    left_out = judged([k for k in keys if not k.startswith("optim.")])
    assert "save and load the optimizer too" in left_out and "get_state_dict" not in left_out
