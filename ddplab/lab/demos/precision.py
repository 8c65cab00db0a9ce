"""Number formats and mixed precision up close: what autocast computes in, why fp16 needs a scaler.

Kernel side (see ``ddplab.lab.demos``). Layers a few numbers wide, run on the CPU in the notebook's
own process, so every fact about float16, bfloat16 and the GradScaler is shown on any machine
(the worker side's own AMP decisions are in ``ddplab.amp``)::

    number_formats()                      # range, precision, and what 1e-8 and 70000 become
    autocast_facts("cpu")                 # matmul in bfloat16, weights and loss in float32
    saved_bytes(torch.bfloat16, 64)       # what a forward keeps for backward, by kind
    tiny_gradient(torch.float16, use_scaler=False)    # 0.0: the gradient underflowed
    scaler_overflow_step()                # an inf gradient: step skipped, scale halved
    matmul_speed()                        # float32 against bf16 products on this CPU
    readings(rows, native_bf16())         # which sizes' timings count: steady, busy, suspect
    native_bf16()                         # does this CPU have bf16 units (AVX-512 BF16, AMX)?
    tf32_settings()                       # TF32's defaults and parents, read in a fresh Python

Lesson: 06.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
import warnings
from typing import Any, Optional, Sequence

import torch
from torch import nn

BATCH_MS = 4.0  # a timed batch of matrix products lasts about this long, or longer
STEADY = 1.25   # a size counts if its second-fastest run is within 25% of its fastest
AVX512_BF16_BOUND = 2.5  # above this speed-up, without AMX, the fp32 runs were slowed by load


def autocast_facts(device_type: str = "cpu", dtype: Optional[torch.dtype] = None
                   ) -> dict[str, torch.dtype]:
    """Run a linear layer, a matmul and a loss under ``torch.autocast`` and report the dtypes.

    Args:
        device_type: ``"cpu"`` (a GPU is never used in the kernel).
        dtype: the autocast dtype; None uses autocast's default for the device.

    Returns:
        ``default`` (autocast's dtype when none is given), ``matmul``, ``linear_output``,
        ``weight`` (the parameter keeps its dtype), ``loss`` (cross-entropy runs in float32),
        ``grad`` (gradients have the parameter's dtype), ``outside`` (the layer called again
        after the block), ``layer_norm`` (a ``LayerNorm`` with float32 weight and bias on the
        16-bit linear output: on the CPU it keeps the input's dtype), and ``sum``,
        ``softmax``, ``prod``, ``exp`` and ``norm`` of the 16-bit matmul output (on the CPU
        only ``prod`` is on autocast's float32 list; on CUDA all five are).

    Lesson: 06.
    """
    torch.manual_seed(0)
    layer, norm = nn.Linear(4, 3), nn.LayerNorm(3)
    x = torch.randn(5, 4)
    with torch.autocast(device_type, dtype=dtype):
        product = x @ x.T
        out = layer(x)
        normed = norm(out)
        loss = nn.functional.cross_entropy(out, torch.zeros(5, dtype=torch.long))
        reduced = {"sum": product.sum(), "softmax": product.softmax(-1), "prod": product.prod(),
                   "exp": product.exp(), "norm": product.norm()}
    loss.backward()
    return {
        "default": torch.get_autocast_dtype(device_type),
        "matmul": product.dtype,
        "linear_output": out.dtype,
        "weight": layer.weight.dtype,
        "loss": loss.dtype,
        "grad": layer.weight.grad.dtype,
        "outside": layer(x).dtype,
        "layer_norm": normed.dtype,
        **{name: value.dtype for name, value in reduced.items()},
    }


def saved_bytes(dtype: Optional[torch.dtype], batch: int) -> dict[str, int]:
    """Count the bytes a small MLP's forward keeps for backward, in float32 or under autocast.

    The model (64 -> 256 -> 256 -> 10, ReLUs between) runs one forward and its cross-entropy loss
    on ``batch`` samples; ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor autograd
    saves for backward, and each storage is counted once. Autocast saves the 16-bit inputs of
    its matmuls, and also the 16-bit copies of the weights it casts for them: new memory, half
    the bytes of the float32 weights they copy, whatever the batch. The first layer's copy is
    not kept: its input, the data, needs no gradient.

    Args:
        dtype: the CPU autocast dtype, or None for plain float32.
        batch: the number of samples.

    Returns:
        ``activations`` (saved tensors computed from the input), ``weight_copies`` (16-bit
        copies of parameters) and ``parameters`` (parameters saved as they are, no new memory),
        in bytes.

    Lesson: 06.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 10))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kinds: dict[int, tuple[str, int]] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        kind = ("parameters" if storage.data_ptr() in params
                else "weight_copies" if _copies_a_leaf(tensor.grad_fn) else "activations")
        kinds[storage.data_ptr()] = (kind, storage.nbytes())
        return tensor

    inputs, labels = torch.randn(batch, 64), torch.zeros(batch, dtype=torch.long)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            nn.functional.cross_entropy(model(inputs), labels)
    totals = dict.fromkeys(("activations", "weight_copies", "parameters"), 0)
    for kind, size in kinds.values():
        totals[kind] += size
    return totals


def _copies_a_leaf(fn: Any) -> bool:
    """True when autograd's graph leads from ``fn`` to one leaf alone (a cast, a transpose)."""
    while fn is not None:
        if getattr(fn, "variable", None) is not None:  # AccumulateGrad: a parameter
            return True
        inputs = [nxt for nxt, _ in fn.next_functions if nxt is not None]
        if len(inputs) != 1:
            return False
        fn = inputs[0]
    return False


def number_formats() -> list[dict[str, Any]]:
    """Compare float32, float16 and bfloat16: range, precision, and three telling conversions.

    Returns:
        One row per dtype: ``dtype``, ``bits``, ``max``, ``smallest`` (smallest normal number,
        ``finfo.tiny``), ``subnormal`` (smallest positive number at all, a subnormal: the
        next number after 0), ``eps`` (gap after 1.0), and ``1e-8``, ``3e-8`` and ``70000``
        (those numbers after conversion). Conversion rounds to the nearest number the format
        has, so in float16 (subnormal 6e-8) everything below half of it, 2^-25 or about 3e-8,
        becomes 0 (1e-8 does), 3e-8 rounds up to 6e-8, and 70000 overflows to inf.

    Lesson: 06.
    """
    rows = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        info = torch.finfo(dtype)
        zero = torch.zeros((), dtype=dtype)
        rows.append({
            "dtype": str(dtype).replace("torch.", ""), "bits": info.bits, "max": info.max,
            "smallest": info.tiny, "subnormal": torch.nextafter(zero, zero + 1).item(),
            "eps": info.eps,
            **{text: torch.tensor(float(text)).to(dtype).item()
               for text in ("1e-8", "3e-8", "70000")},
        })
    return rows


def tiny_gradient(dtype: Optional[torch.dtype], use_scaler: bool, loss_scale: float = 1e-8
                  ) -> float:
    """Train step in miniature: return the largest weight gradient of a layer run in ``dtype``.

    A layer maps three samples of ones to two outputs; the loss is the outputs' sum times
    ``loss_scale`` (1e-8). Backward then hands every output the gradient 1e-8, and each weight
    gets the sum over the three samples, 3e-8. Under autocast the outputs are 16-bit, so the
    1e-8 arriving at them is stored in that format first: in float16 it is below half the
    smallest subnormal (about 3e-8) and becomes 0, and so does every weight gradient behind it.
    bfloat16 has float32's range and keeps it. A ``torch.amp.GradScaler`` multiplies the loss
    by 65536 before backward (the 1e-8 becomes 6.6e-4, fine in float16) and divides the
    gradients by the same factor afterwards.

    Args:
        dtype: the autocast dtype (``torch.float16`` or ``torch.bfloat16``) on the CPU, or
            None for plain float32 (the reference).
        use_scaler: scale the loss with a GradScaler.
        loss_scale: the factor that makes the gradients tiny.

    Returns:
        ``max |grad|`` of the weight after unscaling: 0.0 means the gradient underflowed.

    Lesson: 06.
    """
    torch.manual_seed(0)
    layer = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=use_scaler)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        out = layer(torch.ones(3, 4))
    loss = out.float().sum() * loss_scale
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)  # gradients back in true units (a no-op when disabled)
    return float(layer.weight.grad.abs().max())


