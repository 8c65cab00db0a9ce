"""Hardware facts for the launcher and the notebooks, without initialising CUDA in the caller.

Asking ``torch.cuda`` about devices in a notebook kernel would create a CUDA context there, and a
kernel holding a context cannot safely start workers by fork and keeps GPU memory for nothing.
So the facts come from a short-lived ``python -m ddplab.env`` subprocess. Importing torch there
costs seconds of CPU, and every notebook's first cell asks, so the answer is kept in a file
(``$DDPLAB_CACHE_DIR``, else ``$XDG_CACHE_HOME/ddplab`` or ``~/.cache/ddplab``) under a key made
of everything that can change it: the Python executable, the torch it would import (version,
path, file time), the environment variables that steer CUDA, ROCm, threads and the import path,
the host, its boot, its CPUs and its GPU device files. Any change asks torch again;
``probe(refresh=True)`` always does. Ports, shared memory and the process start method are read
directly.

Example::

    >>> import ddplab
    >>> ddplab.doctor()            # prints a report and returns it as a dict

Lessons: 01 (hardware cell of every notebook), 07 (ports and backends).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Union

from . import versions

_PROBE: Optional[tuple[dict[str, Any], dict[str, Any]]] = None   # (key, facts), this process

#: Environment variables read by torch, CUDA, ROCm or OpenMP when they count devices and threads,
#: and the ones that decide which torch (and which CUDA libraries) a new process imports.
KEY_PREFIXES = ("CUDA_", "NVIDIA_", "HIP_", "ROCR_", "ROCM_", "OMP_", "MKL_", "PYTORCH_")
KEY_VARIABLES = ("PYTHONPATH", "LD_LIBRARY_PATH")


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when nothing listens on ``host:port`` and we may bind it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, int(port)))
        except OSError:
            return False
    return True


# ------------------------------------------------------------------------- platform choices
# Every choice that depends on the platform, for the launcher and the doctor alike, lives in
# this section and is unit-tested with ``sys.platform`` patched to linux, darwin and win32
# (tests/test_platform.py): the code a Mac or Windows runs is code a test ran.


def is_linux() -> bool:
    """Linux: ``prctl`` (death signals, subreapers), ``/proc``, abstract UNIX sockets."""
    return sys.platform.startswith("linux")


def loopback_interface() -> Optional[str]:
    """The interface gloo should use for a 127.0.0.1 job (``GLOO_SOCKET_IFNAME``): Linux's
    ``lo`` or macOS's ``lo0``, whichever this machine lists; None on Windows, which names no
    loopback interface (gloo then finds the address by the hostname, as torch documents)."""
    if sys.platform == "win32" or not hasattr(socket, "if_nameindex"):
        return None
    names = {name for _index, name in socket.if_nameindex()}
    return next((name for name in ("lo", "lo0") if name in names), None)


def cpu_flags(cpuinfo: Union[str, Path] = "/proc/cpuinfo") -> Optional[set[str]]:
    """The instruction-set flags the Linux kernel lists for this CPU (``avx512_bf16``,
    ``amx_bf16``, ...); None elsewhere (macOS and Windows list them otherwise: unknown)."""
    path = Path(cpuinfo)
    if not is_linux() or not path.exists():
        return None
    return {flag for line in path.read_text(errors="replace").splitlines()
            if line.split(":")[0].strip() in ("flags", "Features")
            for flag in line.split(":", 1)[-1].split()}


def _prctl(option: int, value: int) -> bool:
    if not is_linux():
        return False
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def set_parent_death_signal(sig: int = signal.SIGKILL,
                            parent: Optional[int] = None) -> None:
    """Ask Linux to send ``sig`` to this process when the thread that started it ends (no-op
    elsewhere; so only for a process whose parent's starting thread lives as long as it is
    wanted); exit at once if the parent (pid ``parent``) died already."""
    _prctl(1, int(sig))  # PR_SET_PDEATHSIG
    if parent is not None and os.getppid() != parent:
        os._exit(70)


def become_subreaper() -> bool:
    """Make this process the parent of every orphan among its descendants (Linux), so that a
    process a rank left in a session of its own still comes back to it to be ended and reaped.
    """
    return _prctl(36, 1)  # PR_SET_CHILD_SUBREAPER


def children(pid: int) -> list[int]:
    """The children of ``pid``, zombies too: from ``/proc/PID/task/*/children`` where the
    kernel keeps them, else from every process's parent in ``/proc`` ([] without ``/proc``)."""
    found: list[int] = []
    lists = glob.glob(f"/proc/{pid}/task/*/children")
    for name in lists:
        with contextlib.suppress(OSError), open(name) as text:
            found += [int(child) for child in text.read().split()]
    for name in [] if lists or not os.path.isdir("/proc") else os.listdir("/proc"):
        if name.isdigit() and _stat(name)[1:2] == [str(pid).encode()]:
            found.append(int(name))
    return found


