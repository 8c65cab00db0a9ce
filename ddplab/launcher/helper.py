"""The launch helper: a process that imported torch once and forks one agent per launch.

The caller starts it once (``Helper.get``) as ``python -m ddplab.launcher.helper FD`` and sends
it requests over a UNIX socket, with the write ends of the job's pipes. Every process below
the caller dies with its parent (``PR_SET_PDEATHSIG``) and each agent leads a session of its
own, so one ``killpg`` ends a launch and a Jupyter interrupt never reaches the workers.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import threading
import uuid
from typing import Any, Optional

from . import stores
from .procs import close_quietly, kill_group, set_parent_death_signal

PRELOAD = ("torch", "torch.distributed", "torch.distributed.run", "torch.nn", "torch.optim")
FDS_PER_MESSAGE = 250  # Linux passes at most 253 descriptors in one message (SCM_MAX_FD)


class Helper:
    """The caller's handle on its helper process (one per calling process)."""

    lock = threading.Lock()
    _current: Optional["Helper"] = None

    def __init__(self, env: dict[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = ours
        self.next_id = 0
        env = {**env, stores.HELPER_TOKEN: uuid.uuid4().hex}  # marks all it starts
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ddplab.launcher.helper", str(theirs.fileno())],
            pass_fds=[theirs.fileno()], start_new_session=True,
            stdin=subprocess.DEVNULL, cwd=os.getcwd(), env=env,
        )
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
        if cls._current is None or cls._current.proc.poll() is not None:
            cls._current = cls(env)
        return cls._current

    def request(self, req: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        """Send one request and its descriptors (in several messages if many); its answer.

        Requests carry an id and the answer must name it. Any exception meanwhile (a Jupyter
        interrupt while the helper imports the training stack, say) ends this helper, and
        with it whatever it started for the request: the next launch starts a fresh one, so
        no answer is ever read by the wrong launch.
        """
        self.next_id += 1
        req = {**req, "id": self.next_id, "fds": len(fds)}
        chunks = [fds[i:i + FDS_PER_MESSAGE] for i in range(0, len(fds), FDS_PER_MESSAGE)]
        try:
            socket.send_fds(self.sock, [json.dumps(req).encode()], chunks[0] if chunks else [])
            for chunk in chunks[1:]:
                socket.send_fds(self.sock, [b"fds"], chunk)
            reply = json.loads(self.sock.recv(1 << 16).decode() or "{}")
            if reply.get("id") != req["id"]:
                raise RuntimeError(f"the ddplab launch helper answered {reply!r} to request "
                                   f"{req['id']}")
            return dict(reply)
        except BaseException:
            self.end()
            raise

    def end(self) -> None:
        """End the helper (its agents and their ranks die with it, see ``stores``)."""
        if Helper._current is self:
            Helper._current = None
        self.proc.kill()
        self.sock.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # (a process in uninterruptible sleep)
            pass


# --------------------------------------------------------------------------- helper side


def serve(sock: socket.socket) -> None:
    """Answer launch requests until the caller closes the socket, then end every launch."""
    from .agent import run_agent

    children: set[int] = set()
    # Reap each agent the moment it exits: until then it is a zombie that still counts as a
    # member of its process group, and the launcher waits for that group to be empty.
    signal.signal(signal.SIGCHLD, lambda _sig, _frame: _reap(children))
    while True:
        _reap(children)
        if not select.select([sock], [], [], 0.2)[0]:
            continue
        req, fds = _receive(sock)
        if req is None:
            break
        answer = {"id": req.get("id")}
        if req.get("op") == "ping":
            answer.update(pid=os.getpid(), store_host=stores.store_host_pid())
            sock.sendall(json.dumps(answer).encode())
            continue
        preload(req.get("preload", ()))
        refusal = fork_refusal()
        if refusal:
            for fd in fds:
                close_quietly(fd)
            sock.sendall(json.dumps({**answer, "refused": refusal}).encode())
            continue
        helper = os.getpid()
        pid = os.fork()
        if pid == 0:
            sock.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                run_agent(req, fds, helper)
            finally:
                os._exit(70)
        for fd in fds:
            close_quietly(fd)
        children.add(pid)
        sock.sendall(json.dumps({**answer, "pid": pid}).encode())
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # reaped below, not by the handler
    for pid in list(children):  # the caller is gone: end every launch it started
        kill_group(pid, signal.SIGKILL)
    _reap(children, block=True)


def _receive(sock: socket.socket) -> tuple[Optional[dict[str, Any]], list[int]]:
    """One request and all its descriptors; (None, []) when the caller closed the socket."""
    try:
        msg, fds, _flags, _addr = socket.recv_fds(sock, 1 << 20, FDS_PER_MESSAGE)
        if not msg:
            return None, []
        req = json.loads(msg.decode())
        while len(fds) < int(req.get("fds", 0)):
            _more, extra, _flags, _addr = socket.recv_fds(sock, 16, FDS_PER_MESSAGE)
            if not extra:
                raise OSError("the caller sent fewer descriptors than announced")
            fds += extra
    except OSError:
        return None, []
    return req, list(fds)


def fork_refusal() -> str:
    """Why forking workers from this process would be unsafe now ("" when it is safe).

    A process that has initialised CUDA cannot be forked: CUDA does not work in the child
    ("Cannot re-initialize CUDA in forked subprocess"). This helper never touches the GPU
    itself, but a module named in ``DDPLAB_PRELOAD`` might. Without its store host, a rank
    could be forked while a store's server thread holds a lock (see ``stores``).
    """
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return ("CUDA is initialised in the launch helper (by a module in DDPLAB_PRELOAD?), "
                "and workers forked from it could not use the GPU")
    if stores.store_host_pid() is None:
        return "the launch helper could not start its store host"
    return ""


def preload(names: Any) -> None:
    """Import modules now so that every forked agent and worker starts with them loaded.

    Then freeze what exists (``gc.freeze``, as pre-forking servers do): the garbage collector
    of every forked process skips the millions of objects torch brought in, so a worker's
    collections only look at what its own script made (and do not touch, hence copy, the
    helper's memory pages).
    """
    for name in names:
        if name and name not in sys.modules:
            try:
                __import__(name)
            except ImportError:
                pass
    gc.freeze()


def _reap(children: set[int], block: bool = False) -> None:
    for pid in list(children):
        try:
            done, _status = os.waitpid(pid, 0 if block else os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            children.discard(pid)


def _more_descriptors() -> None:
    """Raise this process's descriptor limit to the hard one: a 256-rank launch needs ~1,500."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass


def main() -> None:
    """``python -m ddplab.launcher.helper FD``: serve the caller on the inherited socket FD."""
    set_parent_death_signal()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=int(sys.argv[1]))
    _more_descriptors()
    preload(PRELOAD + tuple(os.environ.get("DDPLAB_PRELOAD", "").split(",")))
    stores.register_rendezvous()
    try:
        stores.start_store_host()
    except OSError as exc:  # launches then go through a torchrun subprocess (fork_refusal)
        print(f"ddplab: the launch helper has no store host ({exc})", file=sys.stderr)
    sock.sendall(b'{"ready": true}')
    try:
        serve(sock)
    finally:
        stores.stop_store_host()


if __name__ == "__main__":
    main()
