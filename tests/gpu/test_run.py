"""``make test-gpu`` (tests/gpu/run.py): what it says on a machine without 2 GPUs, and its tally."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

RUN = Path(__file__).with_name("run.py")
sys.path.insert(0, str(RUN.parent))
import run  # noqa: E402


def run_with_path(tmp_path: Path, smi: str | None) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if smi is not None:
        (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\n{smi}\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    env = dict(os.environ, PATH=str(bin_dir))  # no real nvidia-smi can be found
    return subprocess.run([sys.executable, str(RUN)], env=env, capture_output=True, text=True,
                          timeout=300)


def test_without_nvidia_smi_it_says_why_in_one_line(tmp_path):
    out = run_with_path(tmp_path, None)
    assert out.returncode == 0
    assert out.stdout.strip().splitlines() == [
        "make test-gpu: nothing to do here, it needs 2 or more GPUs: no nvidia-smi on PATH "
        "(no NVIDIA driver)"]


def test_one_gpu_is_not_enough(tmp_path):
    out = run_with_path(tmp_path, "echo 'GPU 0: Tesla T4 (UUID: GPU-1)'")
    assert out.returncode == 0
    assert out.stdout.strip() == \
        "make test-gpu: nothing to do here, it needs 2 or more GPUs: nvidia-smi lists 1"


def test_gpus_the_driver_lists_but_torch_cannot_use_are_said(tmp_path):
    out = run_with_path(tmp_path, "echo 'GPU 0: A (UUID: 1)'; echo 'GPU 1: B (UUID: 2)'")
    facts = run.torch_facts()
    if facts["gpu_count"] >= 2:  # a real 2-GPU machine: this case cannot be faked there
        return
    assert out.returncode == 0
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and "nvidia-smi lists 2 GPUs but torch" in lines[0]
    assert f"sees {facts['gpu_count']}" in lines[0]


def test_outcomes_are_tallied_per_file_and_notebook(tmp_path):
    report = tmp_path / "r.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_launch" name="test_a"/>'
        '<testcase classname="tests.test_launch" name="test_b"><failure message="x"/></testcase>'
        '<testcase classname="notebooks.03_ddp_spawn.ipynb" name="Cell 0"/>'
        '<testcase classname="notebooks.03_ddp_spawn.ipynb" name="Cell 1"><skipped/></testcase>'
        '</testsuite></testsuites>')
    rows = run.outcomes(report)
    assert rows == [("tests.test_launch::test_a", "passed"),
                    ("tests.test_launch::test_b", "failed"),
                    ("notebooks.03_ddp_spawn.ipynb::Cell 0", "passed"),
                    ("notebooks.03_ddp_spawn.ipynb::Cell 1", "skipped")]
    tally = run.summarise(rows)
    assert tally["tests.test_launch"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 0}
    assert tally["notebooks.03_ddp_spawn.ipynb"]["skipped"] == 1
