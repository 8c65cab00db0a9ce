"""Imported by a launch helper (``DDPLAB_PRELOAD=fork_watch``, this folder on ``PYTHONPATH``):
just before every ``os.fork`` of the helper or of a process it forked (an agent forking a
rank), the forking process's threads are noted, by name, in ``THREADS``, which the child
inherits: what ran beside the fork itself, not what ran a moment later."""
import os

THREADS: list[str] = []


def _note() -> None:
    THREADS[:] = sorted(open(f"/proc/self/task/{task}/comm").read().strip()
                        for task in os.listdir("/proc/self/task"))


os.register_at_fork(before=_note)
