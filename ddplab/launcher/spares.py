"""Warm processes for launches that cannot fork: the spare path.

Where workers cannot be forked from the preloaded helper (macOS, ``DDPLAB_LAUNCH_PATH=subprocess``
on Linux, CUDA initialised in the helper), a launch is torchrun as a subprocess, and each of its
processes would be a fresh ``python`` importing torch: seconds per launch. Instead the launcher
keeps *spares*: processes started by exec (never forked), that have imported torch (and the
training stack) ahead of time and wait for work. Each serves one launch, then ends; when the
launch has ended, the pool starts fresh ones in the background (so that their imports never
slow a running launch). A spare can start work once torch is imported; it preloads the training
stack while it waits, and stops preloading when work comes.

- One spare becomes the launch's torchrun: it calls ``torch.distributed.run.main`` with the
  command line a cold launch would run; its stdout and stderr are the pipes the launcher reads,
  and it leads the job's process group, exactly as the cold subprocess did.
- torchrun starts every rank as usual, as a process of its own: ``python -u stub.py TARGET
  ARGS`` (``stub``, standard library only). The stub hands its environment, directory and
  stdio to the broker over a UNIX socket; the broker passes them to an idle spare, which becomes
  the rank (``entry.run_spare_rank``). The stub forwards torchrun's signals and exits as the
  spare exited, so torchrun sees its worker's true exit code or signal.

Process tree (every spare leads a session of its own; nothing outlives the caller)::

    caller --> spare as torchrun --> stub of rank 0..N-1
      |  `--> broker thread (pairs stubs and spares, reaps the spares)
      `------> spare as rank 0..N-1 (and its own children, ended with it)

- every spare reads a pipe whose only writer is the caller: when the caller dies the pipe
  closes and the spare kills its process group (portable: no ``PR_SET_PDEATHSIG`` needed);
- when a stub's connection closes before its rank ended (torchrun killed it), the broker kills
  the rank's group; when a rank ends, the broker kills what it left in its group, then tells
  the stub the exit status;
- a ``Job`` on this path ends its ranks' spares when it is reaped (``end_job``).

``DDPLAB_SPARES``: ``warm`` (default: replace used spares, for a notebook), ``once`` (start the
spares a launch needs, none after it: the CLI), ``off`` (no spares: a cold
``python -m torch.distributed.run``, as on a platform without UNIX sockets).

Lesson: every notebook that launches workers (on macOS, or with DDPLAB_LAUNCH_PATH=subprocess).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections import deque
from typing import Any, Optional

from .procs import kill_group, kill_marked, socket_folder, whole_lines

STUB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stub.py")
JOB_TOKEN = "DDPLAB_SPARE_JOB"  # in the job's environment: which launch a rank belongs to
MAX_WARM = 9  # idle spares kept at most (each holds torch in memory, ~0.3-0.6 GB)


def _frame(message: dict[str, Any]) -> bytes:
    body = json.dumps(message).encode()
    return struct.pack("!I", len(body)) + body


def _receive(sock: socket.socket, max_fds: int) -> tuple[Optional[dict[str, Any]], list[int]]:
    """One length-prefixed JSON message and the descriptors sent with it; (None, []) at EOF."""
    data, fds, _flags, _addr = socket.recv_fds(sock, 1 << 16, max_fds)
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    while len(data) < 4 or len(data) < 4 + struct.unpack("!I", data[:4])[0]:
        more = sock.recv(1 << 16)
        if not more:
            for fd in fds:
                os.close(fd)
            return None, []
        data += more
    return dict(json.loads(data[4:].decode())), list(fds)


class Spare:
    """One warm process as the caller sees it."""

    def __init__(self, env: dict[str, str], watch: int, home: str, preload: list[str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.ctl = ours
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ddplab.launcher.spares", str(theirs.fileno()), str(watch)],
            pass_fds=[theirs.fileno(), watch], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True, cwd=home,
            env={**env, "DDPLAB_SPARE_PRELOAD": ",".join(preload)})
        theirs.close()
        self.usable = False  # it has imported torch ("R"): it can start work at once
        self.ready = False  # it has imported everything it preloads ("W")
        self.watched = False  # the broker listens for its "R" and "W"
        self.preload = preload
        self.stub: Optional[socket.socket] = None
        self.job = ""

    def send(self, message: dict[str, Any], fds: list[int]) -> None:
        frame = _frame(message)
        sent = socket.send_fds(self.ctl, [frame], fds)
        self.ctl.sendall(frame[sent:])

    def drop_pipes(self) -> None:
        """Close the caller's ends of the spare's stdout and stderr (a rank writes elsewhere)."""
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


class Pool:
    """The caller's spares and the broker thread that pairs them with torchrun's stubs."""

    _current: Optional["Pool"] = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.home = socket_folder("ddplab-spares-")  # 0700: only this user connects
        self.address = os.path.join(self.home, "broker")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.address)
        self.listener.listen(256)
        self.watch_r, self.watch_w = os.pipe()  # the spares' read end closes only with us
        os.set_inheritable(self.watch_r, False)
        self.wake_r, self.wake_w = os.pipe()
        self.cond = threading.Condition()
        self.idle: list[Spare] = []  # warming or ready, not yet given work
        self.ranks: dict[int, Spare] = {}  # pid -> spare running a rank
        self.ended: deque[tuple[Spare, int]] = deque()
        self.requests: deque[dict[str, Any]] = deque()  # torchrun jobs for the broker
        self.warm = 0  # idle spares to keep (1 torchrun + the last launch's ranks)
        self.preload: list[str] = []
        self.closed = False
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ, ("listen", None))
        self.sel.register(self.wake_r, selectors.EVENT_READ, ("wake", None))
        self.thread = threading.Thread(target=self._broker, name="ddplab-spares", daemon=True)
        self.thread.start()
        atexit.register(self.close)

    @classmethod
    def get(cls) -> "Pool":
        """The calling process's pool (a forked child of the caller gets one of its own)."""
        with cls._lock:
            pool = cls._current
            if pool is None or pool.closed or pool.pid != os.getpid():
                cls._current = cls()
            return cls._current

    @classmethod
    def current(cls) -> Optional["Pool"]:
        return cls._current

    # ------------------------------------------------------------------ the caller's side
    def torchrun(self, args: list[str], env: dict[str, str], cwd: str, ranks: int,
                 preload: list[str], keep_warm: bool) -> subprocess.Popen:
        """A spare running ``torchrun ARGS`` for one launch of ``ranks`` local ranks.

        Ranks that find no idle spare get a new one at once; with ``keep_warm``, as many
        spares as this launch used are started again for the next one. (The broker thread
        does the work: it alone touches the spares' control sockets.)
        """
        request: dict[str, Any] = {"role": "torchrun", "args": args, "cwd": cwd,
                                   "env": {**env, "DDPLAB_SPARES_SOCKET": self.address}}
        with self.cond:
            if self.closed:
                raise RuntimeError("ddplab: the warm processes were ended (interpreter exit)")
            self.preload = list(preload)
            self.warm = min(1 + ranks, MAX_WARM) if keep_warm else 0
            self.requests.append(request)
            ready = sum(1 for s in self.idle if s.preload == self.preload)
            self._start(1 + ranks - ready)  # the ranks need not wait for a spare to start
            self._wake()
            self.cond.wait_for(lambda: "spare" in request or self.closed, timeout=60)
        if "spare" not in request:
            raise RuntimeError("ddplab: no warm process took the launch (see the messages "
                               "above); set DDPLAB_SPARES=off to launch without them")
        return request["spare"].proc

    def _take(self) -> Spare:
        """An idle spare for new work (the most warmed first), started now if there is none."""
        alive = [s for s in self.idle if s.preload == self.preload and s.proc.poll() is None]
        spare = max(alive, key=lambda s: (s.ready, s.usable), default=None) or self._new()
        self.idle.remove(spare)
        return spare

    def _new(self) -> Spare:
        from .jobs import child_env

        # the caller's environment now (what a process reads as it starts: PYTHONPATH, ...)
        spare = Spare(child_env(os.environ), self.watch_r, self.home, self.preload)
        self.idle.append(spare)
        self._wake()
        return spare

    def _start(self, count: int) -> None:
        for _ in range(max(0, count)):
            self._new()

    def _refill(self) -> None:
        """Start spares until ``warm`` of them wait with the current preload; end the idle
        ones that preload something else (the broker forgets them when they are gone)."""
        for spare in self.idle:
            if spare.preload != self.preload:
                kill_group(spare.proc.pid, signal.SIGKILL)
        waiting = sum(1 for s in self.idle
                      if s.preload == self.preload and s.proc.poll() is None)
        self._start(self.warm - waiting)

    def end_job(self, token: str, grace: float = 2.0) -> None:
        """End every rank of launch ``token`` still running (its job is being reaped), then
        start the spares that replace the used ones: their imports never slow a launch."""
        with self.cond:
            mine = [s for s in self.ranks.values() if s.job == token]
        for spare in mine:
            kill_group(spare.proc.pid, signal.SIGKILL)
        with self.cond:
            self.cond.wait_for(lambda: not any(s.job == token for s in self.ranks.values()),
                               timeout=grace)
            if not self.closed:
                self._refill()

    def wait_ready(self, timeout: float = 120.0) -> bool:
        """Wait until every idle spare has imported what it preloads (for benchmarks)."""
        with self.cond:
            return self.cond.wait_for(lambda: all(s.ready for s in self.idle
                                                  if s.preload == self.preload), timeout=timeout)

    def close(self) -> None:
        """End every spare and the broker (at the caller's exit)."""
        with self.cond:
            if self.closed or os.getpid() != self.pid:  # (not in a forked child of the caller)
                return
            self.closed = True
            spares = [*self.idle, *self.ranks.values()]
        self._wake()
        os.close(self.watch_w)  # every spare kills its group when this closes
        for spare in spares:
            kill_group(spare.proc.pid, signal.SIGKILL)
        for spare in spares:
            try:
                spare.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            spare.drop_pipes()
        self.thread.join(timeout=5)
        shutil.rmtree(self.home, ignore_errors=True)

    def _wake(self) -> None:
        try:
            os.write(self.wake_w, b"w")
        except OSError:
            pass

    # ------------------------------------------------------------------ the broker thread
    def _broker(self) -> None:
        waiting: deque[tuple[socket.socket, dict[str, Any], list[int]]] = deque()
        while not self.closed:
            try:
                self._serve(waiting)
            except Exception as exc:  # noqa: BLE001  (a broker that dies hangs every launch)
                print(f"ddplab: the warm processes' broker: {type(exc).__name__}: {exc}",
                      file=sys.stderr)
        for conn, _job, fds in waiting:
            conn.close()
            for fd in fds:
                os.close(fd)

    def _serve(self, waiting: deque[tuple[socket.socket, dict[str, Any], list[int]]]) -> None:
        """One round of the broker: read what came, then lead, pair and finish."""
        with self.cond:
            for spare in self.idle:  # watch the new spares' "R", "W" and end
                if not spare.watched:
                    spare.watched = True
                    self.sel.register(spare.ctl, selectors.EVENT_READ, ("ready", spare))
        for key, _mask in self.sel.select(timeout=1.0):
            kind, spare = key.data
            if kind == "wake":
                os.read(self.wake_r, 4096)
            elif kind == "listen":
                conn, _addr = self.listener.accept()
                conn.settimeout(10)
                try:
                    job, fds = _receive(conn, 3)
                except (OSError, ValueError):
                    job, fds = None, []
                if job is None or len(fds) != 3:
                    conn.close()
                    for fd in fds:
                        os.close(fd)
                    continue
                waiting.append((conn, job, fds))
            elif kind == "ready":  # "R", "W", or its end (killed, or it failed to start)
                said = key.fileobj.recv(1)
                with self.cond:
                    spare.usable = spare.usable or said in (b"R", b"W")
                    spare.ready = spare.ready or said == b"W"
                    if not said:
                        self.sel.unregister(key.fileobj)
                        spare.watched = False
                        spare.ctl.close()
                        if spare in self.idle:
                            self.idle.remove(spare)
                        spare.drop_pipes()
                        threading.Thread(target=self._wait, args=(spare,), daemon=True).start()
                    self.cond.notify_all()
            elif kind == "stub":  # torchrun killed the stub: end its rank
                if not key.fileobj.recv(1):
                    self.sel.unregister(key.fileobj)
                    kill_group(spare.proc.pid, signal.SIGKILL)
        while self.requests:
            self._lead(self.requests.popleft())
        while waiting:
            self._pair(*waiting.popleft())
        while self.ended:
            self._finish(*self.ended.popleft())

    def _claim(self) -> Spare:
        """Take an idle spare for work; from now on the broker no longer watches it idle."""
        with self.cond:
            spare = self._take()
        if spare.watched:
            self.sel.unregister(spare.ctl)
            spare.watched = False
        return spare

    def _lead(self, request: dict[str, Any]) -> None:
        """Make a spare the torchrun of a launch; the caller reads its pipes from now on."""
        spare = self._claim()
        try:
            spare.send(request, [])
        except OSError:
            pass  # it died: the caller sees torchrun exit at once
        spare.ctl.close()
        with self.cond:
            request["spare"] = spare
            self.cond.notify_all()

    def _pair(self, conn: socket.socket, job: dict[str, Any], fds: list[int]) -> None:
        """Give a stub's rank to an idle spare; tell the stub which process runs it."""
        spare = self._claim()
        with self.cond:
            spare.job = str(job.get("env", {}).get(JOB_TOKEN, ""))
            spare.stub = conn
            self.ranks[spare.proc.pid] = spare
        spare.drop_pipes()
        try:
            spare.send({"role": "rank", **job}, fds)
        except OSError:
            pass  # it died: its waiter reports the exit
        for fd in fds:
            os.close(fd)
        spare.ctl.close()
        try:
            conn.sendall(json.dumps({"pid": spare.proc.pid}).encode() + b"\n")
        except OSError:
            pass
        conn.settimeout(None)
        self.sel.register(conn, selectors.EVENT_READ, ("stub", spare))
        threading.Thread(target=self._wait, args=(spare,), daemon=True).start()

    def _wait(self, spare: Spare) -> None:
        code = spare.proc.wait()
        self.ended.append((spare, code))
        self._wake()

    def _finish(self, spare: Spare, code: int) -> None:
        """A rank's process ended: end what it left, tell its stub, forget it."""
        kill_group(spare.proc.pid, signal.SIGKILL)
        stub = spare.stub
        if stub is not None:
            try:
                self.sel.unregister(stub)
            except (KeyError, ValueError):
                pass
            try:
                stub.sendall(json.dumps({"exit": code}).encode() + b"\n")
            except OSError:
                pass
            stub.close()
        with self.cond:
            self.ranks.pop(spare.proc.pid, None)
            self.cond.notify_all()


