"""What the op files share: the dispatch call of their public functions (check inputs, pick the
impl, call it; see registry.fastpath) and the random input helpers of their make_inputs."""

from __future__ import annotations

import torch

from lmkernels.registry.fastpath import dispatch, op_function

__all__ = ["dispatch", "generator", "op_function", "randn"]


def randn(shape, dtype: torch.dtype, device, generator: torch.Generator, scale: float = 1.0):
    """Random normal values drawn in fp32 on the CPU (same values on every device), then cast."""
    t = torch.randn(shape, generator=generator, dtype=torch.float32) * scale
    return t.to(device=device, dtype=dtype)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
