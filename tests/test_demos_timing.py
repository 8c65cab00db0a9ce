"""ddplab.lab.demos.timing: torch.utils.benchmark for the kernel, without the CUDA_HOME notice."""

from __future__ import annotations

import logging

from ddplab.lab.demos import timing


def test_benchmark_is_torch_utils_benchmark_with_the_extension_notice_silenced():
    import torch.utils.benchmark

    logger = logging.getLogger("torch.utils.cpp_extension")
    level = logger.level
    try:
        logger.setLevel(logging.NOTSET)
        assert timing.benchmark() is torch.utils.benchmark
        assert logger.getEffectiveLevel() == logging.ERROR      # notices and warnings dropped
    finally:
        logger.setLevel(level)
