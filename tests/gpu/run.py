"""`make test-gpu`: the launcher suite and every notebook on 2 or more GPUs, with nccl.

Run it::

    make test-gpu                       # or: .venv/bin/python tests/gpu/run.py

On a machine with fewer than 2 GPUs it prints one line saying why it did nothing and exits 0.
GPUs are counted by ``nvidia-smi`` and then by torch in a subprocess (``python -m ddplab.env``):
this process never imports torch, so it never initialises CUDA. Launches pick nccl by themselves
whenever every process gets a GPU (``ddplab.dist.pick_backend``); the run prints which backend
the machine's launches use, then each test and notebook with its outcome, then the totals.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER_TESTS = ["tests/test_launch.py", "tests/test_rank_behaviour.py", "tests/test_cli.py"]
NB_TIMEOUT = os.environ.get("NB_TIMEOUT", "600")


def nvidia_smi_gpus() -> tuple[int, str]:
    """GPUs the NVIDIA driver lists (``nvidia-smi -L``), and a note when it cannot tell."""
    if shutil.which("nvidia-smi") is None:
        return 0, "no nvidia-smi on PATH (no NVIDIA driver)"
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 0, f"nvidia-smi failed: {exc}"
    if out.returncode != 0:
        return 0, f"nvidia-smi failed: {(out.stderr or out.stdout).strip()[:200]}"
    count = sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    return count, f"nvidia-smi lists {count}"


def torch_facts() -> dict:
    """What torch sees, asked in a subprocess (``python -m ddplab.env --json``)."""
    out = subprocess.run([sys.executable, "-m", "ddplab.env", "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise SystemExit("make test-gpu: torch could not be inspected:\n" + out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def outcomes(junit: Path) -> list[tuple[str, str]]:
    """(test id, passed/failed/error/skipped) for every test case in a JUnit XML report."""
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}".strip(":")
        kind = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                kind = {"failure": "failed"}.get(child.tag, child.tag)
        rows.append((name, kind))
    return rows


def summarise(rows: list[tuple[str, str]]) -> dict[str, dict[str, int]]:
    """Outcome counts per test file or notebook (the part of a test id before ``::``)."""
    groups: dict[str, dict[str, int]] = {}
    for name, kind in rows:
        counts = groups.setdefault(name.split("::")[0],
                                   {"passed": 0, "failed": 0, "error": 0, "skipped": 0})
        counts[kind] += 1
    return groups


def run_pytest(label: str, args: list[str], junit: Path) -> list[tuple[str, str]]:
    """Run pytest with live output; return each test's outcome."""
    print(f"--- {label}", flush=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           f"--junitxml={junit}", *args]
    subprocess.run(cmd, cwd=ROOT)
    if not junit.exists():
        return [(label, "error")]
    return outcomes(junit)


def main() -> int:
    smi_count, smi_note = nvidia_smi_gpus()
    if smi_count < 2:
        print(f"make test-gpu: nothing to do here, it needs 2 or more GPUs: {smi_note}")
        return 0
    facts = torch_facts()
    if facts["gpu_count"] < 2 or not facts["backends"]["nccl"]:
        print(f"make test-gpu: nothing to do here: {smi_note} GPUs but torch {facts['torch']} "
              f"sees {facts['gpu_count']} (nccl available: {facts['backends']['nccl']}); "
              "install a CUDA build of torch that matches the driver")
        return 0
    names = ", ".join(g["name"] for g in facts["gpus"])
    print(f"make test-gpu: torch {facts['torch']} (CUDA {facts['cuda_build']}), "
          f"{facts['gpu_count']} GPUs ({names}); launches whose processes each get a GPU "
          "use nccl")
    out = ROOT / "build" / "gpu"
    out.mkdir(parents=True, exist_ok=True)
    env_note = os.environ.get("DDPLAB_BACKEND")
    if env_note:
        print(f"note: DDPLAB_BACKEND={env_note} is set and forces that backend")
    rows = run_pytest("launcher suite", LAUNCHER_TESTS, out / "launcher.xml")
    notebooks = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "notebooks").glob("*.ipynb"))
    rows += run_pytest("notebooks", ["--nbval-lax", "--nbval-current-env",
                                     f"--nbval-cell-timeout={NB_TIMEOUT}", *notebooks],
                       out / "notebooks.xml")
    print("--- make test-gpu results (per test file or notebook)")
    for group, kinds in summarise(rows).items():
        print(f"{group}: " + ", ".join(f"{n} {k}" for k, n in kinds.items() if n))
    for name, kind in rows:
        if kind in ("failed", "error"):
            print(f"{kind.upper()}: {name}")
    counts = {k: sum(1 for _n, kind in rows if kind == k)
              for k in ("passed", "failed", "error", "skipped")}
    print(f"gpu: {counts['passed']} passed, {counts['failed'] + counts['error']} failed, "
          f"{counts['skipped']} skipped")
    return 0 if counts["failed"] + counts["error"] == 0 and counts["passed"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
