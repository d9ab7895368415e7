"""LayerNorm in Triton: forward and backward kernels, launchers, torch.library ops, registration.

Semantics are those of `lmkernels.ops.layer_norm.layer_norm_reference`: fp32 math, one rounding
of y to x.dtype; weight and bias are optional and independent. The work is laid out as
_norms.py describes: a tile of rows per program forward, a persistent backward that sums the
weight and bias gradient partials in fp32 (registers, or memory for wide rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmkernels.backends.triton import triton_devices, triton_unavailable_reason
from lmkernels.backends.triton._common import (
    call,
    cdiv,
    device_guard,
    eager_function,
    op_or_raw,
    pdl,
    pdl_enter,
    soft_bf16,
)
from lmkernels.backends.triton._launch import launch
from lmkernels.backends.triton._norms import (
    PATH_WIDE,
    BwdConfig,
    FwdConfig,
    bwd_config,
    can_prefetch,
    col_sums,
    column_splits,
    const_n,
    fwd_config,
    load_block,
    load_x_dy,
    num_rows,
    num_tiles,
    partial_buffer,
    per_col,
    per_row,
    persistent_programs,
    pipeline_stages,
    prefetch_tile,
    reloads_x,
    row_block,
    row_limit_reasons,
    row_sums,
    row_sums2,
    sum_partials,
    tile_block,
    tile_rows,
    tile_zeros,
    to_dtype,
)
from lmkernels.backends.triton.configs import tables_for
from lmkernels.registry.core import register
from lmkernels.utils import empty

WIDE: tl.constexpr = tl.constexpr(PATH_WIDE)

# --- kernels -----------------------------------------------------------------------------------


@triton.jit
def _layer_norm_fwd_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    mean_ptr,
    rstd_ptr,
    M,
    N,
    eps,
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
        mean = row_sums(x, ROWS) / N
        centered = tl.where(mask, x - per_row(mean, ROWS), 0.0)
        # Two passes over the row in registers (mean, then squared deviations), as the reference.
        rstd = tl.rsqrt(row_sums(centered * centered, ROWS) / N + eps)
        y = centered * per_row(rstd, ROWS)
        if HAS_WEIGHT:
            y = y * per_col(tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32), ROWS)
        if HAS_BIAS:
            y = y + per_col(tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32), ROWS)
        tl.store(y_ptr + offs, to_dtype(y, dtype, SOFT_BF16), mask=mask)
        tl.store(mean_ptr + rows, mean, mask=row_mask)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)
    else:
        # Wide rows: three passes (sum, squared deviations, output); passes 2 and 3 hit L2. The
        # passes are not software-pipelined (num_stages=1).
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * N
        y_row = y_ptr + row * N
        acc = tl.zeros([BLOCK], tl.float32)
        for start in tl.range(0, N, BLOCK, num_stages=1):
            acc += load_block(x_row + start + cols, start + cols < N, HINTS, True)
        mean = tl.sum(acc, axis=0) / N
        acc = tl.zeros([BLOCK], tl.float32)
        for start in tl.range(0, N, BLOCK, num_stages=1):
            mask = start + cols < N
            x = load_block(x_row + start + cols, mask, HINTS, True)
            centered = tl.where(mask, x - mean, 0.0)
            acc += centered * centered
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / N + eps)
        for start in tl.range(0, N, BLOCK, num_stages=1):
            mask = start + cols < N
            x = load_block(x_row + start + cols, mask, HINTS, False)
            y = (x - mean) * rstd
            if HAS_WEIGHT:
                y = y * tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS:
                y = y + tl.load(b_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_row + start + cols, to_dtype(y, dtype, SOFT_BF16), mask=mask)
        tl.store(mean_ptr + row, mean)
        tl.store(rstd_ptr + row, rstd)


@triton.jit
def _bwd_terms(x, dy, w_ptr, cols, col_mask, w, mean, rstd, RELOAD_W: tl.constexpr, HAS_WEIGHT: tl.constexpr,
               ROWS: tl.constexpr, FMA: tl.constexpr):  # fmt: skip
    """x_hat, dy and g = dy * w in fp32 from a block as loaded. FMA: x_hat = x * rstd +
    (-mean * rstd), one fused multiply-add an element (see _bwd_store)."""
    x = x.to(tl.float32)
    dy = dy.to(tl.float32)
    if FMA:
        x_hat = x * per_row(rstd, ROWS) + per_row(-mean * rstd, ROWS)
    else:
        x_hat = (x - per_row(mean, ROWS)) * per_row(rstd, ROWS)
    g = dy
    if HAS_WEIGHT:
        if RELOAD_W:  # reloaded (an L1 hit) rather than held in registers
            w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        g = dy * per_col(w, ROWS)
    return x_hat, dy, g


@triton.jit
def _bwd_store(dx_ptr, offs, mask, x_hat, dy, g, rstd, mean_g, mean_gx, dw_acc, db_acc, ACC_DW: tl.constexpr,
               ACC_DB: tl.constexpr, SOFT_BF16: tl.constexpr, ROWS: tl.constexpr, FMA: tl.constexpr):  # fmt: skip
    """Writes dx of one register block and adds its dw / db contributions (ACC_DW / ACC_DB) to
    the accumulators.

    FMA: dx = g * rstd + (x_hat * c_x + c_0) with the row's products c_x = -mean_gx * rstd and
    c_0 = -mean_g * rstd, two fused multiply-adds an element. The backward of rows over 8192
    columns issues instructions at ~60% of the SM's rate (ncu, H200); the table's fma field says
    where these forms measured faster (at 1024-2048 columns they were 0.80-0.93x)."""
    if FMA:
        c_x = per_row(-mean_gx * rstd, ROWS)
        dx = g * per_row(rstd, ROWS) + (x_hat * c_x + per_row(-mean_g * rstd, ROWS))
    else:
        dx = (g - per_row(mean_g, ROWS) - x_hat * per_row(mean_gx, ROWS)) * per_row(rstd, ROWS)
    tl.store(dx_ptr + offs, to_dtype(dx, dx_ptr.dtype.element_ty, SOFT_BF16), mask=mask)
    # Padding columns and rows have dy = 0: they add nothing to any sum.
    if ACC_DW:
        dw_acc += col_sums(dy * x_hat, ROWS)
    if ACC_DB:
        db_acc += col_sums(dy, ROWS)
    return dw_acc, db_acc


@triton.jit
def _layer_norm_bwd_kernel(
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
    FMA: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat)) with g = dy * w, x_hat = (x - mean) * rstd;
    dw = sum dy * x_hat, db = sum dy over rows.

    Program pid handles row tiles pid, pid + P, ... (ROWS rows each; one row on the wide path)
    and writes row pid of the P x N fp32 partials it accumulates (ACC_DW, ACC_DB; the others
    are left to the column kernel; the wide path leaves them all), P <= the number of tiles. On
    the single-block path a row is columns [0, BLOCK) and, when TAIL > 0, [BLOCK, BLOCK + TAIL):
    two register blocks. RELOAD_X: x and dy are read again (L1 / L2 hits) after the row sums,
    one register block at a time, instead of being held: what lets both fp32 accumulators of a
    16384-column row stay in registers. PREFETCH: right after a tile's first loads are issued,
    L2 is asked for the program's next tile (prefetch_tile).
    """
    pdl_enter(PDL)
    if N_CONST > 0:  # the row width as a compile-time constant (const_n)
        N = N_CONST
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    dw_row = dw_partial_ptr + pid.to(tl.int64) * N
    db_row = db_partial_ptr + pid.to(tl.int64) * N
    if PATH != WIDE:
        col_mask = cols < N
        w = tl.zeros([BLOCK], tl.float32)
        if HAS_WEIGHT and not RELOAD_W:
            w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        dw_acc = tl.zeros([BLOCK], tl.float32)
        db_acc = tl.zeros([BLOCK], tl.float32)
        if TAIL > 0:
            cols_t = BLOCK + tl.arange(0, TAIL)
            tail_mask = cols_t < N
            w_t = tl.zeros([TAIL], tl.float32)
            if HAS_WEIGHT and not RELOAD_W:
                w_t = tl.load(w_ptr + cols_t, mask=tail_mask, other=0.0).to(tl.float32)
            dw_acc_t = tl.zeros([TAIL], tl.float32)
            db_acc_t = tl.zeros([TAIL], tl.float32)
        # NUM_STAGES > 1: the next tiles' loads are issued while this one is computed.
        for i in tl.range(0, tl.cdiv(tl.cdiv(M, ROWS) - pid, num_programs), num_stages=NUM_STAGES):
            rows, row_mask = tile_rows(pid + i * num_programs, M, ROWS)
            mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
            offs, mask = tile_block(rows, row_mask, cols, col_mask, N, ROWS)
            first: tl.constexpr = "evict_last" if RELOAD_X else ""
            x_raw, dy_raw = load_x_dy(x_ptr, dy_ptr, offs, mask, first)
            x_hat, dy, g = _bwd_terms(x_raw, dy_raw, w_ptr, cols, col_mask, w, mean, rstd, RELOAD_W, HAS_WEIGHT,
                                      ROWS, FMA)  # fmt: skip
            if PREFETCH:  # the next tile, while this one's loads are in flight
                prefetch_tile(x_ptr, dy_ptr, pid + (i + 1) * num_programs, M, N, ROWS)
            if BLOCK < 16384:
                sum_g, sum_gx = row_sums2(g, g * x_hat, ROWS)
            else:  # one 16384-column block at the register limit: the paired sum measured 1.5% slower
                sum_g = row_sums(g, ROWS)
                sum_gx = row_sums(g * x_hat, ROWS)
            if TAIL > 0:
                offs_t, mask_t = tile_block(rows, row_mask, cols_t, tail_mask, N, ROWS)
                x_raw_t, dy_raw_t = load_x_dy(x_ptr, dy_ptr, offs_t, mask_t, first)
                x_hat_t, dy_t, g_t = _bwd_terms(x_raw_t, dy_raw_t, w_ptr, cols_t, tail_mask, w_t, mean, rstd,
                                                RELOAD_W, HAS_WEIGHT, ROWS, FMA)  # fmt: skip
                sum_g_t, sum_gx_t = row_sums2(g_t, g_t * x_hat_t, ROWS)
                sum_g += sum_g_t
                sum_gx += sum_gx_t
            mean_g = sum_g / N
            mean_gx = sum_gx / N
            if RELOAD_X:  # another eviction policy: the compiler does not merge the two loads
                x_raw, dy_raw = load_x_dy(x_ptr, dy_ptr, offs, mask, "evict_first")
                x_hat, dy, g = _bwd_terms(x_raw, dy_raw, w_ptr, cols, col_mask, w, mean, rstd, RELOAD_W,
                                          HAS_WEIGHT, ROWS, FMA)  # fmt: skip
            dw_acc, db_acc = _bwd_store(dx_ptr, offs, mask, x_hat, dy, g, rstd, mean_g, mean_gx, dw_acc, db_acc,
                                        ACC_DW, ACC_DB, SOFT_BF16, ROWS, FMA)  # fmt: skip
            if TAIL > 0:
                if RELOAD_X:
                    x_raw_t, dy_raw_t = load_x_dy(x_ptr, dy_ptr, offs_t, mask_t, "evict_first")
                    x_hat_t, dy_t, g_t = _bwd_terms(x_raw_t, dy_raw_t, w_ptr, cols_t, tail_mask, w_t, mean, rstd,
                                                    RELOAD_W, HAS_WEIGHT, ROWS, FMA)  # fmt: skip
                dw_acc_t, db_acc_t = _bwd_store(dx_ptr, offs_t, mask_t, x_hat_t, dy_t, g_t, rstd, mean_g, mean_gx,
                                                dw_acc_t, db_acc_t, ACC_DW, ACC_DB, SOFT_BF16, ROWS, FMA)  # fmt: skip
        if ACC_DW:
            tl.store(dw_row + cols, dw_acc, mask=col_mask)
            if TAIL > 0:
                tl.store(dw_row + cols_t, dw_acc_t, mask=tail_mask)
        if ACC_DB:
            tl.store(db_row + cols, db_acc, mask=col_mask)
            if TAIL > 0:
                tl.store(db_row + cols_t, db_acc_t, mask=tail_mask)
    else:
        # Wide rows, in tiles of ROWS rows x BLOCK columns: pass 1 reduces the two row sums,
        # pass 2 reads x and dy again (from L2) and writes dx; the column kernel sums dw and db
        # (the launcher passes ACC_DW and ACC_DB False). NUM_STAGES > 1 pipelines the loops over
        # blocks.
        for i in range(0, tl.cdiv(tl.cdiv(M, ROWS) - pid, num_programs)):
            rows, row_mask = tile_rows(pid + i * num_programs, M, ROWS)
            mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
            acc_g = tile_zeros(ROWS, BLOCK)
            acc_gx = tile_zeros(ROWS, BLOCK)
            for start in tl.range(0, N, BLOCK, num_stages=NUM_STAGES):
                block_cols, block_mask, offs, mask = row_block(rows, row_mask, cols, start, N, ROWS)
                x_raw, dy_raw = load_x_dy(x_ptr, dy_ptr, offs, mask, "")
                x_hat, dy, g = _bwd_terms(x_raw, dy_raw, w_ptr, block_cols, block_mask, cols, mean, rstd, True,
                                          HAS_WEIGHT, ROWS, FMA)  # fmt: skip
                acc_g += g
                acc_gx += g * x_hat
            sum_g, sum_gx = row_sums2(acc_g, acc_gx, ROWS)
            mean_g = sum_g / N
            mean_gx = sum_gx / N
            for start in tl.range(0, N, BLOCK, num_stages=NUM_STAGES):
                block_cols, block_mask, offs, mask = row_block(rows, row_mask, cols, start, N, ROWS)
                x_raw, dy_raw = load_x_dy(x_ptr, dy_ptr, offs, mask, "")
                x_hat, dy, g = _bwd_terms(x_raw, dy_raw, w_ptr, block_cols, block_mask, cols, mean, rstd, True,
                                          HAS_WEIGHT, ROWS, FMA)  # fmt: skip
                _bwd_store(dx_ptr, offs, mask, x_hat, dy, g, rstd, mean_g, mean_gx, acc_g, acc_gx, False, False,
                           SOFT_BF16, ROWS, FMA)  # fmt: skip


