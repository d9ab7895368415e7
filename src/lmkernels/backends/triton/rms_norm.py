"""RMSNorm in Triton: forward and backward kernels, torch.library ops, registration.

Semantics are those of `lmkernels.ops.rms_norm.rms_norm_reference`, casting modes included:
"llama" rounds the normalized row to x.dtype before the weight multiply, "gemma" rounds once at
the end, "none" rounds after every step as eager PyTorch does in x.dtype (emulated in-kernel).

Layout of the work:
- forward: one row per program; the row stays in registers when it fits (N <= MAX_FUSED_N),
  wider rows loop over blocks of WIDE_BLOCK and read x twice (the second read mostly from L2).
- backward: a persistent grid (a few programs per SM), each program loops over rows
  pid, pid + P, ... and keeps its weight-gradient partial sum in fp32 registers; it writes one
  partial row at the end, and a small kernel sums the P partial rows (deterministic, no atomics).

In-place backward (off by default): with IN_PLACE_BACKWARD = True (or the environment variable
LMKERNELS_RMSNORM_INPLACE_BWD=1 at import) dx is written into the incoming gradient buffer when
nothing else can see that buffer, which saves one M x N allocation. See _grad_is_exclusive.

This module also holds helpers the other norm kernels share (exact bf16 rounding, SM count,
row configuration, the partial-sum reduction).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import sys

import torch
import triton
import triton.language as tl

from lmkernels.backends.triton import triton_devices, triton_unavailable_reason
from lmkernels.registry.core import register
from lmkernels.utils import empty


def in_place_backward_from_env() -> bool:
    return os.environ.get("LMKERNELS_RMSNORM_INPLACE_BWD", "0").strip().lower() in ("1", "true", "yes")


# Write dx into the incoming gradient buffer when that is provably safe (see _grad_is_exclusive).
IN_PLACE_BACKWARD = in_place_backward_from_env()

# Rows up to this width are kept in registers; wider rows loop over blocks of WIDE_BLOCK.
# (sm_90, from ptxas: the fused backward fits 64 registers per thread up to N = 8192; at 16384
# it spills ~100-200 bytes per thread, which the wide path avoids at the cost of a second read
# and a read-modify-write of the dweight partials. Which is faster there is for the benchmark.)
MAX_FUSED_N = 16384
WIDE_BLOCK = 4096
# Resident warps per SM the persistent backward aims for (half of the 64 an SM can hold).
TARGET_WARPS_PER_SM = 32
# Programs of the backward under the CPU interpreter: few, so each one loops over several rows.
INTERPRETER_PROGRAMS = 3

_MODES = {"llama": 0, "gemma": 1, "none": 2}  # casting_mode -> MODE of the kernels
GEMMA: tl.constexpr = tl.constexpr(1)
NONE: tl.constexpr = tl.constexpr(2)


# --- shared jit helpers ----------------------------------------------------------------------


@triton.jit
def to_dtype(v, dtype: tl.constexpr, SOFT_BF16: tl.constexpr):
    """fp32 `v` rounded to nearest-even in `dtype`.

    The GPU converts with round-to-nearest-even. The CPU interpreter truncates fp32 -> bf16, so
    there (SOFT_BF16) the rounding is done on the bits: add half an ulp (ties to even), clear the
    low 16 bits; the conversion that follows is then exact. Only the interpreter takes this path.
    """
    if SOFT_BF16 and dtype == tl.bfloat16:
        bits = v.to(tl.int32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        v = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    return v.to(dtype)


@triton.jit
def round_as(v, dtype: tl.constexpr, SOFT_BF16: tl.constexpr):
    """fp32 `v` as if stored in `dtype` and loaded back: emulates one eager op in `dtype`."""
    return to_dtype(v, dtype, SOFT_BF16).to(tl.float32)


@triton.jit
def _sum_partials_kernel(
    partial_ptr, out_ptr, P, N, SOFT_BF16: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr
):
    """out[c] = sum over p of partial[p, c] (fp32), rounded to out's dtype. One column block each."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    acc = tl.zeros([BLOCK_P, BLOCK_N], tl.float32)
    for start in range(0, P, BLOCK_P):
        rows = start + tl.arange(0, BLOCK_P)
        mask = (rows[:, None] < P) & col_mask[None, :]
        acc += tl.load(partial_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], mask=mask, other=0.0)
    total = tl.sum(acc, axis=0)
    tl.store(out_ptr + cols, to_dtype(total, out_ptr.dtype.element_ty, SOFT_BF16), mask=col_mask)


