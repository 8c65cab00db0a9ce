"""In-kernel demonstrations for lessons 02 and 03: what DataParallel does, and what spawn needs.

Each function runs a small experiment on the CPU inside the notebook kernel and returns plain
facts to print and assert on. Nothing here touches a GPU: the kernel never initialises CUDA.

- 02: ``data_parallel_gradient`` does by hand what ``nn.DataParallel`` does in one forward and
  backward (scatter, replicate, parallel_apply, gather, reduce), and ``dp_by_hand`` compares it
  with the full-batch gradient, with and without BatchNorm. ``scatter_sizes`` shows how a batch
  is cut. ``module_prefix_demo`` shows the ``module.`` prefix error and both fixes.
- 03: ``spawn_from_notebook`` really calls ``torch.multiprocessing.spawn`` on a function defined
  in a notebook cell and returns the failure the children report.

Lessons: 02, 03.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ddplab.models import build_model

Gradients = dict[str, torch.Tensor]

# ------------------------------------------------------------------ 02: DataParallel by hand


def scatter_sizes(batch_size: int, gpus: int) -> list[int]:
    """Return how many samples each GPU gets when DataParallel scatters a batch.

    DataParallel cuts the batch with ``Tensor.chunk``: chunks of ``ceil(batch / gpus)`` and a
    smaller last one, and possibly fewer chunks than GPUs (the rest of the GPUs then sit idle).

    Example::

        >>> scatter_sizes(32, 4), scatter_sizes(10, 4), scatter_sizes(6, 4)
        ([8, 8, 8, 8], [3, 3, 3, 1], [2, 2, 2])

    Lesson: 02.
    """
    return [len(chunk) for chunk in torch.arange(batch_size).chunk(gpus)]


def full_batch_gradient(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor
                        ) -> Gradients:
    """Return the gradient of the mean cross-entropy over the whole batch (one device).

    The model is copied first, so its weights and BatchNorm statistics stay untouched.

    Lesson: 02.
    """
    model = copy.deepcopy(model)
    F.cross_entropy(model(inputs), labels).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def data_parallel_gradient(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor,
                           devices: int) -> Gradients:
    """Return the gradient DataParallel computes on ``devices`` GPUs, done step by step on CPU.

    Each step is what ``nn.DataParallel`` does in one training step; here every "GPU" is a copy
    of the model on the CPU, and the replicas run one after the other instead of in threads.

    Args:
        model: the model on "GPU 0".
        inputs, labels: the whole batch, on "GPU 0".
        devices: number of GPUs to spread the batch over.

    Returns:
        The gradient of every parameter, as it ends up in the model on GPU 0.

    Lesson: 02.
    """
    # [scatter] cut the batch into one chunk per GPU (dimension 0)
    chunks = inputs.chunk(devices)
    # [/scatter]
    # [replicate] copy the module (weights and buffers) to every GPU, at every forward
    replicas = [copy.deepcopy(model) for _ in chunks]
    # [/replicate]
    # [parallel_apply] every replica runs its chunk (one thread per GPU)
    outputs = [replica(chunk) for replica, chunk in zip(replicas, chunks)]
    # [/parallel_apply]
    # [gather] the outputs come back to GPU 0, where the loss of the whole batch is computed
    logits = torch.cat(outputs)
    F.cross_entropy(logits, labels).backward()
    # [/gather]
    # [reduce] backward flows into every replica; their gradients are summed onto GPU 0
    names = [name for name, _ in model.named_parameters()]
    return {name: sum(dict(r.named_parameters())[name].grad for r in replicas).detach()
            for name in names}
    # [/reduce]


@dataclass
class GradientComparison:
    """The outcome of ``dp_by_hand``: how far DataParallel's gradient is from the full batch's.

    ``max_rel_diff`` is the largest over parameters of ``max|g_dp - g_full| / max|g_full|``.
    """

    model: str
    batch_size: int
    devices: int
    chunk_sizes: list[int]
    max_abs_diff: float
    max_rel_diff: float

    @property
    def equal(self) -> bool:
        """True when the two gradients agree to float32 rounding."""
        return self.max_rel_diff < 1e-5


def dp_by_hand(model_name: str = "cnn", batch_size: int = 32, devices: int = 2, seed: int = 0
               ) -> GradientComparison:
    """Compare DataParallel's gradient (done by hand) with the gradient of the full batch.

    Without BatchNorm the two agree to float rounding: the loss of the gathered outputs is the
    loss of the full batch. With BatchNorm (``cnn_bn``) each replica normalises its chunk with
    the chunk's own mean and variance, so the computation itself is different.

    Args:
        model_name: ``"cnn"`` (no BatchNorm) or ``"cnn_bn"``.
        batch_size: samples in the batch (random 8x8 images, random labels).
        devices: number of GPUs to simulate.
        seed: seeds the weights and the batch.

    Returns:
        A ``GradientComparison``.

    Lesson: 02.
    """
    torch.manual_seed(seed)
    model = build_model(model_name, num_classes=10, in_channels=1)
    inputs, labels = torch.randn(batch_size, 1, 8, 8), torch.randint(0, 10, (batch_size,))
    full = full_batch_gradient(model, inputs, labels)
    dp = data_parallel_gradient(model, inputs, labels, devices)
    abs_diffs = [(dp[n] - full[n]).abs().max().item() for n in full]
    rel_diffs = [d / max(full[n].abs().max().item(), 1e-12) for d, n in zip(abs_diffs, full)]
    return GradientComparison(model_name, batch_size, devices,
                              scatter_sizes(batch_size, devices), max(abs_diffs), max(rel_diffs))


# ------------------------------------------------------------------ 02: the module. prefix


class Wrapper(nn.Module):
    """What DataParallel and DDP look like to ``state_dict``: the model kept as ``.module``.

    Used instead of ``nn.DataParallel`` on machines with GPUs, whose constructor would set up
    CUDA in the notebook kernel.

    Lesson: 02.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def strip_prefix(state_dict: dict[str, Any], prefix: str = "module.") -> dict[str, Any]:
    """Return ``state_dict`` with ``prefix`` removed from the start of every key.

    Lesson: 02 (ddplab's worker-side ``checkpoint.strip_module_prefix`` does the same).
    """
    return {(k[len(prefix):] if k.startswith(prefix) else k): v for k, v in state_dict.items()}


