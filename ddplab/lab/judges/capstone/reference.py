"""The capstone's reference job, launched with a run's arguments to judge it by, and the
reference's runs kept on disk where ``DDPLAB_REFERENCE_CACHE`` names a folder (a class's grading:
one launch for every process that shares it)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

from .. import is_run_result

REFERENCE = "ddplab.workers.capstone"
CACHE_ENV = "DDPLAB_REFERENCE_CACHE"   # a folder: the reference's runs, shared by processes


def _launch_reference(world_size: int, args: dict[str, Any]) -> Any:
    import ddplab

    folder = tempfile.mkdtemp(prefix="ddplab-13-reference-")
    argv: list[str] = ["--checkpoint-dir", folder]
    for name, value in sorted(args.items()):
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv += [flag] if value else []
        elif value is not None:
            argv += [flag, str(value)]
    try:
        return ddplab.launch(REFERENCE, world_size, args=argv, quiet=True, live=False,
                             timeout=1800)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def cache_key(key: tuple) -> str:
    """The name of a reference run's entry in ``DDPLAB_REFERENCE_CACHE``: a hash of ``key``
    (world size, arguments), torch's and ddplab's versions and the reference's sources."""
    import importlib.util

    import torch

    import ddplab

    digest = hashlib.sha256(repr((key, torch.__version__, ddplab.__version__)).encode())
    for module in (REFERENCE, "ddplab.capstone"):
        spec = importlib.util.find_spec(module)
        digest.update(Path(spec.origin).read_bytes() if spec and spec.origin else b"?")
    return f"capstone-reference-{digest.hexdigest()[:32]}.pickle"


def _cache_file(key: tuple) -> Optional[Path]:
    folder = os.environ.get(CACHE_ENV)
    return Path(folder) / cache_key(key) if folder else None


def _read_cached(path: Path) -> Any:
    try:
        with open(path, "rb") as file:
            found = pickle.load(file)
    except Exception:   # missing, cut short, or written by another version: launch again
        return None
    return found if is_run_result(found) and getattr(found, "ok", False) else None


def _write_cached(path: Path, result: Any) -> None:
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("wb", dir=path.parent, prefix=".tmp-",
                                         delete=False) as file:
            temporary = file.name
            pickle.dump(result, file)
        os.replace(temporary, path)
    except Exception:   # a cache that cannot be written only costs the next process a launch
        if temporary:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