# ``/proc`` (Linux): the facts the launcher reads of its processes; nothing elsewhere.


def _stat(pid: Union[int, str]) -> list[bytes]:
    """The fields of ``/proc/PID/stat`` after the command (state, ppid, pgid, ...), or []."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return []


def start_time(pid: int) -> Optional[int]:
    """When ``pid`` started (clock ticks since boot: tells a reused pid); None if unknown."""
    fields = _stat(pid)
    return int(fields[19]) if len(fields) > 19 else None


def age(start: int) -> float:
    """Seconds since a process began at ``start`` (a ``start_time``; Linux)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME) - start / os.sysconf("SC_CLK_TCK")


def running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    return _stat(pid)[:1] not in ([], [b"Z"])


def process_table(pgid: int = 0) -> dict[int, tuple[int, int]]:
    """Running (non-zombie) processes, of group ``pgid`` if given: pid -> (ppid, start time)."""
    found: dict[int, tuple[int, int]] = {}
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        fields = _stat(name) if name.isdigit() else []
        if len(fields) > 19 and (not pgid or int(fields[2]) == pgid) and fields[0] != b"Z":
            found[int(name)] = (int(fields[1]), int(fields[19]))
    return found


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as text:
            return text.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def dies_with_parent(cmd: list[str], sig: int = signal.SIGKILL) -> list[str]:
    """``cmd`` behind a tiny Python that asks for ``sig`` at this process's death, then runs
    it (Linux; no ``preexec_fn``: code between fork and exec can deadlock with threads)."""
    if not is_linux():
        return cmd
    return [sys.executable, "-I", "-S", "-c", _WITH_PARENT, str(int(sig)), str(os.getpid()),
            *cmd]


_WITH_PARENT = ("import ctypes, os, sys\n"
                "ctypes.CDLL(None).prctl(1, int(sys.argv[1]), 0, 0, 0)\n"
                "if os.getppid() != int(sys.argv[2]):\n    os._exit(1)\n"
                "os.execv(sys.argv[3], sys.argv[3:])\n")


def shm_bytes() -> Optional[int]:
    """Size of ``/dev/shm`` in bytes (DataLoader workers share tensors there), None if absent."""
    try:
        return shutil.disk_usage("/dev/shm").total
    except OSError:
        return None


def _probe_here() -> dict[str, Any]:
    """Collect torch facts in this process (run by ``python -m ddplab.env``, never in a kernel)."""
    import torch
    import torch.distributed as dist

    devices = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            devices.append({"index": index, "name": props.name,
                            "memory_gb": round(props.total_memory / 2**30, 1)})
    available = dist.is_available()
    return {
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpu_count": len(devices),
        "gpus": devices,
        "backends": {
            "gloo": available and dist.is_gloo_available(),
            "nccl": available and dist.is_nccl_available(),
            "mpi": available and dist.is_mpi_available(),
        },
        "threads": torch.get_num_threads(),
        "p2p": _peer_access(len(devices)),
    }


def _peer_access(count: int) -> Optional[bool]:
    """Whether every GPU can reach every other directly (peer-to-peer); None below 2 GPUs.

    Runs in the probe subprocess only (it asks the CUDA driver).
    """
    import torch

    if count < 2:
        return None
    return all(torch.cuda.can_device_access_peer(i, j)
               for i in range(count) for j in range(count) if i != j)


