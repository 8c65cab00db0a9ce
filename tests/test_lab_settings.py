"""The course's JupyterLab settings: ``make lab`` and ``ddplab lab`` open without JupyterLab's
"get notified about official Jupyter news?" pop-up. ``ddplab/lab/jupyter/labconfig/
default_setting_overrides.json`` (package data, so it is in the wheel) turns the news and the
update check off; JupyterLab reads it from every folder on ``JUPYTER_CONFIG_PATH``
(``<folder>/labconfig/default_setting_overrides.json``), which both put first."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from ddplab import cli, workspace

ROOT = Path(__file__).resolve().parent.parent
OVERRIDES = workspace.LAB_CONFIG / "labconfig" / "default_setting_overrides.json"
PLUGIN = "@jupyterlab/apputils-extension:notification"
WANTED = {"fetchNews": "false", "checkForUpdates": False}


def overrides_seen(config_path: str) -> dict:
    """What JupyterLab's server reads as setting overrides with this ``JUPYTER_CONFIG_PATH``."""
    manager = pytest.importorskip("jupyter_server.services.config.manager")
    old = os.environ.get("JUPYTER_CONFIG_PATH")
    os.environ["JUPYTER_CONFIG_PATH"] = config_path
    try:
        return manager.ConfigManager(config_dir_name="labconfig").get("default_setting_overrides")
    finally:
        os.environ.pop("JUPYTER_CONFIG_PATH")
        if old is not None:
            os.environ["JUPYTER_CONFIG_PATH"] = old


def test_jupyterlab_reads_the_overrides_from_the_config_path():
    assert overrides_seen(str(workspace.LAB_CONFIG))[PLUGIN] == WANTED


def test_ddplab_lab_starts_jupyterlab_with_the_course_settings(tmp_path, monkeypatch):
    """``ddplab lab`` (the pip-installed learner's route), without starting JupyterLab: the
    environment it hands to JupyterLab puts the shipped settings first on
    JUPYTER_CONFIG_PATH, keeps the learner's own folders after them, and plots inline."""
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "exercises").mkdir()
    started = []
    monkeypatch.setattr(workspace.subprocess, "call",
                        lambda cmd, env: started.append((cmd, env)) or 0)
    monkeypatch.setenv("JUPYTER_CONFIG_PATH", str(tmp_path / "mine"))
    assert cli.main(["lab", str(tmp_path), "--no-browser"]) == 0
    [(cmd, env)] = started
    assert cmd[:3] == [sys.executable, "-m", "jupyterlab"] and cmd[-1] == "--no-browser"
    assert env["JUPYTER_CONFIG_PATH"].split(os.pathsep) == [str(workspace.LAB_CONFIG),
                                                           str(tmp_path / "mine")]
    assert env["MPLBACKEND"] == "module://matplotlib_inline.backend_inline"
    assert overrides_seen(env["JUPYTER_CONFIG_PATH"])[PLUGIN] == WANTED


def test_lab_environment_without_a_config_path_of_the_learners():
    env = workspace.lab_environment({"HOME": "/home/learner"})
    assert env["JUPYTER_CONFIG_PATH"] == str(workspace.LAB_CONFIG)
    assert env["HOME"] == "/home/learner"


def test_the_settings_ship_with_the_package_and_make_lab_uses_them():
    package_data = (ROOT / "pyproject.toml").read_text()
    shipped = OVERRIDES.relative_to(workspace.PACKAGE).as_posix()
    assert re.search(r'ddplab = \[[^\]]*"lab/jupyter/labconfig/\*\.json"', package_data), shipped
    assert 'JUPYTER_CONFIG_PATH="$(CURDIR)/ddplab/lab/jupyter' in (ROOT / "Makefile").read_text()


def test_the_overrides_are_valid_settings_of_the_installed_jupyterlab():
    schema_file = (Path(sys.prefix) / "share" / "jupyter" / "lab" / "schemas" / "@jupyterlab"
                   / "apputils-extension" / "notification.json")
    if not schema_file.is_file():
        pytest.skip(f"JupyterLab is not installed in {sys.prefix}")
    properties = json.loads(schema_file.read_text())["properties"]
    settings = json.loads(OVERRIDES.read_text())[PLUGIN]
    assert set(settings) <= set(properties)
    assert settings["fetchNews"] in {c["const"] for c in properties["fetchNews"]["oneOf"]}
    assert isinstance(settings["checkForUpdates"], bool)
