"""The committed notebooks: all there, stripped, and built the way the course promises."""

import json
import re
from pathlib import Path

import pytest

from ddplab.lab.course import is_stripped, strip
from ddplab.workspace import NOTEBOOK_GLOB

ROOT = Path(__file__).resolve().parent.parent
EXPECTED = ["01_single_gpu", "02_data_parallel", "03_ddp_spawn", "03b_ddp_internals",
            "04_sampler_set_epoch", "05_barrier_checkpoint", "06_amp", "07_torchrun_multinode",
            "07b_nodes_slurm", "08_collectives_ring_allreduce", "09_scaling_benchmark",
            "10_debugging", "11_sharding_and_model_parallel", "12_tensor_parallel", "13_capstone"]
NOTEBOOKS = sorted((ROOT / "notebooks").glob(NOTEBOOK_GLOB))


def code_of(nb: dict) -> str:
    return "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")


def test_the_course_has_every_notebook_in_order():
    assert [p.stem for p in NOTEBOOKS] == EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_stripped(path):
    nb = json.loads(path.read_text())
    assert is_stripped(nb), f"{path.name} has outputs or metadata: run `make strip`"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_follows_the_course_shape(path):
    nb = json.loads(path.read_text())
    first = "".join(nb["cells"][0]["source"]).lower()
    assert nb["cells"][0]["cell_type"] == "markdown"
    assert "you will" in first or "goals" in first, "open with what the learner will do"
    code = code_of(nb)
    assert "ddplab.doctor(" in code, "every notebook has a hardware cell"
    assert len(re.findall(r"^\s*assert\b", code, re.M)) >= 3, "claims need asserts"
    assert "ddplab.check(" in code, "every notebook ends with a checked exercise"
    assert "ddplab.show(" in code, "code is shown from the real files"
    assert "DDPLAB_WORKLOAD" in code, "the documented workload knob"


def test_strip_removes_outputs_and_counts():
    nb = {"cells": [{"cell_type": "code", "source": "1", "metadata": {"collapsed": True},
                     "outputs": [{"output_type": "stream", "name": "stdout", "text": "1"}],
                     "execution_count": 4}],
          "metadata": {"widgets": {}, "kernelspec": {"name": "x"}}, "nbformat": 4,
          "nbformat_minor": 5}
    assert not is_stripped(nb)
    clean = strip(nb)
    assert clean["cells"][0]["outputs"] == [] and clean["cells"][0]["execution_count"] is None
    assert "widgets" not in clean["metadata"] and is_stripped(clean)
