"""DataParallel by hand: how a batch is cut, what one step computes, the ``module.`` prefix.

Kernel side (see ``ddplab.lab.demos``). Every "GPU" here is a copy of the model on the CPU, so any
machine shows what ``nn.DataParallel`` does in one training step:

- ``scatter_sizes``: how DataParallel cuts a batch over the GPUs (``Tensor.chunk``).
- ``data_parallel_gradient`` does step by step what DataParallel does in one forward and
  backward (scatter, replicate, parallel_apply, gather, reduce), and ``dp_by_hand`` compares
  its gradient with the full batch's (notebook 02 asks when they agree).
- ``memory_by_hand`` adds up the bytes of the tensors each GPU holds in that step, at its
  peak (the gradient reduction) and after backward, to show why GPU 0 needs more memory.
- ``time_copies`` times one copy of each of several models, as the replicate step makes one
  per GPU at every step, to show that its cost grows with the model's size.
- ``time_steps`` times the by-hand DataParallel step against a plain step of the same batch,
  on the CPU, to show what the step's extra pieces cost at every step.
- ``module_prefix_demo``: a wrapped model's state_dict does not load into a plain model; both
  fixes, shown working.

The models come from the notebook (``ddplab.models.build_model``: the kernel side never imports
the worker side)::

    from ddplab import checkpoint, models
    from ddplab.lab.demos import dataparallel

    run = dataparallel.dp_by_hand(models.build_model("cnn_bn"), "cnn_bn", devices=2)
    demo = dataparallel.module_prefix_demo(lambda: models.build_model("cnn"),
                                           checkpoint.strip_module_prefix)

Lesson: 02.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

Gradients = dict[str, torch.Tensor]

# ------------------------------------------------------------------ DataParallel by hand


def scatter_sizes(batch_size: int, gpus: int) -> list[int]:
    """Return how many samples each GPU gets when DataParallel scatters a batch.

    DataParallel cuts the batch with ``Tensor.chunk``: chunks of ``ceil(batch / gpus)`` and a
    smaller last one, and possibly fewer chunks than GPUs (the rest of the GPUs then sit idle).

    Example::

        >>> scatter_sizes(32, 4), scatter_sizes(10, 4), scatter_sizes(10, 8)
        ([8, 8, 8, 8], [3, 3, 3, 1], [2, 2, 2, 2, 2])

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
                           devices: int, replicas: Optional[Sequence[nn.Module]] = None
                           ) -> Gradients:
    """Return the gradient DataParallel computes on ``devices`` GPUs, done step by step on CPU.

    Each step is what ``nn.DataParallel`` does in one training step; here every "GPU" is a copy
    of the model on the CPU, and the replicas run one after the other instead of in threads.

    Args:
        model: the model on "GPU 0".
        inputs, labels: the whole batch, on "GPU 0".
        devices: number of GPUs to spread the batch over.
        replicas: copies made by the caller instead of here; copies that already ran a step
            must have their gradients cleared first.

    Returns:
        The gradient of every parameter, as it ends up in the model on GPU 0.

    Lesson: 02.
    """
    # [scatter] cut the batch into one chunk per GPU (dimension 0)
    chunks = inputs.chunk(devices)
    # [/scatter]
    # [replicate] copy the module (weights and buffers) to every GPU, at every forward;
    # the copies are dropped after the step: what their forward writes to attributes is lost;
    # DataParallel's copies are outputs of Broadcast, not leaves: their .grad stays empty
    if replicas is None:
        replicas = [copy.deepcopy(model) for _ in chunks]
    # [/replicate]
    replicas = list(replicas)[:len(chunks)]
    # [parallel_apply] every replica runs its chunk (one thread per GPU)
    outputs = [replica(chunk) for replica, chunk in zip(replicas, chunks)]
    # [/parallel_apply]
    # [gather] the outputs come back to GPU 0, where the loss of the whole batch is computed
    # (a forward that returned its chunk's loss would give one loss per GPU: .mean() them)
    logits = torch.cat(outputs)
    F.cross_entropy(logits, labels).backward()
    # [/gather]
    # [reduce] backward flows into every replica; their gradients are summed onto GPU 0
    # (here each copy is a leaf and keeps its .grad; in DataParallel, Broadcast.backward sums
    # the replicas' gradients, and the sum becomes the model's .grad)
    names = [name for name, _ in model.named_parameters()]
    return {name: sum(dict(r.named_parameters())[name].grad for r in replicas).detach()
            for name in names}
    # [/reduce]


