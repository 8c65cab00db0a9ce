"""Copies of the shipped references: found by ``ddplab.lab.copies`` and reported by ``ddplab check
--submissions`` as their own verdict (text, JSON, JUnit), without a launch; a learner's own job,
in another style, is not one."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

from ddplab.lab import copies, grading

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "ddplab" / "workers" / "capstone.py"
SOLUTIONS = ROOT / "tests" / "solutions"
SKELETON = ROOT / "exercises" / "capstone.py"
ONLY_WORKER = {copies.CAPSTONE: WORKER}


class _Rename(ast.NodeTransformer):
    """A copier's disguise: every name the author chose renamed, docstrings gone."""

    def __init__(self, keep: set[str]):
        self.keep, self.names = keep, {}

    def new(self, name: str) -> str:
        return name if name in self.keep else self.names.setdefault(name, f"v{len(self.names)}")

    def visit_Name(self, node):
        node.id = self.new(node.id)
        return node

    def visit_arg(self, node):
        node.arg = self.new(node.arg)
        return node

    def visit_FunctionDef(self, node):
        node.name = self.new(node.name)
        if ast.get_docstring(node):
            node.body = node.body[1:]
        return self.generic_visit(node)


def disguised(path: Path) -> str:
    tree = ast.parse(path.read_text())
    tree.body = tree.body[1:]   # the module's docstring
    keep = {a.asname or a.name.split(".")[0] for n in ast.walk(tree)
            if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    keep |= set(dir(__builtins__)) | {"__name__"}
    return '"""My capstone."""\n' + ast.unparse(_Rename(keep).visit(tree))


def judged(tmp_path: Path, text: str, key: str = "13", found=None) -> str | None:
    spec = grading.LAUNCHES[key]
    mine = tmp_path / spec.skeleton
    mine.write_text(text)
    return copies.copied(key, mine, ROOT / "exercises" / spec.skeleton, found)


def test_the_reference_job_copied_is_named(tmp_path):
    said = judged(tmp_path, WORKER.read_text())
    assert said and "ddplab.workers.capstone" in said, said


def test_a_disguised_copy_is_found_in_its_syntax(tmp_path):
    text = disguised(WORKER)
    assert "def main" not in text and "checkpoint_dir" in text   # renamed, the API kept
    said = judged(tmp_path, text, found=ONLY_WORKER)
    assert said and "runs of 3 statements" in said and "ddplab.workers.capstone's" in said, said


def test_a_job_that_imports_or_runs_the_reference_is_a_copy(tmp_path):
    imports = "from ddplab.workers.capstone import main\n\nmain()\n"
    imported = "import ddplab.workers.capstone as job\n\njob.main()\n"
    runs = ('"""My job."""\nimport runpy\n\nrunpy.run_module("ddplab.workers.capstone", '
            'run_name="__main__")\n')
    for text, words in ((imports, "imports main from ddplab.workers.capstone (line 1)"),
                        (imported, "imports ddplab.workers.capstone (line 1)"),
                        (runs, "names ddplab.workers.capstone in a string (line 4)")):
        said = judged(tmp_path, text)
        assert said and words in said, (text, said)


def test_a_copied_exercise_solution_is_named(tmp_path):
    said = judged(tmp_path, (SOLUTIONS / "tp_plan.py").read_text(), key="12")
    assert said and "tests/solutions/tp_plan.py" in said, said


def test_a_job_of_ones_own_is_not_a_copy(tmp_path):
    # the tests' right job in another style: the same API, other code
    assert judged(tmp_path, (SOLUTIONS / "capstone.py").read_text(), found=ONLY_WORKER) is None
    # the skeleton, and a file that does not parse, are nobody's copy
    assert judged(tmp_path, SKELETON.read_text()) is None
    assert judged(tmp_path, "def main(:\n") is None
    # a docstring may name the reference; a course module that is not one may be imported
    own = (SOLUTIONS / "capstone.py").read_text().replace(
        '"""A right capstone', '"""Unlike ddplab.workers.capstone, a right capstone', 1)
    assert judged(tmp_path, own, found=ONLY_WORKER) is None
    ten = (SOLUTIONS / "uneven_join.py").read_text()
    assert "from ddplab.lab.answers.running_loss import" in ten
    mine = '"""My answer to 10."""\n' + ten.split('"""', 2)[2]
    assert judged(tmp_path, mine, key="10") is None


def test_the_references_are_the_shipped_ones():
    assert copies.references("13", "capstone.py") == {
        copies.CAPSTONE: WORKER, "tests/solutions/capstone.py": SOLUTIONS / "capstone.py"}
    assert copies.references("08", "collective.py") == {
        "tests/solutions/collective.py": SOLUTIONS / "collective.py"}


def test_a_class_s_copies_get_their_own_verdict_in_every_report(tmp_path):
    """Three copies, reported without a launch: a copied capstone, one that imports the
    reference, a copied exercise (12); each other exercise is not handed in."""
    root = tmp_path / "class"
    files = {"copies-13": ("capstone.py", WORKER.read_text()),
             "imports-13": ("capstone.py", "from ddplab.workers.capstone import main\nmain()\n"),
             "copies-12": ("tp_plan.py", (SOLUTIONS / "tp_plan.py").read_text())}
    for name, (file, text) in files.items():
        (root / name / "exercises").mkdir(parents=True)
        (root / name / "exercises" / file).write_text(text)
    out = tmp_path / "out"
    out.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "ddplab", "check", "--submissions", str(root), "--json",
         str(out / "grades.json"), "--junit", str(out / "grades.xml")],
        capture_output=True, text=True, timeout=300, cwd=out,
        env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 1, done.stderr
    rows = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines()[1:4]}
    assert rows == {"copies-12": ["COPY", "FAIL", "0/2"], "copies-13": ["FAIL", "COPY", "0/2"],
                    "imports-13": ["FAIL", "COPY", "0/2"]}, done.stdout
    assert done.stdout.count(grading.COPIED) == 3, done.stdout
    found = {s["name"]: {e["key"]: e for e in s["exercises"]}
             for s in json.loads((out / "grades.json").read_text())["submissions"]}
    assert {name: {k: e["verdict"] for k, e in ex.items()} for name, ex in found.items()} == {
        "copies-12": {"12": grading.COPIED, "13": "not handed in"},
        "copies-13": {"12": "not handed in", "13": grading.COPIED},
        "imports-13": {"12": "not handed in", "13": grading.COPIED}}
    assert "ddplab.workers.capstone" in found["imports-13"]["13"]["message"]
    assert "tests/solutions/tp_plan.py" in found["copies-12"]["12"]["message"]
    cases = ElementTree.parse(out / "grades.xml").getroot().iter("testcase")
    types = {(c.get("classname").split(".")[0], c.get("name").split()[0]):
             c.find("failure").get("type") for c in cases}
    assert [k for k, t in sorted(types.items()) if t == grading.COPIED] == [
        ("copies-12", "12"), ("copies-13", "13"), ("imports-13", "13")]
