"""The norms' launch configurations: the kernels' backward paths, the forward and backward
configuration records, and the table of measured entries per op and row width (TUNED) with the
rule by which a width finds its entry (tuned_key). _norms.fwd_config / bwd_config turn them into
a launch; _norms' docstring describes what each path and field does."""

from __future__ import annotations

import dataclasses

# Backward paths (the PATH constexpr of the kernels).
PATH_REGS = 0  # whole row in registers, weight-gradient partial sums in registers
PATH_MEM = 1  # whole row in registers, partial sums in the program's partial row (memory)
PATH_WIDE = 2  # the row in blocks of WIDE_BLOCK, two passes, partial sums in memory

# Which weight-gradient sums the column kernel computes instead of the backward kernel.
APART_NONE = 0
APART_DB = 1  # LayerNorm: the bias gradient (the weight gradient stays in the backward kernel)
APART_ALL = 2  # every one: the backward kernel only writes dx


@dataclasses.dataclass(frozen=True)
class FwdConfig:
    rows: int  # rows per program (a rows x block tile)
    block: int  # columns a program handles at once
    single_block: bool  # the whole row fits in one block (kept in registers)
    num_warps: int
    hints: bool = False  # wide path: eviction hints that keep the row in L2 between passes
    stages: int = 1  # wide path: software pipelining of the loops over column blocks
    const_n: bool = False  # compile for this row width (N a constexpr): see Tuned.const_n


@dataclasses.dataclass(frozen=True)
class BwdConfig:
    rows: int  # rows per loop iteration of a program
    block: int
    path: int  # PATH_REGS, PATH_MEM or PATH_WIDE
    num_warps: int
    programs_per_sm: int  # persistent grid: programs = SMs x this (at most one per row tile)
    reload_w: bool = False  # PATH_REGS: load the weight per tile (an L1 hit) instead of holding it
    tail: int = 0  # single-block paths: a second register block of the row, columns block.. +tail
    apart: int = APART_NONE  # the gradient sums left to the column kernel
    stages: int = 1  # software pipelining of the loop over row tiles (wide path: column blocks)
    const_n: bool = False  # compile for this row width (N a constexpr): see Tuned.const_n
    reload_x: bool = False  # single-block paths: see Tuned.reload_x
    prefetch: bool = False  # single-block paths: see Tuned.prefetch
    hold_x: bool = False  # single-block paths: see Tuned.hold_x
    fma: bool = False  # LayerNorm, single-block paths: see Tuned.fma

    @property
    def single_block(self) -> bool:
        return self.path != PATH_WIDE


@dataclasses.dataclass(frozen=True)
class Tuned:
    """A table entry: the forward's and the backward's configuration for a row block."""

    fwd_rows: int  # rows per program (row in registers)
    fwd_warps: int
    bwd_warps: int
    programs_per_sm: int  # of the persistent backward
    fwd_chunk: int = 0  # > 0: the forward reads the row in chunks of this many columns, in passes
    hints: bool = False  # chunked forward: eviction hints (the row stays in L2 between passes)
    bwd_rows: int = 1
    path: int = PATH_REGS
    reload_w: bool = False
    tail: bool = False  # the backward holds the row as two register blocks: block / 2 and the rest
    apart: int = APART_NONE
    stages: int = 1  # software pipelining of the backward's loop over row tiles
    # Both kernels compiled for the row width (N a constexpr; one compile per width). The masks
    # of a padded block are then known at compile time and the lanes past N fold away, which
    # is what lets one padded power-of-two block beat two exact ones (11008 columns:
    # benchmarks/results/2026-11-23-norm-probe).
    const_n: bool = False
    # The backward reads x and dy again after the row sums, a register block at a time, instead
    # of holding them, so that the weight-gradient accumulators of a wide row fit in registers.
    reload_x: bool = False
    # The backward asks L2 for its next row tile while the current one's loads are in flight
    # (prefetch_tile). Asking for the tile 2-3 iterations ahead instead measured 0.87-0.97x
    # (benchmarks/results/2026-11-24-h200-issue/ahead-eabb5eb/).
    prefetch: bool = False
    # The backward holds x and dy as loaded (bf16: half the registers of fp32) across the row
    # sums and widens them again for dx and the gradient sums (widen): about reload_x's
    # register budget without its second reads. Other dtypes keep the entry's reload_x or fp32
    # registers (holds_x).
    hold_x: bool = False
    # LayerNorm's backward computes x_hat and dx as fused multiply-adds with per-row products
    # (layer_norm._bwd_store): fewer instructions where the backward issues at ~60% of the SM's
    # rate.
    fma: bool = False


