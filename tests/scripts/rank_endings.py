"""A rank for the tests of how ranks end (test_launch), on either path: what it sees, or how
rank 1 ends.

report: print one JSON line of what the rank sees (environment, directory, argv, stdin,
torch's threads, descriptors above 2 that a program it ran would inherit). hold: write its pid to held-RANK in the working directory, then sleep.
raise | kill | segv | interrupt | minus1 (sys.exit(-1)): rank 1 ends that way, rank 0 exits 0
(no process group). after0 [WAY]: rank 0 writes its pid to pid-0 in the working directory and
exits 0; rank 1 waits until that process is gone, then ends by WAY (one of the above; raise when
not given).
"""
import json
import os
import signal
import sys
import time

mode = sys.argv[1]
rank = int(os.environ["RANK"])
if mode == "report":
    inherited = [fd for fd in map(int, os.listdir("/proc/self/fd"))
                 if fd > 2 and os.path.exists(f"/proc/self/fd/{fd}") and os.get_inheritable(fd)]
    import torch

    print(json.dumps({
        "env": {name: os.environ.get(name) for name in (
            "MY_VAR", "DDPLAB_TEST_LATE", "RANK", "LOCAL_RANK", "WORLD_SIZE",
            "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS", "PYTHONWARNINGS")},
        "cwd": os.getcwd(), "argv": sys.argv, "name": __name__, "path0": sys.path[0],
        "stdin": sys.stdin.read(), "threads": torch.get_num_threads(), "pid": os.getpid(),
        "inherited": inherited,
    }), flush=True)
elif mode == "hold":
    with open(f"held-{rank}.tmp", "w") as out:
        out.write(str(os.getpid()))
    os.rename(f"held-{rank}.tmp", f"held-{rank}")
    time.sleep(600)
elif mode == "after0":
    if rank == 0:
        with open("pid-0.tmp", "w") as out:
            out.write(str(os.getpid()))
        os.rename("pid-0.tmp", "pid-0")
        sys.exit(0)
    while not os.path.exists("pid-0"):
        time.sleep(0.02)
    with open("pid-0") as pid_file:
        first = int(pid_file.read())
    while True:
        try:
            os.kill(first, 0)
        except ProcessLookupError:
            break
        time.sleep(0.02)
    mode = sys.argv[2] if sys.argv[2:] else "raise"
if rank == 1:
    if mode == "raise":
        raise ValueError("rank 1 fails on purpose")
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    if mode == "interrupt":
        raise KeyboardInterrupt
    if mode == "minus1":
        sys.exit(-1)
