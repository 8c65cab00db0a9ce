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
            "09b_inside_a_step", "10_debugging", "11_sharding_and_model_parallel",
            "12_tensor_parallel", "13_capstone"]
NOTEBOOKS = sorted((ROOT / "notebooks").glob(NOTEBOOK_GLOB))
MAX_CELLS = 50   # longer, a notebook splits where its story turns, or cuts, or says why it cannot


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


def says_why_it_is_long(nb: dict) -> bool:
    """Its first markdown cell gives the reason it has more than MAX_CELLS cells."""
    first = next("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    return bool(re.search(rf"\b(?:over|more than) {MAX_CELLS} cells\b[^.]*\bbecause\b",
                          " ".join(first.split())))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_notebook_over_the_cell_limit_says_why(path):
    nb = json.loads(path.read_text())
    assert len(nb["cells"]) <= MAX_CELLS or says_why_it_is_long(nb), (
        f"{path.name} has {len(nb['cells'])} cells: split it where its story turns, or cut it, "
        f"or say why in its first markdown cell (\"... more than {MAX_CELLS} cells because ...\")")


MAX_WORDS = 3000   # of markdown: a lesson a learner reads in one sitting


def markdown_words(nb: dict) -> int:
    """Words of a notebook's markdown cells, reference-link definitions (``[a]: https://...``)
    left out: a source's address is not reading."""
    return sum(len(line.split()) for cell in nb["cells"] if cell["cell_type"] == "markdown"
               for line in "".join(cell["source"]).split("\n")
               if not re.match(r"\[[^\]]+\]:\s*https?://", line))


def test_words_are_counted_without_link_definitions():
    nb = {"cells": [{"cell_type": "markdown", "source": ["One two [three](x).\n", "\n",
                                                           "[a]: https://example.org/a b c\n"]},
                    {"cell_type": "code", "source": ["four five"]}]}
    assert markdown_words(nb) == 3


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_notebook_stays_under_the_word_limit(path):
    words = markdown_words(json.loads(path.read_text()))
    assert words <= MAX_WORDS, f"{path.name}: {words} words of markdown, over {MAX_WORDS}: cut"


def test_the_reason_for_a_long_notebook_is_read_from_its_first_markdown_cell():
    def notebook(*sources: str) -> dict:
        return {"cells": [{"cell_type": "code", "source": "import ddplab"}]
                + [{"cell_type": "markdown", "source": text} for text in sources]}

    why = f"It has more than {MAX_CELLS}\ncells because every fault gets a launch of its own."
    assert says_why_it_is_long(notebook(f"# 10 · Debugging\n\n{why}", "## 1."))
    assert not says_why_it_is_long(notebook("# 10 · Debugging", why))        # not its opening
    assert not says_why_it_is_long(notebook(f"# 10\n\nIt has more than {MAX_CELLS} cells."))


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


def test_strip_keeps_a_collapsed_proof_cell_collapsed():
    """A cell that only asserts the course's own claims is committed collapsed
    (``jupyter.source_hidden``: JupyterLab hides it, nbval still runs it); strip keeps that."""
    hidden = {"jupyter": {"source_hidden": True}, "tags": ["x"]}
    nb = {"cells": [{"cell_type": "code", "source": "assert 1", "outputs": [],
                     "execution_count": 3, "metadata": {**hidden, "execution": {"t": 1}}}],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    assert strip(nb)["cells"][0]["metadata"] == hidden


def collapsed_cells(nb: dict) -> list[dict]:
    return [c for c in nb["cells"] if c.get("metadata", {}).get("jupyter", {}).get("source_hidden")]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_collapsed_cell_is_a_proof_that_says_what_it_verified(path):
    """Collapsed, a proof must still be seen to have run: it asserts, and prints one line, which
    stays in view (its source is hidden, its output is not)."""
    for cell in collapsed_cells(json.loads(path.read_text())):
        source = "".join(cell["source"])
        assert cell["cell_type"] == "code", f"{path.name}: only proof cells are collapsed"
        assert re.search(r"^\s*assert\b", source, re.M), \
            f"{path.name}: a collapsed cell asserts:\n{source}"
        assert "print(" in source, \
            f"{path.name}: a collapsed cell prints what it verified:\n{source}"
        assert not cell["metadata"]["jupyter"].get("outputs_hidden"), \
            f"{path.name}: a collapsed cell's one line of output stays visible:\n{source}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_torch_is_cited_at_the_release_the_course_checks(path):
    """torch's files at the tag of the locked release (their lines move on main), its docs at
    docs.pytorch.org (the one host the course links)."""
    from ddplab.versions import LOCKED_TORCH

    text = path.read_text()
    blobs = set(re.findall(r"github\.com/pytorch/pytorch/blob/([^/\s\"]+)/", text))
    assert blobs <= {f"v{LOCKED_TORCH}"}, f"{path.name} links torch's files at {sorted(blobs)}"
    assert "://pytorch.org/docs" not in text, f"{path.name}: link docs.pytorch.org/docs instead"
