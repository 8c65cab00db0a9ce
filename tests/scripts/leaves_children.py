"""A rank that starts a child and exits 0 at once, leaving the child running.

Run it: ``torchrun --nproc-per-node 2 tests/scripts/leaves_children.py MODE [SECONDS]``.
MODE says how the child is started, as logging and telemetry services and shell scripts do (or
several, comma-separated: one child of each):

- ``session``: ``subprocess.Popen(start_new_session=True)``: a session of its own, holding the
  rank's stdout and stderr;
- ``background``: ``os.system("sleep N &")``: in the rank's own process group;
- ``fork``: ``os.fork()``, a child that sleeps holding every descriptor the rank has.

Every rank prints ``child PID MODE`` first, one line per child. With MODE ``hold`` the rank
itself sleeps too after starting a ``session`` and a ``background`` child (for a caller that is
then killed), and emits the event ``hang`` just before (for a launch's ``on_event``).
"""
import os
import subprocess
import sys
import time

modes = sys.argv[1].split(",")
seconds = sys.argv[2] if len(sys.argv) > 2 else "60"
if "session" in modes or "hold" in modes:
    child = subprocess.Popen(["sleep", seconds], start_new_session=True)
    print(f"child {child.pid} session", flush=True)
if "background" in modes or "hold" in modes:
    out = subprocess.run(f"sleep {seconds} >/dev/null 2>&1 & echo $!", shell=True,
                         capture_output=True, text=True).stdout
    print(f"child {int(out)} background", flush=True)
if "fork" in modes:
    pid = os.fork()
    if pid == 0:
        time.sleep(float(seconds))
        os._exit(0)
    print(f"child {pid} fork", flush=True)
if "hold" in modes:
    from ddplab import events

    print(f"pid {os.getpid()}", flush=True)
    events.emit("metric", name="hang", rank=int(os.environ["RANK"]))
    time.sleep(float(seconds))
print(f"rank {os.environ['RANK']} done", flush=True)
