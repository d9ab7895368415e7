"""The norm kernel family: one forward, one backward and one column kernel, of which RMSNorm and
LayerNorm are specializations, and the jit helpers they share. The host code: norms.py."""

from __future__ import annotations

import triton
import triton.language as tl

from lmkernels.backends.triton import interpreting
from lmkernels.backends.triton.common import pdl_enter, to_dtype
from lmkernels.backends.triton.configs.records import PATH_WIDE

# The norm kernel family: one forward kernel, one backward kernel and one column kernel, of
# which RMSNorm and LayerNorm are specializations, and their launchers.
#
# LayerNorm is RMSNorm of the centered row plus a bias: HAS_MEAN centers x (and keeps the row's
# mean), HAS_BIAS adds the bias, and the backward's dx gets LayerNorm's extra mean(g) term. The
# rest of the variation is the casting MODE, RMSNorm's casting_mode (the semantics of
# `lmkernels.ops.rms_norm.rms_norm_reference`): "llama" rounds the normalized row to x.dtype
# before the weight multiply, "gemma" rounds once at the end, "none" rounds after every step as
# eager PyTorch does in x.dtype (emulated in-kernel). LayerNorm's semantics
# (`lmkernels.ops.layer_norm.layer_norm_reference`: fp32 math, one rounding of y) are "gemma"'s,
# with the weight used as it is (no offset).
#
# An argument a norm does not have (RMSNorm's mean and bias pointers, LayerNorm's offset) is
# passed as None: Triton makes a None argument a constexpr, absent from the compiled kernel,
# which then has only the parameters its norm reads.
#
# The work is laid out as the layout above describes: a tile of rows per program forward, a persistent
# backward that sums the weight (and bias) gradient partials in fp32 (registers, or the column
# kernel for wide rows).
#
# Both norms lay the work out the same way:
# - forward: a tile of `rows` rows per program, in registers; or (rows wider than the table's
#   max_fused_n, and where the table says so) one row per program in chunks, x read again from
#   L2 (with eviction `hints` that keep it there between the passes).
# - backward (PATH_REGS): a persistent grid (a few programs per SM); each program loops over row
#   tiles pid, pid + P, ... and sums its weight (and bias) gradient contributions in fp32
#   registers, one partial row written at the end. A second small kernel sums the P partial rows
#   (deterministic, no atomics). `stages` > 1 software-pipelines the loop over row tiles: the
#   next rows' loads are in flight (through shared memory) while a row is reduced, which is what
#   lets one row per SM reach the copy bandwidth.
# - PATH_WIDE (rows wider than max_fused_n): tiles of rows in column blocks, two passes (the
#   second from L2), the column loops pipelined; the backward kernel writes dx only, and a column
#   kernel, one program per (column block, row range), sums the weight (and bias) gradients from
#   x and dy read again. That costs two more reads, and saves the per-row accumulators that make
#   the wide backward spill.
# - rows that fill at most 3/4 of their power-of-two block (5120, 11008) may be held as two
#   register blocks, `block` (a power of two <= N) and `tail` (e.g. 4096 + 1024): fewer padding
#   lanes, hence fewer registers per thread and more rows in flight per SM.
# - `reload_x`: the backward reads a row's x and dy a second time after the row sums, one
#   register block at a time, from L1 / L2, instead of holding them. That frees the registers the
#   gradient sums of a wide row need (LayerNorm's two), without the column kernel's HBM reads.
# - `prefetch`: a backward with one program per SM and one row in flight asks L2 for its next
#   row as soon as the current row's loads are issued (prefetch_tile), so that HBM streams
#   through the row's reductions.
# - `hold_x` (RMSNorm): the backward holds a bf16 row's x and dy as loaded across the row sums,
#   then widens them to fp32 a second time (widen) instead of reading them again (reload_x) or
#   keeping fp32 copies.

MODES = {"llama": 0, "gemma": 1, "none": 2}  # casting_mode -> MODE of the kernels
LAYER_NORM_MODE = MODES["gemma"]  # LayerNorm rounds once, at the end
GEMMA: tl.constexpr = tl.constexpr(MODES["gemma"])
NONE: tl.constexpr = tl.constexpr(MODES["none"])
WIDE: tl.constexpr = tl.constexpr(PATH_WIDE)


# --- jit helpers -------------------------------------------------------------------------------


