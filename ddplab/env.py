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

import glob
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

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
    if not sys.platform.startswith("linux") or not hasattr(os, "waitid"):
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
    return facts


def format_summary(facts: dict[str, Any]) -> str:
    """The doctor's report in one line, then one line per problem and its fix."""
    gpus = facts["gpu_count"]
    where = f"{gpus} GPU{'s' if gpus != 1 else ''}" if gpus else "no GPU"
    launches = "fork" if (facts.get("launch_path") or launch_path()).startswith("fork") \
        else "cold subprocess"
    found = facts["problems"]
    lines = [f"ddplab doctor: torch {facts['torch']}, {where}, {facts['cpu_count']} CPU cores; "
             f"the course runs {facts.get('plan') or course_plan(facts)}; launches: {launches}; "
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
        ("the course runs", facts.get("plan") or course_plan(facts)),
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
