"""What ddplab decides on a machine with GPUs, on a machine without: torch.cuda's answers are
patched in this process only (run it as a subprocess, so the test process never asks CUDA).

    python tests/scripts/fake_gpus.py '[{"gpus": 2, "p2p": false, "nccl": true}, ...]'

Each machine is a JSON object: ``gpus``, ``p2p`` and ``nccl`` (default true), and ``env``, the
environment variables set for it (``DDPLAB_BACKEND`` and ``NCCL_P2P_DISABLE`` are unset unless
named there). Prints first this machine's own GPU count and torch version, as torch answers
before anything is patched; then one JSON line per machine, in order: the probe's facts, the
doctor's plan line and problems, and the backend and devices ``ddplab.dist`` gives the ranks of
a course launch (max(2, gpus) processes), and what ``ddplab.doctor`` reports (its backend and
plan) there.
"""
import json
import os
import sys
from types import SimpleNamespace
from unittest import mock

import torch
import torch.distributed as dist

from ddplab import env
from ddplab import dist as ddist


def decide(spec: dict) -> dict:
    """What the probe, the doctor and ``ddplab.dist`` decide on the machine ``spec``."""
    gpus, p2p, nccl = spec["gpus"], spec.get("p2p", True), spec.get("nccl", True)
    for name in ("DDPLAB_BACKEND", "NCCL_P2P_DISABLE"):
        os.environ.pop(name, None)
    os.environ.update(spec.get("env", {}))
    with mock.patch.object(torch.cuda, "is_available", lambda: gpus > 0), \
            mock.patch.object(torch.cuda, "device_count", lambda: gpus), \
            mock.patch.object(torch.cuda, "get_device_properties",
                              lambda i: SimpleNamespace(name="NVIDIA GeForce RTX 4090",
                                                        total_memory=24 * 2**30)), \
            mock.patch.object(torch.cuda, "can_device_access_peer", lambda i, j: p2p), \
            mock.patch.object(dist, "is_nccl_available", lambda: nccl):
        facts = env._probe_here()
        facts.update(shm_bytes=2**32, start_method="fork")
        nprocs = max(2, gpus)
        os.environ["LOCAL_WORLD_SIZE"] = str(nprocs)
        backend = ddist.pick_backend()
        devices = [str(ddist.pick_device(rank, backend)) for rank in range(nprocs)]
        single = ddist.pick_backend(None, 1)
        with mock.patch.object(env, "probe", lambda refresh=False: dict(facts)):
            report = env.doctor(quiet=True)
        return {"facts": facts, "plan": env.course_plan(facts),
                "problems": env.problems(facts), "backend": backend, "devices": devices,
                "single": str(ddist.pick_device(0, single)),
                "doctor": {"backend": report["backend"], "plan": report["plan"]}}


print(json.dumps({"gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
                  "torch": torch.__version__}), flush=True)
for machine in json.loads(sys.argv[1]):
    print(json.dumps(decide(machine)), flush=True)
