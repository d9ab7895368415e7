"""What every op's public function does: check inputs, pick the impl, call it."""

from __future__ import annotations

from typing import Any

import torch

from lmkernels.registry.core import get_op
from lmkernels.registry.dispatch import resolve


def dispatch(op: str, backend: str | None, **inputs: Any) -> Any:
    get_op(op).check_inputs(**inputs)
    impl = resolve(op, inputs, backend)
    return impl.fn(**inputs)


def randn(shape, dtype: torch.dtype, device, generator: torch.Generator, scale: float = 1.0):
    """Random normal values drawn in fp32 on the CPU (same values on every device), then cast."""
    t = torch.randn(shape, generator=generator, dtype=torch.float32) * scale
    return t.to(device=device, dtype=dtype)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
