"""Worker-side helpers for torch.distributed: setup, rank info, barrier, print0, collectives.

Everything here needs only torch and the standard library, so any function can be copied into
your own training script. A torchrun-style worker, which also runs as plain ``python``::

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from ddplab.dist import cleanup, print0, setup

    info = setup()                     # reads RANK, LOCAL_RANK, WORLD_SIZE from torchrun
    model = torch.nn.Linear(4, 2).to(info.device)
    if info.world_size > 1:            # a world of one has no process group: no DDP needed
        model = DDP(model, device_ids=info.device_ids)
    loss = model(torch.randn(8, 4, device=info.device)).pow(2).mean()
    loss.backward()                    # under DDP: gradients averaged over every rank
    print0(f"trained on {info.world_size} process(es) with {info.backend}")
    del model                          # DDP holds the process group: drop it first
    cleanup()

Lessons: 03 (setup by hand and with mp.spawn; numbers summed, averaged and gathered over ranks),
05 (barrier, save on rank 0), 07 (torchrun).
"""

from __future__ import annotations

import builtins
import collections
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
# Imported before any process group exists, on purpose: torch.distributed.nn.functional keeps
# group.WORLD as a default argument, evaluated when it is first imported. DDP's constructor
# imports it late, after init_process_group, and the group it captured then outlives
# destroy_process_group(): gloo's threads run into interpreter exit, which now and then aborts
# ("terminate called without an active exception"). Imported first, it captures nothing.
import torch.distributed.nn  # noqa: F401,E402

# Before torch 2.8, gloo's process-group destructor joins its worker thread while holding the
# GIL, and that thread may be dropping the last reference to a tensor of the last collective,
# which needs the GIL: the process hangs at exit (fixed upstream in pytorch#154976). Keeping
# Python references to the tensors of these helpers' collectives means the worker thread never
# drops the last one. A few dozen small tensors; harmless on newer torch.
_KEEP: collections.deque = collections.deque(maxlen=64)
_GLOO_DESTRUCTOR_HOLDS_GIL = torch.__version__ < "2.8"  # a TorchVersion: compares as versions


@dataclass(frozen=True)
class DistInfo:
    """Who this process is: what ``setup()`` returns.

    ``device_ids`` is what DDP's ``device_ids=`` argument wants: ``[local_rank]`` on CUDA, and
    None on CPU (DDP refuses device ids for CPU modules).

    Lesson: 03, 07.
    """

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device_ids(self) -> Optional[list[int]]:
        return [self.device.index] if self.device.type == "cuda" else None


def pick_backend(requested: Optional[str] = None,
                 local_world_size: Optional[int] = None) -> str:
    """Return the process-group backend: ``nccl`` when every local process gets a GPU, else gloo.

    For more than one local process, automatic choice also needs a torch built with nccl (the
    Linux CUDA wheels; not Windows): without it they fall back to gloo on CPU. One process joins
    no group, so it gets its GPU either way.

    Args:
        requested: force a backend (``"gloo"``, ``"nccl"``, ``"mpi"``) or None for automatic
            (``ddplab.launch(..., backend=...)`` passes its choice as ``DDPLAB_BACKEND``).
        local_world_size: processes on this machine (default: torchrun's ``LOCAL_WORLD_SIZE``,
            else 1). With more processes than GPUs, automatic choice falls back to gloo on CPU,
            so a lesson written for 2 processes still runs on a 1-GPU laptop.

    Raises:
        RuntimeError: ``nccl`` was requested on a machine without a CUDA GPU.

    Example::

        from ddplab.dist import pick_backend

        print(pick_backend())       # gloo on a laptop; nccl when every local rank has a GPU
        assert pick_backend("gloo") == "gloo"

    Lesson: 03, 07.
    """
    requested = requested or os.environ.get("DDPLAB_BACKEND") or None
    if requested in (None, "", "auto"):
        if local_world_size is None:
            local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        usable = torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size
        nccl = local_world_size == 1 or dist.is_nccl_available()
        return "nccl" if usable and nccl else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        raise RuntimeError(
            "nccl was requested but no CUDA GPU is visible: use backend='gloo' (or leave it "
            "unset so ddplab picks gloo on CPU)."
        )
    return requested


def pick_device(local_rank: int, backend: str) -> torch.device:
    """Return the device of this process: ``cuda:<local_rank>`` with nccl, else the CPU.

    Raises:
        RuntimeError: more processes on this node than GPUs (each nccl rank needs its own GPU).

    Lesson: 03, 07.
    """
    if backend == "nccl":
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise RuntimeError(
                f"local rank {local_rank} has no GPU: this node has {count} GPU(s). Start at "
                f"most {count} processes per node (--nproc-per-node {count}) or use gloo on CPU."
            )
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def env_info() -> tuple[int, int, int]:
    """Return ``(rank, local_rank, world_size)`` from the torchrun environment (0, 0, 1 alone).

    Lesson: 07.
    """
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return rank, local_rank, world_size


