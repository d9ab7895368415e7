"""RMSNorm and LayerNorm in Triton, host side: launch configurations from the device's tables
(configs.tables_for), the launchers of the norm kernel family (norm_kernels.py), and each norm's
torch.library ops, autograd and registration.

Semantics: `lmkernels.ops.rms_norm.rms_norm_reference` (casting modes: the kernels' MODE) and
`lmkernels.ops.layer_norm.layer_norm_reference` (fp32 math, one rounding of y; weight and bias
optional and independent).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import triton

from lmkernels.backends.triton import triton_devices, triton_unavailable_reason
from lmkernels.backends.triton.common import (
    call,
    cdiv,
    device_guard,
    eager_function,
    gpu_capabilities,
    launch,
    op_or_raw,
    pdl,
    refuse_nested_jvp,
    soft_bf16,
    target_ptx,
    transforms_function,
    vmap_over_rows,
)
from lmkernels.backends.triton.configs import tables_for
from lmkernels.backends.triton.configs import targets as _targets
from lmkernels.backends.triton.configs.generic import SHARED_MARGIN as SHARED_MARGIN
from lmkernels.backends.triton.configs.generic import fit_stages, norm_stage_bytes
from lmkernels.backends.triton.configs.records import PATH_REGS as PATH_REGS
from lmkernels.backends.triton.configs.records import PATH_WIDE as PATH_WIDE
from lmkernels.backends.triton.configs.records import BwdConfig as BwdConfig
from lmkernels.backends.triton.configs.records import ColumnConfig, NormTable, SumConfig
from lmkernels.backends.triton.configs.records import FwdConfig as FwdConfig
from lmkernels.backends.triton.norm_kernels import (
    LAYER_NORM_MODE,
    MODES,
    _norm_bwd_kernel,
    _norm_col_kernel,
    _norm_fwd_kernel,
    _sum_partials_kernel,
)
from lmkernels.registry.core import register
from lmkernels.types import CastingMode
from lmkernels.utils import empty

# Programs of the backward under the CPU interpreter: few, so each one loops over several tiles.
INTERPRETER_PROGRAMS = 3


# --- launcher helpers --------------------------------------------------------------------------


def _default_warps(elements: int, per_thread: int, cap: int) -> int:
    return min(cap, max(1, triton.next_power_of_2(max(1, elements // (32 * per_thread)))))


# Cached per table (tables are immutable and hashed by identity): the host cost of a launch.
@functools.cache
def fwd_config(table: NormTable, op: str, N: int) -> FwdConfig:
    """The forward's launch for rows of N columns, from `table` (configs.tables_for)."""
    if N > table.max_fused_n:
        return FwdConfig(1, table.wide.block, False, table.wide.fwd_warps, hints=True)
    block = triton.next_power_of_2(N)
    t = table.entry(op, N)
    if t is not None:
        if t.fwd_chunk:
            return FwdConfig(1, t.fwd_chunk, False, t.fwd_warps, t.hints, const_n=t.const_n)
        return FwdConfig(t.fwd_rows, block, True, t.fwd_warps, const_n=t.const_n)
    # Narrow rows (below the table): several rows per program, about 16 elements per thread.
    rows = max(1, 1024 // block)
    return FwdConfig(rows, block, True, _default_warps(rows * block, 16, 16))


@functools.cache
def bwd_config(table: NormTable, op: str, N: int) -> BwdConfig:
    """The backward's launch for rows of N columns, from `table` (configs.tables_for)."""
    shared: dict[str, Any] = dict(column=table.column, sums=table.sums)
    if N > table.max_fused_n:
        wide = table.wide
        return BwdConfig(
            1, wide.block, PATH_WIDE, wide.bwd_warps, wide.programs_per_sm, stages=wide.stages, **shared
        )
    block = triton.next_power_of_2(N)
    t = table.entry(op, N)
    if t is not None:
        tail = 0
        if t.tail:  # two register blocks: the largest power of two <= N, then the rest
            block //= 2
            tail = triton.next_power_of_2(N - block)
        return BwdConfig(1, block, PATH_REGS, t.bwd_warps, t.programs_per_sm, reload_w=t.reload_w, tail=tail,
                         stages=t.stages, const_n=t.const_n, reload_x=t.reload_x, prefetch=t.prefetch,
                         hold_x=t.hold_x, fma=t.fma, **shared)  # fmt: skip
    rows = max(1, 1024 // block)
    num_warps = _default_warps(rows * block, 8, 16)
    return BwdConfig(rows, block, PATH_REGS, num_warps, max(1, 32 // num_warps), **shared)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _max_shared_bytes(device_index: int) -> int:
    return triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"]


def pipeline_stages(cfg: BwdConfig, x: torch.Tensor, weight: torch.Tensor | None, iterations: int = 2) -> int:
    """cfg.stages, lowered until the pipeline buffers fit the device's shared memory (under
    targets.simulate: the simulated target's); 1 where each program's loop over row tiles runs
    once (`iterations`): nothing to overlap there, and the pipeline's copies through shared
    memory only add to the one pass.

    Triton keeps stages - 1 copies of a loop iteration's pipelined loads in shared memory: x and
    dy, and the weight where it is reloaded per tile (generic.norm_stage_bytes). The table's
    stages fit bf16 rows on its GPU (Hopper's: 227 KiB per block); fp32 inputs need twice the
    bytes, and other GPUs have less (A100 163 KiB, consumer parts 99 KiB), where the table's
    stages would fail to launch."""
    simulation = _targets.ACTIVE
    if cfg.stages <= 1 or (x.device.type != "cuda" and simulation is None):
        return cfg.stages
    if iterations <= 1:
        return 1
    if simulation is not None:
        limit = simulation.target.shared_per_block
    else:
        limit = _max_shared_bytes(_device_index(x.device))
    reload_w = cfg.reload_w or cfg.path != PATH_REGS
    w_bytes = weight.element_size() if weight is not None and reload_w else 0
    return _fit_stages(cfg, x.element_size(), w_bytes, reloads_x(cfg, x), limit)


@functools.cache
def _fit_stages(cfg: BwdConfig, x_bytes: int, w_bytes: int, reload_x: bool, shared_per_block: int) -> int:
    # reload_x (reloads_x: cfg.reload_x unless the row is held as loaded): the second reads of x
    # and dy are pipelined as well, with buffers of their own.
    stage = norm_stage_bytes(cfg.rows, cfg.block + cfg.tail, x_bytes, w_bytes, reload_x)
    return fit_stages(cfg.stages, stage, shared_per_block)


def holds_x(cfg: BwdConfig, x: torch.Tensor) -> bool:
    """The backward kernel's HOLD_X: cfg.hold_x for bf16 inputs, whose second widening is a
    shift (widen); other dtypes keep the entry's reload_x or fp32 registers."""
    return cfg.hold_x and x.dtype == torch.bfloat16


def reloads_x(cfg: BwdConfig, x: torch.Tensor) -> bool:
    """The backward kernel's RELOAD_X: cfg.reload_x, unless it holds x as loaded instead."""
    return cfg.reload_x and not holds_x(cfg, x)


def can_prefetch(cfg: BwdConfig, x: torch.Tensor) -> bool:
    """The backward kernel's PREFETCH: cfg.prefetch on NVIDIA devices of sm_90 and later (and
    targets, under targets.simulate); never in the interpreter or on ROCm, which run no PTX."""
    return cfg.prefetch and target_ptx(x)


def persistent_programs(tiles: int, programs_per_sm: int, device: torch.device) -> int:
    """Number of programs of a persistent kernel: enough to fill the GPU, at most one per tile."""
    if device.type == "cuda":
        programs = _sm_count(_device_index(device)) * programs_per_sm
    else:
        programs = INTERPRETER_PROGRAMS
    return max(1, min(tiles, programs))


def partial_buffer(P: int, N: int, device: torch.device) -> torch.Tensor:
    """A P x N fp32 buffer of weight-gradient partials. Every path writes each partial row in
    full (the memory paths store on their first tile, then add), so it needs no zeroing: under
    the harness it starts as NaN, and a row left out fails."""
    return empty((P, N), torch.float32, device)


def column_splits(M: int, N: int, column: ColumnConfig, device: torch.device) -> int:
    """Row ranges of a column kernel: about column.programs_per_sm programs per SM in all, each
    range at least column.block_m rows. Each range writes one partial row."""
    if device.type == "cuda":
        target = _sm_count(_device_index(device)) * column.programs_per_sm
    else:
        target = INTERPRETER_PROGRAMS
    return max(1, min(cdiv(M, column.block_m), cdiv(target, cdiv(N, column.block_n))))


def sum_partials(
    partial: torch.Tensor,
    out: torch.Tensor,
    sums: SumConfig,
    partial2: torch.Tensor | None = None,
    out2: torch.Tensor | None = None,
) -> None:
    """out (1-D, any float dtype) = partial.sum(0), with one fp32 accumulation per column; and
    the same for (partial2, out2) in the same launch when given (its own number of rows)."""
    P, N = partial.shape
    second = partial2 is not None
    launch(
        _sum_partials_kernel,
        (cdiv(N, sums.block_n), 2 if second else 1),
        partial,
        out,
        partial2 if second else partial,
        out2 if second else out,
        P,
        partial2.shape[0] if partial2 is not None else P,
        N,
        SOFT_BF16=soft_bf16(out),
        BLOCK_P=sums.block_p,
        BLOCK_N=sums.block_n,
        num_warps=sums.num_warps,
        **pdl(out),
    )


def const_n(cfg: FwdConfig | BwdConfig, N: int) -> int:
    """The kernels' N_CONST: the row width where the configuration compiles for it, else 0."""
    return N if cfg.const_n else 0


def num_rows(x: torch.Tensor) -> int:
    return math.prod(x.shape[:-1])


def num_tiles(M: int, rows: int) -> int:
    return cdiv(M, rows)


def row_limit_reasons(x: torch.Tensor, **_: Any) -> list[str]:
    """The norms' supports(): the only inputs they refuse are beyond their index ranges."""
    reasons = []
    if x.shape[-1] >= 2**31:
        reasons.append(f"x: rows of {x.shape[-1]} elements; the kernels index columns with int32")
    if num_rows(x) >= 2**31:
        reasons.append(f"x: {num_rows(x)} rows; the forward launches one program per row (< 2^31)")
    return reasons


# --- the launchers -----------------------------------------------------------------------------


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


# === RMSNorm ===================================================================================


# --- launchers -------------------------------------------------------------------------------


def rms_norm_forward(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, casting_mode: str, cfg: FwdConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns y (x's shape and dtype, contiguous) and rstd (fp32, one per row), launched as cfg
    says."""
    y, _, rstd = norm_forward(x, weight, None, eps, offset, MODES[casting_mode], False, cfg)
    return y, rstd


def rms_norm_backward_into(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    offset: float,
    casting_mode: str,
    dx: torch.Tensor,
    cfg: BwdConfig,
) -> torch.Tensor:
    """Writes dx and returns dw (empty when weight is None), launched as cfg says. dy and dx are
    contiguous; dx may be dy itself (in-place backward)."""
    dw, _ = norm_backward_into(dy, x, weight, None, rstd, offset, MODES[casting_mode], None, dx, cfg)
    return dw


def rms_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    offset: float,
    casting_mode: str,
    cfg: BwdConfig,
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
def _(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, casting_mode: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), x.new_empty((num_rows(x),), dtype=torch.float32)


@rms_norm_bwd.register_fake
def _(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    offset: float,
    casting_mode: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    dw_shape = (0,) if weight is None else weight.shape
    dw_dtype = x.dtype if weight is None else weight.dtype
    return x.new_empty(x.shape), x.new_empty(dw_shape, dtype=dw_dtype)


# --- autograd ----------------------------------------------------------------------------------


def _rms_setup_context(ctx: Any, inputs: tuple, output: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, weight, eps, offset, casting_mode = inputs
    _, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(x, weight, rstd)
    ctx.offset = offset
    ctx.casting_mode = casting_mode
    # Autograd would materialize a zero gradient for rstd (an allocation and a fill kernel per
    # backward) that nothing reads.
    ctx.set_materialize_grads(False)


def _rms_backward(
    ctx: Any, dy: torch.Tensor | None, drstd: torch.Tensor | None
) -> tuple[torch.Tensor | None, None, None, None, None]:
    if dy is None:  # y got no gradient (grads are not materialized)
        return None, None, None, None, None
    x, weight, rstd = ctx.saved_tensors
    args = (x, weight, rstd, ctx.offset, ctx.casting_mode)
    dx, dw = _rms_run_bwd(dy, *args)
    dx = dx if ctx.needs_input_grad[0] else None
    dw = dw if weight is not None and ctx.needs_input_grad[1] else None
    return dx, dw, None, None, None


def _rms_setup_context_transforms(ctx: Any, inputs: tuple, output: tuple[torch.Tensor, torch.Tensor]) -> None:
    _rms_setup_context(ctx, inputs, output)
    ctx.save_for_forward(inputs[0], inputs[1])  # x, weight
    ctx.eps = inputs[2]


def _rms_jvp(
    ctx: Any, dx: torch.Tensor | None, dweight: torch.Tensor | None, *_: torch.Tensor | None
) -> tuple[torch.Tensor, None]:
    """The tangent of y = x * rstd * (weight + offset), in fp32 (the casting modes differ only
    in where they round, and a rounding's tangent is the identity); rstd has none. rstd is
    recomputed from x, not read from the forward's output: an outer grad transform
    differentiates this tangent, through x."""
    refuse_nested_jvp("rms_norm")
    x, weight = ctx.saved_tensors
    dtype, x = x.dtype, x.float()
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + ctx.eps)
    xhat = x * rstd
    dy = None
    if dx is not None:
        dx = dx.float()
        dy = rstd * (dx - xhat * (xhat * dx).mean(-1, keepdim=True))
        if weight is not None:
            dy = dy * (weight.float() + ctx.offset)
    if dweight is not None:
        dy = xhat * dweight.float() if dy is None else dy + xhat * dweight.float()
    assert dy is not None  # (jvp runs for a tangent of x or of the weight)
    return dy.to(dtype), None


_rms_run_bwd = op_or_raw(rms_norm_bwd, _rms_norm_bwd, "rms_norm")
rms_norm_fwd.register_autograd(_rms_backward, setup_context=_rms_setup_context)
_RMSNormFunction = eager_function(
    "_RMSNormFunction",
    _rms_norm_fwd,
    _rms_setup_context,
    _rms_backward,
    transforms_function(
        "_RMSNormTransforms",
        rms_norm_fwd,
        _rms_norm_fwd,
        _rms_setup_context_transforms,
        _rms_backward,
        _rms_jvp,
        vmap_over_rows((0,), stats=1),
    ),
)


# --- the impl ----------------------------------------------------------------------------------


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting_mode: CastingMode = "llama",
) -> torch.Tensor:
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
    **gpu_capabilities("rms_norm", row_limit_reasons),
    forward_ad=True,
    compiled_transforms=False,
    description="Triton: row tiles forward, persistent backward with fp32 dw partials",
)


# === LayerNorm =================================================================================


# --- launchers -------------------------------------------------------------------------------


def layer_norm_forward(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, cfg: FwdConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns y (x's shape and dtype, contiguous), mean and rstd (fp32, one per row), launched
    as cfg says."""
    y, mean, rstd = norm_forward(x, weight, bias, eps, None, LAYER_NORM_MODE, True, cfg)
    assert mean is not None  # (has_mean)
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
    dx = empty(x.shape, x.dtype, x.device)
    dw, db = norm_backward_into(dy, x, weight, mean, rstd, None, LAYER_NORM_MODE, bias_dtype, dx, cfg)
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
def _(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    stats = (num_rows(x),)
    return (
        x.new_empty(x.shape),
        x.new_empty(stats, dtype=torch.float32),
        x.new_empty(stats, dtype=torch.float32),
    )


@layer_norm_bwd.register_fake
def _(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    bias_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    N = x.shape[-1]
    dw = x.new_empty((0,)) if weight is None else x.new_empty((N,), dtype=weight.dtype)
    db = x.new_empty((0,)) if bias_dtype is None else x.new_empty((N,), dtype=bias_dtype)
    return x.new_empty(x.shape), dw, db


# --- autograd ----------------------------------------------------------------------------------


def _ln_setup_context(
    ctx: Any, inputs: tuple, output: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> None:
    x, weight, bias, eps = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.bias_dtype = bias.dtype if bias is not None else None
    # No zero gradients for mean and rstd, which the backward never reads (an allocation and a
    # fill kernel each per backward otherwise).
    ctx.set_materialize_grads(False)


def _ln_backward(
    ctx: Any, dy: torch.Tensor | None, dmean: torch.Tensor | None, drstd: torch.Tensor | None
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None]:
    if dy is None:  # y got no gradient
        return None, None, None, None
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = _ln_run_bwd(dy, x, weight, mean, rstd, ctx.bias_dtype)
    return (
        dx if ctx.needs_input_grad[0] else None,
        dw if weight is not None and ctx.needs_input_grad[1] else None,
        db if ctx.bias_dtype is not None and ctx.needs_input_grad[2] else None,
        None,
    )


def _ln_setup_context_transforms(
    ctx: Any, inputs: tuple, output: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> None:
    _ln_setup_context(ctx, inputs, output)
    ctx.save_for_forward(inputs[0], inputs[1])  # x, weight
    ctx.eps = inputs[3]


def _ln_jvp(
    ctx: Any,
    dx: torch.Tensor | None,
    dweight: torch.Tensor | None,
    dbias: torch.Tensor | None,
    _: torch.Tensor | None,
) -> tuple[torch.Tensor, None, None]:
    """The tangent of y = (x - mean) * rstd * weight + bias, in fp32; mean and rstd have none.
    They are recomputed from x, not read from the forward's outputs: an outer grad transform
    differentiates this tangent, through x."""
    refuse_nested_jvp("layer_norm")
    x, weight = ctx.saved_tensors
    dtype, x = x.dtype, x.float()
    centered = x - x.mean(-1, keepdim=True)
    rstd = torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + ctx.eps)
    xhat = centered * rstd
    terms = []
    if dx is not None:
        dx = dx.float()
        dxhat = rstd * (dx - dx.mean(-1, keepdim=True) - xhat * (xhat * dx).mean(-1, keepdim=True))
        terms.append(dxhat if weight is None else dxhat * weight.float())
    if dweight is not None:
        terms.append(xhat * dweight.float())
    if dbias is not None:
        terms.append(dbias.float().expand(x.shape))
    return sum(terms[1:], terms[0]).to(dtype), None, None


_ln_run_bwd = op_or_raw(layer_norm_bwd, _layer_norm_bwd, "layer_norm")
layer_norm_fwd.register_autograd(_ln_backward, setup_context=_ln_setup_context)
_LayerNormFunction = eager_function(
    "_LayerNormFunction",
    _layer_norm_fwd,
    _ln_setup_context,
    _ln_backward,
    transforms_function(
        "_LayerNormTransforms",
        layer_norm_fwd,
        _layer_norm_fwd,
        _ln_setup_context_transforms,
        _ln_backward,
        _ln_jvp,
        vmap_over_rows((0,), stats=2),
    ),
)


# --- the impl ----------------------------------------------------------------------------------


def layer_norm_triton(
    x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, eps: float = 1e-5
) -> torch.Tensor:
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
    **gpu_capabilities("layer_norm", row_limit_reasons),
    forward_ad=True,
    compiled_transforms=False,
    description="Triton: row tiles forward, persistent backward with fp32 dw/db partials",
)
