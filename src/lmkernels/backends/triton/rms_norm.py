"""RMSNorm in Triton: forward and backward kernels, launchers, torch.library ops, registration.

Semantics are those of `lmkernels.ops.rms_norm.rms_norm_reference`, casting modes included:
"llama" rounds the normalized row to x.dtype before the weight multiply, "gemma" rounds once at
the end, "none" rounds after every step as eager PyTorch does in x.dtype (emulated in-kernel).

The work is laid out as _norms.py describes: a tile of rows per program forward, a persistent
backward that sums the weight-gradient partials in fp32 (registers, or memory for wide rows).
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
    holds_x,
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
    round_as,
    row_block,
    row_limit_reasons,
    row_sums,
    sum_partials,
    tile_block,
    tile_rows,
    tile_zeros,
    to_dtype,
    widen,
)
from lmkernels.backends.triton.configs import tables_for
from lmkernels.registry.core import register
from lmkernels.utils import empty

_MODES = {"llama": 0, "gemma": 1, "none": 2}  # casting_mode -> MODE of the kernels
GEMMA: tl.constexpr = tl.constexpr(1)
NONE: tl.constexpr = tl.constexpr(2)
WIDE: tl.constexpr = tl.constexpr(PATH_WIDE)


# --- RMSNorm kernels ---------------------------------------------------------------------------


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
    """weight + offset, as the reference forms it (in x.dtype for "none", else fp32)."""
    if MODE == NONE:
        return round_as(round_as(w, dtype, SOFT_BF16) + offset, dtype, SOFT_BF16)
    return w + offset


@triton.jit
def _normalized(x, rstd, MODE: tl.constexpr, dtype: tl.constexpr, SOFT_BF16: tl.constexpr):
    """x * rstd as the weight multiply sees it: rounded to x.dtype except in "gemma" mode."""
    if MODE == GEMMA:
        return x * rstd
    return round_as(x * rstd, dtype, SOFT_BF16)


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    rstd_ptr,
    M,
    N,
    eps,
    offset,
    MODE: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
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
        rstd = _rstd(row_sums(_square(x, MODE, dtype, SOFT_BF16), ROWS), N, eps, MODE, dtype, SOFT_BF16)
        y = _normalized(x, per_row(rstd, ROWS), MODE, dtype, SOFT_BF16)
        if HAS_WEIGHT:
            w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            y = y * per_col(_weight_factor(w, offset, MODE, dtype, SOFT_BF16), ROWS)
        tl.store(y_ptr + offs, to_dtype(y, dtype, SOFT_BF16), mask=mask)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)
    else:
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * N
        y_row = y_ptr + row * N
        acc = tl.zeros([BLOCK], tl.float32)
        # The passes over the row's chunks are not software-pipelined (num_stages=1).
        for start in tl.range(0, N, BLOCK, num_stages=1):
            mask = start + cols < N
            x = load_block(x_row + start + cols, mask, HINTS, True)
            acc += _square(x, MODE, dtype, SOFT_BF16)
        rstd = _rstd(tl.sum(acc, axis=0), N, eps, MODE, dtype, SOFT_BF16)
        for start in tl.range(0, N, BLOCK, num_stages=1):
            mask = start + cols < N
            x = load_block(x_row + start + cols, mask, HINTS, False)
            y = _normalized(x, rstd, MODE, dtype, SOFT_BF16)
            if HAS_WEIGHT:
                w = tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
                y = y * _weight_factor(w, offset, MODE, dtype, SOFT_BF16)
            tl.store(y_row + start + cols, to_dtype(y, dtype, SOFT_BF16), mask=mask)
        tl.store(rstd_ptr + row, rstd)


@triton.jit
def _bwd_terms(x, dy, w_ptr, cols, col_mask, w_factor, offset, RELOAD_W: tl.constexpr, MODE: tl.constexpr,
               HAS_WEIGHT: tl.constexpr, dtype: tl.constexpr, SOFT_BF16: tl.constexpr, ROWS: tl.constexpr,
               AGAIN: tl.constexpr):  # fmt: skip
    """x, dy and g = dy * (w + offset) in fp32 from a block as loaded. AGAIN: the block's
    second widening (widen)."""
    x = widen(x, AGAIN)
    dy = widen(dy, AGAIN)
    g = dy
    if HAS_WEIGHT:
        if RELOAD_W:  # reloaded (an L1 hit) rather than held in registers
            w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            w_factor = _weight_factor(w, offset, MODE, dtype, SOFT_BF16)
        g = dy * per_col(w_factor, ROWS)
    return x, dy, g


@triton.jit
def _bwd_store(dx_ptr, offs, mask, x, dy, g, rstd, scale, dw_acc, ACC: tl.constexpr, MODE: tl.constexpr,
               SOFT_BF16: tl.constexpr, ROWS: tl.constexpr):  # fmt: skip
    """Writes dx of one register block and adds its dw contribution to dw_acc (ACC); returns
    dw_acc."""
    dtype = dx_ptr.dtype.element_ty
    dx = (g - x * per_row(scale, ROWS)) * per_row(rstd, ROWS)
    tl.store(dx_ptr + offs, to_dtype(dx, dtype, SOFT_BF16), mask=mask)
    if ACC:
        # Rows past M have dy = 0: they add nothing.
        dw_acc += col_sums(dy * _normalized(x, per_row(rstd, ROWS), MODE, dtype, SOFT_BF16), ROWS)
    return dw_acc


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    rstd_ptr,
    dx_ptr,
    dw_partial_ptr,
    M,
    N,
    offset,
    MODE: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    ACC: tl.constexpr,
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
    PDL: tl.constexpr = False,
):
    """dx = rstd * (g - x * rstd^2 * mean(g * x)) with g = dy * (w + offset); dw = sum dy * x_hat.

    Program pid handles row tiles pid, pid + P, ... (ROWS rows each; one row on the wide path)
    and, when ACC (a weight whose gradient is not left to the column kernel), writes row pid of
    dw_partial (P x N, fp32), P <= the number of tiles. On the single-block path a row is
    columns [0, BLOCK) and, when TAIL > 0, [BLOCK, BLOCK + TAIL): two register blocks.
    dx_ptr may equal dy_ptr (in-place backward): every element of dy is read before the dx
    element at the same address is written, by the same program. RELOAD_X: x and dy are read
    again (L1 / L2 hits) after the row sum, one register block at a time, instead of being
    held (fewer registers per thread; a block is read again before its own dx is written).
    HOLD_X: x and dy are held as loaded (bf16) across the row sum and widened again (widen).
    PREFETCH: right after a tile's first loads are issued, L2 is asked for the
    program's next tile (prefetch_tile).
    """
    pdl_enter(PDL)
    if N_CONST > 0:  # the row width as a compile-time constant (const_n)
        N = N_CONST
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    dtype = dx_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    partial_row = dw_partial_ptr + pid.to(tl.int64) * N
    if PATH != WIDE:
        col_mask = cols < N
        w_factor = tl.zeros([BLOCK], tl.float32)
        if HAS_WEIGHT and not RELOAD_W:
            w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            w_factor = _weight_factor(w, offset, MODE, dtype, SOFT_BF16)
        dw_acc = tl.zeros([BLOCK], tl.float32)
        if TAIL > 0:
            cols_t = BLOCK + tl.arange(0, TAIL)
            tail_mask = cols_t < N
            w_factor_t = tl.zeros([TAIL], tl.float32)
            if HAS_WEIGHT and not RELOAD_W:
                w = tl.load(w_ptr + cols_t, mask=tail_mask, other=0.0).to(tl.float32)
                w_factor_t = _weight_factor(w, offset, MODE, dtype, SOFT_BF16)
            dw_acc_t = tl.zeros([TAIL], tl.float32)
        # NUM_STAGES > 1: the next tiles' loads are issued while this one is computed.
        for i in tl.range(0, tl.cdiv(tl.cdiv(M, ROWS) - pid, num_programs), num_stages=NUM_STAGES):
            rows, row_mask = tile_rows(pid + i * num_programs, M, ROWS)
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
            offs, mask = tile_block(rows, row_mask, cols, col_mask, N, ROWS)
            first: tl.constexpr = "evict_last" if RELOAD_X else ""
            x_raw, dy_raw = load_x_dy(x_ptr, dy_ptr, offs, mask, first)
            x, dy, g = _bwd_terms(x_raw, dy_raw, w_ptr, cols, col_mask, w_factor, offset, RELOAD_W, MODE,
                                  HAS_WEIGHT, dtype, SOFT_BF16, ROWS, False)  # fmt: skip
            if PREFETCH:  # the next tile, while this one's loads are in flight
                prefetch_tile(x_ptr, dy_ptr, pid + (i + 1) * num_programs, M, N, ROWS)
            dot = row_sums(g * x, ROWS)
            if TAIL > 0:
                offs_t, mask_t = tile_block(rows, row_mask, cols_t, tail_mask, N, ROWS)
                x_raw_t, dy_raw_t = load_x_dy(x_ptr, dy_ptr, offs_t, mask_t, first)
                x_t, dy_t, g_t = _bwd_terms(x_raw_t, dy_raw_t, w_ptr, cols_t, tail_mask, w_factor_t, offset,
                                            RELOAD_W, MODE, HAS_WEIGHT, dtype, SOFT_BF16, ROWS, False)  # fmt: skip
                dot += row_sums(g_t * x_t, ROWS)
            scale = rstd * rstd * dot / N
            if RELOAD_X:  # another eviction policy: the compiler does not merge the two loads
                x_raw, dy_raw = load_x_dy(x_ptr, dy_ptr, offs, mask, "evict_first")
            if RELOAD_X or HOLD_X:
                x, dy, g = _bwd_terms(x_raw, dy_raw, w_ptr, cols, col_mask, w_factor, offset, RELOAD_W, MODE,
                                      HAS_WEIGHT, dtype, SOFT_BF16, ROWS, HOLD_X)  # fmt: skip
            dw_acc = _bwd_store(dx_ptr, offs, mask, x, dy, g, rstd, scale, dw_acc, ACC, MODE, SOFT_BF16, ROWS)
            if TAIL > 0:
                if RELOAD_X:
                    x_raw_t, dy_raw_t = load_x_dy(x_ptr, dy_ptr, offs_t, mask_t, "evict_first")
                if RELOAD_X or HOLD_X:
                    x_t, dy_t, g_t = _bwd_terms(x_raw_t, dy_raw_t, w_ptr, cols_t, tail_mask, w_factor_t, offset,
                                                RELOAD_W, MODE, HAS_WEIGHT, dtype, SOFT_BF16, ROWS, HOLD_X)  # fmt: skip
                dw_acc_t = _bwd_store(dx_ptr, offs_t, mask_t, x_t, dy_t, g_t, rstd, scale, dw_acc_t, ACC, MODE,
                                      SOFT_BF16, ROWS)  # fmt: skip
        if ACC:
            tl.store(partial_row + cols, dw_acc, mask=col_mask)
            if TAIL > 0:
                tl.store(partial_row + cols_t, dw_acc_t, mask=tail_mask)
    else:
        # Wide rows, in tiles of ROWS rows x BLOCK columns: pass 1 reduces g * x over the rows,
        # pass 2 reads x and dy again (from L2) and writes dx; the column kernel sums dw (the
        # launcher passes ACC False). NUM_STAGES > 1 pipelines the loops over blocks.
        for i in range(0, tl.cdiv(tl.cdiv(M, ROWS) - pid, num_programs)):
            rows, row_mask = tile_rows(pid + i * num_programs, M, ROWS)
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
            acc = tile_zeros(ROWS, BLOCK)
            for start in tl.range(0, N, BLOCK, num_stages=NUM_STAGES):
                block_cols, block_mask, offs, mask = row_block(rows, row_mask, cols, start, N, ROWS)
                x_raw, dy_raw = load_x_dy(x_ptr, dy_ptr, offs, mask, "")
                x, dy, g = _bwd_terms(x_raw, dy_raw, w_ptr, block_cols, block_mask, cols, offset, True, MODE,
                                      HAS_WEIGHT, dtype, SOFT_BF16, ROWS, False)  # fmt: skip
                acc += g * x
            scale = rstd * rstd * row_sums(acc, ROWS) / N
            for start in tl.range(0, N, BLOCK, num_stages=NUM_STAGES):
                block_cols, block_mask, offs, mask = row_block(rows, row_mask, cols, start, N, ROWS)
                x_raw, dy_raw = load_x_dy(x_ptr, dy_ptr, offs, mask, "")
                x, dy, g = _bwd_terms(x_raw, dy_raw, w_ptr, block_cols, block_mask, cols, offset, True, MODE,
                                      HAS_WEIGHT, dtype, SOFT_BF16, ROWS, False)  # fmt: skip
                _bwd_store(dx_ptr, offs, mask, x, dy, g, rstd, scale, acc, False, MODE, SOFT_BF16, ROWS)


@triton.jit
def _rms_norm_dw_kernel(
    dy_ptr,
    x_ptr,
    rstd_ptr,
    partial_ptr,
    M,
    N,
    rows_per_split,
    MODE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SOFT_BF16: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """The column kernel (the wide path's dw): partial[s, c] = sum of dy * x_hat over the rows of range s
    (program_id(1)) in the columns of block program_id(0); x_hat as the weight multiply sees it."""
    pdl_enter(PDL)
    dtype = x_ptr.dtype.element_ty
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    split = tl.program_id(1)
    start = split * rows_per_split
    end = tl.minimum(M, start + rows_per_split)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for first in range(start, end, BLOCK_M):
        rows = first + tl.arange(0, BLOCK_M)
        row_mask = rows < end
        mask = row_mask[:, None] & col_mask[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        acc += dy * _normalized(x, rstd[:, None], MODE, dtype, SOFT_BF16)
    tl.store(partial_ptr + split.to(tl.int64) * N + cols, tl.sum(acc, axis=0), mask=col_mask)


# --- launchers -------------------------------------------------------------------------------


def rms_norm_forward(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, casting_mode: str, cfg: FwdConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns y (x's shape and dtype, contiguous) and rstd (fp32, one per row), launched as cfg
    says."""
    N = x.shape[-1]
    x = x.contiguous()  # the kernels read rows of N elements from flat memory
    M = num_rows(x)
    y = empty(x.shape, x.dtype, x.device)
    rstd = empty((M,), torch.float32, x.device)
    if M == 0:
        return y, rstd
    rows = cfg.rows if cfg.single_block else 1
    with device_guard(x):
        launch(
            _rms_norm_fwd_kernel,
            (num_tiles(M, rows),),
            x,
            weight.contiguous() if weight is not None else x,  # x: placeholder, never read
            y,
            rstd,
            M,
            N,
            eps,
            offset,
            MODE=_MODES[casting_mode],
            HAS_WEIGHT=weight is not None,
            ROWS=rows,
            BLOCK=cfg.block,
            SINGLE_BLOCK=cfg.single_block,
            HINTS=cfg.hints,
            SOFT_BF16=soft_bf16(x),
            N_CONST=const_n(cfg, N),
            num_warps=cfg.num_warps,
            **pdl(x),
        )
    return y, rstd


def rms_norm_backward_into(dy, x, weight, rstd, offset, casting_mode, dx, cfg: BwdConfig) -> torch.Tensor:
    """Writes dx and returns dw (empty when weight is None), launched as cfg says. dy and dx are
    contiguous; dx may be dy itself (in-place backward)."""
    N = x.shape[-1]
    x = x.contiguous()  # the kernels read rows of N elements from flat memory
    M = num_rows(x)
    dw = empty((N,), weight.dtype, x.device) if weight is not None else x.new_empty((0,))
    if M == 0:
        return dw.zero_()
    rows = cfg.rows
    P = persistent_programs(num_tiles(M, rows), cfg.programs_per_sm, x.device)
    acc = weight is not None and cfg.single_block  # the wide path leaves dw to the column kernel
    partial = partial_buffer(P, N, x.device) if acc else None
    with device_guard(x):
        if weight is not None and not acc:
            # First: the backward kernel may write dx over dy.
            partial = _dw_apart(dy, x, rstd, casting_mode, cfg)
        launch(
            _rms_norm_bwd_kernel,
            (P,),
            dy,
            x,
            weight.contiguous() if weight is not None else x,  # placeholders when no weight
            rstd,
            dx,
            partial if acc else rstd,
            M,
            N,
            offset,
            MODE=_MODES[casting_mode],
            HAS_WEIGHT=weight is not None,
            ACC=acc,
            ROWS=rows,
            BLOCK=cfg.block,
            TAIL=cfg.tail,
            PATH=cfg.path,
            RELOAD_W=cfg.reload_w,
            NUM_STAGES=pipeline_stages(cfg, x, weight, cdiv(num_tiles(M, rows), P)),
            SOFT_BF16=soft_bf16(x),
            N_CONST=const_n(cfg, N),
            RELOAD_X=reloads_x(cfg, x),
            HOLD_X=holds_x(cfg, x),
            PREFETCH=can_prefetch(cfg, x),
            num_warps=cfg.num_warps,
            **pdl(x),
        )
        if partial is not None:
            sum_partials(partial, dw, cfg.sums)
    return dw


def _dw_apart(dy, x, rstd, casting_mode, cfg: BwdConfig) -> torch.Tensor:
    """The dw partials (S x N, fp32) from the column kernel: S ranges of rows."""
    M, N = num_rows(x), x.shape[-1]
    col = cfg.column
    S = column_splits(M, N, col, x.device)
    partial = partial_buffer(S, N, x.device)
    launch(
        _rms_norm_dw_kernel,
        (cdiv(N, col.block_n), S),
        dy,
        x,
        rstd,
        partial,
        M,
        N,
        cdiv(M, S),
        MODE=_MODES[casting_mode],
        BLOCK_M=col.block_m,
        BLOCK_N=col.block_n,
        SOFT_BF16=soft_bf16(x),
        num_warps=col.num_warps,
        **pdl(x),
    )
    return partial


def rms_norm_backward(
    dy, x, weight, rstd, offset, casting_mode, cfg: BwdConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns dx (x's shape and dtype) and dw (empty when weight is None), launched as cfg says."""
    dx = empty(x.shape, x.dtype, x.device)
    dw = rms_norm_backward_into(dy.contiguous(), x, weight, rstd, offset, casting_mode, dx, cfg)
    return dx, dw


# The custom ops' bodies: the launch configurations of the device's tables (configs.tables_for).


def _rms_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, casting_mode: str
) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = fwd_config(tables_for(x.device).norms, "rms_norm", x.shape[-1])
    return rms_norm_forward(x, weight, eps, offset, casting_mode, cfg)


def _rms_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    offset: float,
    casting_mode: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = bwd_config(tables_for(x.device).norms, "rms_norm", x.shape[-1])
    return rms_norm_backward(dy, x, weight, rstd, offset, casting_mode, cfg)


# --- torch.library ops -----------------------------------------------------------------------

rms_norm_fwd = torch.library.custom_op("lmkernels::rms_norm_fwd", _rms_norm_fwd, mutates_args=())
rms_norm_bwd = torch.library.custom_op("lmkernels::rms_norm_bwd", _rms_norm_bwd, mutates_args=())


@rms_norm_fwd.register_fake
def _(x, weight, eps, offset, casting_mode):
    return x.new_empty(x.shape), x.new_empty((num_rows(x),), dtype=torch.float32)


@rms_norm_bwd.register_fake
def _(dy, x, weight, rstd, offset, casting_mode):
    dw_shape = (0,) if weight is None else weight.shape
    dw_dtype = x.dtype if weight is None else weight.dtype
    return x.new_empty(x.shape), x.new_empty(dw_shape, dtype=dw_dtype)


# --- autograd ----------------------------------------------------------------------------------


def _setup_context(ctx, inputs, output):
    x, weight, eps, offset, casting_mode = inputs
    _, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(x, weight, rstd)
    ctx.offset = offset
    ctx.casting_mode = casting_mode
    # Autograd would materialize a zero gradient for rstd (an allocation and a fill kernel per
    # backward) that nothing reads.
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, drstd):
    if dy is None:  # y got no gradient (grads are not materialized)
        return None, None, None, None, None
    x, weight, rstd = ctx.saved_tensors
    args = (x, weight, rstd, ctx.offset, ctx.casting_mode)
    dx, dw = _run_bwd(dy, *args)
    dx = dx if ctx.needs_input_grad[0] else None
    dw = dw if weight is not None and ctx.needs_input_grad[1] else None
    return dx, dw, None, None, None


_run_bwd = op_or_raw(rms_norm_bwd, _rms_norm_bwd, "rms_norm")
rms_norm_fwd.register_autograd(_backward, setup_context=_setup_context)
_RMSNormFunction = eager_function("_RMSNormFunction", _rms_norm_fwd, _setup_context, _backward)


# --- the impl ----------------------------------------------------------------------------------


def rms_norm_triton(x, weight=None, eps=1e-6, offset=0.0, casting_mode="llama"):
    y, _ = call(rms_norm_fwd, _RMSNormFunction, x, weight, float(eps), float(offset), casting_mode)
    return y


register(
    "rms_norm",
    "triton",
    rms_norm_triton,
    priority=100,
    devices=triton_devices(),
    auto_devices=("cuda",),
    available=triton_unavailable_reason,
    supports=row_limit_reasons,
    description="Triton: row tiles forward, persistent backward with fp32 dw partials",
)