# Per op and next_power_of_2(N) =: block, optionally "part" (rows that fill at most 3/4 of their
# block, e.g. 5120 and 11008), "part-11/16" (e.g. 11008) or "part-5/8" (at most 5/8, e.g.
# 5120; see _tuned). Each entry is
# the fastest fwd+bwd combination measured on an H200 (scripts/roofline_tune.py;
# benchmarks/results/2026-11-23-roofline-tune/, -tune2/ and 2026-11-23-norm-pipelining/). The
# backward's loop over row tiles is pipelined (stages 2-3, Triton keeps the next tiles' loads in
# flight in shared memory) wherever that measured faster: 6-22% of the fwd+bwd time at 2048-8192
# columns. const_n where it measured faster
# (benchmarks/results/2026-11-23-norm-probe/constn): above all at 11008 columns, where one
# padded 16384 block now beats the two exact register blocks (RMSNorm backward 0.87x), and
# RMSNorm at 16384 columns since one-row tiles are 1-D (1.07-1.14x fwd+bwd,
# benchmarks/results/2026-11-24-h200-norm-1d/). The "part" entries of the 2048 and 4096 blocks
# (e.g. 1536 and 2304-3072 columns) are const_n (the masked lanes fold away): 2-7% over the full
# blocks' entries (benchmarks/results/2026-11-24-h200-offgrid/parts/). LayerNorm above 8192
# columns reads x and dy again after the row sums (reload_x), so that both gradient sums stay in
# registers and no column kernel reads x and dy a second time from memory: fwd+bwd 1.08-1.14x
# at 11008-16384 columns, and 1.15x at 1024-1536 rows, where the table had an entry of its own
# for few rows (benchmarks/results/2026-11-24-h200-ln-reload/tune/, few/). RMSNorm at 16384
# columns: reload_x with 32 warps, 1.01-1.02x (ln-reload/rms/). The 16384 block's one program
# per SM asks L2 for its next row while the current row's loads are in flight (prefetch):
# LayerNorm 1.05-1.14x at 11008-16384 columns from 3000 rows up, RMSNorm 1.08-1.10x at
# 11008-12288; RMSNorm at 12289-16384 columns with it takes 16 warps instead of 32, 1.04-1.06x
# (benchmarks/results/2026-11-24-h200-prefetch/, layouts/). Elsewhere it measured slower.
# hold_x (bf16 rows held as loaded instead of read again): RMSNorm at 13824-16384 columns
# 0.99-1.02x, at 5120 1.00-1.03x, in two runs (benchmarks/results/2026-11-24-h200-hold/).
# LayerNorm gained 1.00-1.02x at 11008 columns but lost 5% at 12288 (the same entry), and
# 0.85-1.00x elsewhere: none of its entries holds.
# Loads in flight per SM (benchmarks/results/2026-11-24-h200-issue/): a deeper pipeline where
# the loop had too few rows ahead for HBM's latency: stages 3 at the 1024 block (1.03-1.08x
# from 4096 rows), 5 at LayerNorm's 8192 "part" entry (5120 columns: one program per SM;
# 1.05-1.06x), 4 at the 4096 and RMSNorm's 8192 "part" widths (2560-3072, 6144 columns;
# 1.01-1.07x). Fewer warps per row (more
# columns per thread: 20-35% fewer instructions per element, scripts/roofline_ptxas.py
# --family issue) gained only where they also left more programs' loads in flight: LayerNorm's
# 4096 entry and 2048 / 4096 "part" entries at 4 warps, the weight held (1.01-1.19x).
# LayerNorm's 16384 block: its three entries differ only in tail and fma.
_LAYER_NORM_16384 = Tuned(
    1, 16, 16, 1, fwd_chunk=4096, hints=True, reload_w=True, const_n=True, reload_x=True, prefetch=True
)
TUNED: dict[tuple, Tuned] = {
    ("rms_norm", 1024): Tuned(2, 4, 4, 8, stages=3),
    ("rms_norm", 2048): Tuned(2, 8, 8, 4, stages=3),
    ("rms_norm", 2048, "part"): Tuned(2, 4, 8, 4, stages=3, const_n=True),
    ("rms_norm", 4096): Tuned(1, 8, 16, 2, stages=3, const_n=True),
    ("rms_norm", 4096, "part"): Tuned(1, 8, 16, 2, stages=4, const_n=True),
    ("rms_norm", 8192): Tuned(1, 16, 8, 1, fwd_chunk=4096, hints=True, reload_w=True, stages=3, const_n=True),
    ("rms_norm", 8192, "part"): Tuned(
        1, 8, 8, 1, fwd_chunk=4096, hints=True, reload_w=True, stages=4, const_n=True
    ),
    # Rows of at most 5/8 of the block (5120 columns): two register blocks that fit the row
    # (4096 + 1024), read again after the row sum (reload_x), two 8-warp programs per SM:
    # 1.04-1.09x (benchmarks/results/2026-11-24-h200-ln-reload/part8192/; at 6144 columns the
    # 4096 + 2048 split is 0.90-0.94x, so the "part" entry keeps those).
    ("rms_norm", 8192, "part-5/8"): Tuned(
        1,
        8,
        8,
        2,
        fwd_chunk=4096,
        hints=True,
        reload_w=True,
        tail=True,
        stages=3,
        const_n=True,
        reload_x=True,
        hold_x=True,
    ),
    ("rms_norm", 16384): Tuned(
        1, 32, 16, 1, reload_w=True, const_n=True, reload_x=True, prefetch=True, hold_x=True
    ),
    ("rms_norm", 16384, "part"): Tuned(
        1, 16, 16, 1, fwd_chunk=4096, hints=True, reload_w=True, const_n=True, prefetch=True
    ),
    ("layer_norm", 1024): Tuned(2, 4, 4, 8, stages=3),
    ("layer_norm", 2048): Tuned(1, 4, 8, 4, stages=3),
    ("layer_norm", 2048, "part"): Tuned(2, 4, 4, 4, stages=3, const_n=True),
    ("layer_norm", 4096): Tuned(1, 8, 4, 2, stages=3),
    ("layer_norm", 4096, "part"): Tuned(1, 4, 4, 2, stages=4, const_n=True),
    ("layer_norm", 8192): Tuned(1, 8, 16, 1, stages=3, const_n=True),
    ("layer_norm", 8192, "part"): Tuned(1, 8, 16, 1, fwd_chunk=2048, hints=True, stages=5, const_n=True),
    # fma: 1.00-1.02x at 11008 columns, 1.01-1.02x at 13824-16384, but 0.96-0.97x at 12288
    # (benchmarks/results/2026-11-24-h200-hold/fma-ab/): rows of at most 11/16 of the block
    # take it, the rest of the "part" range (11265-12288 columns) does not.
    ("layer_norm", 16384, "part-11/16"): dataclasses.replace(_LAYER_NORM_16384, fma=True),
    ("layer_norm", 16384, "part"): _LAYER_NORM_16384,
    ("layer_norm", 16384): dataclasses.replace(_LAYER_NORM_16384, tail=True, fma=True),
}


def tuned_key(op: str, N: int, block: int) -> tuple:
    """TUNED's key for rows of N columns in a power-of-two block: "part-5/8" (at most 5/8 of the
    block), else "part-11/16", else "part" (at most 3/4), else the block's own, whichever
    exists first."""
    parts = (
        ("part-5/8", 8 * N <= 5 * block),
        ("part-11/16", 16 * N <= 11 * block),
        ("part", 4 * N <= 3 * block),
    )
    for kind, fits in parts:
        if fits and (op, block, kind) in TUNED:
            return (op, block, kind)
    return (op, block)