def setup(
    backend: Optional[str] = None,
    *,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    init_method: Optional[str] = None,
    timeout_s: float = 300.0,
) -> DistInfo:
    """Join the process group and pick this process's device.

    With no arguments it reads torchrun's ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR`` and ``MASTER_PORT`` (``env://``). For ``mp.spawn`` pass ``rank`` and
    ``world_size``, as in ``setup(rank=rank, world_size=2)`` (the local rank is the rank on one
    machine); they are then also set as ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` where unset,
    as torchrun would, for code that reads them. A world of one process skips the process group
    entirely, so the same script also runs as plain ``python train.py``: use the model as it is
    there (DDP needs a process group; ``info.world_size > 1`` tells when to wrap it).

    Args:
        backend: None picks ``nccl`` with CUDA, ``gloo`` without (see ``pick_backend``).
        rank: this process's global rank (default: ``RANK``).
        world_size: number of processes (default: ``WORLD_SIZE``).
        init_method: ``env://`` (default), ``tcp://ADDR:PORT`` or ``file:///path``.
        timeout_s: how long collectives may wait for a peer before failing.

    Returns:
        A ``DistInfo`` with rank, local_rank, world_size, device and backend.

    Example::

        from ddplab.dist import cleanup, setup

        info = setup()            # under torchrun; plain python: rank 0 of a world of one
        print(f"rank {info.rank} of {info.world_size} on {info.device} with {info.backend}")
        cleanup()

    Lesson: 03, 07.
    """
    env_rank, local_rank, env_world = env_info()
    rank = env_rank if rank is None else rank
    if os.environ.get("DDPLAB_RANK_PREFIX") == "1":
        prefix_output(rank)
    world_size = env_world if world_size is None else world_size
    if "LOCAL_RANK" not in os.environ:
        local_rank = rank
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    chosen = pick_backend(backend, local_world)
    device = pick_device(local_rank, chosen)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1:  # mp.spawn sets none of torchrun's variables (ddplab.events reads RANK)
        for name, value in (("RANK", rank), ("LOCAL_RANK", local_rank), ("WORLD_SIZE", world_size)):
            os.environ.setdefault(name, str(value))
    if world_size > 1 and not dist.is_initialized():
        kwargs: dict[str, Any] = {"timeout": timedelta(seconds=timeout_s)}
        if device.type == "cuda":
            kwargs["device_id"] = device  # lets nccl bind the communicator to this GPU early
        # Return only once every rank has joined (a barrier on the store, not a collective):
        # else a rank whose connections came up first can finish and exit while a slower peer
        # still connects to it, and gloo fails that peer ("connection closed by peer").
        os.environ.setdefault("TORCH_DIST_INIT_BARRIER", "1")
        dist.init_process_group(
            chosen, init_method=init_method, rank=rank, world_size=world_size, **kwargs
        )
    return DistInfo(rank, local_rank, world_size, device, chosen)


class _Prefixed:
    """A text stream that starts every line with ``[rankN]``, so merged logs stay readable.

    Whole lines are written at once: processes sharing one pipe then never cut into each
    other's lines (writes under 4 KiB to a pipe are atomic).
    """

    def __init__(self, stream: Any, prefix: str) -> None:
        self.stream, self.prefix, self.pending = stream, prefix, ""

    def write(self, text: str) -> int:
        self.pending += text
        if "\n" in self.pending:
            *lines, self.pending = self.pending.split("\n")
            self.stream.write("".join(f"{self.prefix}{line}\n" for line in lines))
            self.stream.flush()
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def prefix_output(rank: int) -> None:
    """Prefix this process's printed lines with ``[rank<rank>]``.

    ``torch.multiprocessing.spawn`` children share one stdout; ddplab's launcher sets
    ``DDPLAB_RANK_PREFIX=1`` for them so it can tell the ranks' lines apart.

    Lesson: 03.
    """
    import sys

    if _streams_of_its_own(rank):
        return
    if not isinstance(sys.stdout, _Prefixed):
        sys.stdout = _Prefixed(sys.stdout, f"[rank{rank}] ")
        sys.stderr = _Prefixed(sys.stderr, f"[rank{rank}] ")


