"""Lesson 12 on real gloo processes: meshes, DTensor placements, TP modules equal to the unsharded
ones with 1/N of the bytes, and 2-D (FSDP2 x TP) training equal to one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ddplab import check, launch
from ddplab.lab.judges import skeleton_path
from ddplab.lab.judges.tensor_parallel import COLWISE, NORMS, ROWWISE
from ddplab.lab.checks import reference_answer
from ddplab.launcher.results import RunResult
from ddplab.workers.tensor_parallel import read_plan

pytestmark = pytest.mark.slow
WORKER = "ddplab.workers.tensor_parallel"
SOLUTION = Path(__file__).resolve().parent / "solutions" / "tp_plan.py"
FSDP_ON_CPU = torch.__version__ >= "2.7"   # a TorchVersion: compares as versions


def by_rank(result, kind: str) -> dict[int, list[dict]]:
    found: dict[int, list[dict]] = {}
    for e in result.events_of(kind):
        found.setdefault(e["rank"], []).append(e)
    return found


def test_four_ranks_meshes_placements_tp_modules_and_2d_equal_one_process():
    result = launch(WORKER, 4, args=["--repeats", "2"], quiet=True)
    assert result.ok, result.error
    mesh = {e["rank"]: e for e in result.events_of("mesh")}
    for r in range(4):
        assert mesh[r]["mesh_1d"] == [0, 1, 2, 3] and mesh[r]["mesh_2d"] == [[0, 1], [2, 3]]
        assert mesh[r]["coordinate"] == [r // 2, r % 2]
        assert mesh[r]["tp_sum"] == sum(mesh[r]["tp_group"]) and r in mesh[r]["tp_group"]
        assert mesh[r]["dp_sum"] == sum(mesh[r]["dp_group"]) and r in mesh[r]["dp_group"]

    whole = torch.arange(32.0).reshape(8, 4)
    for r, placed in by_rank(result, "placement").items():
        local = {e["placement"]: torch.tensor(e["local"]) for e in placed}
        assert torch.equal(local["Shard(0)"], whole[2 * r:2 * r + 2])
        assert torch.equal(local["Shard(1)"], whole[:, r:r + 1])
        assert torch.equal(local["Replicate()"], whole)
        assert torch.equal(local["Partial()"], whole / 4)      # a quarter of the same tensor
        partial = next(e for e in placed if e["placement"] == "Partial()")
        assert torch.equal(torch.tensor(partial["full"]), whole)
    moves = {(e["source"], e["target"]): e["collectives"] for e in result.events_of("redistribute")}
    assert moves[("Partial()", "Replicate()")] == {"all_reduce": 1}
    assert list(moves[("Partial()", "Shard(0)")]) == ["reduce_scatter_tensor"]
    assert list(moves[("Shard(0)", "Replicate()")]) == ["all_gather_into_tensor"]
    assert moves[("Replicate()", "Shard(0)")] == {}                  # a local slice, no message
    sp = {(e["module"], e["rank"]): e for e in result.events_of("sp")}
    assert set(sp) == {("norm_mlp", r) for r in range(4)}   # the quiz's attention: its own event
    sp.update({("attention", e["rank"]): e for e in result.events_of("sp_attention")})
    assert len(sp) == 8                        # sequence parallel: each rank fed its tokens
    ag, rs = "all_gather_into_tensor", "reduce_scatter_tensor"
    for r in range(4):
        block, attention = sp["norm_mlp", r], sp["attention", r]
        for e in (block, attention):           # the same output and gradients as run whole
            assert e["local_shape"] == [16, 2, 16] and e["shape"] == [16, 8, 16]
            assert max(e["output_error"], e["grad_error"], e["input_grad_error"]) < 1e-4, e
            assert e["activation_bytes"] * 4 == e["whole_activation_bytes"] == 16 * 8 * 16 * 4
        # LayerNorm + MLP: up gathers the sequence, down scatters it; backward mirrors that
        assert block["forward_collectives"] == block["backward_collectives"] == {ag: 1, rs: 1}
        assert block["norm_grad_placement"] == "[Partial(sum)]"   # each rank: its tokens' share
        assert block["norm_summed_collectives"] == {"all_reduce": 1}
        # attention: q, k and v each gather their input, and each reduce-scatter its gradient
        assert attention["forward_collectives"] == {ag: 3, rs: 1}
        assert attention["backward_collectives"] == {ag: 1, rs: 3}
        passes = (attention["forward_collectives"], attention["backward_collectives"])
        counted = tuple(counts.get(kind, 0) for counts in passes for kind in (ag, rs))
        assert counted == reference_answer("12")          # notebook 12's quiz, as the run says
    whole = {e["rank"]: e for e in result.events_of("sp_whole")}
    assert sorted(whole) == list(range(4))
    for e in whole.values():   # PrepareModuleInput/Output: the whole sequence in, the whole out
        assert e["in_shape"] == e["out_shape"] == [16, 8, 16] and not e["output_is_dtensor"]
        assert max(e["output_error"], e["input_grad_error"]) < 1e-4, e
        # the input sliced locally; the output's all-gather added to the block's own pair
        assert e["forward_collectives"] == e["backward_collectives"] == {ag: 2, rs: 1}

    tp = {(e["module"], e["rank"]): e for e in result.events_of("tp")}
    d, h = 16, 64
    for r in range(4):
        for name, params, inputs in (("mlp", (d * h + h) / 4 + h * d / 4 + d, 1),
                                     ("attention", d * d, 3)):
            e = tp[name, r]
            assert e["output_error"] < 1e-5 and e["grad_error"] < 1e-5, e
            assert e["param_bytes"] == 4 * params
            assert e["forward_collectives"] == {"all_reduce": 1}     # the row-wise output
            # the input's gradient: one all-reduce per column-wise layer that reads it
            assert e["backward_collectives"] == {"all_reduce": inputs}
    once = {e["rank"]: e for e in result.events_of("tp_input_once")}
    assert sorted(once) == list(range(4))
    for e in once.values():   # the attention's input declared once: its gradient summed once
        assert e["forward_collectives"] == {"all_reduce": 1}
        # on torch 2.14 (2.6 still all-reduces once per column-wise layer)
        assert e["backward_collectives"] == {"all_reduce": 1} or torch.__version__ < "2.14", e

    if not FSDP_ON_CPU:
        reason = result.events_of("skipped")[0]["reason"]
        assert "2.7" in reason
        pytest.skip(f"torch {torch.__version__}: {reason} (the 1-D tensor parallel part checked)")
    memory = {e["rank"]: e for e in result.events_of("memory_2d")}
    bias = 4 * 10                                    # the last bias: over dp only (TP replicates it)
    assert all(memory[r]["param_bytes"] == (memory[r]["full_param_bytes"] - bias) / 4 + bias / 2
               for r in range(4))
    for e in result.events_of("comm_2d"):            # one step: TP in tp, FSDP2 in dp
        forward, backward = (" ".join(f"{op}:{n}" for op, n in sorted(e[k].items()))
                             for k in ("forward_collectives", "backward_collectives"))
        assert forward == "all_reduce:1 allgather:1" and backward == "reduce_scatter:1", e
    assert sorted(e["rank"] for e in result.events_of("comm_2d")) == [0, 1, 2, 3]
    single = launch(WORKER, 1, args=["--parts", "2d"], quiet=True)
    assert single.ok, single.error
    two_d = [e["loss"] for e in result.events_of("loss")]
    alone = [e["loss"] for e in single.events_of("loss")]
    assert len(two_d) == len(alone) == 5 and two_d == pytest.approx(alone, abs=1e-5)
    assert alone[-1] < alone[0]
    for a, b in zip(result.events_of("weights")[0]["values"], single.events_of("weights")[0]["values"]):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)


def test_two_ranks_skip_2d_and_a_bad_width_is_refused():
    result = launch(WORKER, 2, args=["--parts", "mlp", "2d", "--repeats", "1"], quiet=True)
    assert result.ok, result.error
    assert {e["tp_size"] for e in result.events_of("tp")} == {2}
    assert "--nproc-per-node 4" in result.events_of("skipped")[0]["reason"]
    bad = launch(WORKER, 2, args=["--parts", "mlp", "--hidden", "33"], quiet=True)
    assert not bad.ok and "--hidden 33" in bad.error
    alone = launch(WORKER, 1, args=["--parts", "mlp"], quiet=True)
    assert not alone.ok and "--parts 2d" in alone.error
    plan = ("--parts", "mlp", "--mlp-plan", "up=colwise", "down=rowwise")   # section 3's plan
    tried = launch(WORKER, 2, args=plan, quiet=True)
    assert tried.ok, tried.error
    section_3 = {e["rank"]: e for e in result.events_of("tp") if e["module"] == "mlp"}
    for e in tried.events_of("plan_try"):              # the plan cell counts what section 3 does
        same = section_3[e["rank"]]
        for key in ("forward_collectives", "backward_collectives", "param_bytes"):
            assert e[key] == same[key], (key, e[key], same[key])
        assert e["backward_collectives"] == {"all_reduce": 1}          # x.grad, summed
        assert max(e["output_error"], e["grad_error"], e["input_grad_error"]) < 1e-5, e


def test_a_plan_tried_on_the_mlp_reports_its_result_or_its_error():
    tried = ("--parts", "mlp", "--mlp-plan")
    gathered = launch(WORKER, 2, args=[*tried, "up=colwise_gathered", "down=none"], quiet=True)
    assert gathered.ok, gathered.error
    for e in gathered.events_of("plan_try"):          # right, but down whole on every rank
        assert e["output_error"] < 1e-5 and e["grad_error"] < 1e-5, e
        assert e["forward_collectives"] == {"all_gather_into_tensor": 1}
        assert e["backward_collectives"] == {"all_reduce": 1} and e["input_grad_error"] < 1e-5
        assert e["full_param_bytes"] / 2 < e["param_bytes"] < e["full_param_bytes"]
    broken = launch(WORKER, 2, args=[*tried, "up=colwise", "down=none"], quiet=True)
    assert broken.ok, broken.error                    # the run reports the error, not a crash
    assert len(broken.events_of("plan_try")) == 2
    assert all(e["error"] for e in broken.events_of("plan_try"))
    sliced = launch(WORKER, 2, args=[*tried, "up=colwise_gathered", "down=colwise"], quiet=True)
    assert sliced.ok, sliced.error                    # each rank returns its slice of the output
    assert all("(16, 8)" in e["error"] and "(16, 16)" in e["error"]
               for e in sliced.events_of("plan_try"))
    with pytest.raises(SystemExit, match="down=diagonal"):
        read_plan(["up=colwise", "down=diagonal"])


# ------------------------------------------------------------------------- exercise 12


def test_the_exercise_differs_from_its_solution_only_inside_parallelize():
    skeleton, solution = skeleton_path("12").read_text(), SOLUTION.read_text()
    cut = ("# [exercise]", "# [/exercise]")
    outside = [text.split(cut[0])[0].split("\n", 1)[1] + text.split(cut[1])[1]
               for text in (skeleton, solution)]
    assert outside[0] == outside[1]                     # the block, the checks, the reports
    assert "TODO(exercise)" in skeleton and "TODO(exercise)" not in solution


def test_the_untouched_exercise_runs_and_is_told_nothing_is_split():
    result = launch(skeleton_path("12"), 2, quiet=True, timeout=240)   # a safety net
    assert result.ok, result.error          # it runs; the judge, not a traceback, explains
    verdict = check("12", result)
    assert not verdict and "nothing is split yet" in verdict.message


def test_the_solution_is_right_on_four_ranks_with_the_reference_collectives():
    result = launch(SOLUTION, 4, quiet=True, timeout=240)   # a safety net
    assert check("12", result), result.error
    for facts in (e["value"] for e in result.events_of("metric") if e["name"] == "tp_plan"):
        assert facts["n_heads"] == 1 and facts["norm_tokens"] == {"attention_norm": 2,
                                                                   "ffn_norm": 2}
        assert facts["forward_collectives"] == {"all_gather_into_tensor": 3,
                                                "reduce_scatter_tensor": 2}
        plain_slice = {"type": "Tensor", "tokens": 2}     # each residual sum: 2 of the 8 tokens
        assert facts["residual_sides"] == dict.fromkeys(("x", "attention", "h", "feed_forward"),
                                                        plain_slice)


def judged(facts: dict, error: dict) -> str:
    """The judge's word on a 2-rank run whose ranks both reported ``facts`` and ``error``."""
    events = {rank: [{"kind": "metric", "rank": rank, "name": "tp_plan", "value": facts},
                     {"kind": "metric", "rank": rank, "name": "error", "value": error}]
              for rank in (0, 1)}
    verdict = check("12", RunResult("ok", 0, 1.0, 2, events=events))
    assert not verdict
    return verdict.message


