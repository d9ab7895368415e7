"""What to measure: the op's shapes (the user's, else its reference "design" shape), the option
sets, and the points (shape, options) a run goes through."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MODES = ("fwd", "bwd", "full")
FLCE = "fused_linear_cross_entropy"

# The reference ("design") shapes: Llama-3-8B-like sizes, one per op.
DESIGN_SHAPES: dict[str, dict[str, int]] = {
    "rms_norm": {"M": 16384, "N": 4096},
    "layer_norm": {"M": 4096, "N": 16384},
    "swiglu": {"M": 8192, "N": 14336},
    "geglu": {"M": 8192, "N": 14336},
    "rope": {"B": 1, "Hq": 32, "Hkv": 8, "T": 8192, "D": 128},
    FLCE: {"BT": 8192, "H": 4096, "V": 128256},
}


def default_shape(op: str) -> dict[str, int]:
    """The op's design shape; for an op without one, the largest shape of its full grid."""
    if op in DESIGN_SHAPES:
        return dict(DESIGN_SHAPES[op])
    from lmkernels.registry import get_op

    largest = max(get_op(op).shapes["full"], key=lambda s: math.prod(s.values()))
    return dict(largest)


def default_cases(op: str, dtype: torch.dtype, quick: bool) -> list[dict[str, Any]]:
    """Option sets per op. FLCE runs with our default fp32 weight-gradient accumulation and
    with accumulation in the weight's dtype: what Liger does by default and all CCE can do."""
    if op == FLCE and not quick and dtype != torch.float32:
        return [{}, {"grad_accum_dtype": dtype}]
    return [{}]


@dataclasses.dataclass
class Point:
    """One (op, shape, options) to measure."""

    op: str
    shape: dict[str, int]
    options: dict[str, Any]


def plan(
    op: str,
    shapes: Sequence[dict[str, int]] | None,
    dtype: torch.dtype,
    quick: bool,
    options: dict[str, Any] | None,
) -> list[Point]:
    """Every shape (default: default_shape) with every option set (default: default_cases)."""
    cases = [options] if options is not None else default_cases(op, dtype, quick)
    return [Point(op, dict(s), case) for case in cases for s in (shapes or [default_shape(op)])]


def options_id(options: dict[str, Any]) -> str:
    def fmt(v: object) -> str:
        return DTYPE_NAMES.get(v, str(v)) if isinstance(v, torch.dtype) else str(v)

    return ",".join(f"{k}={fmt(v)}" for k, v in options.items()) or "default"
