"""What to measure: the shape grids (the reference "design" shapes, sweeps), the option sets per op,
and the points (op, shape, options) a run goes through."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from lmkernels.registry.core import get_op

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MODES = ("fwd", "bwd", "full")
FLCE = "fused_linear_cross_entropy"

# The reference ("design") shapes: Llama-3-8B-like sizes, one per op. An op not listed here is
# measured on its OpSpec's last "full" shape, and one without SWEEPS swept over its "full" shapes.
DESIGN_SHAPES: dict[str, dict[str, int]] = {
    "rms_norm": {"M": 16384, "N": 4096},
    "layer_norm": {"M": 4096, "N": 16384},
    "swiglu": {"M": 8192, "N": 14336},
    "geglu": {"M": 8192, "N": 14336},
    "rope": {"B": 1, "Hq": 32, "Hkv": 8, "T": 8192, "D": 128},
    FLCE: {"BT": 8192, "H": 4096, "V": 128256},
}

_POW2 = [1024, 2048, 4096, 8192, 16384]

# Sweeps: op -> list of (swept dim, shapes). Norms over the hidden size, RoPE and the GLUs over
# the sequence (tokens), FLCE over tokens and over the vocabulary.
SWEEPS: dict[str, list[tuple[str, list[dict[str, int]]]]] = {
    "rms_norm": [("N", [{"M": 16384, "N": n} for n in _POW2])],
    "layer_norm": [("N", [{"M": 4096, "N": n} for n in _POW2])],
    "swiglu": [("M", [{"M": m, "N": 14336} for m in _POW2])],
    "geglu": [("M", [{"M": m, "N": 14336} for m in _POW2])],
    "rope": [("T", [{"B": 1, "Hq": 32, "Hkv": 8, "T": t, "D": 128} for t in _POW2])],
    FLCE: [
        ("BT", [{"BT": bt, "H": 4096, "V": 128256} for bt in [*_POW2, 32768]]),
        ("V", [{"BT": 8192, "H": 4096, "V": v} for v in (32000, 64000, 128256, 256000)]),
    ],
}


def default_cases(op: str, dtype: torch.dtype, quick: bool) -> list[dict[str, Any]]:
    """Option sets per op. FLCE runs with our default fp32 weight-gradient accumulation and
    with accumulation in the weight's dtype: what Liger does by default and all CCE can do."""
    if op == FLCE and not quick and dtype != torch.float32:
        return [{}, {"grad_accum_dtype": dtype}]
    return [{}]


def design_shape(op: str) -> dict[str, int]:
    """The op's design shape: DESIGN_SHAPES', else its OpSpec's last "full" shape."""
    return DESIGN_SHAPES.get(op) or get_op(op).shapes["full"][-1]


def sweeps(op: str) -> list[tuple[str, list[dict[str, int]]]]:
    """The op's sweeps: SWEEPS', else one over its OpSpec's "full" shapes."""
    return SWEEPS.get(op) or [("shape", get_op(op).shapes["full"])]


@dataclasses.dataclass
class Point:
    """One (op, shape, options) to measure, and where it belongs in the report."""

    op: str
    shape: dict[str, int]
    options: dict[str, Any]
    sweep: str  # "design" or the swept dim ("N", "T", "BT", ...)


def plan(ops: Sequence[str], grid: str, dtype: torch.dtype, quick: bool, options: dict | None) -> list[Point]:
    points = []
    for op in ops:
        cases = [options] if options is not None else default_cases(op, dtype, quick)
        for case in cases:
            if grid == "design":
                points.append(Point(op, design_shape(op), case, "design"))
                continue
            for dim, shapes in sweeps(op):
                if quick:  # first, middle and last size
                    shapes = (
                        shapes[::2] if len(shapes) % 2 else [shapes[0], shapes[len(shapes) // 2], shapes[-1]]
                    )
                points.extend(Point(op, s, case, dim) for s in shapes)
    return points


def options_id(options: dict[str, Any]) -> str:
    def fmt(v):
        return DTYPE_NAMES.get(v, str(v)) if isinstance(v, torch.dtype) else str(v)

    return ",".join(f"{k}={fmt(v)}" for k, v in options.items()) or "default"
