"""``ddplab check``: a class graded in one run (right and wrong submissions, a hang, a rank that
starts children, one that prints without end, one that leaves files), a learner's folder, and
the command's usage errors. Every submission solves exercise 08 (the cheapest launch)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from xml.etree import ElementTree

import pytest
from launch_path import launch_timeout

from ddplab import launch
from ddplab.lab import classrun, grading
from ddplab.workspace import NOTEBOOK_GLOB

from test_launch import processes, wait_gone

SOLUTIONS = Path(__file__).resolve().parent / "solutions"
NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
MEAN = "    return tensor / torch_dist.get_world_size()"
AVERAGE = '    """Return the element-wise mean of ``tensor`` over every rank (on every rank)."""\n'
LEAK = "leak-from-a-submission.txt"
SEEN = "reference-folders.txt"  # each rank of a-writes and z-reads: the folder it was given


def ddplab(*args, env=None, cwd=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "ddplab", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=cwd)


def variant(*edits: tuple[str, str]) -> str:
    """The reference solution of 08 with ``edits`` (old -> new, each found exactly once), and
    the skeleton's docstring: a learner's answer (the reference's own docstring marks a copy)."""
    text = mine((SOLUTIONS / "collective.py").read_text())
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


def mine(text: str) -> str:
    """A solution with the skeleton's docstring in place of the reference's first paragraph."""
    first = ('"""Reference solution of exercise 08 (the tests run it; the notebook never '
             'shows it).\n\n')
    assert text.startswith(first)
    return '"""' + text[len(first):]


def at_start_of_average(code: str) -> tuple[str, str]:
    """An edit that runs ``code`` (lines, indented 4) when ``average`` is called."""
    return AVERAGE, AVERAGE + code


# ------------------------------------------------------------------- a class in one run


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    root = tmp_path_factory.mktemp("class")
    tmp = tmp_path_factory.mktemp("tmp")
    outside = tmp_path_factory.mktemp("outside")  # where the test watches, not the grader
    pids = outside / "children.txt"
    seen = (f"    open({str(outside / SEEN)!r}, 'a').write(\n"
            f"        os.environ.get({classrun.REFERENCE_CACHE!r}, 'unset') + '\\n')\n")
    submissions = {
        "a-writes": variant(at_start_of_average(  # files where it runs, and 20 children
            seen + "    import subprocess, tempfile\n"
            f"    for folder in (os.getcwd(), tempfile.gettempdir(), '../exercises'):\n"
            f"        open(os.path.join(folder, {LEAK!r}), 'w').write('mine')\n"
            "    if torch_dist.get_rank() == 0 and not os.path.exists('started'):\n"
            "        open('started', 'w').close()\n"
            "        kids = [subprocess.Popen(['sleep', '600'], start_new_session=True)\n"
            "                for _ in range(20)]\n"
            f"        open({str(pids)!r}, 'a').write(''.join(f'{{k.pid}}\\n' for k in kids))\n"
        )),
        "hang": variant(("    torch_dist.all_reduce(tensor)  # SUM, in place\n",
                         "    if torch_dist.get_rank() == 0:\n"
                         "        torch_dist.all_reduce(tensor)\n")),
        "prints": variant(at_start_of_average(
            "    while torch_dist.get_rank() == 1:\n        print('spam ' * 2000)\n")),
        "right": variant(),
        "sum": variant((MEAN, "    return tensor")),
        "two-ranks": variant((MEAN, "    return tensor / 2")),
        "z-reads": variant(at_start_of_average(
            seen + "    import tempfile\n"
            f"    for folder in (os.getcwd(), tempfile.gettempdir(), '../exercises'):\n"
            f"        if os.path.exists(os.path.join(folder, {LEAK!r})):\n"
            "            raise SystemExit(f'another submission left a file in {folder}')\n")),
    }
    for name, text in submissions.items():
        text = text.replace("import torch\n", "import os\n\nimport torch\n", 1)
        if name == "two-ranks":  # a zip of the bare file
            with zipfile.ZipFile(root / f"{name}.zip", "w") as zipped:
                zipped.writestr("collective.py", text)
        elif name == "right":  # a whole course folder
            (root / name / "exercises").mkdir(parents=True)
            (root / name / "notebooks").mkdir()
            (root / name / "exercises" / "collective.py").write_text(text)
        else:  # the exercises folder alone
            (root / name / "exercises").mkdir(parents=True)
            (root / name / "exercises" / "collective.py").write_text(text)
    env = {**os.environ, "TMPDIR": str(tmp)}
    per_launch = f"{launch_timeout(15):g}"  # the hang and the printer run it out
    done = ddplab("check", "--submissions", str(root), "--jobs", "2", "--timeout", per_launch,
                  "--json", str(outside / "grades.json"), "--junit", str(outside / "grades.xml"),
                  env=env, cwd=outside)
    return {"done": done, "tmp": tmp, "outside": outside, "pids": pids, "root": root,
            "json": json.loads((outside / "grades.json").read_text()),
            "junit": ElementTree.parse(outside / "grades.xml").getroot()}


EXPECTED = {"a-writes": True, "hang": False, "prints": False, "right": True,
            "sum": False, "two-ranks": False, "z-reads": True}


def test_the_class_is_graded_with_one_verdict_per_submission(graded):
    done = graded["done"]
    assert done.returncode == 1, done.stderr  # not all pass
    rows = [line for line in done.stdout.splitlines()
            if re.fullmatch(r"\S+ +(pass|FAIL) +\d+/\d+", line)]
    assert rows == [f"{name:<10}  {'pass' if ok else 'FAIL':>4}  {int(ok)}/1"
                    for name, ok in EXPECTED.items()], done.stdout
    assert done.stdout.splitlines()[0].split() == ["submission", "08", "passed"]


def test_the_json_names_each_mistake(graded):
    found = {s["name"]: s["exercises"] for s in graded["json"]["submissions"]}
    assert list(found) == list(EXPECTED)
    assert {name: [e["correct"] for e in ex] for name, ex in found.items()} == \
        {name: [ok] for name, ok in EXPECTED.items()}
    assert found["right"][0]["sizes"] == [4, 2]
    assert "the sum over ranks" in found["sum"][0]["message"]
    two = found["two-ranks"][0]
    assert two["sizes"] == [4] and two["message"].startswith("not yet at 4 ranks")
    hang = found["hang"][0]["message"]
    assert "deadlock" in hang and re.search(r"rank \d waits in .* at line \d+ of "
                                            r"exercises/collective\.py", hang), hang
    assert "rank 1 waits at line" in found["prints"][0]["message"] and \
        "print('spam" in found["prints"][0]["message"]  # the endless printer, named
    assert graded["json"]["exercises"] == {"08": "collective.py"}


#: What the common JUnit schema (Apache Ant's junit.xsd, read by Jenkins, GitLab and GitHub
#: Classroom) requires: element -> (required attributes, required children in order).
JUNIT_REQUIRED = {
    "testsuite": ({"name", "tests", "failures", "errors", "time", "timestamp", "hostname",
                   "id", "package"}, ["properties", "system-out", "system-err"]),
    "testcase": ({"name", "classname", "time"}, []),
    "failure": ({"type"}, []),
}


def test_the_junit_file_has_one_suite_per_submission_and_one_case_per_exercise(graded):
    root = graded["junit"]
    assert root.tag == "testsuites"
    suites = root.findall("testsuite")
    assert [s.get("name") for s in suites] == list(EXPECTED)
    for suite in suites:
        attrs, children = JUNIT_REQUIRED["testsuite"]
        assert attrs <= set(suite.attrib), suite.attrib
        tags = [child.tag for child in suite]
        assert tags[0] == "properties" and tags[-2:] == ["system-out", "system-err"]
        assert set(tags[1:-2]) == {"testcase"}
        assert set(tags) <= {*children, "testcase"}
        cases = suite.findall("testcase")
        failures = [c for c in cases if c.find("failure") is not None]
        assert int(suite.get("tests")) == len(cases) == 1
        assert int(suite.get("failures")) == len(failures) == (not EXPECTED[suite.get("name")])
        float(suite.get("time"))
        for case in cases:
            assert JUNIT_REQUIRED["testcase"][0] <= set(case.attrib)
            float(case.get("time"))
            assert case.get("name") == "08 collective.py"
            for failure in case.findall("failure"):
                assert JUNIT_REQUIRED["failure"][0] <= set(failure.attrib)
                assert failure.get("message") and failure.text.startswith(failure.get("message"))
    assert int(root.get("failures")) == sum(not ok for ok in EXPECTED.values())


def test_no_process_of_any_submission_is_left(graded):
    started = [int(pid) for pid in graded["pids"].read_text().split()]
    assert len(started) >= 20  # the children were started (20 per launch of rank 0)
    assert wait_gone(started, 5.0) == []
    marker = f"TMPDIR={graded['tmp']}".encode()
    left = [pid for pid, _ppid, _argv, environ in processes()
            if any(item.startswith(marker) for item in environ)]
    assert left == []


def test_nothing_a_submission_wrote_reaches_another_or_stays(graded):
    # z-reads ran after a-writes, looking in its folder, its TMPDIR and its exercises/
    assert graded["json"]["submissions"][-1]["exercises"][0]["correct"]
    assert list(graded["tmp"].iterdir()) == []  # every working copy is gone
    assert not (graded["outside"] / LEAK).exists()
    assert sorted(p.name for p in graded["root"].iterdir()) == sorted(
        [n for n in EXPECTED if n != "two-ranks"] + ["two-ranks.zip"])  # submissions untouched


def test_the_grading_processes_of_a_class_share_one_reference_folder(graded):
    """What does not depend on the learner is done once per class: every grading process
    (and so every rank it launches) of two submissions is given the same folder for the
    capstone's reference runs, which is gone with the class's temporary folder."""
    seen = (graded["outside"] / SEEN).read_text().split()
    assert len(seen) >= 2 * (4 + 2), seen   # each rank of each launch of both submissions
    folders = set(seen)
    assert len(folders) == 1 and "unset" not in folders, folders
    folder = Path(folders.pop())
    assert folder.is_absolute() and str(folder).startswith(str(graded["tmp"]))
    assert not folder.exists()


# ------------------------------------------------------------------- a learner's folder


def test_a_learner_checks_the_exercise_they_changed(tmp_path):
    course = tmp_path / "course"
    (course / "notebooks").mkdir(parents=True)
    (course / "exercises").mkdir()
    for spec in grading.LAUNCHES.values():
        (course / "exercises" / spec.skeleton).write_bytes(
            grading.shipped_exercise(spec.skeleton).read_bytes())
    assert grading.changed(course) == []
    (course / "exercises" / "collective.py").write_text(variant((MEAN, "    return tensor / 2")))
    assert grading.changed(course) == ["08"]
    done = ddplab("check", "--junit", str(tmp_path / "mine.xml"),
                  env={**os.environ, "TMPDIR": str(tmp_path)}, cwd=course / "notebooks")
    assert done.returncode == 1, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Exercise 08 (collective.py): not yet at 4 "
                                                   "ranks:"), done.stdout
    suites = ElementTree.parse(tmp_path / "mine.xml").getroot().findall("testsuite")
    assert [(s.get("name"), s.get("tests"), s.get("failures")) for s in suites] == [
        ("course", "1", "1")]


