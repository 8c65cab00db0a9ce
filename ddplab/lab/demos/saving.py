"""Checkpoint files up close: what they hold, where their tensors land, what breaks them.

Kernel side (see ``ddplab.lab.demos``). Small files written and read in the notebook's own process,
to show what the worker-side ``ddplab.checkpoint`` guards against::

    torch.save(TinyNet().state_dict(), "tiny.pt")
    as_if_saved_on("tiny.pt", "tiny_gpu.pt", "cuda:0")   # the same bytes, tagged as from GPU 0
    saved_locations("tiny_gpu.pt")                      # Counter({'cuda:0': 4})
    tensor_devices("tiny_gpu.pt", "cpu")                # map_location brings them to the CPU

- where tensors land: ``saved_locations``, ``tensor_devices``, ``as_if_saved_on``;
- what a file holds: ``checkpoint_table``, ``wrapped_state_dict`` (the ``module.`` prefix);
- why a pickled module is fragile: ``pickled_globals``, ``load_without_class``;
- a crash mid-write: ``truncate``.

Lesson: 05.
"""

from __future__ import annotations

import contextlib
import os
import pickletools
import shutil
import sys
import zipfile
from collections import Counter
from typing import Any, Iterator, Optional, Union

import torch
from torch import nn

from ddplab.lab.demos import error_of
from ddplab.lab.demos.dataparallel import Wrapper

PathLike = Union[str, "os.PathLike[str]"]


class TinyNet(nn.Sequential):
    """A two-layer network for checkpoint experiments (small enough to read its state_dict).

    Lesson: 05.
    """

    def __init__(self) -> None:
        super().__init__(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def wrapped_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Return the state_dict a DDP or DataParallel wrapper around ``model`` would save.

    The wrapper keeps the model as its ``module`` attribute, so every key gains ``module.``.
    (Wrapped in ``dataparallel.Wrapper``, which looks the same to ``state_dict``, so the kernel
    never builds a real DDP or DataParallel, which could touch a GPU.)

    Lesson: 05.
    """
    return Wrapper(model).state_dict()


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Yield every tensor inside nested dicts, lists and tuples.

    Lesson: 05.
    """
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from tensors_in(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from tensors_in(value)


def checkpoint_table(path: PathLike) -> list[tuple[str, str]]:
    """Describe the top-level entries of a checkpoint file, one ``(key, what)`` row each.

    The file is read with ``map_location="cpu"`` and ``weights_only=True``.

    Lesson: 05.
    """
    state = torch.load(path, map_location="cpu", weights_only=True)
    rows = []
    for key, value in state.items():
        tensors = list(tensors_in(value))
        if tensors:
            size = sum(t.numel() * t.element_size() for t in tensors)
            what = f"{len(tensors)} tensors, {size / 1024:.1f} KiB"
        elif isinstance(value, (dict, list)):
            what = f"{type(value).__name__} of {len(value)} plain values"
        else:
            what = repr(value)
        rows.append((key, what))
    return rows


def saved_locations(path: PathLike) -> Counter:
    """Count the device tags a file recorded for its tensors (``"cpu"``, ``"cuda:0"``, ...).

    ``torch.save`` writes each tensor's bytes as a record of their own and names the device
    the tensor lived on in ``data.pkl``, in the persistent id that points to the record.
    ``torch.load`` puts it back there unless ``map_location`` says otherwise. Read here without
    moving anything: a ``map_location`` function sees each tag and keeps the tensor on the CPU.

    Lesson: 05.
    """
    tags: Counter = Counter()

    def keep_on_cpu(storage: Any, location: str) -> Any:
        tags[location] += 1
        return storage

    torch.load(path, map_location=keep_on_cpu, weights_only=True)
    return tags


def tensor_devices(path: PathLike, map_location: Any = None) -> Counter:
    """Load ``path`` with ``map_location`` and count the devices its tensors land on.

    Raises:
        RuntimeError: the file asks for a device this machine does not have (PyTorch's error,
            which says to pass ``map_location``).

    Lesson: 05.
    """
    state = torch.load(path, map_location=map_location, weights_only=True)
    return Counter(str(t.device) for t in tensors_in(state))


def as_if_saved_on(src: PathLike, dst: PathLike, device: str = "cuda:0") -> None:
    """Copy a CPU checkpoint, changing its device tags to ``device``.

    The copy is what ``torch.save`` writes on a rank whose tensors live on ``device``: the same
    bytes, a different tag. It lets a machine without GPUs show how a GPU checkpoint loads.

    Lesson: 05.
    """
    old = b"X\x03\x00\x00\x00cpu"  # the pickle string "cpu" (protocol 2, BINUNICODE)
    new = b"X" + len(device).to_bytes(4, "little") + device.encode()
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            if info.filename.endswith("/data.pkl"):
                if old not in data:
                    raise ValueError(f"{os.fspath(src)!r} holds no CPU tensors to re-tag.")
                data = data.replace(old, new)
            zout.writestr(info.filename, data)


def pickled_globals(path: PathLike) -> list[str]:
    """List the Python names a ``torch.save`` file will import when it is loaded.

    A state_dict needs only a few torch rebuild functions and ``OrderedDict``; a pickled module
    names its own class and every layer class, so loading it needs that exact code.

    Lesson: 05.
    """
    with zipfile.ZipFile(path) as archive:
        name = next(n for n in archive.namelist() if n.endswith("/data.pkl"))
        data = archive.read(name)
    found = []
    for opcode, arg, _ in pickletools.genops(data):
        if opcode.name in ("GLOBAL", "INST"):
            text = str(arg).replace(" ", ".")
            if text not in found:
                found.append(text)
    return found


@contextlib.contextmanager
def class_removed(cls: type) -> Iterator[None]:
    """Hide ``cls`` from its module for a while, as a rename or a move in a refactor would.

    Lesson: 05.
    """
    module = sys.modules[cls.__module__]
    setattr(module, "_hidden_" + cls.__name__, cls)
    delattr(module, cls.__name__)
    try:
        yield
    finally:
        setattr(module, cls.__name__, cls)
        delattr(module, "_hidden_" + cls.__name__)


def load_without_class(path: PathLike, cls: type = TinyNet) -> Optional[BaseException]:
    """Load a pickled module (trusting it) after its class was renamed; return the error.

    Lesson: 05.
    """
    with class_removed(cls):
        return error_of(lambda: torch.load(path, map_location="cpu", weights_only=False))


def truncate(src: PathLike, dst: PathLike, keep: float = 0.5) -> int:
    """Copy the first ``keep`` fraction of a file, as a crash or a failed copy leaves it.

    Returns:
        The number of bytes kept.

    Lesson: 05.
    """
    size = os.path.getsize(src)
    kept = int(size * keep)
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        fout.write(fin.read(kept))
    return kept


def copy_file(src: PathLike, dst: PathLike) -> None:
    """Copy a file (used to keep a checkpoint aside before an experiment overwrites it).

    Lesson: 05.
    """
    shutil.copyfile(src, dst)
