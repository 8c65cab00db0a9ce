"""The learner's course folder: ``ddplab init`` keeps the learner's changes, ``ddplab lab`` opens
it, exercises and results are found in it (ddplab.workspace)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddplab import cli, workspace
from ddplab.lab import judges, plots
from ddplab.workspace import NOTEBOOK_GLOB

ROOT = Path(__file__).resolve().parent.parent


def _shipped() -> set[str]:
    return {f"notebooks/{p.name}" for p in (ROOT / "notebooks").glob(NOTEBOOK_GLOB)} | \
        {f"exercises/{p.name}" for p in (ROOT / "exercises").glob("*.py")}


def test_init_writes_every_notebook_and_exercise(tmp_path):
    report = workspace.init(tmp_path / "course")
    assert set(report.written) == _shipped() and not report.kept
    for rel in report.written:
        assert (tmp_path / "course" / rel).read_bytes() == (ROOT / rel).read_bytes()


def test_init_keeps_what_the_learner_changed_and_says_so(tmp_path, capsys):
    workspace.init(tmp_path)
    mine = tmp_path / "exercises" / "ddp_wrap.py"
    mine.write_text(mine.read_text() + "# my answer\n")
    (tmp_path / "notebooks" / "04_sampler_set_epoch.ipynb").unlink()

    assert cli.main(["init", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert mine.read_text().endswith("# my answer\n")
    assert "kept 1 file(s) you changed" in out and "exercises/ddp_wrap.py" in out
    assert "wrote 1 notebooks" in out and f"ddplab lab {tmp_path}" in out
    assert (tmp_path / "notebooks" / "04_sampler_set_epoch.ipynb").exists()


def test_init_refreshes_a_file_an_earlier_init_wrote_and_nobody_changed(tmp_path):
    workspace.init(tmp_path)
    old = tmp_path / "exercises" / "amp.py"
    old.write_text("# what an older ddplab shipped\n")
    manifest = json.loads((tmp_path / workspace.MANIFEST).read_text())
    manifest["files"]["exercises/amp.py"] = workspace._sha256(old)
    (tmp_path / workspace.MANIFEST).write_text(json.dumps(manifest))

    report = workspace.init(tmp_path)
    assert report.refreshed == ["exercises/amp.py"] and not report.kept
    assert old.read_bytes() == (ROOT / "exercises" / "amp.py").read_bytes()
    assert len(report.unchanged) == len(_shipped()) - 1


def test_init_refuses_a_file_and_the_installed_package(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert cli.main(["init", str(tmp_path / "file")]) == 2
    assert "give ddplab init a folder" in capsys.readouterr().err
    with pytest.raises(ValueError, match="inside the installed ddplab package"):
        workspace.init(workspace.PACKAGE / "course")
    assert not (workspace.PACKAGE / "course").exists()


def test_the_course_folder_is_found_from_the_notebooks_folder(tmp_path, monkeypatch):
    workspace.init(tmp_path)
    monkeypatch.delenv("DDPLAB_RESULTS", raising=False)
    monkeypatch.chdir(tmp_path / "notebooks")
    assert workspace.find_course() == tmp_path
    assert judges.skeleton_path("05") == tmp_path / "exercises" / "checkpoint.py"
    assert plots.save_result("baseline", {"a": 1}) == tmp_path / "results" / "baseline.json"
    assert plots.load_result("baseline") == {"a": 1}


def test_results_go_to_ddplab_results_else_the_user_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPLAB_RESULTS", str(tmp_path / "mine"))
    monkeypatch.chdir(tmp_path)
    assert workspace.results_dir() == tmp_path / "mine"
    monkeypatch.delenv("DDPLAB_RESULTS")
    assert workspace.find_course() is None
    assert workspace.results_dir() == workspace.user_dir() / "results"
    assert workspace.PACKAGE not in workspace.results_dir().parents
    # Outside a course, the judges and ddplab.show read the shipped skeletons.
    assert judges.skeleton_path("03") == workspace.shipped_dir() / "exercises" / "ddp_wrap.py"


def test_a_course_folder_inside_the_package_does_not_count(tmp_path, monkeypatch):
    fake_package = tmp_path / "ddplab"
    (fake_package / "_course" / "notebooks").mkdir(parents=True)
    (fake_package / "_course" / "exercises").mkdir()
    monkeypatch.setattr(workspace, "PACKAGE", fake_package)
    assert workspace.shipped_dir() == fake_package / "_course"
    assert workspace.find_course(fake_package / "_course" / "notebooks") is None


def test_lab_command_listens_on_loopback_and_allows_root_only_as_root(tmp_path):
    as_user = workspace.lab_command(tmp_path, is_root=False)
    assert as_user[:3] == [sys.executable, "-m", "jupyterlab"]
    assert f"--notebook-dir={tmp_path.resolve()}" in as_user and "--ip=127.0.0.1" in as_user
    assert "--allow-root" not in as_user
    assert "--allow-root" in workspace.lab_command(tmp_path, is_root=True)


def test_lab_without_a_course_says_to_run_init(tmp_path, capsys):
    assert cli.main(["lab", str(tmp_path / "none")]) == 2
    assert f"ddplab init {tmp_path / 'none'}" in capsys.readouterr().err


@pytest.mark.slow
def test_ddplab_lab_starts_jupyterlab_in_the_course_folder(tmp_path):
    workspace.init(tmp_path / "course")
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           "JUPYTER_CONFIG_DIR": str(tmp_path / "config")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddplab", "lab", str(tmp_path / "course"), "--no-browser",
         "--port=0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True)
    seen = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            if "http://127.0.0.1:" in line:
                break
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = "".join(seen)
    assert "http://127.0.0.1:" in text, text
    assert str((tmp_path / "course").resolve()) in text, text