# ---------------------------------------------------------------------------- spare side
def _die_with_caller(watch: int) -> None:
    """Block on the caller's pipe; when it closes (the caller died), kill this group, and on
    Linux every process of this launch (children of a rank in a session of their own)."""
    while True:
        try:
            if not os.read(watch, 1):
                break
        except InterruptedError:
            continue
        except OSError:  # the rank closed the descriptor: it can no longer be watched
            return
    kill_marked(JOB_TOKEN, os.environ.get(JOB_TOKEN, ""))
    os.killpg(os.getpgid(0), signal.SIGKILL)


def main() -> None:
    """``python -m ddplab.launcher.spares CTL WATCH``: preload, say ready, serve one job."""
    from .helper import PRELOAD, preload

    ctl = socket.socket(fileno=int(sys.argv[1]))
    watch = int(sys.argv[2])
    os.set_inheritable(ctl.fileno(), False)
    os.set_inheritable(watch, False)
    threading.Thread(target=_die_with_caller, args=(watch,), daemon=True).start()
    extra = [name for name in os.environ.pop("DDPLAB_SPARE_PRELOAD", "").split(",") if name]
    preload(PRELOAD)
    _say(ctl, b"R")  # torch is in: it can be torchrun, or a rank that imports the rest itself
    for name in extra:
        if select.select([ctl], [], [], 0)[0]:
            break  # work came before the training stack was in: stop preloading
        preload([name])
    else:
        _say(ctl, b"W")
    job, fds = _receive(ctl, 3)
    ctl.close()
    if job is None:
        sys.exit(0)
    os.environ.clear()
    os.environ.update(job["env"])
    os.chdir(job["cwd"])
    if job["role"] == "torchrun":
        _run_torchrun(job["args"])
    else:
        from .entry import run_spare_rank

        for fd, target in zip(fds, (0, 1, 2)):
            os.dup2(fd, target)
            os.close(fd)
        run_spare_rank(job["target"], job["args"])


def _say(ctl: socket.socket, what: bytes) -> None:
    try:
        ctl.sendall(what)
    except OSError:  # the broker gave it work without waiting for this, and closed its end
        pass


def _run_torchrun(args: list[str]) -> None:
    """Be ``torchrun ARGS``, each line it copies written whole (as ``fallback.main``)."""
    import logging

    whole_lines()

    from torch.distributed.run import main as torchrun

    sys.argv = ["torchrun", *args]
    code: Any = 0
    try:
        torchrun(args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001  (reported as python reports it: the same text)
        sys.excepthook(*sys.exc_info())
        code = 1
    # Leave without the interpreter's teardown of torch (half a second): nothing is left to
    # run but logging's flush.
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code & 0xFF)


if __name__ == "__main__":
    main()
