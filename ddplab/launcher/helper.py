"""The launch helper: a fresh interpreter that imported torch once and forks one agent a launch
(the leader of the launch's own session) per JSON request; when the caller goes, so does all of it.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import uuid
from typing import Any, Optional

from ..env import become_subreaper
from .procs import end_children, kill_group, kill_marked

PRELOAD = ("torch", "torch.distributed", "torch.distributed.run", "torch.nn", "torch.optim")
HELPER_TOKEN = "DDPLAB_HELPER"  # environment variable marking every process of one helper


class Helper:
    """The caller's handle on its helper process (one per calling process)."""

    lock = threading.Lock()
    _current: Optional["Helper"] = None

    def __init__(self, env: dict[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock, self.next_id, self.env = ours, 0, env
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ddplab.launcher.helper", str(theirs.fileno())],
            pass_fds=[theirs.fileno()], start_new_session=True, stdin=subprocess.DEVNULL,
            cwd=os.getcwd(), env={**env, HELPER_TOKEN: uuid.uuid4().hex})
        theirs.close()
        try:
            self.sock.settimeout(300)
            if self.sock.recv(4096) != b'{"ready": true}':
                raise RuntimeError("the ddplab launch helper did not start: see the messages "
                                   "above.")
            self.sock.settimeout(None)
        except BaseException:
            self.end()
            raise

    @classmethod
    def get(cls, env: dict[str, str]) -> "Helper":
        if cls._current is not None and cls._current.proc.poll() is not None:
            cls._current.end()  # (it died: killed, or the OOM killer; its socket closes)
        if cls._current is None:
            cls._current = cls(env)
        return cls._current

    def request(self, req: dict[str, Any]) -> dict[str, Any]:
        """Send one request; its answer. Any exception meanwhile (an interrupt) ends this helper
        and what it started, so that no answer is ever read by the wrong launch."""
        self.next_id += 1
        req = {**req, "id": self.next_id}
        try:
            self.sock.sendall(json.dumps(req).encode())
            self.sock.settimeout(300)  # (a helper stuck in an import: its preload)
            reply = json.loads(self.sock.recv(1 << 16).decode() or "{}")
            self.sock.settimeout(None)
            if reply.get("id") != req["id"] or "error" in reply:
                raise RuntimeError(reply.get("error") or f"the ddplab launch helper answered "
                                   f"{reply!r} to request {req['id']}")
            return dict(reply)
        except TimeoutError as exc:
            self.end()
            raise RuntimeError("the ddplab launch helper did not answer in 300 s (stuck in an "
                               "import of DDPLAB_PRELOAD?) and was ended; the next launch "
                               "starts a fresh one.") from exc
        except BaseException:
            self.end()
            raise

    def end(self) -> None:
        """End the helper; it ends its agents, and their ranks die with them."""
        if Helper._current is self:
            Helper._current = None
        self.proc.terminate()
        self.sock.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# --------------------------------------------------------------------------- helper side


def serve(sock: socket.socket, agents: set[int]) -> None:
    """Answer launch requests until the caller closes the socket."""
    from .agent import run_agent

    # Reap each agent as it exits (the caller waits for its group to be empty of zombies too).
    signal.signal(signal.SIGCHLD, lambda _sig, _frame: _reap(agents))
    while True:
        _reap(agents)
        end_children(frozenset(agents))  # (orphans of agents that died, adopted by it)
        if not select.select([sock], [], [], 0.2)[0]:
            continue
        try:
            req = json.loads(sock.recv(1 << 22).decode() or "null")
        except (OSError, ValueError):
            req = None
        if req is None:
            return
        answer = {"id": req.get("id"), "pid": os.getpid()}
        if req.get("op") == "launch":
            preload(req.get("preload", ()))
            torch = sys.modules.get("torch")
            if torch is not None and torch.cuda.is_initialized():
                answer["error"] = ("CUDA is initialised in the ddplab launch helper (by a module "
                                   "in DDPLAB_PRELOAD?): ranks forked from it could not use the "
                                   "GPU. Leave that module out of DDPLAB_PRELOAD, or set "
                                   "DDPLAB_LAUNCH_PATH=subprocess to launch through torchrun.")
            else:
                helper = os.getpid()
                req["env"][HELPER_TOKEN] = os.environ[HELPER_TOKEN]  # (what it must end)
                answer["pid"] = pid = os.fork()
                if pid == 0:
                    sock.close()
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                    try:
                        run_agent(req, helper)
                    finally:
                        os._exit(70)
                agents.add(pid)
        sock.sendall(json.dumps(answer).encode())


def preload(names: Any) -> None:
    """Import modules for every later fork, then ``gc.freeze``: a worker's collections skip
    (and do not copy) torch's millions of objects."""
    for name in filter(None, names):
        with contextlib.suppress(ImportError):
            __import__(name)
    gc.freeze()


def _reap(agents: set[int], block: bool = False) -> None:
    for pid in list(agents):
        try:
            done, _status = os.waitpid(pid, 0 if block else os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            agents.discard(pid)
            kill_group(pid, signal.SIGKILL)  # (its pid names its group while one is left)


def main() -> None:
    """``python -m ddplab.launcher.helper FD``: serve the caller on the inherited socket FD."""
    signal.signal(signal.SIGTERM, lambda _sig, _frame: sys.exit(0))
    become_subreaper()  # (no death signal: it would follow the caller's thread that started
    # the helper, not the caller; the socket's end tells the caller's death)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=int(sys.argv[1]))
    agents: set[int] = set()
    try:
        preload(PRELOAD + tuple(os.environ.get("DDPLAB_PRELOAD", "").split(",")))
        sock.sendall(b'{"ready": true}')
        serve(sock, agents)
    finally:  # the caller is gone: end every launch it started, and what they left anywhere
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # (the caller's SIGTERM may come meanwhile)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for pid in list(agents):
            kill_group(pid, signal.SIGKILL)
        kill_marked(HELPER_TOKEN, os.environ.get(HELPER_TOKEN, ""))
        _reap(agents, block=True)
        os._exit(0)  # (torch's exit handlers have nothing to do here)


if __name__ == "__main__":
    main()