# --- shared launcher helpers -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RowConfig:
    block: int  # columns a program handles at once
    single_block: bool  # the whole row fits in one block (kept in registers)
    num_warps: int


def row_config(N: int, backward: bool = False) -> RowConfig:
    single = N <= MAX_FUSED_N
    block = triton.next_power_of_2(N) if single else WIDE_BLOCK
    # Registers per thread grow with the elements each thread holds. About 16 elements per thread
    # forward (x only) and 8 backward (x, dy, dw partial, ...) keep the fused kernels near 64
    # registers per thread on sm_90 at N = 4096, so two programs fit on an SM.
    elements_per_thread = 8 if backward else 16
    num_warps = min(32 if backward else 16, max(1, block // (32 * elements_per_thread)))
    return RowConfig(block, single, num_warps)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def persistent_programs(M: int, num_warps: int, device: torch.device) -> int:
    """Number of programs of a persistent kernel: enough to fill the GPU, at most one per row."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        programs = _sm_count(index) * max(1, TARGET_WARPS_PER_SM // num_warps)
    else:
        programs = INTERPRETER_PROGRAMS
    return max(1, min(M, programs))


def device_guard(t: torch.Tensor):
    """Triton launches on the current CUDA device: make it t's device."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def soft_bf16(t: torch.Tensor) -> bool:
    return not t.is_cuda


def sum_partials(partial: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out (1-D, any float dtype) = partial.sum(0), with one fp32 accumulation per column."""
    P, N = partial.shape
    BLOCK_N = 64
    _sum_partials_kernel[(triton.cdiv(N, BLOCK_N),)](
        partial, out, P, N, SOFT_BF16=soft_bf16(out), BLOCK_P=32, BLOCK_N=BLOCK_N, num_warps=4
    )
    return out


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
    N,
    eps,
    offset,
    MODE: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    BLOCK: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr,
    SOFT_BF16: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * N
    y_row = y_ptr + row * N
    dtype = y_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    if SINGLE_BLOCK:
        mask = cols < N
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = _rstd(tl.sum(_square(x, MODE, dtype, SOFT_BF16), axis=0), N, eps, MODE, dtype, SOFT_BF16)
        y = _normalized(x, rstd, MODE, dtype, SOFT_BF16)
        if HAS_WEIGHT:
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            y = y * _weight_factor(w, offset, MODE, dtype, SOFT_BF16)
        tl.store(y_row + cols, to_dtype(y, dtype, SOFT_BF16), mask=mask)
    else:
        acc = tl.zeros([BLOCK], tl.float32)
        for start in range(0, N, BLOCK):
            mask = start + cols < N
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            acc += _square(x, MODE, dtype, SOFT_BF16)
        rstd = _rstd(tl.sum(acc, axis=0), N, eps, MODE, dtype, SOFT_BF16)
        for start in range(0, N, BLOCK):
            mask = start + cols < N
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            y = _normalized(x, rstd, MODE, dtype, SOFT_BF16)
            if HAS_WEIGHT:
                w = tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
                y = y * _weight_factor(w, offset, MODE, dtype, SOFT_BF16)
            tl.store(y_row + start + cols, to_dtype(y, dtype, SOFT_BF16), mask=mask)
    tl.store(rstd_ptr + row, rstd)


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
    BLOCK: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr,
    SOFT_BF16: tl.constexpr,
):
    """dx = rstd * (g - x * rstd^2 * mean(g * x)) with g = dy * (w + offset); dw = sum dy * x_hat.

    Program pid handles rows pid, pid + P, ... and writes row pid of dw_partial (P x N, fp32).
    dx_ptr may equal dy_ptr (in-place backward): every element of dy is read before the dx
    element at the same address is written, by the same program.
    """
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    first_row = pid.to(tl.int64)
    dtype = dx_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    partial_row = dw_partial_ptr + first_row * N
    if SINGLE_BLOCK:
        mask = cols < N
        if HAS_WEIGHT:
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            w_factor = _weight_factor(w, offset, MODE, dtype, SOFT_BF16)
        dw_acc = tl.zeros([BLOCK], tl.float32)
        for i in range(0, tl.cdiv(M - pid, num_programs)):
            row = first_row + i * num_programs
            x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + row)
            g = dy
            if HAS_WEIGHT:
                g = dy * w_factor
            dot = tl.sum(g * x, axis=0)
            dx = (g - x * (rstd * rstd * dot / N)) * rstd
            tl.store(dx_ptr + row * N + cols, to_dtype(dx, dtype, SOFT_BF16), mask=mask)
            if HAS_WEIGHT:
                dw_acc += dy * _normalized(x, rstd, MODE, dtype, SOFT_BF16)
        if HAS_WEIGHT:
            tl.store(partial_row + cols, dw_acc, mask=mask)
    else:
        # Wide rows: pass 1 reduces g * x over the row, pass 2 writes dx block by block and adds
        # this program's dw contribution into its (zero-initialized) partial row.
        for i in range(0, tl.cdiv(M - pid, num_programs)):
            row = first_row + i * num_programs
            rstd = tl.load(rstd_ptr + row)
            acc = tl.zeros([BLOCK], tl.float32)
            for start in range(0, N, BLOCK):
                mask = start + cols < N
                x = tl.load(x_ptr + row * N + start + cols, mask=mask, other=0.0).to(tl.float32)
                g = tl.load(dy_ptr + row * N + start + cols, mask=mask, other=0.0).to(tl.float32)
                if HAS_WEIGHT:
                    w = tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
                    g = g * _weight_factor(w, offset, MODE, dtype, SOFT_BF16)
                acc += g * x
            scale = rstd * rstd * tl.sum(acc, axis=0) / N
            for start in range(0, N, BLOCK):
                mask = start + cols < N
                x = tl.load(x_ptr + row * N + start + cols, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + row * N + start + cols, mask=mask, other=0.0).to(tl.float32)
                g = dy
                if HAS_WEIGHT:
                    w = tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
                    g = dy * _weight_factor(w, offset, MODE, dtype, SOFT_BF16)
                dx = (g - x * scale) * rstd
                tl.store(dx_ptr + row * N + start + cols, to_dtype(dx, dtype, SOFT_BF16), mask=mask)
                if HAS_WEIGHT:
                    dw = tl.load(partial_row + start + cols, mask=mask, other=0.0)
                    dw += dy * _normalized(x, rstd, MODE, dtype, SOFT_BF16)
                    tl.store(partial_row + start + cols, dw, mask=mask)


# --- launchers -------------------------------------------------------------------------------


def _num_rows(x: torch.Tensor) -> int:
    return math.prod(x.shape[:-1])


def _rms_norm_fwd(x, weight, eps, offset, casting_mode):
    N = x.shape[-1]
    x2d = x.contiguous().view(-1, N)
    M = x2d.shape[0]
    y = empty(x.shape, x.dtype, x.device)
    rstd = empty((M,), torch.float32, x.device)
    if M == 0:
        return y, rstd
    cfg = row_config(N)
    with device_guard(x):
        _rms_norm_fwd_kernel[(M,)](
            x2d,
            weight.contiguous() if weight is not None else x2d,  # x2d: placeholder, never read
            y,
            rstd,
            N,
            eps,
            offset,
            MODE=_MODES[casting_mode],
            HAS_WEIGHT=weight is not None,
            BLOCK=cfg.block,
            SINGLE_BLOCK=cfg.single_block,
            SOFT_BF16=soft_bf16(x),
            num_warps=cfg.num_warps,
        )
    return y, rstd


def _rms_norm_bwd(dy, x, weight, rstd, offset, casting_mode, dx):
    """Writes dx (which may be dy itself) and returns dw (empty when weight is None)."""
    N = x.shape[-1]
    x2d = x.contiguous().view(-1, N)
    M = x2d.shape[0]
    if weight is None:
        dw = x.new_empty((0,))
    else:
        dw = empty((N,), weight.dtype, x.device)
    if M == 0:
        return dw.zero_()
    cfg = row_config(N, backward=True)
    P = persistent_programs(M, cfg.num_warps, x.device)
    # The fused path writes every partial row in full; the wide path accumulates into it.
    alloc = empty if cfg.single_block else torch.zeros
    partial = alloc((P, N), dtype=torch.float32, device=x.device) if weight is not None else None
    with device_guard(x):
        _rms_norm_bwd_kernel[(P,)](
            dy.view(-1, N),
            x2d,
            weight.contiguous() if weight is not None else x2d,  # placeholders when no weight
            rstd,
            dx.view(-1, N),
            partial if partial is not None else rstd,
            M,
            N,
            offset,
            MODE=_MODES[casting_mode],
            HAS_WEIGHT=weight is not None,
            BLOCK=cfg.block,
            SINGLE_BLOCK=cfg.single_block,
            SOFT_BF16=soft_bf16(x),
            num_warps=cfg.num_warps,
        )
        if weight is not None:
            sum_partials(partial, dw)
    return dw


# --- torch.library ops -----------------------------------------------------------------------


@torch.library.custom_op("lmkernels::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, casting_mode: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns y (x's shape and dtype, contiguous) and rstd (fp32, one per row)."""
    return _rms_norm_fwd(x, weight, eps, offset, casting_mode)


@rms_norm_fwd.register_fake
def _(x, weight, eps, offset, casting_mode):
    return x.new_empty(x.shape), x.new_empty((_num_rows(x),), dtype=torch.float32)


@torch.library.custom_op("lmkernels::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    offset: float,
    casting_mode: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns dx and dw (dw is empty when weight is None)."""
    dy = dy.contiguous()
    dx = empty(x.shape, x.dtype, x.device)
    dw = _rms_norm_bwd(dy, x, weight, rstd, offset, casting_mode, dx)
    return dx, dw


@rms_norm_bwd.register_fake
def _(dy, x, weight, rstd, offset, casting_mode):
    dw_shape = (0,) if weight is None else weight.shape
    dw_dtype = x.dtype if weight is None else weight.dtype
    return x.new_empty(x.shape), x.new_empty(dw_shape, dtype=dw_dtype)


@torch.library.custom_op("lmkernels::rms_norm_bwd_inplace", mutates_args=("dy",))
def rms_norm_bwd_inplace(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    offset: float,
    casting_mode: str,
) -> torch.Tensor:
    """Overwrites dy (contiguous, x's dtype) with dx; returns dw (empty when weight is None)."""
    if not dy.is_contiguous() or dy.dtype != x.dtype or dy.shape != x.shape:
        raise ValueError("rms_norm_bwd_inplace: dy must be contiguous with x's shape and dtype")
    return _rms_norm_bwd(dy, x, weight, rstd, offset, casting_mode, dy)


@rms_norm_bwd_inplace.register_fake
def _(dy, x, weight, rstd, offset, casting_mode):
    dw_shape = (0,) if weight is None else weight.shape
    dw_dtype = x.dtype if weight is None else weight.dtype
    return x.new_empty(dw_shape, dtype=dw_dtype)


# --- autograd ----------------------------------------------------------------------------------


def _reference_counts(t: torch.Tensor) -> tuple[int, int, int]:
    """(holders of t's TensorImpl, holders of its storage, Python references to t).

    The storage count includes the temporary Python storage object made here.
    """
    storage = t.untyped_storage()
    storage_count = torch._C._storage_Use_Count(storage._cdata)
    del storage
    return t._use_count(), storage_count, sys.getrefcount(t)


def _grad_is_exclusive(dy, control) -> bool:
    """True when nobody but this backward can see dy's memory, so dx may be written into it.

    Called first thing in the backward. `control` is the gradient autograd materializes for the
    non-differentiable rstd output: a fresh tensor handed over exactly like dy, so its Python
    reference count is the baseline of an unshared gradient. dy is exclusive when:
    - its TensorImpl has one holder (autograd passing the same gradient to two consumers, e.g.
      both inputs of an add, keeps a second holder until the other consumer has run);
    - its storage has no other TensorImpl (views, detach(), .data, a retained copy sharing it);
    - it has no more Python references than `control` (the caller's tensor in
      y.backward(grad), a tensor hook keeping the gradient, ...).
    Any doubt (a tensor subclass, tracing, a missing torch API, no control) answers False.
    """
    try:
        if type(dy) is not torch.Tensor or type(control) is not torch.Tensor:
            return False
        if torch._C._functorch.is_functorch_wrapped_tensor(dy):
            return False
        impl_count, storage_count, py_count = _reference_counts(dy)
        *_, control_py_count = _reference_counts(control)
    except (AttributeError, RuntimeError):
        return False
    return impl_count <= 1 and storage_count <= 2 and py_count <= control_py_count


def _setup_context(ctx, inputs, output):
    x, weight, eps, offset, casting_mode = inputs
    _, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(x, weight, rstd)
    ctx.offset = offset
    ctx.casting_mode = casting_mode


def _backward(ctx, dy, drstd):
    # First, before anything else takes a reference to dy.
    exclusive = IN_PLACE_BACKWARD and _grad_is_exclusive(dy, drstd)
    x, weight, rstd = ctx.saved_tensors
    in_place = (
        IN_PLACE_BACKWARD
        and dy.dtype == x.dtype
        and not torch.is_grad_enabled()  # create_graph=True: dy may be part of a graph
        and not torch.compiler.is_compiling()
        and type(dy) is torch.Tensor
    )
    if in_place and not dy.is_contiguous():
        dy = dy.contiguous()  # a fresh copy: ours to overwrite
    elif in_place:
        in_place = exclusive
    if in_place:
        dw = torch.ops.lmkernels.rms_norm_bwd_inplace(dy, x, weight, rstd, ctx.offset, ctx.casting_mode)
        dx = dy
    else:
        dx, dw = torch.ops.lmkernels.rms_norm_bwd(dy, x, weight, rstd, ctx.offset, ctx.casting_mode)
    dx = dx if ctx.needs_input_grad[0] else None
    dw = dw if weight is not None and ctx.needs_input_grad[1] else None
    return dx, dw, None, None, None


rms_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


# --- the impl ----------------------------------------------------------------------------------


def rms_norm_triton(x, weight=None, eps=1e-6, offset=0.0, casting_mode="llama"):
    y, _ = torch.ops.lmkernels.rms_norm_fwd(x, weight, float(eps), float(offset), casting_mode)
    return y


def _supports(x, weight=None, eps=1e-6, offset=0.0, casting_mode="llama", **_) -> list[str]:
    reasons = []
    if x.shape[-1] >= 2**31:
        reasons.append(f"x: rows of {x.shape[-1]} elements; the kernels index columns with int32")
    if _num_rows(x) >= 2**31:
        reasons.append(f"x: {_num_rows(x)} rows; the forward launches one program per row (< 2^31)")
    return reasons


register(
    "rms_norm",
    "triton",
    rms_norm_triton,
    priority=100,
    devices=triton_devices(),
    auto_devices=("cuda",),
    available=triton_unavailable_reason,
    supports=_supports,
    description="Triton: one row per program forward, persistent backward with fp32 dw partials",
)
