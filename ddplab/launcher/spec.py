"""One launch's arguments, checked before anything starts (``LaunchError`` says what to do)."""

from __future__ import annotations

import math
import os
import resource
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from .. import env as _env
from .entry import LOCAL_RANK_OPTIONS

ENGINES = ("torchrun", "spawn")
MAX_NPROCS = 256  # ranks one launch may start here (the caller holds two sockets for each)


class LaunchError(ValueError):
    """Bad input to ``launch``, found before any process starts. The message says what to do."""


@dataclass
class LaunchSpec:
    """What to run, on how many processes, and how (the arguments of ``ddplab.launch``)."""

    target: Union[str, os.PathLike]
    nprocs: int = 2
    args: Sequence[Any] = ()
    engine: str = "torchrun"
    env: Optional[dict[str, str]] = None
    backend: Optional[str] = None
    threads: int = 1
    cwd: Optional[Union[str, os.PathLike]] = None
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: Optional[str] = None
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    max_restarts: int = 0
    local_rank_arg: Union[bool, str] = False
    # Filled by check():
    resolved: str = ""
    host: str = "127.0.0.1"
    port: Optional[int] = None
    argv: list[str] = field(default_factory=list)
    local_rank_style: Optional[str] = None

    def check(self) -> "LaunchSpec":
        """Validate every field and resolve the target; LaunchError on the first problem."""
        self.cwd = os.fspath(self.cwd) if self.cwd is not None else os.getcwd()
        self.host = self.master_addr or "127.0.0.1"
        self.port = self.master_port
        if self.rdzv_endpoint:
            host, _, port_text = self.rdzv_endpoint.rpartition(":")
            self.host, self.port = host, int(port_text) if port_text.isdigit() else None
        self._check_values()
        if self.port is not None and self.node_rank == 0 and \
                not _env.port_is_free(self.port, self.host):
            raise LaunchError(f"port {self.port} on {self.host} is busy: pass another "
                              f"master_port, or leave it out and ddplab picks a free one.")
        self.local_rank_style = _local_rank_style(self.local_rank_arg, self.engine)
        self.resolved = resolve_target(self.target, self.cwd)
        self.argv = [str(a) for a in self.args]
        return self

    def job_env(self) -> dict[str, str]:
        """What the launch adds to the caller's environment for its processes."""
        extra = dict(self.env or {})
        if self.local_rank_style:
            extra["DDPLAB_LOCAL_RANK_ARG"] = self.local_rank_style  # read by the rank's entry
        if self.backend not in (None, "auto"):
            extra["DDPLAB_BACKEND"] = str(self.backend)
        inherited = {"OMP_NUM_THREADS": str(self.threads)}
        if self.nnodes > 1 or self.max_restarts:
            # A torchrun's workers would share its c10d rendezvous's store (torch >= 2.5), and
            # a restarted attempt read the failed one's addresses there (pytorch#135712).
            inherited["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        if self.host.startswith("127.") and (loopback := _env.loopback_interface()):
            inherited["GLOO_SOCKET_IFNAME"] = loopback
        for name, value in inherited.items():
            extra.setdefault(name, os.environ.get(name, value))
        return extra

    def _check_values(self) -> None:
        if self.engine not in ENGINES:
            raise LaunchError(f"unknown engine {self.engine!r}: use one of {', '.join(ENGINES)}.")
        restarts = self.max_restarts
        if not _whole(restarts) or restarts < 0:
            raise LaunchError(f"max_restarts must be a whole number >= 0, got {restarts!r}.")
        if restarts and self.engine != "torchrun":
            raise LaunchError("max_restarts needs engine='torchrun' (its elastic agent restarts "
                              "the workers); an mp.spawn script restarts nothing by itself.")
        if not _whole(self.nprocs) or not 1 <= self.nprocs <= MAX_NPROCS:
            raise LaunchError(f"nprocs must be a whole number from 1 to {MAX_NPROCS} (processes "
                              f"on this machine), got {self.nprocs!r}.")
        _enough_descriptors(self.nprocs)
        if not _whole(self.nnodes) or self.nnodes < 1 or not _whole(self.node_rank) \
                or not 0 <= self.node_rank < self.nnodes:
            raise LaunchError(f"node_rank must be in 0..{self.nnodes - 1} for "
                              f"nnodes={self.nnodes}.")
        if self.backend not in (None, "auto", "gloo", "nccl", "mpi"):
            raise LaunchError(f"unknown backend {self.backend!r}: use gloo, nccl, mpi or None "
                              f"(auto).")
        gpus = _env.gpu_count() if self.backend == "nccl" else 0
        if self.backend == "nccl" and gpus == 0:
            raise LaunchError("backend='nccl' needs CUDA GPUs and none is visible: "
                              "use backend='gloo' (or None to choose automatically).")
        if self.backend == "nccl" and self.nprocs > gpus:
            raise LaunchError(f"nprocs={self.nprocs} but only {gpus} GPU(s) for nccl: use "
                              f"nprocs<={gpus}, or backend='gloo' to run more CPU processes.")


def check_timeout(timeout: Any, default: float) -> float:
    """The timeout in seconds (``math.inf``: none, None: ``default``); else LaunchError."""
    timeout = default if timeout is None else timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
            or math.isnan(timeout) or timeout <= 0:
        raise LaunchError(f"timeout must be a number of seconds > 0 (math.inf for no limit, "
                          f"None for the default, DDPLAB_TIMEOUT or 3600), got {timeout!r}.")
    return float(timeout)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _enough_descriptors(nprocs: int) -> None:
    """Raise this process's descriptor limit for ``nprocs`` ranks, or say why it cannot."""
    need = 64 + 6 * nprocs
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise LaunchError(f"nprocs={nprocs} needs about {need} open files and this process "
                              f"may have {hard} (ulimit -n): use fewer processes or raise the "
                              f"limit.")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def resolve_target(target: Union[str, os.PathLike], cwd: str) -> str:
    """An absolute script path (file, directory or zip) or a module name; else LaunchError."""
    text = os.fspath(target)
    path = Path(text) if os.path.isabs(text) else Path(cwd, text)
    if path.is_file() or (path.is_dir() and (path / "__main__.py").is_file()):
        return str(path.resolve())
    looks_like_path = text.endswith(".py") or os.sep in text or "/" in text
    if not looks_like_path and _find_module(text, cwd) is not None:
        return text
    if path.is_dir():
        raise LaunchError(f"{path} is a directory without __main__.py: give the script inside "
                          f"it, or add a __main__.py to run the directory.")
    raise LaunchError(f"no script or module named {text!r} (looked for {path}). Give a path to "
                      f"a script (relative to {cwd}), a directory or zip with __main__.py, or "
                      f"an importable module name such as 'ddplab.workers.train'.")


def _find_module(name: str, cwd: str) -> Any:
    """The spec of the module ``python -m name`` would run from ``cwd`` (none imported)."""
    import importlib.util
    from importlib.machinery import PathFinder

    spec: Any = None
    search: Optional[list[str]] = [cwd, *sys.path]
    for depth, part in enumerate(name.split(".")):
        if search is None or not part.isidentifier():
            return None
        spec = PathFinder.find_spec(part, search)
        if spec is None and depth == 0:  # installed packages (editable installs use a finder)
            spec = importlib.util.find_spec(part)
        if spec is None:
            return None
        search = list(spec.submodule_search_locations or []) or None
    return spec


def _local_rank_style(value: Union[bool, str], engine: str) -> Optional[str]:
    """The ``--local_rank`` spelling to pass (None: pass nothing); LaunchError if unknown."""
    if value is False or value is None:
        return None
    style = "underscore" if value is True else value
    if style not in LOCAL_RANK_OPTIONS:
        raise LaunchError(f"local_rank_arg must be True, 'underscore' (--local_rank) or 'dash' "
                          f"(--local-rank), got {value!r}.")
    if engine != "torchrun":
        raise LaunchError("local_rank_arg needs engine='torchrun': an mp.spawn script gets "
                          "its rank as the first argument of the function it spawns.")
    return str(style)