@dataclass
class PrefixDemo:
    """What ``module_prefix_demo`` found."""

    wrapper: str
    wrapped_keys: list[str]
    plain_keys: list[str]
    error: str
    fixes: dict[str, bool] = field(default_factory=dict)


def module_prefix_demo(use_data_parallel: bool = True, model_name: str = "cnn") -> PrefixDemo:
    """Save a wrapped model's state_dict, fail to load it into a plain model, then fix it twice.

    Fix 1 saves ``wrapped.module.state_dict()`` (no prefix in the first place); fix 2 strips the
    prefix from the file that was already saved. Each fix counts only if the loaded weights
    equal the saved ones.

    Args:
        use_data_parallel: wrap with a real ``nn.DataParallel`` (only when no GPU is visible;
            with GPUs its constructor would initialise CUDA in the kernel) or with ``Wrapper``.
        model_name: which ddplab model to use.

    Returns:
        A ``PrefixDemo`` with example keys, PyTorch's error text and ``fixes`` by name.

    Lesson: 02.
    """
    torch.manual_seed(0)
    model = build_model(model_name, num_classes=10, in_channels=1)
    wrapped = nn.DataParallel(model) if use_data_parallel else Wrapper(model)
    saved = wrapped.state_dict()               # the mistake: saving the wrapper
    error = ""
    try:
        build_model(model_name, num_classes=10, in_channels=1).load_state_dict(saved)
    except RuntimeError as exc:
        error = str(exc)
    fixes = {
        "save model.module.state_dict()": _loads_same(model_name, wrapped.module.state_dict(),
                                                      model),
        "strip the prefix when loading": _loads_same(model_name, strip_prefix(saved), model),
    }
    return PrefixDemo(type(wrapped).__name__, list(saved)[:3], list(model.state_dict())[:3],
                      error, fixes)


