"""A rank as torchrun starts it on the spare path: it hands its place to a warm process.

``python -u stub.py TARGET [ARGS...]`` is the worker command torchrun runs when a launch goes
through a spare (see ``spares``). It imports the standard library only and is run by path, not
as a module of the package, so it starts in a few milliseconds. It

- connects to the launcher's broker (``DDPLAB_SPARES_SOCKET``, a UNIX socket) and sends its
  environment (torchrun's RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...), working directory,
  target and arguments, with its stdin, stdout and stderr (SCM_RIGHTS);
- learns the pid of the warm process that now runs the rank, and forwards to it the signals
  torchrun sends its workers (SIGTERM, SIGINT, SIGHUP);
- exits as that process exited: the same code, or killed by the same signal, so torchrun's
  report of a failed rank is what it would have been.

If the stub is killed, the broker sees its connection close and kills the rank.

Lesson: every notebook that launches workers (on macOS, or with DDPLAB_LAUNCH_PATH=subprocess).
"""

import json
import os
import signal
import socket
import struct
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def mirror(code: int) -> None:
    """Exit as the rank did: ``code`` >= 0 is an exit code, ``-N`` death by signal N."""
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:
        try:
            signal.signal(-code, signal.SIG_DFL)
        except (OSError, ValueError):  # SIGKILL and SIGSTOP keep their default
            pass
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [-code])
        os.kill(os.getpid(), -code)
        code = 128 - code  # (only if the signal did not end this process)
    os._exit(code)


def main() -> None:
    address = os.environ.get("DDPLAB_SPARES_SOCKET", "")
    if len(sys.argv) < 2 or not address:
        sys.exit("usage: DDPLAB_SPARES_SOCKET=PATH python stub.py TARGET [ARGS...] (started by a "
                 "ddplab launch, not by hand)")
    pid = [0]
    pending: list[int] = []

    def forward(sig: int, _frame: object) -> None:
        if not pid[0]:
            pending.append(sig)
            return
        try:
            os.kill(pid[0], sig)
        except OSError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(address)
    except OSError as exc:
        sys.exit(f"ddplab: the launcher's warm processes cannot be reached at {address} "
                 f"({exc}): was the launching process ended?")
    body = json.dumps({"target": sys.argv[1], "args": sys.argv[2:], "env": dict(os.environ),
                       "cwd": os.getcwd(), "stub": os.getpid()}).encode()
    frame = struct.pack("!I", len(body)) + body
    sent = socket.send_fds(sock, [frame], [0, 1, 2])
    sock.sendall(frame[sent:])
    for line in sock.makefile("rb"):
        message = json.loads(line)
        if "pid" in message:
            pid[0] = int(message["pid"])
            for sig in pending:
                forward(sig, None)
        elif "exit" in message:
            mirror(int(message["exit"]))
    sys.stderr.write("ddplab: the launcher lost the process running this rank\n")
    mirror(1)


if __name__ == "__main__":
    main()
