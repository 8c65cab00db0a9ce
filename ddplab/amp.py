"""Mixed precision decisions: which autocast dtype ``--amp`` means on a device, and the scaler.

Worker side. One place decides, for every worker, what ``--amp {off,bf16,fp16}`` becomes on
the device at hand, so the CPU path runs the same code as the GPU path::

    dtype = autocast_dtype(args.amp, device.type)         # None, torch.bfloat16 or float16
    scaler = make_grad_scaler(args.amp, device)            # enabled only for fp16 on a GPU
    with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
        loss = loss_fn(model(inputs), labels)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()

- bf16 has float32's range, so its gradients never underflow: no scaler.
- fp16 flushes small gradients to zero: a ``torch.amp.GradScaler`` scales the loss up before
  backward and the gradients back down before the step.
- bf16 is CPU autocast's default dtype; ddplab makes ``fp16`` there fall back to bf16, with a
  warning (its choice: torch's CPU autocast accepts float16 too).

Lesson: 06.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch

AMP_MODES = ("off", "bf16", "fp16")


def autocast_dtype(amp: str, device_type: str) -> Optional[torch.dtype]:
    """Return the autocast dtype for ``--amp`` on a device type, or None for full precision.

    ``fp16`` on a CPU falls back to ``bf16`` with a warning (ddplab's choice: bfloat16 is CPU
    autocast's default, and fp16 there would also need a GradScaler for no gain), so one cell runs
    on any machine.

    Args:
        amp: ``"off"``, ``"bf16"`` or ``"fp16"``.
        device_type: ``"cuda"`` or ``"cpu"`` (``device.type``).

    Returns:
        ``torch.bfloat16``, ``torch.float16`` or None.

    Lesson: 06.
    """
    if amp not in AMP_MODES:
        raise ValueError(f"unknown --amp {amp!r}: choose one of {', '.join(AMP_MODES)}.")
    if amp == "off":
        return None
    if amp == "fp16" and device_type != "cuda":
        warnings.warn(
            f"--amp fp16 on {device_type}: ddplab uses bfloat16 instead (CPU autocast's default "
            "dtype, which needs no GradScaler). Pass --amp bf16 to silence this.",
            stacklevel=2,
        )
        return torch.bfloat16
    return torch.float16 if amp == "fp16" else torch.bfloat16


def dtype_name(dtype: Optional[torch.dtype]) -> Optional[str]:
    """Return ``"bfloat16"`` for ``torch.bfloat16`` (None stays None), for JSON summaries.

    Lesson: 06.
    """
    return None if dtype is None else str(dtype).removeprefix("torch.")


def grad_scaler_enabled(amp: str, device_type: str) -> bool:
    """True when gradients need loss scaling: fp16 autocast on a GPU (bf16 never does).

    Lesson: 06.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # autocast_dtype already warned about the fallback
        return autocast_dtype(amp, device_type) == torch.float16


def make_grad_scaler(amp: str, device: torch.device) -> torch.amp.GradScaler:
    """Return a ``torch.amp.GradScaler`` for ``device``, enabled only when fp16 needs it.

    A disabled scaler passes losses and steps through unchanged, so the loop has one shape.

    Lesson: 06.
    """
    return torch.amp.GradScaler(device.type, enabled=grad_scaler_enabled(amp, device.type))
