"""What scripts/roofline_tune.py measures: the shape grids, the candidate launch configurations
of the norm and RoPE kernels (and their names in the results), and the table each --lean run
times beside the committed one ("previous table")."""

from __future__ import annotations

import dataclasses

NORM_GRID = {
    "tune": [(16384, n) for n in (1024, 2048, 3584, 4096, 5120, 8192, 11008, 16384)]
    + [(4096, 1024), (4096, 16384), (65536, 1024), (65536, 4096), (65536, 16384)],
    "wide": [(m, n) for m in (16384, 65536) for n in (5120, 8192, 11008, 16384)],
    "tiles": [(m, n) for m in (65536, 16384, 4096) for n in (2048, 3584, 4096, 5120, 8192, 11008, 16384)],
    # Rows wider than MAX_FUSED_N (the wide path), outside the issue's grid.
    "over": [(8192, 32768), (2048, 65536)],
    "final": [
        (m, n) for m in (1024, 4096, 16384, 65536) for n in (1024, 2048, 3584, 4096, 5120, 8192, 11008, 16384)
    ],
    # Shapes the tables were not tuned on: real models' hidden sizes (Qwen2.5 1536, Gemma-2
    # 2304, Phi-2 / Qwen3-4B 2560, Llama-3.2-3B 3072, 6144, DeepSeek-V3 7168, GPT-3 12288,
    # 13824) at row counts off the powers of two.
    "offgrid": [
        (m, n) for m in (3000, 12288, 40960) for n in (1536, 2304, 2560, 3072, 6144, 7168, 12288, 13824)
    ],
    # Rows that fill at most 3/4 of a 2048 or 4096 block, which the table had no "part" entry for.
    "parts": [(m, n) for m in (12288, 40960) for n in (1536, 2304, 2560, 3072)],
    # LayerNorm's wide rows, where its backward read x and dy twice (the column kernel): the
    # backward that reads them again from L1 / L2 instead (reload_x).
    "reload": [(m, n) for m in (4096, 65536) for n in (8192, 11008, 12288, 16384)]
    + [(16384, 5120), (16384, 16384)],
    # Between the two: rows that fill 84% of the 16384 block (one register block or two).
    "reload-13824": [(m, 13824) for m in (3000, 12288, 40960)],
    # Rows of 4097-6144 columns (the 8192 block's "part" entry), where RMSNorm's reload_x
    # backward in two blocks (4096 + 1024 at 5120) measured 1.07x at 16384 rows.
    "part8192": [(m, 5120) for m in (4096, 16384, 65536)] + [(m, 6144) for m in (3000, 12288, 40960)],
    # The persistent backward asking L2 for its next row tile (--prefetch): every table block.
    "prefetch": [
        (m, n) for m in (4096, 16384, 65536) for n in (1024, 2048, 3584, 4096, 5120, 8192, 11008, 16384)
    ],
    # The rows where prefetching helped (the 16384 block) or might.
    "prefetch-wide": [(m, n) for m in (4096, 16384, 65536) for n in (5120, 8192, 11008, 16384)]
    + [(12288, 13824), (40960, 13824)],
    "prefetch-narrow": [(16384, n) for n in (1024, 2048, 3584, 4096)],
    # The 16384 block's layouts with the prefetch.
    "prefetch-layouts": [(m, n) for m in (4096, 16384, 65536) for n in (11008, 16384)]
    + [(12288, 13824), (3000, 12288)],
    # hold_x (--hold): the widths whose backward reads x and dy again (reload_x) or holds them
    # in fp32 at over 100 registers a thread, with 13824 (84% of the 16384 block) between.
    "hold": [(m, n) for m in (4096, 16384, 65536) for n in (5120, 8192, 11008, 16384)]
    + [(12288, 13824), (40960, 13824)],
    # Fewer instructions per element (--issue): the widths where a backward issues 24-35
    # instructions per element (scripts/roofline_ptxas.py --family issue) and the grid points
    # at 80-85% of copy.
    "issue": [(16384, n) for n in (1024, 2048, 3584, 4096, 5120)]
    + [(65536, 1024), (65536, 2048), (4096, 2048), (4096, 5120), (65536, 5120)],
    # Deeper pipelines (--deep): the pipelined widths' points under 90% of copy.
    "deep": [(16384, n) for n in (1024, 2048, 3584, 5120)] + [(65536, 1024), (4096, 5120), (65536, 5120)],
    # The pipelined entries' other widths (--deep, --issue): the "part" entries' widths off the
    # grid, and the 8192 block's full entries.
    "parts2": [(m, n) for m in (12288, 40960) for n in (1536, 2560, 3072, 6144, 7168)]
    + [(4096, 8192), (16384, 8192), (4096, 4096)],
    # LayerNorm's "part-11/16" entry (8193-11264 columns, fma since session 17) with hold_x
    # (--hold): session 17 measured hold_x at 11008 when 12288 shared the entry.
    "hold-11": [(m, 11008) for m in (4096, 16384, 65536)] + [(12288, 9216), (12288, 10240)],
    # Rows of 9216-10240 columns, over 40% padding in the 16384 block (--prefetch: its layouts
    # include two register blocks, 8192 + 1024 / 2048).
    "part-9": [(m, n) for m in (4096, 12288, 40960) for n in (9216, 10240)],
    # Fewer programs per SM at the narrow blocks (--fewer).
    "fewer": [(m, n) for m in (16384, 65536) for n in (1024, 2048)] + [(40960, 1536)],
    # Few rows: below 2048 the table had an entry of its own (FEW_ROWS, now removed); above it.
    "reload-few": [(1024, 11008), (1024, 16384), (1536, 16384), (2048, 11008), (2048, 16384)],
}
# (B, Hq, Hkv, T, D, rotary_dim or None)
ROPE_GRID = {
    # Where the position kernel lost to torch.compile or stayed under 75% of copy (2026-11-23),
    # and Llama's D = 128 as a check that the tile kernel is not better there too.
    "rope": [
        (2, 16, 16, 8192, 64, None),
        (1, 12, 12, 65536, 64, None),
        (1, 32, 8, 16384, 128, 64),
        (1, 32, 8, 65536, 128, 32),
        (1, 32, 8, 16384, 128, None),
    ],
    "tune": [
        (1, 32, 8, 1024, 128, None),
        (1, 32, 8, 8192, 128, None),
        (1, 32, 8, 131072, 128, None),
        (4, 32, 32, 4096, 128, None),
        (2, 16, 16, 8192, 64, None),
        (1, 16, 4, 16384, 256, None),
        (1, 32, 8, 16384, 128, 64),
    ],
    # D = 128 on (B, H, T, D) memory, for the choice between the position and the tile kernel.
    # The tile table's other keys over batch sizes: D = 64, D = 256, partial rotary.
    "tiles": [
        (b, hq, hkv, t, d, r)
        for b in (1, 4, 8)
        for t in (1024, 8192)
        for hq, hkv, d, r in ((16, 16, 64, None), (16, 4, 256, None), (32, 8, 128, 64), (32, 8, 128, 32))
    ],
    "d128": [
        (b, hq, hkv, t, 128, None)
        for b in (1, 2, 4, 8)
        for t in (1024, 4096, 16384)
        for hq, hkv in ((32, 8), (32, 32))
    ],
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
    # Models' attention shapes the tile table and the position kernel were not tuned on.
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
    # Head dims off the powers of two (Phi-3's 96, 80): position kernel against tile kernel.
    "d96": [(b, 32, 32, t, 96, None) for b in (1, 2, 4) for t in (1024, 4096)]
    + [(1, 32, 8, 8192, 96, None), (2, 32, 32, 4096, 80, None)],
}