def test_an_exercise_past_its_hard_limit_is_killed_with_all_it_started(tmp_path, monkeypatch):
    course = tmp_path / "course"
    (course / "exercises").mkdir(parents=True)
    (course / "exercises" / "collective.py").write_text(variant(at_start_of_average(
        "    import time\n    time.sleep(600)\n")))  # no launch of it ends before its timeout
    # the hard limit: 2 launches x (30 s - 29 s), long before the launch's own 30 s timeout
    # ends anything (whichever way ranks start, and however slowly)
    monkeypatch.setattr(grading, "SLACK", -29.0)
    outcome = grading.run_exercise("08", course, tmp_path, timeout=30.0)
    assert not outcome.correct and "still running after 2 s" in outcome.message
    ours = f"DDPLAB_RESULTS={course / 'results'}".encode()  # in the environment of all it ran
    assert [pid for pid, _ppid, _argv, environ in processes() if ours in environ] == []


# ------------------------------------------------------------------- the parts, no launch


def test_a_rank_that_prints_without_end_costs_a_bounded_tail(tmp_path, monkeypatch):
    script = tmp_path / "loud.py"
    script.write_text("for i in range(2000):\n    print('line', i, 'x' * 9000)\n")
    monkeypatch.setenv("DDPLAB_KEEP_LINES", "100")
    monkeypatch.setenv("DDPLAB_PRELOAD_TRAINING", "0")  # (a plain script: no torch needed)
    result = launch(script, 1, quiet=True, live=False, timeout=300)
    assert result.ok, result.error
    kept = result.logs[0]
    assert 100 <= len(kept) <= 200
    assert kept[-1].startswith("line 1999 xxx") and kept[-1].endswith("[cut]")
    assert all(len(line) < 9000 for line in kept)


