"""The tuner's points and arguments: light enough for the CLI to build its parser without
loading the kernels."""

from __future__ import annotations

import argparse

from lmkernels import cliargs

OPS = ("rms_norm", "layer_norm", "rope")

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

# A norm's points: (rows, columns); RoPE's: (batch, q heads, kv heads, tokens, head dim, rotary dim).
NORMS = {
    **NORM_GRIDS,
    "tune": [(16384, n) for n in (1024, 2048, 3584, 4096, 5120, 8192, 11008, 16384)]
    + [(4096, 1024), (4096, 16384), (65536, 1024), (65536, 4096), (65536, 16384)],
}
ROPES = {
    **ROPE_GRIDS,
    "tune": [
        (1, 32, 8, 1024, 128, None),
        (1, 32, 8, 8192, 128, None),
        (1, 32, 8, 131072, 128, None),
        (4, 32, 32, 4096, 128, None),
        (2, 16, 16, 8192, 64, None),
        (1, 16, 4, 16384, 256, None),
        (1, 32, 8, 16384, 128, 64),
    ],
    # The tile table's keys over batch sizes, for the choice between the tile and position kernel.
    "tiles": [
        (b, hq, hkv, t, d, r)
        for b in (1, 4, 8)
        for t in (1024, 8192)
        for hq, hkv, d, r in ((16, 16, 64, None), (16, 4, 256, None), (32, 8, 128, 64), (32, 32, 128, None))
    ],
}
NORMS["all"] = NORMS["final"] + NORMS["offgrid"]
ROPES["all"] = ROPES["final"] + ROPES["offgrid"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="report directory (tune.json, tune.md)")
    p.add_argument(
        "--ops",
        type=cliargs.choice_list(OPS, "op"),
        default=list(OPS),
        help=f"comma-separated, of {', '.join(OPS)} (default: all)",
    )
    p.add_argument("--grid", default="tune", choices=sorted(set(NORMS) | set(ROPES)))
    p.add_argument(
        "--reps", type=cliargs.positive_int, default=30, help="GPU-timed calls per variant (median)"
    )
    p.add_argument("--jobs", type=cliargs.positive_int, default=12, help="compiling worker processes")
    p.add_argument(
        "--warm-budget", type=cliargs.positive_float, default=150.0, help="seconds for the parallel compile"
    )
    p.add_argument(
        "--budget", type=cliargs.positive_float, default=330.0, help="seconds; later points are skipped"
    )
    p.add_argument("--table-only", action="store_true", help="the committed tables and the peers only")
    p.add_argument(
        "--install",
        action="store_true",
        help="write the tuned tables where lmkernels loads them on this GPU model (~/.cache/lmkernels/configs)",
    )
    p.add_argument("--no-peers", dest="peers", action="store_false", help="no torch.compile, no Liger")
    p.add_argument(
        "--rope-layout", default="bhtd", choices=["bhtd", "bthd"], help="bthd: as transformers passes q, k"
    )