@triton.jit
def load_x_dy(x_ptr, dy_ptr, offs, mask, EVICT: tl.constexpr):
    """x and dy of one register block of a backward's row tile, as stored (bf16: half the
    registers of fp32). EVICT: the loads' cache eviction policy (reload_x reads the block
    twice: keep it, then let it go)."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0, eviction_policy=EVICT)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0, eviction_policy=EVICT)
    return x, dy


@triton.jit
def widen(v, AGAIN: tl.constexpr):
    """`v` (a block as loaded) in fp32. AGAIN: a second widening of the same held registers
    (hold_x), written with other operations (bf16: its bits shifted into an fp32's top half, the
    same value) so that the compiler cannot merge it with the first and keep the fp32 copy
    alive across the row sums instead of the half-size one."""
    if AGAIN and v.dtype == tl.bfloat16:
        out = (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        out = v.to(tl.float32)
    return out


@triton.jit
def round_as(v, dtype: tl.constexpr, SOFT_BF16: tl.constexpr):
    """fp32 `v` as if stored in `dtype` and loaded back: emulates one eager op in `dtype`."""
    return to_dtype(v, dtype, SOFT_BF16).to(tl.float32)


@triton.jit
def load_block(ptr, mask, HINTS: tl.constexpr, AGAIN: tl.constexpr):
    """A block of a row read in passes (the wide forward), in fp32. HINTS: tell the cache
    that the block will be read again by a later pass (AGAIN: keep it in L2) or not (evict it
    first), so that the later passes find the row in L2."""
    if HINTS and AGAIN:
        v = tl.load(ptr, mask=mask, other=0.0, eviction_policy="evict_last")
    elif HINTS:
        v = tl.load(ptr, mask=mask, other=0.0, eviction_policy="evict_first")
    else:
        v = tl.load(ptr, mask=mask, other=0.0)
    return v.to(tl.float32)


# A tile of ROWS rows is a [ROWS, columns] block, except a single row (ROWS == 1): a scalar row
# index and 1-D blocks. The computation is the same, the code Triton makes of it is not: the
# 1-D form runs the wide rows' backward markedly faster than a [1, N] tile
# (docs/performance.md, "Design decisions and their measurements"). The helpers give the
# kernels one text for both.


@triton.jit
def tile_rows(tile, M, ROWS: tl.constexpr):
    """The rows of tile `tile` (int64) and their mask."""
    if ROWS == 1:
        rows = tile.to(tl.int64)
    else:
        rows = tile.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    return rows, rows < M


@triton.jit
def tile_block(rows, row_mask, cols, col_mask, N, ROWS: tl.constexpr):
    """The element offsets and mask of columns `cols` of a tile's rows. A single row needs no row
    mask: the grid (forward) or the loop bound (backward) keeps it below M."""
    if ROWS == 1:
        offs = rows * N + cols
        mask = col_mask
    else:
        offs = rows[:, None] * N + cols[None, :]
        mask = row_mask[:, None] & col_mask[None, :]
    return offs, mask


@triton.jit
def per_row(v, ROWS: tl.constexpr):
    """A per-row value, broadcast against a tile."""
    if ROWS == 1:
        out = v
    else:
        out = v[:, None]
    return out


@triton.jit
def per_col(v, ROWS: tl.constexpr):
    """A per-column value (a block of the weight), broadcast against a tile."""
    if ROWS == 1:
        out = v
    else:
        out = v[None, :]
    return out


@triton.jit
def row_sums(t, ROWS: tl.constexpr):
    """Sums over the columns of a tile: one per row."""
    if ROWS == 1:
        out = tl.sum(t, axis=0)
    else:
        out = tl.sum(t, axis=1)
    return out


@triton.jit
def _add_pairs(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


# Triton's CPU interpreter runs a tl.reduce with a combine function element by element in
# Python (most of the norms' test time); interpreted, row_sums2 takes two tl.sum calls instead:
# the same sums. Compiled, the constant is False and the branch is not in the kernel.
INTERPRETED: tl.constexpr = tl.constexpr(interpreting())


@triton.jit
def row_sums2(a, b, ROWS: tl.constexpr):
    """row_sums of two tiles in one reduction. Two tl.sum calls are two reductions, each with
    its own exchange through shared memory and barriers, and the second waits for the first;
    one reduction of both exchanges both values at once (sm_90 PTX: one barrier fewer)."""
    if INTERPRETED:
        sa = row_sums(a, ROWS)
        sb = row_sums(b, ROWS)
    elif ROWS == 1:
        sa, sb = tl.reduce((a, b), 0, _add_pairs)
    else:
        sa, sb = tl.reduce((a, b), 1, _add_pairs)
    return sa, sb


@triton.jit
def col_sums(t, ROWS: tl.constexpr):
    """Sums over the rows of a tile: one per column."""
    if ROWS == 1:
        out = t
    else:
        out = tl.sum(t, axis=0)
    return out


@triton.jit
def tile_zeros(ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """An fp32 accumulator the shape of a tile's block."""
    if ROWS == 1:
        out = tl.zeros([BLOCK], tl.float32)
    else:
        out = tl.zeros([ROWS, BLOCK], tl.float32)
    return out


