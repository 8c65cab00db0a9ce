"""Prints the threads of the process that forked this rank, by name: `forker {"rank": R, ...}`,
and whether this rank then executed a program of its own (``execed``). The threads are those
at the fork where the helper preloaded ``fork_watch``, else those of the parent now.

A process that forks while another of its threads holds a lock hands that lock, held, to
the child, unless the child executes a new program. The launcher's agent forks the ranks, so
it must have no other thread then; above all not a store server's, which takes libc's
resolver lock while it accepts a peer.
"""
import json
import os
import sys

parent = os.getppid()
watch = sys.modules.get("fork_watch")
threads = list(watch.THREADS) if watch is not None and watch.THREADS else sorted(
    open(f"/proc/{parent}/task/{task}/comm").read().strip()
    for task in os.listdir(f"/proc/{parent}/task"))
print("forker " + json.dumps({"rank": int(os.environ["RANK"]), "threads": threads,
                             "group": os.getpgid(0),
                             "execed": open("/proc/self/cmdline").read()
                             != open(f"/proc/{parent}/cmdline").read()}), flush=True)
