"""The shapes the suite's parts measure (`lmkernels bench --suite`): the norms' and RoPE's grids
(the tuning grid, and real models' shapes off it), the design shapes beyond them, and the labels
and dimensions the data rows carry."""

from __future__ import annotations

FLCE = "fused_linear_cross_entropy"
DTYPE = "bf16"

# --- the shapes -------------------------------------------------------------------------------------

# Norms (rows M, hidden N): "final" is the grid the launch tables are judged on (1k-64k rows,
# hidden 1024-16384 with Llama's 3584 / 5120 / 11008); "offgrid" real models' hidden sizes at
# row counts off the powers of two, which the tables were not tuned on.
NORM_GRIDS: dict[str, list[tuple[int, int]]] = {
    "final": [
        (m, n) for m in (1024, 4096, 16384, 65536) for n in (1024, 2048, 3584, 4096, 5120, 8192, 11008, 16384)
    ],
    "offgrid": [
        (m, n) for m in (3000, 12288, 40960) for n in (1536, 2304, 2560, 3072, 6144, 7168, 12288, 13824)
    ],
}
# RoPE: (B, Hq, Hkv, T, D, rotary dim or None for the whole head).
ROPE_GRIDS: dict[str, list[tuple[int, int, int, int, int, int | None]]] = {
    "final": [
        (1, 32, 8, 1024, 128, None),
        (1, 32, 8, 4096, 128, None),
        (1, 32, 8, 16384, 128, None),
        (1, 32, 8, 131072, 128, None),
        (8, 32, 8, 1024, 128, None),
        (4, 32, 32, 4096, 128, None),
        (1, 32, 32, 32768, 128, None),
        (2, 16, 16, 8192, 64, None),
        (1, 12, 12, 65536, 64, None),
        (1, 16, 4, 16384, 256, None),
        (1, 8, 8, 65536, 256, None),
        (1, 32, 8, 16384, 128, 64),
        (1, 32, 8, 65536, 128, 32),
    ],
    "offgrid": [
        (2, 28, 4, 4096, 128, None),  # Qwen2.5-7B
        (4, 12, 2, 2048, 128, None),  # Qwen2.5-1.5B
        (1, 64, 8, 8192, 128, None),  # Llama-3-70B
        (1, 28, 4, 32768, 128, None),
        (2, 32, 32, 4096, 96, None),  # Phi-3-mini: a head dim off the powers of two
        (4, 32, 32, 2048, 80, 32),  # Phi-2: partial rotary of an 80-dim head
        (2, 8, 4, 8192, 256, None),  # Gemma-2-2B
        (4, 16, 1, 4096, 64, None),  # multi-query
        (2, 32, 8, 8192, 64, None),
        (8, 16, 16, 1024, 64, None),
        (2, 16, 16, 2048, 128, 32),  # GPT-NeoX: a quarter of the head rotated
        (1, 40, 8, 131072, 128, None),
    ],
}
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
    out = []
    for i in range(max(len(norms), len(ropes))):
        if i < len(norms):
            out += [(op, norms[i]) for op in ("rms_norm", "layer_norm") if op in ops]
        if i < len(ropes) and "rope" in ops:
            out.append(("rope", ropes[i]))
    return out