@triton.jit
def row_block(rows, row_mask, cols, start, N, ROWS: tl.constexpr):
    """Columns start + cols of a tile of rows (the wide backward's blocks): the block's column
    indices and mask, the tile's element offsets and mask (as tile_block)."""
    block_cols = start + cols
    block_mask = block_cols < N
    offs, mask = tile_block(rows, row_mask, block_cols, block_mask, N, ROWS)
    return block_cols, block_mask, offs, mask


@triton.jit
def prefetch_l2(ptr, start, count):
    """Asks L2 for elements [start, start + count) of `ptr` (their 16-byte aligned interior), with
    one `cp.async.bulk.prefetch.L2` (sm_90+) from the program's first thread, and does not wait:
    a hint, nothing depends on it. PTX: the interpreter cannot run it."""
    esize: tl.constexpr = ptr.dtype.element_ty.primitive_bitwidth // 8
    begin = (ptr + start).to(tl.int64)
    end = begin + count * esize
    begin = (begin + 15) // 16 * 16
    size = (end // 16 * 16 - begin).to(tl.int32)
    tl.inline_asm_elementwise(
        """{ .reg .pred p, q; .reg .u32 t;
        mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; setp.gt.s32 q, $2, 0; and.pred p, p, q;
        @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }""",
        "=r,l,r", [begin, size], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def prefetch_tile(x_ptr, dy_ptr, tile, M, N, ROWS: tl.constexpr):
    """prefetch_l2 of row tile `tile` of x and dy ([M, N], row-major), if it exists. The
    persistent backward asks for a tile it will work on later, so that HBM keeps streaming
    while it reduces the current one and that tile's loads then wait on L2, not HBM."""
    if tile * ROWS < M:
        start = tile.to(tl.int64) * ROWS * N
        count = tl.minimum(M - tile * ROWS, ROWS).to(tl.int64) * N
        prefetch_l2(x_ptr, start, count)
        prefetch_l2(dy_ptr, start, count)


@triton.jit
def _sum_columns(
    partial_ptr, out_ptr, P, N, SOFT_BF16: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    acc = tl.zeros([BLOCK_P, BLOCK_N], tl.float32)
    for start in range(0, P, BLOCK_P):
        rows = start + tl.arange(0, BLOCK_P)
        mask = (rows[:, None] < P) & col_mask[None, :]
        acc += tl.load(partial_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], mask=mask, other=0.0)
    total = tl.sum(acc, axis=0)
    tl.store(out_ptr + cols, to_dtype(total, out_ptr.dtype.element_ty, SOFT_BF16), mask=col_mask)


@triton.jit
def _sum_partials_kernel(
    partial0_ptr,
    out0_ptr,
    partial1_ptr,
    out1_ptr,
    P0,
    P1,
    N,
    SOFT_BF16: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """out_j[c] = sum over p of partial_j[p, c] (fp32), rounded to out_j's dtype; j = program_id(1).
    One launch reduces both the weight and the bias partials of LayerNorm (P0 and P1 rows)."""
    pdl_enter(PDL)
    if tl.program_id(1) == 0:
        _sum_columns(partial0_ptr, out0_ptr, P0, N, SOFT_BF16, BLOCK_P, BLOCK_N)
    else:
        _sum_columns(partial1_ptr, out1_ptr, P1, N, SOFT_BF16, BLOCK_P, BLOCK_N)


# --- the math of one block ---------------------------------------------------------------------


@triton.jit
def _square(x, MODE: tl.constexpr, dtype: tl.constexpr, SOFT_BF16: tl.constexpr):
    if MODE == NONE:
        return round_as(x * x, dtype, SOFT_BF16)
    return x * x


@triton.jit
def _rstd(sum_sq, N, eps, MODE: tl.constexpr, dtype: tl.constexpr, SOFT_BF16: tl.constexpr):
    if MODE == NONE:
        # mean, + eps and rsqrt each produce an x.dtype tensor in eager.
        mean_sq = round_as(sum_sq / N, dtype, SOFT_BF16)
        return round_as(tl.rsqrt(round_as(mean_sq + eps, dtype, SOFT_BF16)), dtype, SOFT_BF16)
    return tl.rsqrt(sum_sq / N + eps)


@triton.jit
def _weight_factor(w, offset, MODE: tl.constexpr, dtype: tl.constexpr, SOFT_BF16: tl.constexpr):
    """The weight as the multiply sees it: RMSNorm's weight + offset, formed as the reference
    forms it (in x.dtype for "none", else fp32); LayerNorm's (offset None) as it is."""
    if offset is None:
        out = w
    elif MODE == NONE:
        out = round_as(round_as(w, dtype, SOFT_BF16) + offset, dtype, SOFT_BF16)
    else:
        out = w + offset
    return out


@triton.jit
def _normalized(x, rstd, MODE: tl.constexpr, dtype: tl.constexpr, SOFT_BF16: tl.constexpr):
    """x * rstd as the weight multiply sees it: rounded to x.dtype except in "gemma" mode."""
    if MODE == GEMMA:
        return x * rstd
    return round_as(x * rstd, dtype, SOFT_BF16)


@triton.jit
def _row_stats(mean_ptr, rstd_ptr, rows, row_mask, HAS_MEAN: tl.constexpr):
    """The rows' mean and rstd, as the forward stored them. RMSNorm has no mean: rstd stands in
    for it, never read."""
    if HAS_MEAN:
        mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
    else:
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        mean = rstd
    return mean, rstd


# --- forward -----------------------------------------------------------------------------------


@triton.jit
def _norm_fwd_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    mean_ptr,
    rstd_ptr,
    M,
    N,
    eps,
    offset,
    MODE: tl.constexpr,
    HAS_MEAN: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr,
    HINTS: tl.constexpr,
    SOFT_BF16: tl.constexpr,
    N_CONST: tl.constexpr = 0,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    if N_CONST > 0:  # the row width as a compile-time constant (const_n)
        N = N_CONST
    dtype = y_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    if SINGLE_BLOCK:
        # A tile of ROWS whole rows.
        rows, row_mask = tile_rows(tl.program_id(0), M, ROWS)
        col_mask = cols < N
        offs, mask = tile_block(rows, row_mask, cols, col_mask, N, ROWS)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_MEAN:
            # Two passes over the row in registers (mean, then squared deviations), as the
            # reference; the padding stays zero.
            mean = row_sums(x, ROWS) / N
            x = tl.where(mask, x - per_row(mean, ROWS), 0.0)
        rstd = _rstd(row_sums(_square(x, MODE, dtype, SOFT_BF16), ROWS), N, eps, MODE, dtype, SOFT_BF16)
        y = _normalized(x, per_row(rstd, ROWS), MODE, dtype, SOFT_BF16)
        if HAS_WEIGHT:
            w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            y = y * per_col(_weight_factor(w, offset, MODE, dtype, SOFT_BF16), ROWS)
        if HAS_BIAS:
            y = y + per_col(tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32), ROWS)
        tl.store(y_ptr + offs, to_dtype(y, dtype, SOFT_BF16), mask=mask)
        if HAS_MEAN:
            tl.store(mean_ptr + rows, mean, mask=row_mask)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)
    else:
        # Wide rows: a pass per statistic (LayerNorm's sum, then the squares), then the output;
        # the later passes hit L2. The passes are not software-pipelined (num_stages=1).
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * N
        y_row = y_ptr + row * N
        if HAS_MEAN:
            acc = tl.zeros([BLOCK], tl.float32)
            for start in tl.range(0, N, BLOCK, num_stages=1):
                acc += load_block(x_row + start + cols, start + cols < N, HINTS, True)
            mean = tl.sum(acc, axis=0) / N
        acc = tl.zeros([BLOCK], tl.float32)
        for start in tl.range(0, N, BLOCK, num_stages=1):
            mask = start + cols < N
            x = load_block(x_row + start + cols, mask, HINTS, True)
            if HAS_MEAN:
                x = tl.where(mask, x - mean, 0.0)
            acc += _square(x, MODE, dtype, SOFT_BF16)
        rstd = _rstd(tl.sum(acc, axis=0), N, eps, MODE, dtype, SOFT_BF16)
        for start in tl.range(0, N, BLOCK, num_stages=1):
            mask = start + cols < N
            x = load_block(x_row + start + cols, mask, HINTS, False)
            if HAS_MEAN:
                x = x - mean
            y = _normalized(x, rstd, MODE, dtype, SOFT_BF16)
            if HAS_WEIGHT:
                w = tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
                y = y * _weight_factor(w, offset, MODE, dtype, SOFT_BF16)
            if HAS_BIAS:
                y = y + tl.load(b_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_row + start + cols, to_dtype(y, dtype, SOFT_BF16), mask=mask)
        if HAS_MEAN:
            tl.store(mean_ptr + row, mean)
        tl.store(rstd_ptr + row, rstd)


# --- backward ----------------------------------------------------------------------------------


@triton.jit
def _bwd_terms(x, dy, w_ptr, cols, col_mask, w_factor, mean, rstd, offset, RELOAD_W: tl.constexpr,
               MODE: tl.constexpr, HAS_MEAN: tl.constexpr, HAS_WEIGHT: tl.constexpr, dtype: tl.constexpr,
               SOFT_BF16: tl.constexpr, ROWS: tl.constexpr, AGAIN: tl.constexpr, FMA: tl.constexpr):  # fmt: skip
    """From a block as loaded, in fp32: x (LayerNorm: x_hat, see _bwd_store for FMA), dy and
    g = dy * the weight factor. AGAIN: the block's second widening (widen)."""
    x = widen(x, AGAIN)
    dy = widen(dy, AGAIN)
    if HAS_MEAN:
        if FMA:
            x = x * per_row(rstd, ROWS) + per_row(-mean * rstd, ROWS)
        else:
            x = (x - per_row(mean, ROWS)) * per_row(rstd, ROWS)
    g = dy
    if HAS_WEIGHT:
        if RELOAD_W:  # reloaded (an L1 hit) rather than held in registers
            w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            w_factor = _weight_factor(w, offset, MODE, dtype, SOFT_BF16)
        g = dy * per_col(w_factor, ROWS)
    return x, dy, g


@triton.jit
def _row_dots(g, x, HAS_MEAN: tl.constexpr, PAIRED: tl.constexpr, ROWS: tl.constexpr):
    """The row sums the backward's dx needs: of g (LayerNorm only) and of g * x. PAIRED: both in
    one reduction (row_sums2); not at one 16384-column block, the register limit, where the
    paired sum is the slower one."""
    if not HAS_MEAN:
        sum_gx = row_sums(g * x, ROWS)
        sum_g = sum_gx  # never read
    elif PAIRED:
        sum_g, sum_gx = row_sums2(g, g * x, ROWS)
    else:
        sum_g = row_sums(g, ROWS)
        sum_gx = row_sums(g * x, ROWS)
    return sum_g, sum_gx


@triton.jit
def _row_scales(sum_g, sum_gx, rstd, N, HAS_MEAN: tl.constexpr):
    """The row's products of dx (_bwd_store): LayerNorm's mean(g) and mean(g * x_hat); RMSNorm's
    rstd^2 * mean(g * x) (its mean(g) never read)."""
    if HAS_MEAN:
        mean_g = sum_g / N
        scale = sum_gx / N
    else:
        scale = rstd * rstd * sum_gx / N
        mean_g = scale
    return mean_g, scale


@triton.jit
def _bwd_store(dx_ptr, offs, mask, x, dy, g, rstd, mean_g, scale, dw_acc, db_acc, ACC_DW: tl.constexpr,
               ACC_DB: tl.constexpr, MODE: tl.constexpr, HAS_MEAN: tl.constexpr, SOFT_BF16: tl.constexpr,
               ROWS: tl.constexpr, FMA: tl.constexpr):  # fmt: skip
    """Writes dx of one register block and adds its dw / db contributions (ACC_DW / ACC_DB) to
    the accumulators; returns them.

    FMA (LayerNorm): x_hat = x * rstd + (-mean * rstd) (_bwd_terms) and dx = g * rstd +
    (x_hat * c_x + c_0) with the row's products c_x = -mean(g * x_hat) * rstd and
    c_0 = -mean(g) * rstd: fused multiply-adds, fewer instructions for the backward of wide
    rows, which issues instructions at a large share of the SM's rate; the table's fma field
    says where these forms are the faster ones (not at narrow rows; docs/performance.md,
    "Design decisions and their measurements")."""
    dtype = dx_ptr.dtype.element_ty
    if not HAS_MEAN:
        dx = (g - x * per_row(scale, ROWS)) * per_row(rstd, ROWS)
    elif FMA:
        c_x = per_row(-scale * rstd, ROWS)
        dx = g * per_row(rstd, ROWS) + (x * c_x + per_row(-mean_g * rstd, ROWS))
    else:
        dx = (g - per_row(mean_g, ROWS) - x * per_row(scale, ROWS)) * per_row(rstd, ROWS)
    tl.store(dx_ptr + offs, to_dtype(dx, dtype, SOFT_BF16), mask=mask)
    # Padding columns and rows have dy = 0: they add nothing to any sum.
    if ACC_DW:
        if HAS_MEAN:
            dw_acc += col_sums(dy * x, ROWS)
        else:
            dw_acc += col_sums(dy * _normalized(x, per_row(rstd, ROWS), MODE, dtype, SOFT_BF16), ROWS)
    if ACC_DB:
        db_acc += col_sums(dy, ROWS)
    return dw_acc, db_acc


@triton.jit
def _norm_bwd_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    mean_ptr,
    rstd_ptr,
    dx_ptr,
    dw_partial_ptr,
    db_partial_ptr,
    M,
    N,
    offset,
    MODE: tl.constexpr,
    HAS_MEAN: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    ACC_DW: tl.constexpr,
    ACC_DB: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    TAIL: tl.constexpr,
    PATH: tl.constexpr,
    RELOAD_W: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    SOFT_BF16: tl.constexpr,
    N_CONST: tl.constexpr = 0,
    RELOAD_X: tl.constexpr = False,
    PREFETCH: tl.constexpr = False,
    HOLD_X: tl.constexpr = False,
    FMA: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """g = dy * (w + offset); RMSNorm: dx = rstd * (g - x * rstd^2 * mean(g * x)); LayerNorm,
    with x_hat = (x - mean) * rstd: dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat)).
    dw = sum dy * x_hat (x_hat as the weight multiply saw it), db = sum dy, over rows.

    Program pid handles row tiles pid, pid + P, ... (ROWS rows each; one row on the wide path)
    and writes row pid of the P x N fp32 partials it accumulates (ACC_DW, ACC_DB; the others
    are left to the column kernel; the wide path leaves them all), P <= the number of tiles. On
    the single-block path a row is columns [0, BLOCK) and, when TAIL > 0, [BLOCK, BLOCK + TAIL):
    two register blocks. dx_ptr may equal dy_ptr (in-place backward): every element of dy is
    read before the dx element at the same address is written, by the same program.
    RELOAD_X: x and dy are read again (L1 / L2 hits) after the row sums, one register block at
    a time, instead of being held (fewer registers per thread: what lets both of LayerNorm's
    fp32 accumulators of a 16384-column row stay in registers). HOLD_X: x and dy are held as
    loaded (bf16) across the row sums and widened again (widen). PREFETCH: right after a tile's
    first loads are issued, L2 is asked for the program's next tile (prefetch_tile).
    """
    pdl_enter(PDL)
    if N_CONST > 0:  # the row width as a compile-time constant (const_n)
        N = N_CONST
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    dtype = dx_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    dw_row = dw_partial_ptr + pid.to(tl.int64) * N
    if ACC_DB:
        db_row = db_partial_ptr + pid.to(tl.int64) * N
    if PATH != WIDE:
        col_mask = cols < N
        w_factor = tl.zeros([BLOCK], tl.float32)
        if HAS_WEIGHT and not RELOAD_W:
            w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            w_factor = _weight_factor(w, offset, MODE, dtype, SOFT_BF16)
        dw_acc = tl.zeros([BLOCK], tl.float32)
        db_acc = tl.zeros([BLOCK], tl.float32)
        if TAIL > 0:
            cols_t = BLOCK + tl.arange(0, TAIL)
            tail_mask = cols_t < N
            w_factor_t = tl.zeros([TAIL], tl.float32)
            if HAS_WEIGHT and not RELOAD_W:
                w = tl.load(w_ptr + cols_t, mask=tail_mask, other=0.0).to(tl.float32)
                w_factor_t = _weight_factor(w, offset, MODE, dtype, SOFT_BF16)
            dw_acc_t = tl.zeros([TAIL], tl.float32)
            db_acc_t = tl.zeros([TAIL], tl.float32)
        # NUM_STAGES > 1: the next tiles' loads are issued while this one is computed.
        for i in tl.range(0, tl.cdiv(tl.cdiv(M, ROWS) - pid, num_programs), num_stages=NUM_STAGES):
            rows, row_mask = tile_rows(pid + i * num_programs, M, ROWS)
            mean, rstd = _row_stats(mean_ptr, rstd_ptr, rows, row_mask, HAS_MEAN)
            offs, mask = tile_block(rows, row_mask, cols, col_mask, N, ROWS)
            first: tl.constexpr = "evict_last" if RELOAD_X else ""
            x_raw, dy_raw = load_x_dy(x_ptr, dy_ptr, offs, mask, first)
            x, dy, g = _bwd_terms(x_raw, dy_raw, w_ptr, cols, col_mask, w_factor, mean, rstd, offset, RELOAD_W,
                                  MODE, HAS_MEAN, HAS_WEIGHT, dtype, SOFT_BF16, ROWS, False, FMA)  # fmt: skip
            if PREFETCH:  # the next tile, while this one's loads are in flight
                prefetch_tile(x_ptr, dy_ptr, pid + (i + 1) * num_programs, M, N, ROWS)
            sum_g, sum_gx = _row_dots(g, x, HAS_MEAN, BLOCK < 16384, ROWS)
            if TAIL > 0:
                offs_t, mask_t = tile_block(rows, row_mask, cols_t, tail_mask, N, ROWS)
                x_raw_t, dy_raw_t = load_x_dy(x_ptr, dy_ptr, offs_t, mask_t, first)
                x_t, dy_t, g_t = _bwd_terms(x_raw_t, dy_raw_t, w_ptr, cols_t, tail_mask, w_factor_t, mean, rstd,
                                            offset, RELOAD_W, MODE, HAS_MEAN, HAS_WEIGHT, dtype, SOFT_BF16, ROWS,
                                            False, FMA)  # fmt: skip
                sum_g_t, sum_gx_t = _row_dots(g_t, x_t, HAS_MEAN, True, ROWS)
                if HAS_MEAN:
                    sum_g += sum_g_t
                sum_gx += sum_gx_t
            mean_g, scale = _row_scales(sum_g, sum_gx, rstd, N, HAS_MEAN)
            if RELOAD_X:  # another eviction policy: the compiler does not merge the two loads
                x_raw, dy_raw = load_x_dy(x_ptr, dy_ptr, offs, mask, "evict_first")
            if RELOAD_X or HOLD_X:
                x, dy, g = _bwd_terms(x_raw, dy_raw, w_ptr, cols, col_mask, w_factor, mean, rstd, offset, RELOAD_W,
                                      MODE, HAS_MEAN, HAS_WEIGHT, dtype, SOFT_BF16, ROWS, HOLD_X, FMA)  # fmt: skip
            dw_acc, db_acc = _bwd_store(dx_ptr, offs, mask, x, dy, g, rstd, mean_g, scale, dw_acc, db_acc, ACC_DW,
                                        ACC_DB, MODE, HAS_MEAN, SOFT_BF16, ROWS, FMA)  # fmt: skip
            if TAIL > 0:
                if RELOAD_X:
                    x_raw_t, dy_raw_t = load_x_dy(x_ptr, dy_ptr, offs_t, mask_t, "evict_first")
                if RELOAD_X or HOLD_X:
                    x_t, dy_t, g_t = _bwd_terms(x_raw_t, dy_raw_t, w_ptr, cols_t, tail_mask, w_factor_t, mean,
                                                rstd, offset, RELOAD_W, MODE, HAS_MEAN, HAS_WEIGHT, dtype, SOFT_BF16,
                                                ROWS, HOLD_X, FMA)  # fmt: skip
                dw_acc_t, db_acc_t = _bwd_store(dx_ptr, offs_t, mask_t, x_t, dy_t, g_t, rstd, mean_g, scale,
                                                dw_acc_t, db_acc_t, ACC_DW, ACC_DB, MODE, HAS_MEAN, SOFT_BF16, ROWS,
                                                FMA)  # fmt: skip
        if ACC_DW:
            tl.store(dw_row + cols, dw_acc, mask=col_mask)
            if TAIL > 0:
                tl.store(dw_row + cols_t, dw_acc_t, mask=tail_mask)
        if ACC_DB:
            tl.store(db_row + cols, db_acc, mask=col_mask)
            if TAIL > 0:
                tl.store(db_row + cols_t, db_acc_t, mask=tail_mask)
    else:
        # Wide rows, in tiles of ROWS rows x BLOCK columns: pass 1 reduces the row sums, pass 2
        # reads x and dy again (from L2) and writes dx; the column kernel sums dw and db (the
        # launcher passes ACC_DW and ACC_DB False). NUM_STAGES > 1 pipelines the loops over
        # blocks.
        for i in range(0, tl.cdiv(tl.cdiv(M, ROWS) - pid, num_programs)):
            rows, row_mask = tile_rows(pid + i * num_programs, M, ROWS)
            mean, rstd = _row_stats(mean_ptr, rstd_ptr, rows, row_mask, HAS_MEAN)
            acc_g = tile_zeros(ROWS, BLOCK)
            acc_gx = tile_zeros(ROWS, BLOCK)
            for start in tl.range(0, N, BLOCK, num_stages=NUM_STAGES):
                block_cols, block_mask, offs, mask = row_block(rows, row_mask, cols, start, N, ROWS)
                x_raw, dy_raw = load_x_dy(x_ptr, dy_ptr, offs, mask, "")
                x, dy, g = _bwd_terms(x_raw, dy_raw, w_ptr, block_cols, block_mask, cols, mean, rstd, offset, True,
                                      MODE, HAS_MEAN, HAS_WEIGHT, dtype, SOFT_BF16, ROWS, False, FMA)  # fmt: skip
                if HAS_MEAN:
                    acc_g += g
                acc_gx += g * x
            if HAS_MEAN:
                sum_g, sum_gx = row_sums2(acc_g, acc_gx, ROWS)
                mean_g, scale = _row_scales(sum_g, sum_gx, rstd, N, HAS_MEAN)
            else:
                scale = rstd * rstd * row_sums(acc_gx, ROWS) / N
                mean_g = scale
            for start in tl.range(0, N, BLOCK, num_stages=NUM_STAGES):
                block_cols, block_mask, offs, mask = row_block(rows, row_mask, cols, start, N, ROWS)
                x_raw, dy_raw = load_x_dy(x_ptr, dy_ptr, offs, mask, "")
                x, dy, g = _bwd_terms(x_raw, dy_raw, w_ptr, block_cols, block_mask, cols, mean, rstd, offset, True,
                                      MODE, HAS_MEAN, HAS_WEIGHT, dtype, SOFT_BF16, ROWS, False, FMA)  # fmt: skip
                _bwd_store(dx_ptr, offs, mask, x, dy, g, rstd, mean_g, scale, acc_g, acc_gx, False, False, MODE,
                           HAS_MEAN, SOFT_BF16, ROWS, FMA)  # fmt: skip


@triton.jit
def _norm_col_kernel(
    dy_ptr,
    x_ptr,
    mean_ptr,
    rstd_ptr,
    dw_partial_ptr,
    db_partial_ptr,
    M,
    N,
    rows_per_split,
    MODE: tl.constexpr,
    HAS_MEAN: tl.constexpr,
    DW: tl.constexpr,
    DB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SOFT_BF16: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """The column kernel (the wide path's gradients): over the rows of range s (program_id(1))
    and the columns of block program_id(0), dw_partial[s] = sum dy * x_hat (DW; x_hat as the
    weight multiply saw it), db_partial[s] = sum dy (DB; reads neither x nor the statistics
    when alone)."""
    pdl_enter(PDL)
    dtype = x_ptr.dtype.element_ty
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    split = tl.program_id(1)
    start = split * rows_per_split
    end = tl.minimum(M, start + rows_per_split)
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    db_acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for first in range(start, end, BLOCK_M):
        rows = first + tl.arange(0, BLOCK_M)
        row_mask = rows < end
        mask = row_mask[:, None] & col_mask[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        # LayerNorm reads dy first (alone where only db is summed), RMSNorm x first: each the
        # order its table entries are tuned for (the order changes the compiled code).
        if HAS_MEAN:
            dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            if DW:
                x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        else:
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if DW:
            mean, rstd = _row_stats(mean_ptr, rstd_ptr, rows, row_mask, HAS_MEAN)
            if HAS_MEAN:
                x_hat = (x - mean[:, None]) * rstd[:, None]
            else:
                x_hat = _normalized(x, rstd[:, None], MODE, dtype, SOFT_BF16)
            dw_acc += dy * x_hat
        if DB:
            db_acc += dy
    row = split.to(tl.int64) * N
    if DW:
        tl.store(dw_partial_ptr + row + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
    if DB:
        tl.store(db_partial_ptr + row + cols, tl.sum(db_acc, axis=0), mask=col_mask)
