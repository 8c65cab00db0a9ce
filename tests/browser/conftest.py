"""Fixtures that put the course in front of a real browser: JupyterLab + headless Chromium.

The tests in this folder are skipped unless ``DDPLAB_BROWSER=1`` (``make test-browser`` sets
it), so the plain ``pytest tests`` run never needs a browser. What they need:

- Debian's ``chromium`` (``apt-get install chromium``; ``DDPLAB_CHROMIUM`` names another
  binary). The browser is never downloaded.
- The ``playwright`` Python package (``pip install playwright``), used only to drive that
  Chromium through ``executable_path``.

Lesson: the whole course, as a learner meets it in JupyterLab.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest

from jlab import (CHROMIUM_ARGS, HERE, SHOTS, Lab, Proc, marked_processes, start_lab, stop_lab,
                  wait_for)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip this folder's tests unless DDPLAB_BROWSER=1: they need Chromium and Playwright."""
    if os.environ.get("DDPLAB_BROWSER") == "1":
        return
    skip = pytest.mark.skip(reason="browser test: run `make test-browser` (DDPLAB_BROWSER=1)")
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def shots() -> Path:
    """Folder for screenshots (``build/browser/``, referenced by the README)."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    return SHOTS


@pytest.fixture(scope="session")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """A JupyterLab for the whole session; on teardown, fail if it left processes behind."""
    server = start_lab(tmp_path_factory.mktemp("jupyterlab"))
    try:
        yield server
    finally:
        left = stop_lab(server)
    assert not left, "processes outlived JupyterLab:\n" + "\n".join(
        f"{p.pid} (parent {p.ppid}): {p.cmd}" for p in left)


def _chromium() -> str:
    path = os.environ.get("DDPLAB_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not os.path.exists(path):
        pytest.fail(f"no Chromium at {path}: install Debian's package (apt-get install "
                    f"chromium) or set DDPLAB_CHROMIUM to a Chromium binary.")
    return path


@pytest.fixture(scope="session")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Headless Chromium (the system's, never a downloaded one) with a fresh profile."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the playwright package is missing: `make test-browser` installs it "
                    "(or: pip install playwright). No browser download is needed.")
    with sync_playwright() as driver:
        context = driver.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=_chromium(),
            args=CHROMIUM_ARGS, viewport={"width": 1400, "height": 1000})
        context.set_default_timeout(60_000)
        try:
            yield context
        finally:
            context.close()


@pytest.fixture
def page(browser: Any, lab: Lab) -> Iterator[Any]:
    """A new tab; afterwards its kernels are shut down and must take their helpers along."""
    tab = browser.new_page()
    errors: list[str] = []
    tab.on("pageerror", lambda exc: errors.append(str(exc)))
    tab.js_errors = errors
    try:
        yield tab
    finally:
        tab.close()
        lab.shutdown_sessions()
    wait_for(lambda: not lab.api("/api/kernels"), 60, "every kernel to shut down")

    def others() -> list[Proc]:
        return [p for p in marked_processes(lab.run_id) if p.pid != lab.proc.pid]

    try:
        wait_for(lambda: not others(), 30, "kernels and their ddplab.launcher.helper processes to exit")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; still running:\n" + "\n".join(
            f"{p.pid} (parent {p.ppid}): {p.cmd}" for p in others())) from None
