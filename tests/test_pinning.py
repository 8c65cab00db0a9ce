"""CPU ranks of a DDP job keep to cores of their own (ddplab.pinning)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from ddplab import dist, pinning

CPU = torch.device("cpu")


def test_each_rank_gets_its_own_cores_when_all_fit() -> None:
    assert pinning.cpu_cores_for(0, 2, 1, [0, 1]) == [0]
    assert pinning.cpu_cores_for(1, 2, 1, {1, 0}) == [1]
    assert pinning.cpu_cores_for(1, 2, 2, [4, 5, 6, 7]) == [6, 7]  # the cores this process may use


def test_no_pinning_when_ranks_do_not_fit_or_are_alone() -> None:
    assert pinning.cpu_cores_for(0, 3, 1, [0, 1]) is None  # more ranks than cores
    assert pinning.cpu_cores_for(0, 2, 2, [0, 1]) is None  # more threads than cores
    assert pinning.cpu_cores_for(0, 1, 1, [0, 1]) is None  # a single process is left alone


def test_ranks_pinned_says_whether_a_launch_s_cpu_ranks_would_be_pinned(monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.delenv("DDPLAB_PIN_CPU", raising=False)
    assert pinning.ranks_pinned(2)
    assert not pinning.ranks_pinned(3)              # more ranks than cores
    assert not pinning.ranks_pinned(1)              # one process is left alone
    assert not pinning.ranks_pinned(2, gpus=2)      # GPU ranks are not pinned
    monkeypatch.setenv("DDPLAB_PIN_CPU", "0")
    assert not pinning.ranks_pinned(2)


@pytest.mark.parametrize("env, info", [
    ({"LOCAL_WORLD_SIZE": "1"}, dist.DistInfo(1, 0, 2, CPU, "gloo")),  # 2 "nodes", 1 machine
    ({"LOCAL_WORLD_SIZE": "2", "DDPLAB_PIN_CPU": "0"}, dist.DistInfo(1, 1, 2, CPU, "gloo")),
    ({"LOCAL_WORLD_SIZE": "2"}, dist.DistInfo(1, 1, 2, torch.device("cuda", 1), "nccl")),
    ({"LOCAL_WORLD_SIZE": "1"}, dist.DistInfo(0, 0, 1, CPU, "gloo")),
])
def test_pin_cpu_rank_leaves_other_cases_to_the_os(env, info, monkeypatch) -> None:
    monkeypatch.delenv("DDPLAB_PIN_CPU", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert pinning.pin_cpu_rank(info) is None


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and two cores")
def test_a_cpu_rank_is_pinned_with_all_its_threads() -> None:
    code = (
        "import json, os, threading, time, torch\n"
        "from ddplab import dist, pinning\n"
        "torch.set_num_threads(1)\n"
        "t = threading.Thread(target=time.sleep, args=(2,)); t.start()\n"
        "cores = pinning.pin_cpu_rank(dist.DistInfo(1, 1, 2, torch.device('cpu'), 'gloo'))\n"
        "tids = os.listdir('/proc/self/task')\n"
        "same = all(os.sched_getaffinity(int(t)) == set(cores) for t in tids)\n"
        "print(json.dumps({'cores': cores, 'threads': len(tids), 'all_threads': same}))\n"
    )
    cores = sorted(os.sched_getaffinity(0))
    env = {**os.environ, "LOCAL_WORLD_SIZE": "2", "DDPLAB_PIN_CPU": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["cores"] == [cores[1]]   # local rank 1 of 2: the second core it may use
    assert report["all_threads"] is True
    assert report["threads"] >= 2  # the extra thread was pinned too
