"""The launchers of the norm kernel family (_norm_kernels.py), shared by RMSNorm and
LayerNorm: a norm's configuration (FwdConfig, BwdConfig) in, its kernels launched."""

from __future__ import annotations

import torch

from lmkernels.backends.triton._common import cdiv, device_guard, pdl, soft_bf16
from lmkernels.backends.triton._launch import launch
from lmkernels.backends.triton._norm_kernels import _norm_bwd_kernel, _norm_col_kernel, _norm_fwd_kernel
from lmkernels.backends.triton._norms import (
    BwdConfig,
    FwdConfig,
    can_prefetch,
    column_splits,
    const_n,
    holds_x,
    num_rows,
    num_tiles,
    partial_buffer,
    persistent_programs,
    pipeline_stages,
    reloads_x,
    sum_partials,
)
from lmkernels.utils import empty


def _or(t: torch.Tensor | None, placeholder: torch.Tensor) -> torch.Tensor:
    """t (contiguous), or a pointer the kernel never reads where there is no t."""
    return t.contiguous() if t is not None else placeholder


def norm_forward(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    offset: float | None,
    mode: int,
    has_mean: bool,
    cfg: FwdConfig,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Returns y (x's shape and dtype, contiguous), mean (LayerNorm, has_mean; else None) and
    rstd (fp32, one per row), launched as cfg says. RMSNorm: bias None, offset a float;
    LayerNorm: offset None."""
    N = x.shape[-1]
    x = x.contiguous()  # the kernels read rows of N elements from flat memory
    M = num_rows(x)
    y = empty(x.shape, x.dtype, x.device)
    mean = empty((M,), torch.float32, x.device) if has_mean else None
    rstd = empty((M,), torch.float32, x.device)
    if M == 0:
        return y, mean, rstd
    rows = cfg.rows if cfg.single_block else 1
    with device_guard(x):
        launch(
            _norm_fwd_kernel,
            (num_tiles(M, rows),),
            x,
            _or(weight, x),
            _or(bias, x) if has_mean else None,
            y,
            mean,
            rstd,
            M,
            N,
            eps,
            offset,
            MODE=mode,
            HAS_MEAN=has_mean,
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


def norm_backward_into(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    offset: float | None,
    mode: int,
    bias_dtype: torch.dtype | None,
    dx: torch.Tensor,
    cfg: BwdConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Writes dx and returns dw and db, launched as cfg says; dw is empty without weight, db
    is empty when bias_dtype is None. mean: LayerNorm's (None: RMSNorm). dx is contiguous and
    may be dy itself (in-place backward)."""
    has_mean = mean is not None
    N = x.shape[-1]
    x = x.contiguous()  # the kernels read rows of N elements from flat memory
    dy = dy.contiguous()
    M = num_rows(x)
    dw = empty((N,), weight.dtype, x.device) if weight is not None else x.new_empty((0,))
    db = empty((N,), bias_dtype, x.device) if bias_dtype is not None else x.new_empty((0,))
    if M == 0:
        return dw.zero_(), db.zero_()
    rows = cfg.rows
    P = persistent_programs(num_tiles(M, rows), cfg.programs_per_sm, x.device)
    # The wide path leaves every gradient sum to the column kernel.
    acc_dw = weight is not None and cfg.single_block
    acc_db = bias_dtype is not None and cfg.single_block
    dw_partial = partial_buffer(P, N, x.device) if acc_dw else None
    db_partial = partial_buffer(P, N, x.device) if acc_db else None
    with device_guard(x):
        apart_dw, apart_db = weight is not None and not acc_dw, bias_dtype is not None and not acc_db
        if apart_dw or apart_db:
            # First: the backward kernel may write dx over dy.
            col = cfg.column
            S = column_splits(M, N, col, x.device)
            if apart_dw:
                dw_partial = partial_buffer(S, N, x.device)
            if apart_db:
                db_partial = partial_buffer(S, N, x.device)
            launch(
                _norm_col_kernel,
                (cdiv(N, col.block_n), S),
                dy,
                x,
                mean,
                rstd,
                dw_partial if apart_dw else rstd,  # placeholders, never touched
                (db_partial if apart_db else rstd) if has_mean else None,
                M,
                N,
                cdiv(M, S),
                MODE=mode,
                HAS_MEAN=has_mean,
                DW=apart_dw,
                DB=apart_db,
                BLOCK_M=col.block_m,
                BLOCK_N=col.block_n,
                SOFT_BF16=soft_bf16(x),
                num_warps=col.num_warps,
                **pdl(x),
            )
        launch(
            _norm_bwd_kernel,
            (P,),
            dy,
            x,
            _or(weight, x),
            mean,
            rstd,
            dx,
            dw_partial if acc_dw else rstd,  # placeholders, never touched
            (db_partial if acc_db else rstd) if has_mean else None,
            M,
            N,
            offset,
            MODE=mode,
            HAS_MEAN=has_mean,
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
            HOLD_X=holds_x(cfg, x),
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
    return dw, db