def scaler_overflow_step() -> dict[str, Any]:
    """Show what ``GradScaler.step`` does when a gradient is inf: skip the step, halve the scale.

    Returns:
        ``scale_before``, ``scale_after``, ``weights_changed`` (False: the step was skipped),
        and ``then_changed`` (a following step with finite gradients does update the weights).

    Lesson: 06.
    """
    torch.manual_seed(0)
    layer = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    before = layer.weight.detach().clone()
    scale_before = scaler.get_scale()
    loss = (layer(torch.tensor([[float("inf"), 1.0]]))).sum()  # an overflow in the forward
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    changed = not torch.equal(before, layer.weight)
    optimizer.zero_grad()
    scaler.scale(layer(torch.ones(1, 2)).sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    return {"scale_before": scale_before, "scale_after": scaler.get_scale(),
            "weights_changed": changed, "then_changed": not torch.equal(before, layer.weight)}


def deprecated_amp_names() -> list[str]:
    """Return the warning PyTorch gives for the old ``torch.cpu.amp.autocast`` spelling.

    ``torch.cuda.amp.autocast`` and ``torch.cuda.amp.GradScaler`` warn the same way; the CPU
    one is used here because it never touches a GPU.

    Lesson: 06.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cpu.amp.autocast(dtype=torch.bfloat16)
    return [f"{w.category.__name__}: {w.message}" for w in caught]


def matmul_speed(sizes: Sequence[int] = (64, 128, 256, 512), repeats: int = 7, inner: int = 10
                 ) -> list[dict[str, float]]:
    """Time square matrix products on the CPU in float32 and under bf16 autocast.

    Shows what this CPU's bf16 units can do: large products may gain, small ones lose to the
    cost of casting. Each of ``repeats`` runs times a batch of float32 products and a batch of
    bf16 ones, alternating which goes first, so a busy moment hits both; a batch holds at
    least ``inner`` products and enough for about ``BATCH_MS`` ms (a first batch of each warms
    up and sets the count). All on one thread, as each worker process of a launch uses. Other
    work on the machine can only make a run slower, never faster, so the fastest run is the
    measurement (as ``timeit``'s documentation advises); the second-fastest run says whether
    the fastest can be trusted (close to it: a quiet moment that came back), the slowest shows
    how noisy the machine was.

    Returns:
        One row per size: ``size``, ``fp32_ms`` and ``bf16_ms`` (the fastest run, per
        product), ``fp32_second_ms`` and ``bf16_second_ms`` (the second fastest),
        ``fp32_max_ms`` and ``bf16_max_ms`` (the slowest), ``fp32_gflops`` and
        ``bf16_gflops`` (``2 * size**3`` operations over the fastest run's time, in GFLOP/s),
        and ``speedup`` (``fp32_ms / bf16_ms``).

    Lesson: 06.
    """
    rows, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for size in sizes:
            rows.append(_time_matmul(size, repeats, inner))
    finally:
        torch.set_num_threads(threads)
    return rows


def _time_matmul(size: int, repeats: int, inner: int) -> dict[str, float]:
    """One row of ``matmul_speed``: fp32 and bf16 batches alternate inside each repeat."""
    a, b = torch.randn(size, size), torch.randn(size, size)

    def batch(bf16: bool, count: int) -> float:  # ms per product
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            for _ in range(count):
                a @ b
        return (time.perf_counter() - start) / count * 1e3

    fastest = min(batch(False, inner), batch(True, inner))  # warms both up; not kept
    count = max(inner, math.ceil(BATCH_MS / max(fastest, 1e-6)))  # about BATCH_MS ms, or more
    samples: dict[bool, list[float]] = {False: [], True: []}
    for repeat in range(repeats):
        for bf16 in ((False, True) if repeat % 2 == 0 else (True, False)):  # either goes first
            samples[bf16].append(batch(bf16, count))
    row: dict[str, float] = {"size": size}
    for name, bf16 in (("fp32", False), ("bf16", True)):
        ordered = sorted(samples[bf16])
        row[f"{name}_ms"], row[f"{name}_max_ms"] = ordered[0], ordered[-1]
        row[f"{name}_second_ms"] = ordered[min(1, len(ordered) - 1)]
        row[f"{name}_gflops"] = 2 * size ** 3 / (row[f"{name}_ms"] * 1e-3) / 1e9
    row["speedup"] = row["fp32_ms"] / row["bf16_ms"]
    return row


def readings(rows: Sequence[dict[str, float]], native: Optional[dict[str, bool]],
             steady: float = STEADY) -> list[str]:
    """Say for each ``matmul_speed`` row whether its timing counts: ``"steady"`` or why not.

    Checked in this order; the first that applies is the reading:

    - ``"busy: not counted"``: a precision's second-fastest run is more than ``steady`` times
      its fastest (the quiet moment did not come back).
    - ``"suspect: above this CPU's bf16 bound"``: the speed-up exceeds ``AVX512_BF16_BOUND``
      (2.5x) on a CPU whose flags list no AMX. AVX-512 BF16's dot product does twice the
      multiply-adds of a float32 FMA instruction as wide (pairs of bf16 into each float32
      lane), a CPU with no bf16 units does float32's multiply-adds; 2.5x leaves room for the
      halved bytes. More means the float32 runs were slowed by load through every repeat.
      With AMX, or unknown flags: no bound.
    - ``"suspect: fp32 slows with size"``: float32's GFLOP/s is below half that of a smaller
      size. A larger product reuses each number it loads more often, so it should not run at
      half the rate; load only slows runs down, so the smaller size's rate is the real one.

    Lesson: 06.
    """
    bound = None if native is None or native["amx"] else AVX512_BF16_BOUND
    out = []
    for i, row in enumerate(rows):
        best_before = max((r["fp32_gflops"] for r in rows[:i] if r["size"] < row["size"]),
                          default=0.0)
        if any(row[f"{n}_second_ms"] > steady * row[f"{n}_ms"] for n in ("fp32", "bf16")):
            out.append("busy: not counted")
        elif bound is not None and row["speedup"] > bound:
            out.append("suspect: above this CPU's bf16 bound")
        elif row["fp32_gflops"] < best_before / 2:
            out.append("suspect: fp32 slows with size")
        else:
            out.append("steady")
    return out


def native_bf16() -> Optional[dict[str, bool]]:
    """Which bf16 units this CPU has, from the flags the Linux kernel lists for it.

    ``avx512_bf16``: AVX-512 BF16 instructions (bf16 dot products into float32); ``amx``: AMX
    tiles with bf16 (``amx_bf16``, Intel's matrix units). torch's CPU matrix products (oneDNN
    or its own kernels) use them when present; without either, the bf16 inputs are converted
    to float32 for the multiply-adds, so a bf16 product does float32's arithmetic plus the
    conversions.

    Returns:
        ``{"avx512_bf16": bool, "amx": bool}``, or None where the flags are unknown (not Linux).

    Lesson: 06.
    """
    from ... import env

    flags = env.cpu_flags()
    if flags is None:
        return None
    return {"avx512_bf16": "avx512_bf16" in flags, "amx": "amx_bf16" in flags}


def speed_verdict(reference: Sequence[float], other: Sequence[float], noise: float = 0.10
                  ) -> str:
    """Compare two precisions' launches (samples/s each): ``other`` against ``reference``.

    ``"machine busy: re-run"`` when either one's launches spread more than 2x (slowest to
    fastest), before any comparison; ``"faster"`` or ``"slower"`` only when the two spreads do
    not overlap and the medians differ by more than ``noise``; else ``"no clear difference"``.

    Lesson: 06.
    """
    from .. import bench   # the same rule as notebook 09's table

    if any(max(runs) > 2 * min(runs) for runs in (reference, other)):
        return "machine busy: re-run"
    return bench.verdict(other, reference, noise)


def bf16_verdict(steady: Sequence[dict[str, Any]], ratio: float, speed_verdict: str,
                 gpus: int = 0, native: Optional[dict[str, bool]] = None) -> str:
    """The measurement's conclusion, as lines of text: this CPU's bf16 units, the steady
    sizes' bf16 products against float32 (``matmul_speed`` rows), and the training's ratio.

    Lesson: 06.
    """
    units = [name for name, key in (("AVX-512 BF16", "avx512_bf16"), ("AMX", "amx"))
             if native and native[key]]
    gains = [str(r["size"]) for r in steady if r["speedup"] > 1]
    losses = [str(r["size"]) for r in steady if r["speedup"] <= 1]
    lines = ["this CPU's bf16 units: " + (", ".join(units) or "none" if native is not None
                                          else "unknown (the kernel lists no CPU flags here)"),
             "bf16 products, steady sizes: " + (", ".join(
                 f"{r['size']}: {r['speedup']:.2f}x of fp32" for r in steady)
                 or "none (busy or suspect at every size)"),
             "bf16 training: " + ("not read (machine busy)" if speed_verdict
                                  == "machine busy: re-run"
                                  else f"{ratio:.2f}x of fp32's median, {speed_verdict}")]
    best = max((r["speedup"] for r in steady), default=None)
    training = {"faster": "Training gained too" + (
                    ", more than the products above: probably noise on a busy machine, "
                    "re-run the launches."
                    if best is not None and ratio > best else "."),
                "slower": "Training did not gain: the small model's steps go mostly into small "
                          "operations, casts and the all-reduce.",
                "machine busy: re-run": "Training's launches spread over 2x: re-run them."
                }.get(speed_verdict, "Training shows no clear difference: the small model's "
                                     "steps go mostly into small operations, casts and the "
                                     "all-reduce.")
    if gpus:
        lines.append("The training ran on GPUs: this CPU's bf16 arithmetic does not bear on it.")
    elif not steady:
        lines.append("Verdict: no steady measurement; re-run the cell above.")
    elif units:
        if len(steady) == 1:    # one size says nothing about the others: no generalizing
            products = (f"only size {steady[0]['size']} was steady, a thin reading: bf16 "
                        f"products were {'faster' if gains else 'not faster'} there; re-run "
                        "the cell above for the other sizes. ")
        else:
            products = ("of the steady sizes, bf16 products were faster " + (
                f"at size{'s' * (len(gains) > 1)} {', '.join(gains)}" if gains
                else "at none") + (f", not at {', '.join(losses)}" if gains and losses else "")
                + ". ")
        lines.append("Verdict: this CPU computes bf16 natively; " + products + training)
    elif native is not None:
        lines.append("Verdict: this CPU has no bf16 units: its bf16 products do float32's "
                     "arithmetic plus the conversions, " + (
                         "so the launches' gain did not come from them (re-run the launches to "
                         "see whether it holds)." if speed_verdict == "faster"
                         else f"and give training nothing to gain ({speed_verdict})."))
    else:
        lines.append("Verdict: the products above say whether this CPU's bf16 gains. " + training)
    return "\n".join(lines)


_READ_TF32 = """import json, torch
cuda, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
read = {"matmul": cuda.fp32_precision, "convolutions": cudnn.conv.fp32_precision,
        "float32 matmul precision": torch.get_float32_matmul_precision()}
cudnn.fp32_precision = "tf32"                    # the CUDA backend's setting
read["matmul, CUDA backend tf32"] = cuda.fp32_precision
cudnn.fp32_precision = "none"
torch.backends.fp32_precision = "tf32"           # the generic setting, the top parent
read["generic set to tf32"] = cuda.fp32_precision
try:                                             # an old name, read after a new setting
    read["then allow_tf32 reads"] = str(cuda.allow_tf32)
except RuntimeError:
    read["then allow_tf32 reads"] = "RuntimeError"
cuda.fp32_precision = "ieee"                     # a new setting that agrees with the old one
read["matmul ieee, then allow_tf32 reads"] = str(cuda.allow_tf32)
print(json.dumps(read))
"""


def tf32_settings() -> dict[str, str]:
    """Read TF32's settings in a fresh Python: the defaults, then each parent set to ``"tf32"``.

    A subprocess, so the caller's settings stay as they are; reading them starts no GPU.

    Returns:
        ``matmul`` and ``convolutions`` (``torch.backends.cuda.matmul.fp32_precision`` and
        ``torch.backends.cudnn.conv.fp32_precision`` as a fresh process has them),
        ``float32 matmul precision`` (``torch.get_float32_matmul_precision()``), the matmul
        setting once ``torch.backends.cudnn.fp32_precision`` (``matmul, CUDA backend tf32``)
        and then only ``torch.backends.fp32_precision`` (``generic set to tf32``) are
        ``"tf32"``, and ``then allow_tf32 reads``: the old name's value, or ``"RuntimeError"``
        (the two disagree), and ``matmul ieee, then allow_tf32 reads`` (they agree).

    Lesson: 06.
    """
    done = subprocess.run([sys.executable, "-c", _READ_TF32], capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout)
