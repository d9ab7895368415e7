"""What the RMSNorm and LayerNorm kernels share: exact bf16 rounding, the row configuration,
the size of the persistent backward grid and the reduction of its weight-gradient partials.

Both norms lay the work out the same way:
- forward: one row per program; the row stays in registers when it fits (N <= MAX_FUSED_N),
  wider rows loop over blocks of WIDE_BLOCK and read x again (mostly from L2).
- backward: a persistent grid (a few programs per SM), each program loops over rows
  pid, pid + P, ... and keeps its weight (and bias) gradient partial sums in fp32 registers; it
  writes one partial row at the end, and a small kernel sums the P partial rows (deterministic,
  no atomics).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton
import triton.language as tl

from lmkernels.backends.triton._common import cdiv, soft_bf16
from lmkernels.utils import empty

# Rows up to this width are kept in registers; wider rows loop over blocks of WIDE_BLOCK.
# (sm_90, from ptxas: the fused RMSNorm backward fits 64 registers per thread up to N = 8192; at
# 16384 it spills ~100-200 bytes per thread, which the wide path avoids at the cost of a second
# read and a read-modify-write of the dweight partials. Which is faster there is for the benchmark.)
MAX_FUSED_N = 16384
WIDE_BLOCK = 4096
# Resident warps per SM the persistent backward aims for (half of the 64 an SM can hold).
TARGET_WARPS_PER_SM = 32
# Programs of the backward under the CPU interpreter: few, so each one loops over several rows.
INTERPRETER_PROGRAMS = 3


# --- jit helpers -------------------------------------------------------------------------------


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


# --- launcher helpers --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RowConfig:
    block: int  # columns a program handles at once
    single_block: bool  # the whole row fits in one block (kept in registers)
    num_warps: int


def row_config(N: int, backward: bool = False) -> RowConfig:
    # The module constants are arguments of the cached function so that changing them (tests,
    # tuning scripts) takes effect.
    return _row_config(N, backward, MAX_FUSED_N, WIDE_BLOCK)


@functools.cache
def _row_config(N: int, backward: bool, max_fused_n: int, wide_block: int) -> RowConfig:
    single = N <= max_fused_n
    block = triton.next_power_of_2(N) if single else wide_block
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


def partial_buffer(P: int, N: int, single_block: bool, device: torch.device) -> torch.Tensor:
    """A P x N fp32 buffer of weight-gradient partials. The fused path writes every partial row
    in full; the wide path accumulates into it, so it must start at zero."""
    if single_block:
        return empty((P, N), torch.float32, device)  # NaN under the harness: a row left out fails
    return torch.zeros((P, N), dtype=torch.float32, device=device)


def sum_partials(partial: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out (1-D, any float dtype) = partial.sum(0), with one fp32 accumulation per column."""
    P, N = partial.shape
    BLOCK_N = 64
    _sum_partials_kernel[(cdiv(N, BLOCK_N),)](
        partial, out, P, N, SOFT_BF16=soft_bf16(out), BLOCK_P=32, BLOCK_N=BLOCK_N, num_warps=4
    )
    return out


def num_rows(x: torch.Tensor) -> int:
    return math.prod(x.shape[:-1])


def row_limit_reasons(x: torch.Tensor, **_) -> list[str]:
    """The norms' supports(): the only inputs they refuse are beyond their index ranges."""
    reasons = []
    if x.shape[-1] >= 2**31:
        reasons.append(f"x: rows of {x.shape[-1]} elements; the kernels index columns with int32")
    if num_rows(x) >= 2**31:
        reasons.append(f"x: {num_rows(x)} rows; the forward launches one program per row (< 2^31)")
    return reasons