@triton.jit
def _layer_norm_dwdb_kernel(
    dy_ptr,
    x_ptr,
    mean_ptr,
    rstd_ptr,
    dw_partial_ptr,
    db_partial_ptr,
    M,
    N,
    rows_per_split,
    DW: tl.constexpr,
    DB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """The column kernel (the wide path's gradients): over the rows of range s (program_id(1)) and the
    columns of block program_id(0), dw_partial[s] = sum dy * x_hat (DW), db_partial[s] = sum dy
    (DB; reads neither x nor the statistics when alone)."""
    pdl_enter(PDL)
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
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if DW:
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
            dw_acc += dy * ((x - mean[:, None]) * rstd[:, None])
        if DB:
            db_acc += dy
    row = split.to(tl.int64) * N
    if DW:
        tl.store(dw_partial_ptr + row + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
    if DB:
        tl.store(db_partial_ptr + row + cols, tl.sum(db_acc, axis=0), mask=col_mask)


# --- launchers -------------------------------------------------------------------------------


def layer_norm_forward(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, cfg: FwdConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns y (x's shape and dtype, contiguous), mean and rstd (fp32, one per row), launched
    as cfg says."""
    N = x.shape[-1]
    x = x.contiguous()  # the kernels read rows of N elements from flat memory
    M = num_rows(x)
    y = empty(x.shape, x.dtype, x.device)
    mean = empty((M,), torch.float32, x.device)
    rstd = empty((M,), torch.float32, x.device)
    if M == 0:
        return y, mean, rstd
    rows = cfg.rows if cfg.single_block else 1
    with device_guard(x):
        launch(
            _layer_norm_fwd_kernel,
            (num_tiles(M, rows),),
            x,
            weight.contiguous() if weight is not None else x,  # x: placeholder, never read
            bias.contiguous() if bias is not None else x,
            y,
            mean,
            rstd,
            M,
            N,
            eps,
            HAS_WEIGHT=weight is not None,
            HAS_BIAS=bias is not None,
            ROWS=rows,
            BLOCK=cfg.block,
            SINGLE_BLOCK=cfg.single_block,
            HINTS=cfg.hints,
            SOFT_BF16=soft_bf16(x),
            N_CONST=const_n(cfg, N),
            num_warps=cfg.num_warps,
            **pdl(x),
        )
    return y, mean, rstd


def layer_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    bias_dtype: torch.dtype | None,
    cfg: BwdConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns dx, dw and db, launched as cfg says; dw is empty without weight, db is empty when
    bias_dtype is None."""
    N = x.shape[-1]
    x = x.contiguous()  # the kernels read rows of N elements from flat memory
    M = num_rows(x)
    dx = empty(x.shape, x.dtype, x.device)
    dw = empty((N,), weight.dtype, x.device) if weight is not None else x.new_empty((0,))
    db = empty((N,), bias_dtype, x.device) if bias_dtype is not None else x.new_empty((0,))
    if M == 0:
        return dx, dw.zero_(), db.zero_()
    rows = cfg.rows
    P = persistent_programs(num_tiles(M, rows), cfg.programs_per_sm, x.device)
    # The wide path leaves both gradient sums to the column kernel.
    acc_dw = weight is not None and cfg.single_block
    acc_db = bias_dtype is not None and cfg.single_block
    dw_partial = partial_buffer(P, N, x.device) if acc_dw else None
    db_partial = partial_buffer(P, N, x.device) if acc_db else None
    dy = dy.contiguous()
    with device_guard(x):
        apart_dw, apart_db = weight is not None and not acc_dw, bias_dtype is not None and not acc_db
        if apart_dw or apart_db:
            col = cfg.column
            S = column_splits(M, N, col, x.device)
            if apart_dw:
                dw_partial = partial_buffer(S, N, x.device)
            if apart_db:
                db_partial = partial_buffer(S, N, x.device)
            launch(
                _layer_norm_dwdb_kernel,
                (cdiv(N, col.block_n), S),
                dy,
                x,
                mean,
                rstd,
                dw_partial if apart_dw else rstd,  # placeholders, never touched
                db_partial if apart_db else rstd,
                M,
                N,
                cdiv(M, S),
                DW=apart_dw,
                DB=apart_db,
                BLOCK_M=col.block_m,
                BLOCK_N=col.block_n,
                num_warps=col.num_warps,
                **pdl(x),
            )
        launch(
            _layer_norm_bwd_kernel,
            (P,),
            dy,
            x,
            weight.contiguous() if weight is not None else x,  # placeholders, never touched
            mean,
            rstd,
            dx,
            dw_partial if acc_dw else rstd,
            db_partial if acc_db else rstd,
            M,
            N,
            HAS_WEIGHT=weight is not None,
            ACC_DW=acc_dw,
            ACC_DB=acc_db,
            ROWS=rows,
            BLOCK=cfg.block,
            TAIL=cfg.tail,
            PATH=cfg.path,
            RELOAD_W=cfg.reload_w,
            NUM_STAGES=pipeline_stages(cfg, x, weight, cdiv(num_tiles(M, rows), P)),
            SOFT_BF16=soft_bf16(x),
            N_CONST=const_n(cfg, N),
            RELOAD_X=reloads_x(cfg, x),
            PREFETCH=can_prefetch(cfg, x),
            FMA=cfg.fma,
            num_warps=cfg.num_warps,
            **pdl(x),
        )
        if dw_partial is not None and db_partial is not None:
            sum_partials(dw_partial, dw, cfg.sums, db_partial, db)  # one launch for both
        elif dw_partial is not None:
            sum_partials(dw_partial, dw, cfg.sums)
        elif db_partial is not None:
            sum_partials(db_partial, db, cfg.sums)
    return dx, dw, db


# The custom ops' bodies: the launch configurations of the device's tables (configs.tables_for).


def _layer_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cfg = fwd_config(tables_for(x.device).norms, "layer_norm", x.shape[-1])
    return layer_norm_forward(x, weight, bias, eps, cfg)


def _layer_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    bias_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cfg = bwd_config(tables_for(x.device).norms, "layer_norm", x.shape[-1])
    return layer_norm_backward(dy, x, weight, mean, rstd, bias_dtype, cfg)


# --- torch.library ops -----------------------------------------------------------------------

layer_norm_fwd = torch.library.custom_op("lmkernels::layer_norm_fwd", _layer_norm_fwd, mutates_args=())
layer_norm_bwd = torch.library.custom_op("lmkernels::layer_norm_bwd", _layer_norm_bwd, mutates_args=())


@layer_norm_fwd.register_fake
def _(x, weight, bias, eps):
    stats = (num_rows(x),)
    return (
        x.new_empty(x.shape),
        x.new_empty(stats, dtype=torch.float32),
        x.new_empty(stats, dtype=torch.float32),
    )


@layer_norm_bwd.register_fake
def _(dy, x, weight, mean, rstd, bias_dtype):
    N = x.shape[-1]
    dw = x.new_empty((0,)) if weight is None else x.new_empty((N,), dtype=weight.dtype)
    db = x.new_empty((0,)) if bias_dtype is None else x.new_empty((N,), dtype=bias_dtype)
    return x.new_empty(x.shape), dw, db


# --- autograd ----------------------------------------------------------------------------------


def _setup_context(ctx, inputs, output):
    x, weight, bias, eps = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.bias_dtype = bias.dtype if bias is not None else None
    # No zero gradients for mean and rstd, which the backward never reads (an allocation and a
    # fill kernel each per backward otherwise).
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, dmean, drstd):
    if dy is None:  # y got no gradient
        return None, None, None, None
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = _run_bwd(dy, x, weight, mean, rstd, ctx.bias_dtype)
    return (
        dx if ctx.needs_input_grad[0] else None,
        dw if weight is not None and ctx.needs_input_grad[1] else None,
        db if ctx.bias_dtype is not None and ctx.needs_input_grad[2] else None,
        None,
    )


_run_bwd = op_or_raw(layer_norm_bwd, _layer_norm_bwd, "layer_norm")
layer_norm_fwd.register_autograd(_backward, setup_context=_setup_context)
_LayerNormFunction = eager_function("_LayerNormFunction", _layer_norm_fwd, _setup_context, _backward)


# --- the impl ----------------------------------------------------------------------------------


def layer_norm_triton(x, weight=None, bias=None, eps=1e-5):
    y, _, _ = call(layer_norm_fwd, _LayerNormFunction, x, weight, bias, float(eps))
    return y


register(
    "layer_norm",
    "triton",
    layer_norm_triton,
    priority=100,
    devices=triton_devices(),
    auto_devices=("cuda",),
    available=triton_unavailable_reason,
    supports=row_limit_reasons,
    description="Triton: row tiles forward, persistent backward with fp32 dw/db partials",
)
