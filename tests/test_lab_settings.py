"""The course's JupyterLab settings: ``make lab`` opens without JupyterLab's "get notified about
official Jupyter news?" pop-up. ``jupyter/labconfig/default_setting_overrides.json`` turns the
news and the update check off; JupyterLab reads it from every folder on ``JUPYTER_CONFIG_PATH``
(``<folder>/labconfig/default_setting_overrides.json``), which the lab target points at
``jupyter/`` of the repository."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OVERRIDES = ROOT / "jupyter" / "labconfig" / "default_setting_overrides.json"
PLUGIN = "@jupyterlab/apputils-extension:notification"


def test_jupyterlab_reads_the_overrides_from_the_config_path(monkeypatch):
    manager = pytest.importorskip("jupyter_server.services.config.manager")
    monkeypatch.setenv("JUPYTER_CONFIG_PATH", str(ROOT / "jupyter"))
    found = manager.ConfigManager(config_dir_name="labconfig").get("default_setting_overrides")
    assert found[PLUGIN] == {"fetchNews": "false", "checkForUpdates": False}


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
