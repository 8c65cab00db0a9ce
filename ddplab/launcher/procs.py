"""Process plumbing: process groups, ending and reaping, private folders, the output channel's
sockets (what ``/proc`` and the platform say: ``ddplab.env``)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
from typing import Optional

from ..env import children, is_linux, process_table, start_time


def kill_group(pgid: int, sig: int = signal.SIGKILL, started: Optional[int] = None) -> None:
    """Signal process group ``pgid`` unless its leader's pid now names another process."""
    if pgid <= 1 or (started is not None and start_time(pgid) not in (None, started)):
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def signal_process(pid: int, sig: int, started: Optional[int]) -> None:
    """Signal ``pid`` only while it is the process that started at ``started``."""
    if os.path.isdir("/proc") and (started is None or start_time(pid) != started):
        return
    with contextlib.suppress(OSError):
        os.kill(pid, sig)


def end_children(keep: frozenset[int] = frozenset()) -> None:
    """SIGKILL and reap this process's children but ``keep`` until none is left (a subreaper
    adopts the orphans of those it ends: they go next)."""
    for _round in range(64):
        if not (pids := set(children(os.getpid())) - keep):
            return
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)


def marked(name: str, value: str) -> list[int]:
    """Every process but this one whose environment holds ``name=value`` (where /proc says)."""
    mark, found = f"{name}={value}".encode(), []
    for pid in process_table() if value else ():
        with contextlib.suppress(OSError), open(f"/proc/{pid}/environ", "rb") as environ:
            if pid != os.getpid() and mark in environ.read().split(b"\0"):
                found.append(pid)
    return found


def kill_marked(name: str, value: str) -> None:
    """SIGKILL every process but this one whose environment holds ``name=value``."""
    for pid in marked(name, value):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def group_running(pgid: int) -> bool:
    """True while a process of group ``pgid`` runs (an orphan's zombie, which PID 1 may never
    reap in a container, does not)."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return not os.path.isdir("/proc") or bool(process_table(pgid))


def private_folder(prefix: str) -> str:
    """A private temporary folder (UNIX sockets, torch's log folders; in /tmp where the usual
    one's path is too long for a socket's: macOS), removed at exit; those of owners that died
    are removed here."""
    import atexit
    import shutil
    import tempfile

    base = tempfile.gettempdir()
    if len(base) + len(prefix) > 60 and os.path.isdir("/tmp"):
        base = "/tmp"
    for name in os.listdir(base):
        owner = name[len(prefix):].split("-")[0] if name.startswith(prefix) else ""
        pid, _, started = owner.partition(".")
        if pid.isdigit() and not _alive(int(pid), started):
            path = os.path.join(base, name)
            if os.path.isdir(path) and os.stat(path).st_uid == os.getuid():
                shutil.rmtree(path, ignore_errors=True)
    folder = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}.{start_time(os.getpid())}-",
                              dir=base)
    atexit.register(shutil.rmtree, folder, True)
    return folder


def _alive(pid: int, started: str) -> bool:
    """Whether ``pid`` still names the process that started at ``started`` (where /proc says)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's: still there)
        pass
    return not os.path.isdir("/proc") or str(start_time(pid)) == started


def rank_channel() -> tuple[socket.socket, str]:
    """A listening UNIX socket for a job's output and its ``DDPLAB_RANK_SOCKET`` address:
    ``@name`` in Linux's abstract namespace, elsewhere a path in a private folder."""
    channel = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if is_linux():
        address = f"@ddplab-ranks-{os.getpid()}-{os.urandom(8).hex()}"
        channel.bind("\0" + address[1:])
    else:
        address = os.path.join(private_folder("ddplab-ranks-"), "ranks")
        channel.bind(address)
    channel.listen(socket.SOMAXCONN)
    return channel, address


def connect_streams(who: str) -> bool:
    """Connect stdout and stderr, one connection each (a shared pipe cuts lines), line-buffered,
    to the caller's ``DDPLAB_RANK_SOCKET``, each saying whose it is first (``rank 3 out 42``)."""
    address = os.environ.get("DDPLAB_RANK_SOCKET", "")
    if not address or not hasattr(socket, "AF_UNIX"):
        return False
    for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.connect("\0" + address[1:] if address.startswith("@") else address)
                conn.sendall(f"{who} {'out' if fd == 1 else 'err'} {os.getpid()}\n".encode())
                stream.flush()
                os.dup2(conn.fileno(), fd)
                stream.reconfigure(line_buffering=True)  # type: ignore[attr-defined]
        except OSError:
            return False
    return True