def memory_by_hand(model: nn.Module, batch_size: int, devices: int,
                   image_shape: Sequence[int] = (1, 8, 8), num_classes: int = 10
                   ) -> list[dict[str, int]]:
    """Add up the bytes of the tensors each GPU holds in one DataParallel step with momentum SGD.

    GPU 0 holds the model itself (its replica shares the model's storage), the momentum
    buffers (SGD makes them in its first ``step()``: counted from then on), the whole input
    batch (lesson 02's worker moves it to GPU 0 before the forward,
    and scatter leaves GPU 0's chunk a view of it: it copies only the chunks bound for another
    GPU), its outputs, and the gathered outputs with the labels, where the loss is computed;
    every other GPU holds a replica (weights and buffers), its input chunk and its outputs. In
    backward every replica's parameters get a gradient tensor of full size on their own GPU,
    holding that chunk's share of the batch's gradient; ``Broadcast.backward``
    then sums them onto GPU 0 (``ReduceAddCoalesced``, in
    ``torch/nn/parallel/_functions.py``), where the sum becomes the model's ``.grad``. So at
    that reduction every GPU holds a replica's gradient, and GPU 0 the sum as well: ``peak``;
    once backward has ended, the replicas and their gradients are gone and GPU 0 keeps the
    weights, ``.grad`` and the momentum: ``after backward`` of any step after the first (the
    batch's tensors left out).
    Activations kept for backward are left out too: they depend on the model's layers, and
    every GPU keeps those of its own chunk.

    Returns:
        One dict per GPU: ``GPU``, the bytes of each kind of tensor, ``peak`` (their sum) and
        ``after backward``.

    Lesson: 02.
    """
    def size(tensors: Any) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    weights = size(list(model.parameters()) + list(model.buffers()))
    parameters = size(model.parameters())
    sample = torch.zeros(1, *image_shape)
    logit = torch.zeros(1, num_classes)
    label = torch.zeros(1, dtype=torch.long)
    rows = []
    for gpu, chunk in enumerate(scatter_sizes(batch_size, devices)):
        row = {"GPU": gpu, "weights and buffers": weights,
               "replica's gradient": parameters,
               "summed gradient (.grad)": parameters if gpu == 0 else 0,
               "momentum": parameters if gpu == 0 else 0,
               "input": (batch_size if gpu == 0 else chunk) * size([sample]),
               "outputs": chunk * size([logit]),
               "gathered outputs, labels": batch_size * size([logit, label]) if gpu == 0 else 0}
        row["peak"] = sum(v for k, v in row.items() if k != "GPU")
        row["after backward"] = weights + 2 * parameters if gpu == 0 else 0
        rows.append(row)
    return rows


