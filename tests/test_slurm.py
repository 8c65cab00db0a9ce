"""The SLURM template: valid bash, rendered values land where they belong, torchrun line intact."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess

import pytest

from ddplab.lab import slurm


def test_default_render_is_the_template_unchanged():
    assert slurm.render() == slurm.template()


def test_the_torchrun_line_uses_slurm_and_the_c10d_rendezvous():
    line = slurm.torchrun_line(slurm.render(nodes=4, gpus_per_node=8))
    assert line.startswith("srun torchrun ")
    for part in ['--nnodes "$SLURM_NNODES"', '--nproc-per-node "$GPUS_PER_NODE"',
                 "--rdzv-backend c10d", '--rdzv-endpoint "$head_node:29500"',
                 '--rdzv-id "$SLURM_JOB_ID"', '-m "$TARGET"']:
        assert part in line


def test_rendered_values():
    script = slurm.render(nodes=4, gpus_per_node=8, target_args=["--epochs", "10", "a b"],
                          partition="gpu", port=29600, time="01:00:00", job_name="x")
    for line in ["#SBATCH --nodes=4", "#SBATCH --gres=gpu:8", "#SBATCH --partition=gpu",
                 "#SBATCH --time=01:00:00", "#SBATCH --job-name=x",
                 "TARGET_ARGS=(--epochs 10 'a b')"]:
        assert line in script.splitlines()
    assert "GPUS_PER_NODE=8 " in script and "$head_node:29600" in script
    assert "29500" not in script
    assert "NCCL_SOCKET_IFNAME" in script


def test_a_script_target_is_run_without_dash_m():
    line = slurm.torchrun_line(slurm.render(target="train.py"))
    assert line.endswith('"$TARGET" "${TARGET_ARGS[@]}"') and "-m" not in line.split()


@pytest.mark.parametrize("bad", [dict(nodes=0), dict(gpus_per_node=0), dict(time="30 min"),
                                 dict(port=80)])
def test_bad_values_are_refused_with_advice(bad):
    with pytest.raises(ValueError, match="must|write it|pick"):
        slurm.render(**bad)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_script_runs_with_fake_slurm_commands(tmp_path):
    # scontrol writes its second line late: a reader that stops at the first must not fail the job
    fakes = {"scontrol": "echo node-a; sleep 0.3; echo node-b", "srun": 'echo SRUN_CPUS_PER_TASK=$SRUN_CPUS_PER_TASK; exec "$@"',
             "torchrun": 'echo TORCHRUN "$@"'}
    for name, body in fakes.items():
        path = tmp_path / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    script = tmp_path / "job.sbatch"
    script.write_text(slurm.render(nodes=3, gpus_per_node=2, target_args=["--epochs", "1"]))
    env = dict(os.environ, PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}",
               SLURM_JOB_NODELIST="node-[a-b]", SLURM_NNODES="3", SLURM_JOB_ID="42",
               SLURM_CPUS_PER_TASK="8")
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert ("TORCHRUN --nnodes 3 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint "
            "node-a:29500 --rdzv-id 42 -m ddplab.workers.train --epochs 1") in out
    assert "SRUN_CPUS_PER_TASK=8" in out.split()   # srun (Slurm >= 22.05) gets the task's cores


def test_node_commands_differ_only_in_the_node_rank():
    first, second = slurm.node_commands("ddplab.workers.train", ["--epochs", "1"], tool="ddplab")
    assert "--node-rank 0" in first and "--node-rank 1" in second
    assert first.replace("--node-rank 0", "--node-rank 1") == second
    assert "--rdzv-endpoint 127.0.0.1:29500" in first


def test_torchrun_commands_are_the_same_on_every_node():
    """c10d numbers the nodes at the rendezvous and ignores --node-rank: none is printed."""
    commands = slurm.node_commands("ddplab.workers.train", ["--epochs", "1"], nnodes=3,
                                   tool="torchrun")
    assert len(commands) == 3 and len(set(commands)) == 1
    assert "--node-rank" not in commands[0] and "--rdzv-backend c10d" in commands[0]


def test_the_rendezvous_numbers_the_agents_by_their_address_as_a_string():
    """torch's c10d rendezvous sorts the agents' --local-addr as strings: 10 before 2."""
    assert slurm.group_ranks(["127.0.0.2", "127.0.0.10"]) == {"127.0.0.10": 0, "127.0.0.2": 1}
    with pytest.raises(ValueError, match="all different"):
        slurm.group_ranks(["127.0.0.2", "127.0.0.2"])


def test_no_agent_opens_a_store_on_its_own_address(monkeypatch):
    """macOS configures only 127.0.0.1: while the agents join, torch's opt-out of the rank-0
    agent's store on its --local-addr is set, and the caller's environment is restored."""
    import os
    import types

    from torch.distributed.elastic.rendezvous import registry

    seen = []

    def handler(params):
        def next_rendezvous():
            seen.append(os.environ.get(slurm.NO_AGENT_STORE))
            return types.SimpleNamespace(rank=len(seen) - 1)
        return types.SimpleNamespace(next_rendezvous=next_rendezvous, shutdown=lambda: None)

    monkeypatch.setattr(registry, "get_rendezvous_handler", handler)
    monkeypatch.setenv(slurm.NO_AGENT_STORE, "0")
    assert sorted(slurm.group_ranks(["127.0.0.2", "127.0.0.3"]).values()) == [0, 1]
    assert seen == ["1", "1"] and os.environ[slurm.NO_AGENT_STORE] == "0"
    monkeypatch.delenv(slurm.NO_AGENT_STORE)
    slurm.group_ranks(["127.0.0.2"])
    assert slurm.NO_AGENT_STORE not in os.environ


@pytest.mark.parametrize("addrs", [["gpu2", "gpu10"], ["127.0.0.2", "10.0.0.1"],
                                   ["127.0.0.2", "::1"], ["127.0.0.2", "127.0.0.300"]])
def test_group_ranks_refuses_a_non_loopback_address_at_once(addrs, monkeypatch):
    """Only 127.x.y.z can be served here: anything else fails before any rendezvous starts."""
    from torch.distributed.elastic.rendezvous import registry

    made = []
    monkeypatch.setattr(registry, "get_rendezvous_handler", lambda *a, **k: made.append(a))
    with pytest.raises(ValueError, match=r"127\.x\.y\.z"):
        slurm.group_ranks(addrs, timeout=30)
    assert made == []   # refused before a single agent was made, nothing waited for


def test_cli_prints_the_script(capsys):
    assert slurm.main(["--nodes", "3", "--", "--epochs", "2"]) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --nodes=3" in out and "TARGET_ARGS=(--epochs 2)" in out