def _fake_class(tmp_path: Path, monkeypatch, stop_at: str = "") -> list[tuple[str, str, bool]]:
    """Two submissions of 08 graded by :func:`classrun.grade_all`, each grading process replaced
    by a note of the reference folder its environment would hold and whether it exists then
    (a Ctrl-C at submission ``stop_at``)."""
    for name in ("a", "b"):
        (tmp_path / "class" / name / "exercises").mkdir(parents=True)
        (tmp_path / "class" / name / "exercises" / "collective.py").write_text(variant())
    seen: list[tuple[str, str, bool]] = []

    def run_exercise(key, course, work, timeout=None, env=None):
        folder = {**os.environ, **(env or {})}.get(classrun.REFERENCE_CACHE, "")
        seen.append((env["TMPDIR"], folder, os.path.isdir(folder)))
        if len(seen) == 2 and stop_at:
            raise KeyboardInterrupt
        return grading.Outcome(key, "collective.py", True, "correct")

    monkeypatch.setattr(classrun, "run_exercise", run_exercise)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))   # the class's temporary folder
    return seen


def test_a_class_s_reference_folder_is_one_and_removed_at_the_end(tmp_path, monkeypatch):
    monkeypatch.delenv(classrun.REFERENCE_CACHE, raising=False)
    seen = _fake_class(tmp_path, monkeypatch)
    results = classrun.grade_all(tmp_path / "class", ["08"])
    assert [r.passed for r in results] == [1, 1]
    (tmp_a, folder, existed), (tmp_b, other, _) = seen
    assert tmp_a != tmp_b and folder == other and existed   # two working copies, one folder
    assert Path(folder).parent.name.startswith("ddplab-grading-")   # the class's own folder
    assert not Path(folder).parent.exists()                           # removed at the end


