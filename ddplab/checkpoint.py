"""Checkpoints that survive crashes: rank-0 atomic save, barrier, map_location load, resume.

Self-contained (torch and the standard library only; numpy's RNG is saved when numpy is
installed), so you can copy this file alone into your own project. That is why the one place
that needs the process group, ``save_checkpoint`` (rank 0 writes, every rank waits), asks
``torch.distributed`` directly instead of importing ``ddplab.dist``. A training script that
resumes where it stopped (run it with ``python`` or ``torchrun --nproc-per-node 2``)::

    import os

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from ddplab.checkpoint import load_checkpoint, save_checkpoint
    from ddplab.dist import cleanup, setup

    info = setup()                                # a world of one under plain python
    model = torch.nn.Linear(4, 2).to(info.device)
    if info.world_size > 1:
        model = DDP(model, device_ids=info.device_ids)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    start = 0
    if os.path.exists("ckpt/checkpoint.pt"):     # a run before this one stopped
        state = load_checkpoint("ckpt/checkpoint.pt", model, optimizer, device=info.device)
        start = state["epoch"]                    # epochs already done
    for epoch in range(start, 3):
        loss = model(torch.randn(8, 4, device=info.device)).pow(2).mean()   # one epoch
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        save_checkpoint("ckpt/checkpoint.pt", model, optimizer, epoch=epoch + 1)
        # rank 0 wrote the file, every rank waited for it
    del model                                     # DDP holds the process group: drop it first
    cleanup()

What it does for you:

- Saves once, on rank 0, the *unwrapped* model (``model.module`` of DDP/DataParallel), the
  optimizer, the AMP GradScaler, the epoch, the sampler epoch and every rank's own RNG states
  (gathered to rank 0, keyed by rank), then waits at a barrier so no rank reads a file that is
  still being written. On resume each rank restores its own RNG states, not rank 0's.
- Writes atomically: a temporary file in the same folder, flushed to disk (fsync), then renamed
  over the old one (``os.replace``); a crash mid-write leaves the previous checkpoint intact.
- Loads with ``map_location`` set to the rank's own device (without it, tensors go back to the
  GPU they were saved from and every rank piles memory onto GPU 0) and ``weights_only=True``
  (a checkpoint from a stranger cannot run code).
- Repairs a ``module.`` key prefix (a state_dict saved from a wrapped model) and says so.
- Raises ``CheckpointError`` with what to do for a truncated or corrupted file.

Lesson: 05.
"""

from __future__ import annotations

import os
import pickle
import random
import socket
import warnings
import zipfile
from typing import Any, Mapping, Optional, Union

import torch
import torch.distributed as torch_dist
from torch import nn

PathLike = Union[str, "os.PathLike[str]"]
PREFIX = "module."
FORMAT = "ddplab-checkpoint-1"


class CheckpointError(RuntimeError):
    """A checkpoint file cannot be used (truncated, corrupted or not a plain state file).

    Lesson: 05.
    """


# ------------------------------------------------------------------ helpers for any script


def unwrap_model(model: nn.Module) -> nn.Module:
    """Return the model inside a DDP or DataParallel wrapper (or the model itself).

    Example::

        import torch
        from ddplab.checkpoint import unwrap_model

        model = torch.nn.DataParallel(torch.nn.Linear(4, 2))   # DDP is unwrapped the same way
        state = unwrap_model(model).state_dict()
        assert list(state) == ["weight", "bias"]               # no "module." prefix
        torch.save(state, "model.pt")

    Lesson: 02, 05.
    """
    wrappers = (nn.DataParallel, nn.parallel.DistributedDataParallel)
    while isinstance(model, wrappers):
        model = model.module
    return model