def probe(refresh: bool = False) -> dict[str, Any]:
    """Return torch and GPU facts, asked in a subprocess once per :func:`cache_key`.

    A fact kept in this process or in the cache file is used while the key is the same;
    ``refresh=True`` asks torch again (and rewrites the file).

    Returns:
        ``torch``, ``cuda_build``, ``cuda_available``, ``gpu_count``, ``gpus`` (name, memory),
        ``backends`` (gloo/nccl/mpi available), ``threads``.
    """
    global _PROBE
    key = cache_key()
    if not refresh and _PROBE is not None and _PROBE[0] == key:
        return dict(_PROBE[1])
    facts = None if refresh else _read_cache(key)
    if facts is None:
        facts = _probe_in_subprocess()
        _write_cache(key, facts)
    _PROBE = (key, facts)
    return dict(facts)


def _probe_in_subprocess() -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "ddplab.env", "--json"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(
            "could not inspect torch in a subprocess:\n" + out.stderr[-2000:]
            + "\nCheck the installation with: python -c 'import torch'"
        )
    return json.loads(out.stdout.strip().splitlines()[-1])


def cache_key() -> dict[str, Any]:
    """Everything the probe's answer depends on, read without importing torch (milliseconds)."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):   # a torch module without a spec: no file to compare
        spec = None
    origin = spec.origin if spec is not None and spec.origin else None
    stamp = os.stat(origin).st_mtime_ns if origin and os.path.isfile(origin) else None
    try:
        version: Optional[str] = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        version = None
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "python": sys.executable,
        "torch": [version, origin, stamp],
        "environment": {name: value for name, value in sorted(os.environ.items())
                        if name.startswith(KEY_PREFIXES) or name in KEY_VARIABLES},
        "host": socket.gethostname(), "boot": boot, "cpus": cpus,
        "gpu_files": sorted(glob.glob("/dev/nvidia*") + glob.glob("/dev/kfd")),
    }


def cache_file() -> Path:
    """This Python's probe cache (one file per executable, so venvs do not evict each other)."""
    folder = os.environ.get("DDPLAB_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "ddplab")
    name = hashlib.sha256(sys.executable.encode()).hexdigest()[:16]
    return Path(folder) / f"probe-{name}.json"


def _read_cache(key: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The cached facts when the file holds them for ``key``; None otherwise (or unreadable)."""
    try:
        kept = json.loads(cache_file().read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(kept, dict) or kept.get("key") != key:
        return None
    return kept.get("facts")


def _write_cache(key: dict[str, Any], facts: dict[str, Any]) -> None:
    """Keep ``facts`` for ``key``, atomically (another kernel may read at the same moment); a
    folder that cannot be written only means asking torch again next time."""
    path = cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name,
                                         delete=False) as out:
            json.dump({"key": key, "facts": facts}, out)
        os.replace(out.name, path)
    except OSError:
        pass


def gpu_count() -> int:
    """Number of CUDA GPUs visible to new processes (does not initialise CUDA here)."""
    return int(probe()["gpu_count"])


def problems(facts: dict[str, Any]) -> list[tuple[str, str]]:
    """Return ``(problem, fix)`` pairs found in ``facts`` (the ``doctor`` report)."""
    found = []
    untested = versions.drift(facts["torch"]) if "torch" in facts else None
    if untested:
        found.append(untested)
    if not facts["backends"].get("gloo"):
        found.append(("gloo backend missing: CPU training cannot form a process group",
                      "install the official torch wheel (pip install torch)"))
    requested = os.environ.get("DDPLAB_BACKEND", "")
    if requested == "nccl" and facts["gpu_count"] == 0:
        found.append(("nccl requested (DDPLAB_BACKEND=nccl) but no GPU is visible",
                      "unset DDPLAB_BACKEND or set it to gloo"))
    if facts["gpu_count"] > 0 and not facts["backends"].get("nccl"):
        found.append(("GPUs present but nccl is unavailable",
                      "install a CUDA build of torch; gloo works meanwhile, slowly"))
    shm = facts.get("shm_bytes")
    if shm is not None and shm < 512 * 2**20:
        found.append((f"/dev/shm holds only {shm // 2**20} MiB: DataLoader workers may crash",
                      "run docker with --shm-size=2g or use --loader tensor (no workers)"))
    found += p2p_problems(facts)
    path = facts.get("launch_path") or launch_path()
    if path.startswith("cold"):
        found.append((f"launches cannot fork workers here: {path}",
                      "nothing to fix, every lesson runs, a few seconds slower a launch; on "
                      "Linux (or WSL 2) a launch forks its workers and takes a tenth of a "
                      "second"))
    return found


def no_fork_reason() -> Optional[str]:
    """Why launches cannot fork their workers from a preloaded helper here (None: they can)."""
    if os.environ.get("DDPLAB_LAUNCH_PATH", "") == "subprocess":
        return "DDPLAB_LAUNCH_PATH=subprocess asks for it"
    if not is_linux() or not hasattr(os, "waitid"):
        return (f"fast launches fork workers from a helper process, which needs Linux "
                f"(this is {sys.platform})")
    return None


def launch_path() -> str:
    """How ``ddplab.launch`` starts workers here, by the launcher's own rule (one line).

    Lesson: the hardware cell of every notebook (``doctor`` prints it).
    """
    why = no_fork_reason()
    if why is None:
        return "fork from a helper that imported torch once (about 0.1 s a launch)"
    return f"cold torchrun subprocess ({why}): seconds a launch"


def course_backend(facts: dict[str, Any]) -> str:
    """The backend of the course's multi-process runs here (``max(2, GPUs)`` ranks): nccl when
    every rank gets a GPU of its own and torch has nccl, unless ``DDPLAB_BACKEND=gloo``; else
    gloo. The one rule behind the doctor's report and plan, and ``ddplab.dist.pick_backend``'s.
    """
    forced = os.environ.get("DDPLAB_BACKEND", "")
    if int(facts["gpu_count"]) >= 2 and forced != "gloo" and facts["backends"].get("nccl"):
        return "nccl"
    return "gloo"


def course_plan(facts: dict[str, Any]) -> str:
    """One line: how the course's multi-process lessons run on this machine.

    The same rule as the notebooks (one process per GPU, at least 2) and as
    ``ddplab.dist.pick_backend`` (nccl only when every rank has a GPU of its own):
    :func:`course_backend`.

    Lesson: the hardware cell of every notebook (``doctor`` prints it).
    """
    gpus = int(facts["gpu_count"])
    nprocs = max(2, gpus)
    forced = os.environ.get("DDPLAB_BACKEND", "")
    if course_backend(facts) == "nccl":
        line = f"{nprocs} ranks with nccl, one per GPU"
        if facts.get("p2p") is False:
            line += (", peer-to-peer off (NCCL_P2P_DISABLE=1)"
                     if os.environ.get("NCCL_P2P_DISABLE") == "1" else
                     " (no peer-to-peer between them: set NCCL_P2P_DISABLE=1)")
        return line
    if gpus == 0:
        why = "no GPU here"
    elif gpus == 1:
        why = "beside 1 GPU: nccl needs a GPU per rank; one-process runs use the GPU"
    else:
        why = "DDPLAB_BACKEND=gloo" if forced == "gloo" else "this torch build has no nccl"
    return f"{nprocs} ranks on CPU with gloo ({why})"


def p2p_problems(facts: dict[str, Any]) -> list[tuple[str, str]]:
    """GPUs without peer-to-peer access (consumer cards): nccl can hang unless told not to try."""
    if facts["gpu_count"] < 2 or facts.get("p2p") is not False \
            or os.environ.get("NCCL_P2P_DISABLE") == "1":
        return []
    return [("these GPUs cannot reach each other directly (no peer-to-peer, as on consumer "
             "cards): nccl may hang at its first collective",
             "export NCCL_P2P_DISABLE=1 before starting Jupyter (or pass "
             "env={'NCCL_P2P_DISABLE': '1'} to ddplab.launch)")]


class Report(dict):
    """The doctor's facts; a short repr, since the report itself was already printed."""

    def __repr__(self) -> str:
        return (f"<doctor: {self['gpu_count']} GPU(s), backend {self['backend']}, "
                f"{len(self['problems'])} problem(s)>")


#: The plans ``doctor`` printed in this process (a kernel's launches then print none).
PLAN_PRINTED: list[str] = []


def doctor(quiet: bool = False, full: bool = False) -> Report:
    """Report torch, devices, backends, the backend ddplab picks, a free port and problems.

    Prints one line (torch, devices, how the course runs here, how launches start) and every
    problem with its fix; ``full=True`` (or ``python -m ddplab doctor``) prints every fact.

    Args:
        quiet: return the report without printing it.
        full: print the whole report, one fact a line.

    Returns:
        The report as a dict (``problems`` is a list of ``{"problem", "fix"}``).

    Lesson: the hardware cell of every notebook.
    """
    import multiprocessing

    facts = Report(probe())
    facts.update({
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "free_port": free_port(),
        "shm_bytes": shm_bytes(),
        "start_method": "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn",
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset"),
    })
    facts["backend"] = course_backend(facts)
    facts["plan"] = course_plan(facts)
    facts["launch_path"] = launch_path()
    facts["problems"] = [{"problem": p, "fix": f} for p, f in problems(facts)]
    if not quiet:
        print(format_report(facts) if full else format_summary(facts))
        PLAN_PRINTED.append(facts["plan"])   # a notebook's first launch need not say it again
    return facts


def format_summary(facts: dict[str, Any]) -> str:
    """The doctor's report in one line, then one line per problem and its fix."""
    gpus = facts["gpu_count"]
    where = f"{gpus} GPU{'s' if gpus != 1 else ''}" if gpus else "no GPU"
    launches = "fork" if (facts.get("launch_path") or launch_path()).startswith("fork") \
        else "cold subprocess"
    found = facts["problems"]
    lines = [f"ddplab doctor: torch {facts['torch']}, {where}, {facts['cpu_count']} CPU cores; "
             f"lessons run {facts.get('plan') or course_plan(facts)} unless a cell asks for more; "
             f"launches: {launches}; "
             f"{len(found) or 'no'} problem{'s' if len(found) != 1 else ''} "
             "(all facts: ddplab.doctor(full=True))"]
    lines += [f"PROBLEM: {item['problem']}\n  fix: {item['fix']}" for item in found]
    return "\n".join(lines)


def format_report(facts: dict[str, Any]) -> str:
    """Render the ``doctor`` report as aligned text lines."""
    gpus = ", ".join(f"{g['name']} ({g['memory_gb']} GB)" for g in facts["gpus"]) or "none"
    backends = ", ".join(k for k, v in facts["backends"].items() if v) or "none"
    shm = facts["shm_bytes"]
    rows = [
        ("python", facts["python"]),
        ("torch", f"{facts['torch']} (CUDA build: {facts['cuda_build'] or 'none'})"),
        ("torch tested", versions.torch_status(facts["torch"]) or "no: see PROBLEM below"),
        ("CPU cores", facts["cpu_count"]),
        ("GPUs", f"{facts['gpu_count']}: {gpus}"),
        ("backends available", backends),
        ("lessons run", facts.get("plan") or course_plan(facts)),
        ("free port", facts["free_port"]),
        ("/dev/shm", f"{shm // 2**20} MiB" if shm else "absent"),
        ("start method", facts["start_method"]),
        ("launches", facts.get("launch_path") or launch_path()),
        ("OMP_NUM_THREADS", facts["omp_num_threads"]),
    ]
    lines = [f"{name:<20} {value}" for name, value in rows]
    for item in facts["problems"]:
        lines.append(f"PROBLEM: {item['problem']}\n  fix: {item['fix']}")
    if not facts["problems"]:
        lines.append("no problems found")
    return "\n".join(lines)


if __name__ == "__main__":
    if "--json" in sys.argv:
        print(json.dumps(_probe_here()))
    else:
        doctor()