@dataclass
class GradientComparison:
    """The outcome of ``dp_by_hand``: how far DataParallel's gradient is from the full batch's.

    ``max_rel_diff`` is the largest over parameters of ``max|g_dp - g_full| / max|g_full|``.

    Lesson: 02.
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


def dp_by_hand(model: nn.Module, name: str = "", batch_size: int = 32, devices: int = 2,
               seed: int = 0, image_shape: Sequence[int] = (1, 8, 8), num_classes: int = 10
               ) -> GradientComparison:
    """Compare DataParallel's gradient (done by hand) with the gradient of the full batch:
    ``max_rel_diff`` is their largest relative difference, ``equal`` whether it is float
    rounding (under 1e-5). Which models agree is notebook 02's question (section 2).

    Args:
        model: the model to test, for ``image_shape`` images and ``num_classes`` classes (the
            digits CNN: ``ddplab.models.build_model("cnn")``); it is left untouched.
        name: how to call it in the result (default: its class name).
        batch_size: samples in the batch (random images, random labels).
        devices: number of GPUs to simulate.
        seed: seeds the batch.
        image_shape: ``(channels, height, width)`` of one input.
        num_classes: number of classes of the random labels.

    Returns:
        A ``GradientComparison``.

    Lesson: 02.
    """
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(batch_size, *image_shape, generator=generator)
    labels = torch.randint(0, num_classes, (batch_size,), generator=generator)
    full = full_batch_gradient(model, inputs, labels)
    dp = data_parallel_gradient(model, inputs, labels, devices)
    abs_diffs = [(dp[n] - full[n]).abs().max().item() for n in full]
    rel_diffs = [d / max(full[n].abs().max().item(), 1e-12) for d, n in zip(abs_diffs, full)]
    return GradientComparison(name or type(model).__name__, batch_size, devices,
                              scatter_sizes(batch_size, devices), max(abs_diffs), max(rel_diffs))


class _Repeats:
    """Seconds per repeat (``times``), read as their median and middle half."""

    times: list[float]

    @property
    def median(self) -> float:
        """The median time of one repeat."""
        return statistics.median(self.times)

    @property
    def spread(self) -> tuple[float, float]:
        """The lower and upper quartiles: the middle half of the repeats lies between them."""
        from .timing import middle_half

        return middle_half(self.times)


@dataclass
class CopyTiming(_Repeats):
    """What ``time_copies`` measured for one model: its bytes and one copy's seconds per repeat.

    Lesson: 02.
    """

    model: str
    nbytes: int                # parameters and buffers: what a replica copies
    times: list[float]


def time_copies(models: Mapping[str, nn.Module], repeats: int = 11) -> list[CopyTiming]:
    """Time one copy of each model, as the by-hand replicate step makes one per GPU.

    Every repeat copies each model once (``copy.deepcopy``) in turn, so a busy moment of the
    machine touches every model; one untimed round comes first (the warm-up). A copy never
    touches the batch, so no batch is needed. On one CPU thread, restored afterwards.

    Args:
        models: name -> model (left untouched).
        repeats: timed copies of each model (at least 2).

    Returns:
        One ``CopyTiming`` per model, in the order of ``models``.

    Lesson: 02.
    """
    # each replica dropped at once, as DataParallel drops its replicas
    times = _in_turn({name: lambda model=model: copy.deepcopy(model)
                      for name, model in models.items()}, repeats)
    return [CopyTiming(name, _nbytes(model), times[name]) for name, model in models.items()]


def _in_turn(calls: Mapping[Any, Callable[[], Any]], repeats: int) -> dict[Any, list[float]]:
    """Seconds of each call, ``repeats`` times, the calls in turn after one untimed round (the
    warm-up); on one CPU thread, restored afterwards."""
    times: dict[Any, list[float]] = {key: [] for key in calls}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for repeat in range(repeats + 1):             # repeat 0 is the warm-up, not kept
            for key, call in calls.items():
                start = time.perf_counter()
                call()
                if repeat:
                    times[key].append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return times


@dataclass
class StepTiming(_Repeats):
    """What ``time_steps`` measured for one way of running the step: its seconds per repeat.

    ``devices`` is 1 for the plain step (DataParallel with one device calls the module itself).

    Lesson: 02.
    """

    devices: int
    times: list[float]


def time_steps(model: nn.Module, batch_size: int = 32, devices: Sequence[int] = (2, 4),
               repeats: int = 11, seed: int = 0, image_shape: Sequence[int] = (1, 8, 8),
               num_classes: int = 10) -> list[StepTiming]:
    """Time a plain forward and backward of one batch against the by-hand DataParallel step.

    The by-hand step is ``data_parallel_gradient``: scatter, replicate, apply, gather, reduce.
    On the CPU its replicas run one after the other, so it does the plain step's arithmetic
    plus its own pieces (the copies, the concatenation, the sum of the gradients): the
    difference is what those pieces cost. Every repeat runs each way once, in turn, after one
    untimed round (the warm-up); on one CPU thread, restored afterwards. The model is copied
    first, so it is left untouched.

    Args:
        model: the model, for ``image_shape`` images and ``num_classes`` classes.
        batch_size: samples in the batch (random images, random labels).
        devices: the "GPU" counts to time the by-hand step with.
        repeats: timed steps of each way (at least 2).
        seed: seeds the batch.

    Returns:
        One ``StepTiming`` for the plain step (``devices`` 1), then one per count in
        ``devices``.

    Lesson: 02.
    """
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(batch_size, *image_shape, generator=generator)
    labels = torch.randint(0, num_classes, (batch_size,), generator=generator)
    model = copy.deepcopy(model)

    def plain() -> None:
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(inputs), labels).backward()

    steps: dict[int, Callable[[], Any]] = {1: plain}
    for n in devices:
        steps[n] = lambda n=n: data_parallel_gradient(model, inputs, labels, n)
    times = _in_turn(steps, repeats)
    return [StepTiming(n, times[n]) for n in steps]


def compare(step: _Repeats, reference: _Repeats, noise: float = 0.10) -> str:
    """Say "slower", "faster" or "no clear difference": ``step``'s time against ``reference``'s.

    ``bench.verdict``'s rule on the middle halves (``spread``): a difference is called only
    where they do not overlap and the medians differ by more than ``noise``, a fraction of the
    reference's median. Times, not speeds: a step ``bench.verdict`` reads "faster" (a higher
    number) took longer, so it is "slower".

    Lesson: 02.
    """
    from .. import bench
    from .timing import middle_half

    said = bench.verdict(step.times, reference.times, noise, spread=middle_half)
    return {"faster": "slower", "slower": "faster"}.get(said, said)


def _nbytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


# ------------------------------------------------------------------ the module. prefix


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


@dataclass
class PrefixDemo:
    """What ``module_prefix_demo`` found.

    Lesson: 02.
    """

    wrapper: str
    wrapped_keys: list[str]
    plain_keys: list[str]
    error: str
    fixes: dict[str, bool] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def module_prefix_demo(make_model: Callable[[], nn.Module],
                       strip_prefix: Callable[[Mapping[str, Any]], dict[str, Any]],
                       use_data_parallel: bool = True) -> PrefixDemo:
    """Save a wrapped model's state_dict, fail to load it into a plain model, then fix it twice.

    Fix 1 saves ``wrapped.module.state_dict()`` (no prefix in the first place); fix 2 strips the
    prefix from the file that was already saved. Each fix counts only if the loaded weights
    equal the saved ones.

    Args:
        make_model: builds a fresh model (``lambda: ddplab.models.build_model("cnn")``).
        strip_prefix: the repair a training script uses on a saved state_dict
            (``ddplab.checkpoint.strip_module_prefix``).
        use_data_parallel: wrap with a real ``nn.DataParallel`` (only when no GPU is visible;
            with GPUs its constructor would initialise CUDA in the kernel) or with ``Wrapper``.

    Returns:
        A ``PrefixDemo`` with example keys, PyTorch's error text, the keys the plain model
        missed and the ones it did not expect (``load_state_dict(..., strict=False)``), and
        ``fixes`` by name.

    Lesson: 02.
    """
    torch.manual_seed(0)
    model = make_model()
    wrapped = nn.DataParallel(model) if use_data_parallel else Wrapper(model)
    saved = wrapped.state_dict()               # the mistake: saving the wrapper
    error = ""
    try:
        make_model().load_state_dict(saved)
    except RuntimeError as exc:
        error = str(exc)
    fixes = {
        "save model.module.state_dict()": _loads_same(make_model, wrapped.module.state_dict(),
                                                      model),
        "strip the prefix when loading": _loads_same(make_model, strip_prefix(saved), model),
    }
    keys = make_model().load_state_dict(saved, strict=False)
    return PrefixDemo(type(wrapped).__name__, list(saved)[:3], list(model.state_dict())[:3],
                      error, fixes, list(keys.missing_keys), list(keys.unexpected_keys))


def _loads_same(make_model: Callable[[], nn.Module], state_dict: Mapping[str, Any],
                reference: nn.Module) -> bool:
    """Load ``state_dict`` into a fresh model; True when it loads and then equals ``reference``."""
    fresh = make_model()
    try:
        fresh.load_state_dict(state_dict)
    except RuntimeError:  # keys or shapes still do not match: not a fix
        return False
    return all(torch.equal(a, b) for a, b in
               zip(fresh.state_dict().values(), reference.state_dict().values()))