def test_a_class_s_reference_folder_is_removed_after_a_ctrl_c(tmp_path, monkeypatch):
    monkeypatch.delenv(classrun.REFERENCE_CACHE, raising=False)
    seen = _fake_class(tmp_path, monkeypatch, stop_at="b")
    try:
        with pytest.raises(KeyboardInterrupt) as stop:
            classrun.grade_all(tmp_path / "class", ["08"])
    finally:
        grading.STOPPING.clear()   # (stop_all set it for this process)
    assert [r.name for r in stop.value.results] == ["a"]
    assert seen[0][1] == seen[1][1] and seen[0][2]
    assert not Path(seen[0][1]).parent.exists() and list(tmp_path.iterdir()) == [tmp_path / "class"]


def test_a_teacher_s_own_reference_folder_is_used_and_kept(tmp_path, monkeypatch):
    mine = tmp_path / "references"
    mine.mkdir()
    (mine / "kept").write_text("a reference run")
    monkeypatch.setenv(classrun.REFERENCE_CACHE, str(mine))
    seen = _fake_class(tmp_path, monkeypatch)
    classrun.grade_all(tmp_path / "class", ["08"])
    assert [folder for _tmp, folder, _ in seen] == [str(mine)] * 2
    assert (mine / "kept").read_text() == "a reference run"


def test_exercises_are_named_by_key_or_file():
    assert grading.exercise_key("04") == "04"
    assert grading.exercise_key("exercises/sampler.py") == "04"
    assert grading.exercise_key("collective") == "08"
    assert grading.exercise_key("sampler.txt") is None and grading.exercise_key("99") is None


def test_the_table_launches_what_the_notebooks_launch():
    """Each notebook's exercise cell: the file, the timeout and the judge of ``LAUNCHES``."""
    cells = {}
    for notebook in sorted(NOTEBOOKS.glob(NOTEBOOK_GLOB)):
        for cell in json.loads(notebook.read_text())["cells"]:
            source = "".join(cell["source"])
            key = re.search(r'ddplab\.check\("(\w+)", (?!answer\))\w+\)', source)  # not a quiz
            launched = re.search(r'launch\("\.\./exercises/(\w+\.py)", (\w+)([^)]*)\)', source)
            if key and launched:
                cells[key.group(1)] = (launched.group(1), launched.group(3))
    cells.pop("13", None)  # the capstone's five launches: test_capstone compares those
    assert set(cells) == set(grading.LAUNCHES) - {"13"}
    for key, (skeleton, rest) in cells.items():
        spec = grading.LAUNCHES[key]
        assert spec.skeleton == skeleton
        assert f"timeout={spec.timeout:g}" in rest
        assert ("args=PG_TIMEOUT" in rest) == bool(spec.args)
        assert len(spec.sizes) > 1 or key in ("06", "11")


