"""Workers and helpers of lessons 02, 07 and 09: what the launchers pass, who writes a
checkpoint on two nodes, each rank's input pipeline, DataParallel's memory (CPU path)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ddplab
from ddplab.lab import cmdlines, slurm
from ddplab.env import free_port
from ddplab.torch_words import UNRECOGNIZED_ARGUMENTS
from ddplab.workers import input_pipeline, legacy_args

ROOT = Path(__file__).resolve().parent.parent
C10D = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", "host0:29500",
        "--rdzv-id", "job"]


# ------------------------------------------------------------------ 07: command lines


def test_c10d_ignores_node_rank_and_static_uses_it():
    def config(backend: str, node: int) -> dict:
        argv = [*C10D, "--rdzv-backend", backend, "--node-rank", str(node), "train.py"]
        return cmdlines.torchrun_config(argv)["config"]

    assert config("c10d", 0) == config("c10d", 1)            # nothing of it reaches the agent
    assert config("static", 0) != config("static", 1)
    assert config("static", 1)["rdzv_configs"]["rank"] == 1


def test_torchrun_config_leaves_the_environment_alone(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    found = cmdlines.torchrun_config([*C10D, "--rdzv-backend", "c10d", "-m", "pkg.mod", "--x"])
    assert "OMP_NUM_THREADS" not in os.environ              # torch's code set it; undone
    assert found["script_args"] == ["--x"] and found["config"]["max_nodes"] == 2


def test_torchrun_shutdown_timeout_is_torchruns_own(monkeypatch):
    for name in ("PET_SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    assert cmdlines.torchrun_shutdown_timeout() == 30                  # the default grace
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "7")
    assert cmdlines.torchrun_shutdown_timeout() == 7                   # the variable
    assert cmdlines.torchrun_shutdown_timeout(["--shutdown-timeout", "5", "w.py"]) == 5
    assert "OMP_NUM_THREADS" not in os.environ                         # the kernel untouched


def test_the_old_launcher_passes_local_rank_with_a_dash_which_the_source_parser_rejects():
    argv = cmdlines.legacy_script_argv(["--epochs", "3"], local_rank=1)
    assert argv == ["--local-rank=1", "--epochs", "3"]
    parsed, error = cmdlines.parse_outcome(legacy_args.parse_args_as_the_source, argv[:1])
    assert parsed is None and UNRECOGNIZED_ARGUMENTS.search(error)["arguments"] == "--local-rank=1"
    fixed, error = cmdlines.parse_outcome(legacy_args.parse_args, argv[:1])
    assert error == "" and fixed.local_rank == 1
    old_style, _ = cmdlines.parse_outcome(legacy_args.parse_args, ["--local_rank=3"])
    assert old_style.local_rank == 3


@pytest.mark.slow
def test_the_real_old_launcher_breaks_the_source_parser_and_not_the_fix(tmp_path):
    """The real ``torch.distributed.launch`` passes ``--local-rank=N``, which the source's
    parser refuses (one rank shows it: each is a fresh interpreter importing torch); the fix
    parses that same argument, passed here by a warm launch in the old launcher's form
    (``local_rank_arg="dash"``) instead of a second cold old launcher."""
    cmd = [sys.executable, "-m", "torch.distributed.launch", "--nproc-per-node", "1",
           "--master-port", str(free_port()), str(ROOT / "ddplab/workers/legacy_args.py")]
    broken = subprocess.run(cmd, env={**os.environ, "LEGACY_PARSER": "source",
                                      "OMP_NUM_THREADS": "1"},
                            capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert broken.returncode != 0
    refused = {m["arguments"] for m in UNRECOGNIZED_ARGUMENTS.pattern.finditer(broken.stderr)}
    assert refused == {"--local-rank=0"}, broken.stderr[-2000:]
    fixed = ddplab.launch("ddplab.workers.legacy_args", 2, local_rank_arg="dash", quiet=True,
                          env={"LEGACY_PARSER": "fixed"}, timeout=240, cwd=tmp_path)
    assert fixed.ok, fixed.error
    assert {e["rank"]: e["value"] for e in fixed.events_of("metric")} == {0: 0, 1: 1}


def test_slurm_script_runs_and_starts_torchrun_as_promised():
    script = slurm.render(nodes=3, gpus_per_node=2, cpus_per_task=16,
                          target_args=["--epochs", "10"])
    run = cmdlines.slurm_dry_run(script, nodes=3)
    assert run["returncode"] == 0, run["stdout"]
    assert run["command"][0] == "torchrun" and run["omp_num_threads"] == "8"   # 16 cores / 2
    parsed = cmdlines.torchrun_config(run["command"][1:])
    assert parsed["config"]["min_nodes"] == parsed["config"]["max_nodes"] == 3
    assert parsed["config"]["nproc_per_node"] == 2 and parsed["config"]["run_id"] == "4242"
    assert parsed["config"]["rdzv_endpoint"] == "node001:29500"
    assert parsed["script_args"] == ["--epochs", "10"]


# ------------------------------------------------------------------ 07: two nodes save


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt")
    nodes = ddplab.launch_multinode("ddplab.workers.multinode_save", nnodes=2, nproc_per_node=2,
                                    args=["--out", str(out)], env={"DDPLAB_BACKEND": "gloo"},
                                    quiet=True, timeout=180)
    assert all(run.ok for run in nodes), [run.error for run in nodes]
    return out, nodes


def test_ddp_across_two_nodes_trains_one_set_of_weights(two_nodes):
    _out, nodes = two_nodes
    sums = {e["rank"]: e for run in nodes for e in run.events_of("metric") if e["name"] == "checksum"}
    assert sorted(sums) == [0, 1, 2, 3]
    assert len({e["value"] for e in sums.values()}) == 1  # each rank's own data, one model
    assert len({e["initial"] for e in sums.values()}) == 1 and sums[0]["value"] != sums[0]["initial"]


def test_local_rank_guard_writes_once_per_node_and_rank_guard_once(two_nodes):
    out, _nodes = two_nodes
    shared = {guard: (out / "shared" / f"{guard}_guard_writes.log").read_text().split()
              for guard in ("local_rank", "rank")}
    assert sorted(shared["local_rank"][::2]) == ["0", "2"]    # ranks 0 and 2 both wrote
    assert shared["rank"][::2] == ["0"]


def test_loading_after_a_barrier_needs_storage_every_node_sees(two_nodes):
    _out, nodes = two_nodes
    loads = [e for run in nodes for e in run.events_of("metric") if e["name"] == "loaded"]
    failed = {(e["rank"], e["guard"], e["storage"]) for e in loads if not e["ok"]}
    assert failed == {(2, "rank", "node-local"), (3, "rank", "node-local")}


def test_group_ranks_follow_the_agents_order_at_the_rendezvous(two_nodes):
    _out, nodes = two_nodes
    who = [e for run in nodes for e in run.events_of("identity")]
    assert sorted(e["rank"] for e in who) == [0, 1, 2, 3]
    for e in who:
        assert e["rank"] == e["group_rank"] * 2 + e["local_rank"]
    by_pid = sorted({(e["hostname"], e["agent_pid"]) for e in who})
    assert [sorted({e["group_rank"] for e in who if e["agent_pid"] == pid})
            for _host, pid in by_pid] == [[0], [1]]


# ------------------------------------------------------------------ 09: input pipeline


def pipeline(*args: str) -> dict:
    result = ddplab.launch("ddplab.workers.input_pipeline", 2, args=["--epochs", "2", *args],
                           quiet=True, live=False, timeout=180)
    assert result.ok, result.error
    metrics = [e for e in result.events_of("metric")]
    return {"draws": {(e["rank"], e["epoch"]): e for e in metrics if e["name"] == "draws"},
            "steps": [e for e in metrics if e["name"] == "steps"]}


def test_loader_workers_without_a_seed_per_rank_repeat_each_others_augmentations():
    run = pipeline("--num-workers", "2")
    draws = run["draws"]
    assert draws[0, 0]["value"] == draws[1, 0]["value"]                 # the same "random"
    assert len(draws[0, 0]["workers"]) == 2                             # two loader processes
    assert not set(draws[0, 0]["workers"]) & set(draws[0, 1]["workers"])  # new ones each epoch
    assert all(e["samples"] == run["steps"][0]["samples"] for e in run["steps"])


def test_persistent_workers_and_a_generator_per_rank():
    draws = pipeline("--num-workers", "2", "--persistent-workers",
                     *input_pipeline.CONTROL)["draws"]      # 09b's control run
    assert draws[0, 0]["value"] != draws[1, 0]["value"]
    assert draws[0, 0]["workers"] == draws[0, 1]["workers"]            # kept between epochs


def test_seed_per_rank_without_workers_and_the_tensor_loader():
    draws = pipeline("--loader-seed-per-rank")["draws"]
    assert draws[0, 0]["value"] != draws[1, 0]["value"] and draws[0, 0]["workers"] == []
    tensor = pipeline("--loader", "tensor")
    assert len(tensor["steps"]) == 4 and all(e["wait_ms"] >= 0 for e in tensor["steps"])
    for e in tensor["steps"]:             # the means are the epoch's: every step waits, computes
        assert math.isclose(e["steps"] * (e["mean_wait_ms"] + e["mean_compute_ms"]),
                            1e3 * e["epoch_time"], rel_tol=1e-6)
        assert math.isclose(e["mean_wait_ms"] * e["steps"], 1e3 * e["wait_share"]
                            * e["epoch_time"], rel_tol=1e-6)


# ------------------------------------------------------------------ 02: DataParallel memory


def test_dp_memory_reports_nothing_to_compare_without_two_gpus():
    result = ddplab.launch("ddplab.workers.dp_memory", 1, quiet=True, live=False, timeout=120)
    assert result.ok, result.error
    event = next(e for e in result.events_of("metric") if e["name"] == "max_memory_allocated")
    gpus = ddplab.env.probe()["gpu_count"]
    assert event["gpus"] == gpus and (event["value"] == [] if gpus < 2 else
                                      event["value"][0] > max(event["value"][1:]))


# ------------------------------------------------------------------ 09: one step's memory and trace


def step_profile(nprocs: int, *args: str) -> dict:
    result = ddplab.launch("ddplab.workers.step_profile", nprocs, quiet=True, live=False,
                           timeout=180, args=["--layers", "4", "--width", "256", "--batch-size", "128",
                                              *args])
    assert result.ok, result.error
    return {(e["rank"], e["name"]): e["value"] for e in result.events_of("metric")}


def test_step_profile_counts_the_step_and_checkpointing_keeps_less_for_backward():
    params = 4 * (256 * 256 + 256) + (256 * 10 + 10)
    activations = 4 * 2 * 128 * 256 * 4                               # two B x W tensors a block
    plain, checkpointed = step_profile(1), step_profile(1, "--checkpoint")
    assert plain[0, "bytes"]["parameters"] == plain[0, "bytes"]["gradients"] == 4 * params
    assert plain[0, "bytes"]["moments"] == 8 * params                  # exp_avg, exp_avg_sq
    assert plain[0, "bytes"]["tensors"] == 2 * 4 + 2                   # weight and bias a Linear
    assert 8 * params < plain[0, "bytes"]["optimizer_state"] <= 8 * params + 8 * 10   # + step counters
    kept = plain[0, "profiled"]["forward"]
    assert activations <= kept < 1.05 * activations
    # checkpointing keeps one B x W tensor a block instead of two, plus the CPU RNG state it
    # saves for each block's recompute (torch.get_rng_state(): 5,056 bytes)
    saved = kept - checkpointed[0, "profiled"]["forward"]
    assert saved == 4 * (128 * 256 * 4 - 5056)
    assert all(p[0, "profiled"][f"{phase}_ms"] > 0 for p in (plain, checkpointed)
               for phase in ("forward", "backward", "step"))
    # the checkpointed run also times steps with no block checkpointed, alternately
    assert all(checkpointed[0, "profiled"][f"plain_{phase}_ms"] > 0
               for phase in ("forward", "backward", "step"))
    assert not any(key.startswith("plain_") for key in plain[0, "profiled"])
    assert plain[0, "trace"] is None


def test_step_profile_measures_exercise_09bs_answer():
    """The 09b exercise (every other block checkpointed) is what the profiler measures."""
    from ddplab.lab.checks import (BATCH_09B, EVERY_09B, LAYERS_09B, WIDTH_09B,
                                   reference_answer)
    result = ddplab.launch("ddplab.workers.step_profile", 1, quiet=True, live=False, timeout=180,
                           args=["--layers", LAYERS_09B, "--width", WIDTH_09B, "--batch-size",
                                 BATCH_09B, "--checkpoint", EVERY_09B, "--warmup", 1,
                                 "--timed", 1])
    assert result.ok, result.error
    (profiled,) = [e["value"] for e in result.events_of("metric") if e["name"] == "profiled"]
    assert 0 <= profiled["forward"] - reference_answer("09b") < 64   # scalars such as the loss


def test_step_profile_under_ddp_writes_traces_with_every_buckets_all_reduce(tmp_path):
    from ddplab.lab import bench
    seen = step_profile(2, "--trace-dir", str(tmp_path), "--bucket-cap-mb", "0.01")
    assert {seen[0, "trace"], seen[1, "trace"]} == {str(tmp_path / "trace_rank0.json"),
                                                    str(tmp_path / "trace_rank1.json")}
    overlap = bench.backward_overlap(seen[0, "trace"])
    assert len(overlap["all_reduces"]) >= 2 and overlap["gradients_ms"] > 0
    # every bucket's all-reduce is launched from inside backward, all but the last before the
    # last gradient is computed
    assert len(overlap["launches_ms"]) == len(overlap["all_reduces"])
    assert overlap["launches_ms"][-2] < overlap["gradients_ms"] <= overlap["launches_ms"][-1]
    assert seen[0, "bytes"] == seen[1, "bytes"]