def _streams_of_its_own(rank: int) -> bool:
    """Give this rank a stdout and a stderr of its own, from ddplab's launcher, if it offers.

    ``DDPLAB_RANK_SOCKET`` names a socket (``@name``: Linux's abstract namespace; else a
    path) where each rank connects once per stream and says
    whose stream it is: its lines, however long, then never mix with another rank's (ranks
    writing to one shared pipe cut into each other's lines longer than 4 KiB). The rank then
    dumps its Python stack at SIGUSR1, as the launcher's torchrun ranks do.
    """
    import socket
    import sys

    address = os.environ.get("DDPLAB_RANK_SOCKET", "")
    if not address or not hasattr(socket, "AF_UNIX"):
        return False
    if address.startswith("@"):  # Linux's abstract namespace
        address = "\0" + address[1:]
    for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
        try:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(address)
            conn.sendall(f"rank {rank} {'out' if fd == 1 else 'err'} {os.getpid()}\n".encode())
        except OSError:
            return False
        stream.flush()
        os.dup2(conn.fileno(), fd)
        conn.close()
    import faulthandler
    import signal

    # As the launcher's own ranks do: at SIGUSR1, every thread's Python stack on stderr (what
    # a launch that timed out asks of each rank still running, before it ends them).
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    return True


def cleanup() -> None:
    """Leave the process group (safe to call when none was created).

    Before torch 2.8 a gloo group's destructor waits for its worker threads while holding the
    GIL, and a worker thread still dropping the last collective's tensors needs the GIL: the
    process hangs (pytorch#154976). There, ``cleanup`` first lets those threads finish, with
    the GIL released for a moment (0.1 s once per process).

    A DDP model still referenced keeps its process group, and the group's threads, alive past
    ``destroy_process_group()``; they then run into the interpreter's exit, which aborts now
    and then ("terminate called without an active exception"). Drop the model first
    (``del model``), or build it inside a function that has returned.

    Lesson: 03, 07.
    """
    if dist.is_available() and dist.is_initialized():
        if _GLOO_DESTRUCTOR_HOLDS_GIL and dist.get_backend() == "gloo":
            time.sleep(0.1)  # the GIL is free while this thread sleeps
        dist.destroy_process_group()


def get_rank() -> int:
    """This process's rank, 0 when no process group exists.

    Lesson: 05.
    """
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size() -> int:
    """The number of processes, 1 when no process group exists.

    Lesson: 05.
    """
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main() -> bool:
    """True on rank 0 (the process that prints and saves).

    Lesson: 05.
    """
    return get_rank() == 0


def barrier() -> None:
    """Wait until every rank arrives here; a no-op without a process group.

    Lesson: 05.
    """
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def print0(*args: Any, **kwargs: Any) -> None:
    """``print`` on rank 0 only, flushed, so a job's log is not N copies of the same line.

    Lesson: 05.
    """
    if is_main():
        kwargs.setdefault("flush", True)
        builtins.print(*args, **kwargs)


def save_on_main(save: Callable[[], Any]) -> Any:
    """Run ``save()`` on rank 0 only, then wait at a barrier so nobody reads too early.

    Example::

        import torch
        from ddplab.dist import cleanup, save_on_main, setup

        info = setup()
        model = torch.nn.Linear(4, 2)
        save_on_main(lambda: torch.save(model.state_dict(), "model.pt"))   # rank 0 writes
        state = torch.load("model.pt", map_location=info.device, weights_only=True)
        cleanup()

    Lesson: 05.
    """
    result = save() if is_main() else None
    barrier()
    return result


# ------------------------------------------------------------------ collectives on numbers


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over all ranks in place and return it (unchanged in a world of one).

    Example::

        import torch
        from ddplab.dist import all_reduce_sum, cleanup, setup

        info = setup()
        counts = all_reduce_sum(torch.tensor([3, 4], device=info.device))  # [correct, total]
        assert counts.tolist() == [3 * info.world_size, 4 * info.world_size]
        cleanup()

    Lesson: 01, 03 (the training loop sums losses and test counts over ranks).
    """
    if get_world_size() > 1:
        dist.all_reduce(tensor)
        _KEEP.append(tensor)
    return tensor


def all_reduce_mean(value: float, device: Optional[torch.device] = None) -> float:
    """Average a Python number over all ranks (for logging a loss or accuracy).

    ``device`` is the rank's device (nccl reduces GPU tensors only).

    Lesson: 03, 11.
    """
    tensor = torch.tensor([float(value)], dtype=torch.float64, device=device)
    return float(all_reduce_sum(tensor).item()) / get_world_size()


def all_gather_floats(value: float, device: Optional[torch.device] = None) -> list[float]:
    """Return ``value`` from every rank, in rank order (``[value]`` in a world of one).

    Example::

        import torch
        from ddplab.dist import all_gather_floats, cleanup, setup

        info = setup()
        torch.manual_seed(0)                     # the same initial weights on every rank
        model = torch.nn.Linear(4, 2)
        checksums = all_gather_floats(sum(p.sum().item() for p in model.parameters()),
                                      info.device)
        assert len(checksums) == info.world_size and len(set(checksums)) == 1
        cleanup()

    Lesson: 03 (equal weights on every rank).
    """
    world = get_world_size()
    if world == 1:
        return [float(value)]
    mine = torch.tensor([float(value)], dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    _KEEP.extend([mine, *gathered])
    return [float(t.item()) for t in gathered]