def _loads_same(model_name: str, state_dict: dict[str, Any], reference: nn.Module) -> bool:
    """Load ``state_dict`` into a fresh model; True when it then equals ``reference``."""
    fresh = build_model(model_name, num_classes=10, in_channels=1)
    fresh.load_state_dict(state_dict)
    return all(torch.equal(a, b) for a, b in
               zip(fresh.state_dict().values(), reference.state_dict().values()))


# ------------------------------------------------------------------ 03: spawn from a cell


@dataclass
class SpawnAttempt:
    """What happened when ``torch.multiprocessing.spawn`` ran a function from the notebook."""

    ok: bool
    exception: str
    exit_codes: list[Optional[int]]
    stderr: str
    wall_time: float
    pids: list[int] = field(default_factory=list)

    @property
    def message(self) -> str:
        """The line that says why the children failed (the unpickling error), or ""."""
        for line in reversed(self.stderr.splitlines()):
            if "Can't get attribute" in line or line.startswith(("AttributeError", "Error")):
                return line.strip()
        return ""


def spawn_from_notebook(fn: Callable[..., Any], args: Sequence[Any] = (), nprocs: int = 2,
                        timeout: float = 60.0) -> SpawnAttempt:
    """Run ``torch.multiprocessing.spawn(fn, args, nprocs)`` and report how it ended.

    ``mp.spawn`` starts fresh interpreters that receive ``fn`` by *name* (pickled as
    ``__main__.fn``) and import it. A function defined in a notebook cell lives only in the
    kernel's memory, so every child fails while unpickling, before ``fn`` runs. The children
    write that traceback to file descriptor 2, which is captured here so the cell can show it.

    Never leaves a process behind: after ``timeout`` seconds, or on any error (including a
    Jupyter interrupt), the children still alive are killed.

    Args:
        fn: the function to run; it receives the rank first, then ``args``.
        args: further arguments for ``fn``.
        nprocs: number of processes.
        timeout: seconds to wait for the children.

    Returns:
        A ``SpawnAttempt``: ``ok``, the parent's exception text, exit codes, the children's
        stderr, the wall time and the children's pids.

    Lesson: 03.
    """
    import torch.multiprocessing as mp

    start = time.monotonic()
    context, exception = None, ""
    with tempfile.TemporaryFile() as capture, _stderr_to(capture), _quiet_spawn_log():
        try:
            context = mp.spawn(fn, args=tuple(args), nprocs=nprocs, join=False)
            exception = _join(context, start + timeout)
        finally:
            _end(context)
        capture.seek(0)
        stderr = capture.read().decode("utf-8", "replace")
    processes = context.processes if context else []
    return SpawnAttempt(not exception, exception, [p.exitcode for p in processes], stderr,
                        time.monotonic() - start, [p.pid for p in processes])


def _join(context: Any, deadline: float) -> str:
    """Wait for every child until ``deadline``; return the failure text ("" when all ended 0)."""
    try:
        while not context.join(timeout=0.2):
            if time.monotonic() > deadline:
                return "timeout: the children did not finish and were killed"
    except Exception as exc:  # ProcessExitedException / ProcessRaisedException: the lesson
        return f"{type(exc).__name__}: {exc}"
    return ""


def _end(context: Any) -> None:
    """Kill and reap every child still alive."""
    for process in getattr(context, "processes", []):
        if process.is_alive():
            process.kill()
        process.join(timeout=10)


@contextlib.contextmanager
def _stderr_to(handle: Any) -> Iterator[None]:
    """Point file descriptor 2 at ``handle`` (children inherit it), then restore it."""
    saved = os.dup(2)
    os.dup2(handle.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@contextlib.contextmanager
def _quiet_spawn_log() -> Iterator[None]:
    """Silence torch's "Terminating process ... via signal SIGTERM" warning during the demo."""
    logger = logging.getLogger("torch.multiprocessing.spawn")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
