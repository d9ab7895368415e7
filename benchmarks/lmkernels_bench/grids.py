"""The shapes the suite's parts measure (`lmkernels-bench suite`): the norms' and RoPE's grids
(the tuner's: lmkernels.harness.tune.grids, the tuning grid and real models' shapes off it), the
design shapes beyond them, and the labels and dimensions the data rows carry."""

from __future__ import annotations

from lmkernels.harness.tune.grids import NORM_GRIDS, ROPE_GRIDS

FLCE = "fused_linear_cross_entropy"
DTYPE = "bf16"

# --- the shapes -------------------------------------------------------------------------------------

# The design shapes (plan.DESIGN_SHAPES) not in the final grid.
DESIGN_EXTRAS = [
    ("rope", (1, 32, 8, 8192, 128, None), "design"),
    ("swiglu", (8192, 14336), "design"),
    ("geglu", (8192, 14336), "design"),
]


def shape_label(op: str, shape: tuple) -> str:
    """ "16384x4096" (norms, GLUs); RoPE "1x32x8x16384x128" plus "x64" for a partial rotary dim."""
    return "x".join(str(v) for v in shape if v is not None)


def dims_of(op: str, shape: tuple) -> dict[str, int]:
    if op == "rope":
        return dict(zip(("B", "Hq", "Hkv", "T", "D"), shape[:5]))
    return {"M": shape[0], "N": shape[1]}


def ops_points(grid: str, ops=("rms_norm", "layer_norm", "rope")) -> list[tuple[str, tuple]]:
    """(op, shape) of a grid, the ops taking turns (a budget that runs out trims each op's end)."""
    norms, ropes = NORM_GRIDS[grid], ROPE_GRIDS[grid]
    out: list[tuple[str, tuple]] = []
    for i in range(max(len(norms), len(ropes))):
        if i < len(norms):
            out += [(op, norms[i]) for op in ("rms_norm", "layer_norm") if op in ops]
        if i < len(ropes) and "rope" in ops:
            out.append(("rope", ropes[i]))
    return out
