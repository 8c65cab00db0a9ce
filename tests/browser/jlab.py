"""Drive a real JupyterLab from tests: start and stop the server, watch its processes.

``start_lab`` runs JupyterLab from this environment on 127.0.0.1 with a random token in a
temporary folder. Every process it starts carries ``DDPLAB_BROWSER_RUN=<id>`` in its
environment, which is how ``Lab.leftovers`` finds worker processes that outlived their launch,
even orphaned ones.

Lesson: the whole course, as a learner meets it in JupyterLab.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar


HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SHOTS = REPO / "build" / "browser"
MARKER = "DDPLAB_BROWSER_RUN"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    # Nothing but the local server may be reached: any other host name fails to resolve.
    "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
]
# User settings for the Lab under test: every cell stays in the page (no virtual scrolling),
# cells record when they ran (for the timing report), and no news or update checks reach for
# the network.
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {
        "windowingMode": "none", "recordTiming": True},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false", "checkForUpdates": False},
}
# Processes a kernel keeps for its whole life (they exit with it): not leftovers of a launch.
KERNEL_HELPERS = ("-m ddplab.launcher.helper", "multiprocessing.resource_tracker",
                  "multiprocessing.forkserver")
T = TypeVar("T")


def wait_for(check: Callable[[], Optional[T]], timeout: float, what: str,
             interval: float = 0.25) -> T:
    """Poll ``check`` until it returns something truthy; fail with ``what`` after ``timeout``.

    Args:
        check: returns a truthy value when the awaited state is reached.
        timeout: seconds before giving up.
        what: the awaited state, for the failure message.
        interval: seconds between polls.
    Returns:
        The first truthy value ``check`` returned.
    """
    end = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


# --------------------------------------------------------------------------- processes


@dataclass
class Proc:
    """One live process: pid, parent pid and command line."""

    pid: int
    ppid: int
    cmd: str
    name: str = ""  # /proc/PID/comm


def _read_proc(pid: int, marker: bytes) -> Optional[Proc]:
    """The process ``pid`` if it is alive (not a zombie) and carries ``marker``, else None."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if marker not in environ:
            return None
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
    if stat[0] in ("Z", "X"):
        return None
    return Proc(pid=pid, ppid=int(stat[1]), cmd=cmd.strip(), name=name)


def marked_processes(run_id: str) -> list[Proc]:
    """Every live process started (directly or not) by the JupyterLab under test."""
    marker = f"{MARKER}={run_id}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            proc = _read_proc(int(entry), marker)
            if proc is not None:
                found.append(proc)
    return found


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


# --------------------------------------------------------------------------- the server


@dataclass
class Lab:
    """A running JupyterLab: where it serves, its token, its folder and its process."""

    root: Path
    port: int
    token: str
    run_id: str
    proc: subprocess.Popen
    log: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def notebook_url(self, path: str, workspace: str) -> str:
        """URL that opens ``path`` in a fresh workspace (no tabs restored from another test)."""
        return f"{self.base}/lab/workspaces/{workspace}/tree/{path}?reset&token={self.token}"

    def api(self, path: str, method: str = "GET") -> Any:
        """Call the server's REST API (``/api/...``) with the token; return the JSON reply."""
        request = urllib.request.Request(self.base + path, method=method,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=10) as reply:
            body = reply.read()
        return json.loads(body) if body else None

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def leftovers(self) -> list[Proc]:
        """Processes of this server that should not exist between launches.

        Allowed: the server, its kernels, and each kernel's own helpers, which live as long as
        their kernel: ``ddplab.launcher.helper`` and multiprocessing's resource
        tracker (started when an in-kernel demo used ``mp.spawn``). Anything else (a rank, a per-launch agent forked
        from the helper, an ``mp.spawn`` script or child) outlived the launch that started it.
        """
        procs = marked_processes(self.run_id)
        kernels = {p.pid for p in procs if "ipykernel_launcher" in p.cmd}
        helpers = {p.pid for p in procs if p.ppid in kernels and any(
            name in p.cmd for name in KERNEL_HELPERS)}
        allowed = {self.proc.pid} | kernels | helpers
        return [p for p in procs if p.pid not in allowed]

    def shutdown_sessions(self) -> None:
        """Shut down every kernel session (as closing and shutting down a notebook does)."""
        for session in self.api("/api/sessions"):
            self.api(f"/api/sessions/{session['id']}", method="DELETE")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _write_settings(folder: Path) -> None:
    for name, values in LAB_SETTINGS.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


def _lab_env(tmp: Path, run_id: str) -> dict[str, str]:
    """This environment, plus private Jupyter folders, inline plots and the run marker."""
    env = dict(os.environ)
    for name in ("settings", "workspaces", "runtime", "config"):
        (tmp / name).mkdir(exist_ok=True)
    env.update({
        MARKER: run_id,
        "JUPYTERLAB_SETTINGS_DIR": str(tmp / "settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(tmp / "workspaces"),
        "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"),
        "JUPYTER_CONFIG_DIR": str(tmp / "config"),
        # What `make lab` gives learners (make's own MPLBACKEND=Agg would hide every plot).
        "MPLBACKEND": "module://matplotlib_inline.backend_inline",
    })
    return env


def start_lab(tmp: Path) -> Lab:
    """Start JupyterLab (this Python's) on 127.0.0.1 serving ``tmp/root``; wait until it answers.

    Args:
        tmp: an empty folder; the notebooks to open go into ``tmp/root`` (before or after).
    Returns:
        The running Lab.
    """
    root = tmp / "root"
    root.mkdir(exist_ok=True)
    _write_settings(tmp / "settings")
    run_id, token, port = uuid.uuid4().hex, uuid.uuid4().hex, _free_port()
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1",
           f"--port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={root}", "--LabApp.expose_app_in_browser=True"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")  # JupyterLab refuses to run as root without it
    log = tmp / "jupyterlab.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=root, env=_lab_env(tmp, run_id), stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    lab = Lab(root=root, port=port, token=token, run_id=run_id, proc=proc, log=log)

    def answers() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"JupyterLab exited with {proc.returncode}:\n{lab.log_tail()}")
        try:
            return lab.api("/api/status") is not None
        except OSError:
            return False

    wait_for(answers, 120, "JupyterLab to answer on /api/status")
    return lab


def stop_lab(lab: Lab) -> list[Proc]:
    """Stop the server (it shuts its kernels down); end and return any process left after it."""
    if lab.proc.poll() is None:
        lab.proc.send_signal(signal.SIGTERM)
        try:
            lab.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(lab.proc.pid, signal.SIGKILL)
            lab.proc.wait()
    end = time.monotonic() + 10
    left = marked_processes(lab.run_id)
    while left and time.monotonic() < end:
        time.sleep(0.2)
        left = marked_processes(lab.run_id)
    for proc in left:  # ours by the marker: never leave them on the machine
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left