# Both grids at once (A/B runs): the issue's grid and the shapes the tables were not tuned on.
for _grid in (NORM_GRID, ROPE_GRID):
    _grid["all"] = _grid["final"] + _grid["offgrid"]


def norm_fwd_candidates(N):
    from lmkernels.backends.triton import _norms

    block = 1 << (N - 1).bit_length()
    out = []
    for rows in (1, 2, 4, 8) if N <= _norms.MAX_FUSED_N else ():
        for warps in (2, 4, 8, 16, 32):
            per_thread = rows * block // (32 * warps)
            if (
                2048 <= rows * block <= 16384
                and 8 <= per_thread <= 32
                or (block >= 16384 and warps == 32 and rows == 1)
            ):
                out.append(_norms.FwdConfig(rows, block, True, warps))
    if block >= 4096:  # the row in blocks, read again from L2: more rows in flight per SM
        for wb, warps in ((1024, 2), (1024, 4), (2048, 4), (4096, 4), (4096, 8), (4096, 16)):
            if wb < N:
                for hints in (False, True):
                    for stages in (1, 2) if N > _norms.MAX_FUSED_N else (1,):
                        out.append(_norms.FwdConfig(1, wb, False, warps, hints, stages))
    return out


def norm_bwd_candidates(N, op="rms_norm", new_only=False):
    """Backward configurations to time; new_only: those added since the pipelining run (the
    kernels compiled for the row width, const_n)."""
    from lmkernels.backends.triton import _norms

    block = 1 << (N - 1).bit_length()
    if new_only and N > _norms.MAX_FUSED_N:
        return _wide_bwd_candidates(_norms)
    if new_only:
        reload = _reload_x_bwd_candidates(N, op, block, _norms)
        return list(
            dict.fromkeys(_const_n_bwd_candidates(N, op, block, _norms) + reload + _stage_candidates(N, op))
        )
    if N > _norms.MAX_FUSED_N:  # only the wide path can hold such rows
        return _wide_tile_bwd_candidates(N, _norms)
    out = _split_bwd_candidates(N, op, block, _norms) + _wide_tile_bwd_candidates(N, _norms)
    paths = [_norms.PATH_REGS] + ([_norms.PATH_MEM] if block >= 4096 else [])
    for path in paths:
        for rows in (1, 2, 4, 8):
            for warps in (4, 8, 16, 32):
                per_thread = rows * block // (32 * warps)
                if not (1024 <= rows * block <= 16384 and 8 <= per_thread <= 16):
                    continue
                for pps in sorted({max(1, 32 // warps), max(1, 64 // warps)}):
                    out.append(_norms.BwdConfig(rows, block, path, warps, pps))
    if block >= 8192:
        for warps in (16, 32):
            for pps in (1, 2):
                out.append(_norms.BwdConfig(1, block, _norms.PATH_REGS, warps, pps, True))
        for wb, warps in ((2048, 8), (4096, 16)):
            for pps in (1, 2):
                out.append(_norms.BwdConfig(1, wb, _norms.PATH_WIDE, warps, pps))
    return out


def _const_n_bwd_candidates(N, op, block, _norms):
    """The table's backward compiled for the row width (const_n), and one padded power-of-two
    block per row (no tail), the weight reloaded, 16 warps, 1-2 programs per SM, const_n: the
    fastest layout of the probe at 11008 columns (benchmarks/results/2026-11-23-norm-probe)."""
    table = _norms.bwd_config(op, N)
    out = [dataclasses.replace(table, const_n=True)]
    if table.single_block and table.stages > 1:
        out.append(dataclasses.replace(table, const_n=True, stages=1))
    if block >= 8192:
        aparts = [_norms.APART_NONE] + ([_norms.APART_DB, _norms.APART_ALL] if op == "layer_norm" else [])
        for apart in aparts:
            for pps in (1, 2):
                out.append(
                    _norms.BwdConfig(1, block, _norms.PATH_REGS, 16, pps, True, apart=apart, const_n=True)
                )
    return list(dict.fromkeys(out))


def _reload_x_bwd_candidates(N, op, block, _norms):
    """Rows of over 4096 columns with x and dy read again after the row sums (reload_x), as one
    register block or two (the largest power of two <= N, then the rest).
    - RMSNorm: no spills at 16384 columns and 16 warps (107 registers against 128 and 80 bytes of
      spills, scripts/roofline_ptxas.py), about half the registers at 8192; 1-2 programs per SM.
    - LayerNorm: both gradient sums (or dw alone) in registers; one program per SM (16 warps use
      128 registers per thread, 32 warps 64: a whole register file), and at the 8192 block two
      programs of 8 warps, as RMSNorm's best at 5120 columns. Stages 3 do not fit a 16384
      block's shared memory (the second reads are pipelined too): pipeline_stages lowers them
      to 2."""
    if block < 8192:
        return []
    none, db = _norms.APART_NONE, _norms.APART_DB
    if op == "rms_norm":  # (warps, programs per SM, stages, apart)
        grid = [(w, pps, st, none) for w in (8, 16, 32) for pps in (1, 2) for st in (1, 3)]
    else:
        grid = [(8, 2, 3, none)] if block == 8192 else []
        grid += [(w, 1, st, apart) for w in (16, 32) for st in (1, 2, 3) for apart in (none, db)]
    return [
        _norms.BwdConfig(1, lo, _norms.PATH_REGS, w, pps, True, tail, apart, st, True, reload_x=True)
        for lo, tail in _register_splits(N, block)
        for w, pps, st, apart in grid
    ]


def _register_splits(N, block):
    """(block, tail) of a row held as one padded register block, or as two: the largest power
    of two <= N, then the rest (rounded up to a power of two)."""
    return ((block, 0), (block // 2, 1 << (N - block // 2 - 1).bit_length()))


def prefetch_bwd_candidates(N, op):
    """The table's backward with the prefetch switched (on where it is off, off where it is on);
    where the table pipelines the loop over row tiles (stages > 1), also unpipelined: the
    prefetch may do the pipelining's job without its shared memory. Above 8192 columns also
    the reload_x layouts (one register block or two, 16 or 32 warps) with the prefetch on: it
    may move the balance between them."""
    from lmkernels.backends.triton import _norms

    table = _norms.bwd_config(op, N)
    if not table.single_block:
        return []
    stages = sorted({1, table.stages})
    out = [dataclasses.replace(table, prefetch=not table.prefetch, stages=st) for st in stages]
    if table.stages > 1:
        out.append(dataclasses.replace(table, stages=1))
    if 8192 < N <= _norms.MAX_FUSED_N:
        block = 1 << (N - 1).bit_length()
        for lo, tail in _register_splits(N, block):
            for warps in (16, 32):
                out.append(_norms.BwdConfig(1, lo, _norms.PATH_REGS, warps, 1, True, tail, const_n=True,
                                            reload_x=True, prefetch=True))  # fmt: skip
    return list(dict.fromkeys(c for c in out if c != table))


def hold_bwd_candidates(N, op):
    """Backwards that hold a row's x and dy as loaded (bf16) across the row sums (hold_x) instead
    of reading them again (reload_x) or holding them in fp32: the table's own with hold_x, and
    hold_x as one register block or two, at the table's layout (16 warps, one program per SM)
    pipelined or not, at 32 warps (16384 block) or two 8-warp programs per SM (8192 block).
    scripts/roofline_ptxas.py (local Triton, sm_90) counts for LayerNorm: no spills at 5120 and
    8192 columns (102 registers against the table's 125), none at 11008 as 8192 + 4096, 8 bytes
    as one 16384 block; 64-112 bytes at 16384 (the table's reload_x: none)."""
    from lmkernels.backends.triton import _norms

    table = _norms.bwd_config(op, N)
    if not table.single_block or N <= 4096:
        return []
    block = 1 << (N - 1).bit_length()
    layouts = [(16, 1, 1), (16, 1, 2), (32, 1, 1)] if block == 16384 else [(16, 1, 3), (8, 2, 3), (8, 2, 1)]
    out = [dataclasses.replace(table, hold_x=True)]
    for lo, tail in _register_splits(N, block):
        for warps, pps, st in layouts:
            prefetch = table.prefetch and pps == 1
            out.append(_norms.BwdConfig(1, lo, _norms.PATH_REGS, warps, pps, True, tail, _norms.APART_NONE, st,
                                        True, reload_x=table.reload_x, prefetch=prefetch, hold_x=True))  # fmt: skip
    return list(dict.fromkeys(c for c in out if c != table))


def issue_bwd_candidates(N, op):
    """Backwards that issue fewer instructions per element: more columns per thread (fewer warps
    per row), with as few programs per SM as their registers allow, and LayerNorm's fused
    multiply-add forms (fma). The row sums and the pipeline cost about the same per row and
    thread at any width, so that a thread holding twice the columns issues 20-35% fewer
    instructions per element (scripts/roofline_ptxas.py --family issue, local Triton, sm_90).
    The first tuning runs tried 8-16 columns per thread at 32-64 warps per SM, where such a
    thread's 120-250 registers do not fit: the layouts here run 8-16 warps per SM."""
    from lmkernels.backends.triton import _norms

    table = _norms.bwd_config(op, N)
    block = 1 << (N - 1).bit_length()
    if not table.single_block or block > 8192:
        return []
    fma = [False, True] if op == "layer_norm" else [False]
    # (block, tail, warps, programs per SM) by row block; 5120 columns: 4096 + 1024.
    layouts = {
        1024: [(1024, 0, 2, 8), (1024, 0, 4, 4)],
        2048: [(2048, 0, 4, 4), (2048, 0, 4, 2)],
        4096: [(4096, 0, 8, 2), (4096, 0, 8, 1), (4096, 0, 4, 2)],
        8192: [(4096, 1024, 8, 2), (4096, 1024, 8, 1)] if 8 * N <= 5 * block else [],
    }[block]
    out = [dataclasses.replace(table, fma=True)] if op == "layer_norm" else []
    for lo, tail, warps, pps in layouts:
        for reload_w in (False, True):
            for f in fma:
                out.append(dataclasses.replace(table, block=lo, tail=tail, num_warps=warps, programs_per_sm=pps,
                                               reload_w=reload_w, fma=f, reload_x=False, hold_x=False))  # fmt: skip
    return list(dict.fromkeys(c for c in out if c != table))


def deep_bwd_candidates(N, op):
    """Deeper software pipelines of the loop over row tiles (stages 2-6), for the table's
    backward and the --issue layouts that measured within 1% of it or better
    (benchmarks/results/2026-11-24-h200-issue/issue/). Loads in flight per SM are what a
    memory-bound loop needs (Little's law: ~4 MB over 132 SMs at ~1 us); LayerNorm at 5120
    columns runs one program per SM with two rows ahead, RMSNorm two programs with two each."""
    from lmkernels.backends.triton import _norms

    table = _norms.bwd_config(op, N)
    block = 1 << (N - 1).bit_length()
    if not table.single_block or block > 8192:
        return []
    bases = [table]
    if op == "layer_norm" and block == 4096:
        bases.append(dataclasses.replace(table, num_warps=4, reload_w=False))
    if op == "layer_norm" and block == 8192 and 8 * N <= 5 * block:  # 4096 + 1024 hold the row
        bases.append(dataclasses.replace(table, block=4096, tail=1024, num_warps=8, fma=True))
    out = [dataclasses.replace(b, stages=st) for b in bases for st in (2, 3, 4, 5, 6)]
    return list(dict.fromkeys(c for c in out if c != table))


def fewer_bwd_candidates(N, op):
    """The 1024 and 2048 blocks' backward with fewer programs per SM (half or three quarters of
    the table's) and deeper pipelines, so that the loads in flight per SM stay about the same
    while the partial rows that the second kernel sums (P x N fp32) shrink: at 2048 columns
    they are 4.3 MB per gradient for 528 programs."""
    from lmkernels.backends.triton import _norms

    table = _norms.bwd_config(op, N)
    block = 1 << (N - 1).bit_length()
    if not table.single_block or block > 2048:
        return []
    out = []
    for pps in sorted({max(1, table.programs_per_sm // 2), max(1, 3 * table.programs_per_sm // 4)}):
        for st in (3, 4, 5, 6):
            out.append(dataclasses.replace(table, programs_per_sm=pps, stages=st))
    return list(dict.fromkeys(c for c in out if c != table))


# The backward candidate families that roofline_tune.py times alone beside the table (--NAME)
# and roofline_ptxas.py counts (--family NAME): name -> (candidates(N, op), help).
BWD_FAMILIES = {
    "prefetch": (prefetch_bwd_candidates, "norms: only the table's backward with and without prefetch"),
    "hold": (
        hold_bwd_candidates,
        "norms: only the table's backward and its layouts holding x and dy as loaded",
    ),
    "issue": (
        issue_bwd_candidates,
        "norms: only the table's backward and layouts issuing fewer instructions",
    ),
    "deep": (deep_bwd_candidates, "norms: only the table's backward and deeper pipelines (stages 2-6)"),
    "fewer": (fewer_bwd_candidates, "norms: only the table's backward and fewer programs per SM"),
}


def _stage_candidates(N, op):
    """The table's backward software-pipelined (stages 2 and 3) where it is not, for rows above
    8192 columns (one program per SM: nothing else overlaps a row's loads with its reductions)."""
    from lmkernels.backends.triton import _norms

    table = _norms.bwd_config(op, N)
    if N <= 8192 or N > _norms.MAX_FUSED_N or table.stages > 1:
        return []
    return [dataclasses.replace(table, stages=s) for s in (2, 3)]


def const_n_fwd_candidates(N, op):
    """The table's forward compiled for the row width, and (4096 columns and wider) the row
    read in chunks with eviction hints, const_n: the probe's fastest forwards."""
    from lmkernels.backends.triton import _norms

    out = [dataclasses.replace(_norms.fwd_config(op, N), const_n=True)]
    if N >= 4096 and N <= _norms.MAX_FUSED_N:
        for chunk, warps in ((2048, 8), (4096, 8), (4096, 16)):
            if chunk < N:
                out.append(_norms.FwdConfig(1, chunk, False, warps, hints=True, const_n=True))
    return list(dict.fromkeys(out))


def _wide_bwd_candidates(_norms):
    """Rows wider than MAX_FUSED_N: the column loops pipelined or not, the weight gradients in
    the backward kernel (partial rows in memory) or left to the column kernel."""
    out = []
    for block, warps in ((2048, 8), (4096, 8), (4096, 16)):
        for pps in (1, 2):
            for stages in (1, 3):
                for apart in (_norms.APART_NONE, _norms.APART_ALL):
                    out.append(
                        _norms.BwdConfig(1, block, _norms.PATH_WIDE, warps, pps, apart=apart, stages=stages)
                    )
    return out


# Wide-path tiles (rows, column block, warps, programs per SM): few registers per program, so
# several rows in flight per SM; x and dy are read twice (the second time from L2). Measured in
# benchmarks/results/2026-11-23-norm-pipelining/tiles: the best per point 1.13-1.78x the table's
# time (RMSNorm at 5120 columns: 0.99-1.03x); not adopted.
WIDE_TILES = [
    (1, 1024, 4, 4),
    (1, 1024, 4, 8),
    (1, 2048, 4, 4),
    (1, 2048, 8, 4),
    (2, 512, 4, 8),
    (2, 1024, 4, 4),
    (2, 1024, 8, 2),
    (2, 1024, 8, 4),
    (2, 2048, 8, 2),
    (4, 512, 4, 4),
    (4, 512, 4, 8),
    (4, 1024, 8, 2),
    (4, 1024, 8, 4),
]


def _wide_tile_bwd_candidates(N, _norms):
    return [
        _norms.BwdConfig(rows, block, _norms.PATH_WIDE, warps, pps)
        for rows, block, warps, pps in WIDE_TILES
        if block < N
    ]


def _split_bwd_candidates(N, op, block, _norms):
    """Two register blocks per row and "apart" gradient sums (tune2)."""
    B = _norms.BwdConfig
    regs, db, all_ = _norms.PATH_REGS, _norms.APART_DB, _norms.APART_ALL
    out = []
    if 4 * N <= 3 * block:  # two register blocks: the largest power of two <= N, then the rest
        lo = block // 2
        tail = 1 << (N - lo - 1).bit_length()
        for warps, pps, rw in (
            (32, 1, True),
            (32, 2, True),
            (16, 1, True),
            (16, 2, True),
            (16, 2, False),
            (8, 2, True),
        ):
            out.append(B(1, lo, regs, warps, pps, rw, tail))
        if op == "layer_norm":
            for warps, pps in ((32, 1), (32, 2), (16, 2)):
                out.append(B(1, lo, regs, warps, pps, True, tail, db))
            for warps, pps in ((32, 1), (32, 2), (16, 2)):
                out.append(B(1, lo, regs, warps, pps, True, tail, all_))
    if block >= 8192:
        if op == "layer_norm":
            for warps, pps in ((16, 1), (32, 1), (32, 2)):
                out.append(B(1, block, regs, warps, pps, True, 0, db))
        for warps, pps in ((16, 2), (32, 1), (32, 2)):
            out.append(B(1, block, regs, warps, pps, True, 0, all_))
    return out


def fwd_name(f):
    tag = f"fwd r{f.rows} w{f.num_warps}" if f.single_block else f"fwd-wide b{f.block} w{f.num_warps}"
    tag += (" hints" if f.hints else "") + (f" s{f.stages}" if f.stages > 1 else "")
    return tag + (" const" if f.const_n else "")


def bwd_name(b):
    from lmkernels.backends.triton import _norms

    names = {_norms.PATH_REGS: "regs", _norms.PATH_MEM: "mem", _norms.PATH_WIDE: "wide"}
    path = names[b.path] + ("-rw" if b.reload_w else "")
    tag = f"bwd {path} r{b.rows} b{b.block} w{b.num_warps} p{b.programs_per_sm}"
    if b.tail:
        tag += f" t{b.tail}"
    if b.apart:
        tag += " apart-" + ("db" if b.apart == _norms.APART_DB else "all")
    if b.stages > 1:
        tag += f" s{b.stages}"
    tag += (" const" if b.const_n else "") + (" rx" if b.reload_x else "")
    return tag + (" pf" if b.prefetch else "") + (" hx" if b.hold_x else "") + (" fma" if b.fma else "")


# Column-kernel configurations tried with the "apart" candidates: (BLOCK_M, BLOCK_N, warps, per SM).
COL_CANDIDATES = [(32, 128, 4, 8), (16, 256, 4, 8), (64, 64, 8, 4)]

# Position kernel: (TILE_ELEMENTS, NUM_WARPS, MIN_PROGRAMS); 2**30: one head group per program.
ROPE_CANDIDATES = [
    (t, w, p)
    for t in (1024, 2048, 4096)
    for w in (2, 4, 8)
    for p in (8192, 2**30)
    if not (t == 1024 and w == 8)
]
SUM_CANDIDATES = [(64, 32, 4), (128, 32, 8), (256, 16, 8), (32, 64, 4), (128, 64, 8), (64, 16, 2)]


# The table before this session's changes (per TUNED key, as _norms.tuned_key gives it: op,
# block and kind; fwd args of FwdConfig or None where unchanged, bwd args of BwdConfig):
# --lean times it beside the table, as "previous table", in the same run. P = PATH_REGS.
# Earlier sessions' runs name the commit whose tuner they used (their own kinds of "previous":
# the table without PDL, session 14; named fields reverted, session 17).
P = 0
# Session 18 changed the pipelines (stages) of the 1024 entries and of the 8192 and 4096
# "part" entries (RMSNorm's 4096 "part" entry is new: the full entry was what those widths
# got), and LayerNorm's 4096 and 2048 "part" entries to 4 warps with the weight held
# (benchmarks/results/2026-11-24-h200-issue/). 5120 columns are RMSNorm's ("rms_norm", 8192,
# "part-5/8") entry, which did not change.
PREVIOUS = {
    ("rms_norm", 1024): (None, (1, 1024, P, 4, 8)),
    ("layer_norm", 1024): (None, (1, 1024, P, 4, 8)),
    ("layer_norm", 4096): (None, (1, 4096, P, 8, 2, True, 0, 0, 3)),
    ("layer_norm", 8192, "part"): (None, (1, 8192, P, 16, 1, False, 0, 0, 3, True)),
    ("layer_norm", 2048, "part"): (None, (1, 2048, P, 8, 4, False, 0, 0, 3, True)),
    ("layer_norm", 4096, "part"): (None, (1, 4096, P, 8, 2, True, 0, 0, 3, True)),
    ("rms_norm", 4096, "part"): (None, (1, 4096, P, 16, 2, False, 0, 0, 3, True)),  # the full entry's
    ("rms_norm", 8192, "part"): (None, (1, 8192, P, 8, 1, True, 0, 0, 3, True)),
}
# RoPE's TILE_TUNED before this session's changes; None: unchanged (the committed table).
PREVIOUS_ROPE_TILES = None