def test_submission_files_are_found_in_a_course_folder_or_bare(tmp_path):
    (tmp_path / "a" / "deep" / "exercises").mkdir(parents=True)
    (tmp_path / "a" / "deep" / "exercises" / "sampler.py").write_text("x")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "sampler.py").write_text("y")
    (tmp_path / "b" / "notes.py").write_text("z")
    assert list(classrun.exercise_files(tmp_path / "a")) == ["sampler.py"]
    assert list(classrun.exercise_files(tmp_path / "b")) == ["sampler.py"]
    assert classrun.handed_in(tmp_path / "b") == ["04"]


def test_a_zip_that_escapes_its_folder_is_refused(tmp_path):
    with zipfile.ZipFile(tmp_path / "evil.zip", "w") as zipped:
        zipped.writestr("../../collective.py", "print('out')\n")
    with pytest.raises(ValueError, match="outside its folder"):
        classrun._unzip(tmp_path / "evil.zip", tmp_path / "into")


@pytest.mark.parametrize("args,words", [
    (["nope"], "neither an exercise"),
    (["99"], "neither an exercise"),
    (["--jobs", "0", "--submissions", "."], "--jobs"),
    (["--timeout", "0", "04"], "--timeout"),
    (["--jobs", "2", "04"], "add --submissions"),
    (["--submissions", "missing"], "not a folder"),
    (["--submissions", "empty"], "holds no submissions"),
    ([], "no course folder"),
])
def test_usage_errors_say_what_to_do(tmp_path, args, words):
    (tmp_path / "empty").mkdir()
    done = ddplab("check", *args, cwd=tmp_path, timeout=60)
    assert done.returncode == 2 and words in done.stderr, done.stderr


def test_an_unchanged_course_asks_for_an_exercise(tmp_path):
    assert ddplab("init", str(tmp_path / "course"), timeout=60).returncode == 0
    done = ddplab("check", str(tmp_path / "course"), timeout=60)
    assert done.returncode == 2 and "ddplab check 04" in done.stderr, done.stderr


def test_the_classroom_workflow_grades_every_exercise():
    yaml = pytest.importorskip("yaml")
    workflow = yaml.safe_load((NOTEBOOKS.parent / "examples" / "github-classroom.yml").read_text())
    steps = workflow["jobs"]["run-autograding-tests"]["steps"]
    graders = {s["id"]: s["with"]["command"] for s in steps
               if s.get("uses", "").startswith("classroom-resources/autograding-command-grader")}
    assert {command.split()[4] for command in graders.values()} == set(grading.LAUNCHES)
    for command in graders.values():
        key = command.split()[4]
        assert command == f"python -m ddplab check {key} --junit verdicts-{key}.xml"
    reporter = next(s for s in steps if "grading-reporter" in s.get("uses", ""))
    assert reporter["with"]["runners"].split(",") == list(graders)
    assert set(reporter["env"]) == {f"{step.upper()}_RESULTS" for step in graders}


def test_11b_is_launched_as_its_judge_expects():
    """``ddplab check 11b``'s three launches are the runs its judge reads, at their sizes."""
    from ddplab.lab.judges.sharding import FSDP2_RUNS as judged

    assert {name: size for name, size, _ in grading.FSDP2_RUNS} == judged
    assert [size for _, size, _ in grading.FSDP2_RUNS] == list(grading.LAUNCHES["11b"].sizes)
    assert [args[0] for _, _, args in grading.FSDP2_RUNS] == ["--save", "--load", "--load"]


def test_a_class_folder_left_by_a_killed_grading_goes_at_the_next_one(tmp_path, monkeypatch):
    short = Path(tempfile.mkdtemp(prefix="dd", dir="/tmp"))  # (a long TMPDIR is left for /tmp)
    try:
        (tmp_path / "alice").mkdir()
        code = ("import sys, time\nfrom pathlib import Path\nfrom ddplab.lab import classrun\n"
                "def hold(path, selected, base, *rest):\n"
                "    print(base, flush=True)\n    time.sleep(120)\n"
                "classrun.grade = hold\nclassrun.grade_all(Path(sys.argv[1]), ['03'])\n")
        held = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], text=True,
                                env={**os.environ, "TMPDIR": str(short)}, stdout=subprocess.PIPE)
        left = Path(held.stdout.readline().strip())
        held.kill()   # kill -9: no finally, no atexit
        held.wait()
        assert left.is_dir() and left.parent == short and (left / "references").is_dir()
        monkeypatch.setattr(tempfile, "tempdir", str(short))
        (tmp_path / "alice").rmdir()
        assert classrun.grade_all(tmp_path, ["03"]) == []
        assert not left.exists() and list(short.iterdir()) == []
    finally:
        shutil.rmtree(short, ignore_errors=True)
