"""``py-spy dump --pid`` on every rank of a hung torchrun job, as one would from a terminal.

``dump_ranks`` finds the job's workers (torchrun's children, each with its ``RANK`` in its
environment), dumps each one's Python stack with py-spy until every rank waits on a line of
``source`` that calls a collective, and hands back the dumps and those lines. It stops at once
when py-spy is missing or may not trace (non-root Linux with ``ptrace_scope`` 1, macOS without
``sudo``) and says why, instead of spinning until its deadline.

Lesson: 10.
"""

from __future__ import annotations

import linecache
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import psutil

COLOURS = re.compile(r"\x1b\[[\d;]*m")   # py-spy colours its text when it thinks it is a terminal
DENIED = ("ermission", "sudo", "root", "ptrace")   # words of py-spy's "may not trace" errors


@dataclass
class Dumps:
    """What ``dump_ranks`` found: ``dumps`` (rank -> py-spy's output), ``pids`` (rank -> pid),
    ``lines`` (rank -> the line of the source each rank waits on), ``error`` (why py-spy gave
    no stacks, or None)."""

    dumps: dict[int, str] = field(default_factory=dict)
    pids: dict[int, int] = field(default_factory=dict)
    lines: dict[int, str] = field(default_factory=dict)
    error: Optional[str] = None


def py_spy() -> Path:
    """The py-spy beside this Python (``pip install py-spy``, in ``ddplab[lab]``)."""
    return Path(sys.executable).with_name("py-spy")


def waiting_line(dump: str, source: str) -> Optional[str]:
    """The code of the innermost frame of ``source`` in a py-spy dump (innermost first), or
    None."""
    found = re.findall(rf"{re.escape(Path(source).name)}:(\d+)\)", COLOURS.sub("", dump))
    return linecache.getline(source, int(found[0])).strip() if found else None


def dump_ranks(job_pid: int, nprocs: int, source: str, *, deadline_s: float = 120.0,
               collective: str = "all_", executable: Optional[Path] = None) -> Dumps:
    """Dump every rank of the job under ``job_pid`` (torchrun's pid) until each of its
    ``nprocs`` ranks waits on a line of ``source`` containing ``collective``.

    Returns early with ``error`` set when py-spy is missing, or when it fails for a reason of
    permission or keeps failing for 2 seconds; ``deadline_s`` is a safety net only.
    """
    executable = executable or py_spy()
    found = Dumps()
    if not executable.exists():
        found.error = f"py-spy is not installed ({executable}): pip install py-spy"
        return found
    deadline, failing_since = time.monotonic() + deadline_s, None
    while len(found.lines) < nprocs and time.monotonic() < deadline:
        time.sleep(0.25)
        try:
            children = psutil.Process(job_pid).children()
            found.pids = {int(p.environ().get("RANK", -1)): p.pid for p in children}
        except psutil.Error:   # the job or a worker ended meanwhile
            continue
        runs = {rank: subprocess.run([str(executable), "dump", "--pid", str(pid)],
                                     capture_output=True, text=True)
                for rank, pid in sorted(found.pids.items())}
        failed = [run.stderr.strip() or run.stdout.strip()
                  for run in runs.values() if run.returncode != 0]
        if failed:
            failing_since = failing_since or time.monotonic()
            if any(word in failed[0] for word in DENIED):
                found.error = (f"py-spy may not trace these processes (it needs ptrace permission: "
                               f"root or sudo, CAP_SYS_PTRACE (Docker: --cap-add SYS_PTRACE), "
                               f"or kernel.yama.ptrace_scope 0 on Linux): {failed[0]}")
                return found
            if time.monotonic() - failing_since > 2:
                found.error = f"py-spy kept failing for 2 s: {failed[0]}"
                return found
            continue   # a worker still starting: py-spy finds no interpreter yet
        failing_since = None
        found.dumps = {rank: run.stdout for rank, run in runs.items()}
        lines = {rank: waiting_line(text, source) for rank, text in found.dumps.items()}
        found.lines = {rank: code for rank, code in lines.items() if code and collective in code}
    return found