def test_a_residual_sum_of_two_layouts_is_named_from_the_sides_the_run_reported():
    placements = {f"{name}.weight": "[Shard(dim=0)]" for name in COLWISE}
    placements.update({f"{name}.weight": "[Shard(dim=1)]" for name in ROWWISE})
    placements.update({f"{norm}.weight": "[Replicate()]" for norm in NORMS})
    facts = {"world_size": 2, "seq": 8, "n_heads_full": 4, "head_dim": 4, "n_heads": 2,
             "wq_rows": 8, "placements": placements}
    error = {"stage": "forward", "type": "RuntimeError", "message": "(torch's words)"}
    part, whole = {"type": "Tensor", "tokens": 4}, {"type": "Tensor", "tokens": 8}
    said = judged({**facts, "residual_sides": {"x": part, "attention": whole}}, error)
    assert "at the residual sum x + attention(...)" in said
    assert "attention returned Replicate() (the whole sequence, 8 tokens on every rank)" in said
    assert "the residual x is Shard(1) (this rank's 4 of the 8 tokens)" in said
    assert "attention.wo" in said and "the residual's layout" in said
    assert "output_layouts=" not in said   # the requirement, not the argument to type
    assert "a DTensor and a plain tensor" not in said
    second = {"x": part, "attention": part, "h": part, "feed_forward": whole}
    said = judged({**facts, "residual_sides": second}, error)
    assert "h + feed_forward(...)" in said and "feed_forward.w2" in said
    mixed = {"x": part, "attention": {"type": "DTensor", "tokens": 4}}
    said = judged({**facts, "residual_sides": mixed}, error)   # that one the old words explain
    assert "a DTensor and a plain tensor cannot be added" in said and "residual sum x" not in said