def strip_module_prefix(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Remove the ``module.`` prefix that DDP/DataParallel put in front of every key.

    Keys without the prefix are kept as they are.

    Example::

        from ddplab.checkpoint import strip_module_prefix

        state = strip_module_prefix({"module.fc.weight": 1, "module.fc.bias": 2})
        assert state == {"fc.weight": 1, "fc.bias": 2}

    Lesson: 02, 05.
    """
    return {(k[len(PREFIX):] if k.startswith(PREFIX) else k): v for k, v in state_dict.items()}


def map_location_for(device: Union[torch.device, str, None] = None) -> torch.device:
    """Return where this rank should load tensors: its own GPU, or the CPU.

    Args:
        device: the rank's device. None picks ``cuda:LOCAL_RANK`` when CUDA is available and
            the CPU otherwise; ``"cuda"`` without an index also means ``cuda:LOCAL_RANK``.

    Returns:
        The device to pass as ``torch.load(..., map_location=...)``.

    Example::

        import torch
        from ddplab.checkpoint import map_location_for

        print(map_location_for())            # cuda:<LOCAL_RANK> with CUDA, else cpu
        assert map_location_for("cpu") == torch.device("cpu")

    Lesson: 05.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        has_cuda = torch.cuda.is_available()
        return torch.device("cuda", local_rank) if has_cuda else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", local_rank)
    return device


# ---------------------------------------------------------------------------------- RNG


def _cuda_in_use() -> bool:
    """True when this process already uses CUDA (never initialise it just for RNG state)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def rng_states() -> dict[str, Any]:
    """Capture the RNG states of torch (CPU and this process's GPU), numpy and ``random``.

    Stored as tensors and plain numbers so the checkpoint loads with ``weights_only=True``.

    Lesson: 05.
    """
    version, state, gauss = random.getstate()
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        # this process's GPU only: get_rng_state_all() would open a CUDA context on every GPU
        "cuda": torch.cuda.get_rng_state() if _cuda_in_use() else None,
        "python": {"version": version, "state": torch.tensor(state, dtype=torch.int64),
                   "gauss": gauss},
        "numpy": None,
    }
    try:
        import numpy as np
    except ImportError:  # numpy is optional for this file
        return states
    name, keys, pos, has_gauss, cached = np.random.get_state()
    states["numpy"] = {"name": name, "keys": torch.from_numpy(keys.astype("int64")),
                       "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}
    return states


def set_rng_states(states: Mapping[str, Any]) -> None:
    """Restore RNG states captured by ``rng_states`` (missing parts are left alone).

    Lesson: 05.
    """
    torch.set_rng_state(states["torch"].cpu())
    if states.get("cuda") is not None and _cuda_in_use():
        torch.cuda.set_rng_state(states["cuda"].cpu())
    py = states["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    if states.get("numpy") is not None:
        import numpy as np

        n = states["numpy"]
        keys = n["keys"].numpy().astype("uint32")
        np.random.set_state((n["name"], keys, n["pos"], n["has_gauss"], n["cached"]))


# ---------------------------------------------------------------------------------- save


def atomic_save(obj: Any, path: PathLike) -> None:
    """``torch.save`` to a temporary file in the same folder, fsync it, then rename it.

    ``os.replace`` is atomic on one file system, so readers see the old file or the new one,
    never half of one; the folder is fsynced after the rename, so that a power cut cannot undo
    the rename itself. The file gets the mode the umask gives (as ``open`` would: 0644 under
    the usual umask 022). The temporary file, ``.<name>.tmp-<host>-<pid>``, is removed if
    anything fails; one that a killed save left (its process is gone) is removed by the next
    save on that host. Several writers (one per node, say) each have their own.

    Example::

        import torch
        from ddplab.checkpoint import atomic_save

        model = torch.nn.Linear(4, 2)
        atomic_save(model.state_dict(), "ckpt/model.pt")   # never half a file on disk
        assert list(torch.load("ckpt/model.pt", weights_only=True)) == ["weight", "bias"]

    Lesson: 05.
    """
    target = os.path.abspath(path)
    folder, name = os.path.split(target)
    os.makedirs(folder, exist_ok=True)
    mine = f".{name}.tmp-{socket.gethostname()}-"
    for stale in os.listdir(folder):
        pid = stale[len(mine):]
        if stale.startswith(mine) and pid.isdigit() and not _running(int(pid)):
            try:
                os.remove(os.path.join(folder, stale))  # a killed save's: reclaimed
            except FileNotFoundError:
                pass
    # [atomic]
    tmp = os.path.join(folder, f"{mine}{os.getpid()}")
    try:
        handle = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # umask applies
        with os.fdopen(handle, "wb") as file:
            torch.save(obj, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    # [/atomic]
    if hasattr(os, "O_DIRECTORY"):  # make the rename itself durable (POSIX)
        dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def save_checkpoint(
    path: PathLike,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    scaler: Optional[torch.amp.GradScaler] = None,
    epoch: int = 0,
    sampler_epoch: Optional[int] = None,
    extra: Optional[Mapping[str, Any]] = None,
) -> None:
    """Save a training checkpoint on rank 0, atomically, then wait for every rank.

    Call it on every rank: every rank's RNG states are gathered to rank 0 (``gather_object``),
    only rank 0 writes, and all ranks leave together after a barrier, so the file is complete
    before anyone can read (or delete) it. With NCCL, ``gather_object`` uses the current CUDA
    device: call ``torch.cuda.set_device(local_rank)`` first (``ddplab.dist.setup`` does).

    Args:
        path: the checkpoint file (its folder is created).
        model: the model, wrapped or not; the unwrapped state_dict is saved.
        optimizer: its state (momentum buffers, ...) is saved too.
        scaler: the AMP GradScaler (its scale and growth tracker).
        epoch: epochs finished so far (resume starts at this epoch index).
        sampler_epoch: the value to give ``sampler.set_epoch`` next (default: ``epoch``).
        extra: anything else made of tensors, numbers, strings, lists and dicts.

    Lesson: 05.
    """
    grouped = torch_dist.is_available() and torch_dist.is_initialized()  # see the module doc
    rank = torch_dist.get_rank() if grouped else 0
    rngs: list[Any] = [rng_states()]
    if grouped and torch_dist.get_world_size() > 1:  # each rank's own stream, keyed by rank
        everyone = [None] * torch_dist.get_world_size() if rank == 0 else None
        torch_dist.gather_object(rngs[0], everyone, dst=0)
        rngs = everyone or []
    if rank == 0:
        state = {
            "format": FORMAT,
            "model": unwrap_model(model).state_dict(),
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "scaler": scaler.state_dict() if scaler is not None else None,
            "epoch": int(epoch),
            "sampler_epoch": int(epoch if sampler_epoch is None else sampler_epoch),
            "rng": dict(enumerate(rngs)),  # {rank: that rank's rng_states()}
            "extra": dict(extra or {}),
        }
        atomic_save(state, path)
    if grouped:
        torch_dist.barrier()  # nobody reads, or deletes, the file before it is complete


# ---------------------------------------------------------------------------------- load


def read_checkpoint(path: PathLike, device: Union[torch.device, str, None] = None) -> dict:
    """Read a checkpoint file onto ``device`` with ``weights_only=True``.

    Args:
        path: the file.
        device: where tensors go (see ``map_location_for``; None: this rank's device).

    Returns:
        The saved dictionary.

    Raises:
        FileNotFoundError: there is no file at ``path``.
        CheckpointError: the file is truncated, corrupted, or holds pickled objects.

    Lesson: 05.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"no checkpoint at {os.fspath(path)!r}: check --checkpoint-dir, or start without "
            "--resume."
        )
    try:
        _verify_zip(path)
        return torch.load(path, map_location=map_location_for(device), weights_only=True)
    except pickle.UnpicklingError as error:
        if "Unsupported global" in str(error):
            raise CheckpointError(
                f"{os.fspath(path)!r} holds pickled Python objects (such as a whole model), not "
                "only tensors, so it is not loaded with weights_only=True: loading it could run "
                "arbitrary code. Save model.state_dict() instead of the model; load this file "
                "with torch.load(..., weights_only=False) only if you trust its author."
            ) from error
        raise _corrupted(path, error) from error
    except (OSError, RuntimeError, EOFError, zipfile.BadZipFile, ValueError, KeyError) as error:
        raise _corrupted(path, error) from error


def _verify_zip(path: PathLike) -> None:
    """Check the CRC of every record of a ``torch.save`` zip file (tensor bytes included).

    ``torch.load`` does not check them, so a flipped byte in a tensor would load silently.
    """
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
        if bad is not None:
            raise zipfile.BadZipFile(f"record {bad} fails its CRC check")


def _corrupted(path: PathLike, error: BaseException) -> CheckpointError:
    """The error for an unreadable file: what happened, the likely cause, what to do."""
    detail = (str(error).splitlines() or [""])[0]
    if len(detail) > 120:  # a long message: its first sentence, or whole words
        end = detail.rfind(". ", 0, 120)
        detail = detail[:end + 1] if end > 0 else detail[:120].rsplit(" ", 1)[0] + " ..."
    return CheckpointError(
        f"checkpoint {os.fspath(path)!r} is truncated or corrupted ({type(error).__name__}: "
        f"{detail}). A crash while it was written, or a copy that did not finish, does this. "
        "Delete it and resume from an earlier checkpoint, or start again without --resume."
    )


def load_model_state(model: nn.Module, state_dict: Mapping[str, Any]) -> None:
    """Load ``state_dict`` into ``model`` (wrapped or not), repairing a ``module.`` prefix.

    Raises:
        RuntimeError: the keys or shapes do not match the model (PyTorch's message).

    Lesson: 02, 05.
    """
    target = unwrap_model(model)
    if any(k.startswith(PREFIX) for k in state_dict) and not any(
        k.startswith(PREFIX) for k in target.state_dict()
    ):
        warnings.warn(
            "checkpoint keys start with 'module.' (it was saved from a DDP/DataParallel "
            "wrapper); the prefix was stripped. Save model.module.state_dict() (or use "
            "ddplab.checkpoint.save_checkpoint) to avoid this.",
            stacklevel=2,
        )
        state_dict = strip_module_prefix(state_dict)
    target.load_state_dict(state_dict)


def load_checkpoint(
    path: PathLike,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    scaler: Optional[torch.amp.GradScaler] = None,
    device: Union[torch.device, str, None] = None,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint into the model (and optimizer, scaler, RNG) on this rank's device.

    Works on any world size: the model and optimizer state do not depend on how many ranks
    saved them. A plain ``state_dict`` file (not made by ``save_checkpoint``) is loaded into the
    model too.

    Args:
        path: the checkpoint file.
        model: the model, wrapped or not, already on its device.
        optimizer: restore its state if given.
        scaler: restore the GradScaler if given (and saved).
        device: where tensors go; None means this rank's device (``map_location_for``).
        restore_rng: also restore this rank's own saved RNG states (rank r gets what rank r
            saved). A rank the checkpoint has no states for (resumed on more ranks than
            saved it) keeps its own and warns; on fewer ranks the extra states go unused.

    Returns:
        ``{"epoch", "sampler_epoch", "extra"}`` of the checkpoint (zeros and {} for a plain
        state_dict).

    Raises:
        CheckpointError: unreadable file (see ``read_checkpoint``).

    Lesson: 05.
    """
    state = read_checkpoint(path, device)
    if state.get("format") != FORMAT:  # a bare state_dict, e.g. torch.save(model.state_dict())
        load_model_state(model, state)
        return {"epoch": 0, "sampler_epoch": 0, "extra": {}}
    load_model_state(model, state["model"])
    if optimizer is not None and state["optimizer"] is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scaler is not None and state["scaler"]:
        scaler.load_state_dict(state["scaler"])
    if restore_rng:
        _restore_own_rng(state["rng"])
    return {k: state[k] for k in ("epoch", "sampler_epoch", "extra")}


def _restore_own_rng(saved: Mapping[Any, Any]) -> None:
    """Restore this rank's entry of ``{rank: rng_states()}`` (never another rank's)."""
    grouped = torch_dist.is_available() and torch_dist.is_initialized()
    rank = torch_dist.get_rank() if grouped else 0
    if "torch" in saved:  # a file from before per-rank states: rank 0's states only
        saved = {0: saved}
    if rank in saved:
        set_rng_states(saved[rank])
        return
    warnings.warn(
        f"the checkpoint holds RNG states for {len(saved)} rank(s) and none for rank {rank} "
        "(it was saved on fewer processes): this rank keeps its current RNG states.",
        stacklevel=3,
    )
