"""What the RMSNorm and LayerNorm kernels share: exact bf16 rounding, the launch configurations,
the size of the persistent backward grid and the reduction of its weight-gradient partials.

Both norms lay the work out the same way:
- forward: a tile of `rows` rows per program, in registers; or (rows wider than MAX_FUSED_N,
  and where the table says so) one row per program in chunks, x read again from L2.
- backward: a persistent grid (a few programs per SM); each program loops over row tiles
  pid, pid + P, ... and sums its weight (and bias) gradient contributions in fp32, either in
  registers (PATH_REGS, one partial row written at the end) or, for wide rows where registers
  would spill, in its own partial row in memory (PATH_MEM: read-modify-write, an L2 hit). A
  second small kernel sums the P partial rows (deterministic, no atomics).
- rows that fill at most 3/4 of their power-of-two block (5120, 11008) may be held as two
  register blocks, `block` (a power of two <= N) and `tail` (e.g. 4096 + 1024): fewer padding
  lanes, hence fewer registers per thread and more rows in flight per SM.
- "apart" gradients (the `apart` field): the backward kernel leaves some weight-gradient sums
  out (LayerNorm: the bias gradient, or both) and a column kernel computes them, one program
  per (column block, row range), reading x and dy again. That costs 1-2 more reads of a
  tensor, and saves the per-row accumulators that make the wide backward spill.

The configurations come from a table per op and row width, filled from measurements on an H200
(scripts/roofline_tune.py, benchmarks/results/2026-11-23-roofline-tune/).
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
MAX_FUSED_N = 16384
WIDE_BLOCK = 4096
# Programs of the backward under the CPU interpreter: few, so each one loops over several tiles.
INTERPRETER_PROGRAMS = 3

# Backward paths (the PATH constexpr of the kernels).
PATH_REGS = 0  # whole row in registers, weight-gradient partial sums in registers
PATH_MEM = 1  # whole row in registers, partial sums in the program's partial row (memory)
PATH_WIDE = 2  # the row in blocks of WIDE_BLOCK, two passes, partial sums in memory

# Which weight-gradient sums the column kernel computes instead of the backward kernel.
APART_NONE = 0
APART_DB = 1  # LayerNorm: the bias gradient (the weight gradient stays in the backward kernel)
APART_ALL = 2  # every one: the backward kernel only writes dx

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
):
    """out_j[c] = sum over p of partial_j[p, c] (fp32), rounded to out_j's dtype; j = program_id(1).
    One launch reduces both the weight and the bias partials of LayerNorm (P0 and P1 rows)."""
    if tl.program_id(1) == 0:
        _sum_columns(partial0_ptr, out0_ptr, P0, N, SOFT_BF16, BLOCK_P, BLOCK_N)
    else:
        _sum_columns(partial1_ptr, out1_ptr, P1, N, SOFT_BF16, BLOCK_P, BLOCK_N)


# --- launcher helpers --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FwdConfig:
    rows: int  # rows per program (a rows x block tile)
    block: int  # columns a program handles at once
    single_block: bool  # the whole row fits in one block (kept in registers)
    num_warps: int


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

    @property
    def single_block(self) -> bool:
        return self.path != PATH_WIDE


# Per op and next_power_of_2(N) =: block, optionally "part" (rows that fill at most 3/4 of their
# block, e.g. 5120 and 11008): (fwd rows, fwd warps, fwd chunk, bwd rows, bwd warps, bwd path,
# bwd programs per SM, bwd reload w[, bwd tail, bwd apart]). fwd chunk 0 keeps the row in
# registers; otherwise the forward reads the row in chunks of that many columns (the wide path:
# several passes, the later ones from L2, with more rows in flight per SM). bwd tail 1: the row
# as two register blocks, block / 2 and the rest (next power of two). Each entry is the fastest
# fwd+bwd combination measured on an H200 (scripts/roofline_tune.py,
# benchmarks/results/2026-11-23-roofline-tune/ and -tune2/).
TUNED: dict[tuple, tuple] = {
    ("rms_norm", 1024): (2, 4, 0, 1, 4, PATH_REGS, 8, False),
    ("rms_norm", 2048): (2, 8, 0, 1, 8, PATH_REGS, 4, False),
    ("rms_norm", 4096): (1, 8, 0, 1, 16, PATH_REGS, 2, False),
    ("rms_norm", 8192): (1, 8, 0, 1, 32, PATH_REGS, 1, True),
    ("rms_norm", 8192, "part"): (1, 8, 0, 1, 16, PATH_REGS, 1, True),
    ("rms_norm", 16384): (1, 32, 0, 1, 16, PATH_REGS, 1, True),
    ("rms_norm", 16384, "part"): (1, 8, 4096, 1, 16, PATH_REGS, 2, False, 1),
    ("layer_norm", 1024): (2, 4, 0, 1, 4, PATH_REGS, 8, False),
    ("layer_norm", 2048): (1, 4, 0, 1, 8, PATH_REGS, 4, False),
    ("layer_norm", 4096): (1, 8, 0, 1, 16, PATH_REGS, 2, False),
    ("layer_norm", 8192): (1, 8, 0, 1, 16, PATH_REGS, 2, False),
    ("layer_norm", 8192, "part"): (1, 4, 2048, 1, 16, PATH_REGS, 2, False),
    ("layer_norm", 16384, "part"): (1, 8, 4096, 1, 16, PATH_REGS, 1, True, 1),
    ("layer_norm", 16384): (1, 8, 4096, 1, 16, PATH_REGS, 2, True, 0, APART_ALL),
}

# Below M_FEW rows, per (op, block, part): the table entry (its backward half) where the one
# above lost at 1024 rows (tune2/run2-final: LayerNorm 1024 x 16384, 0.1016 ms against 0.1031
# for the column kernel, which has few rows per program there).
M_FEW = 2048
FEW_ROWS: dict[tuple, tuple] = {
    ("layer_norm", 16384, False): (1, 8, 4096, 1, 16, PATH_REGS, 1, True),
}

# Tuning hook (scripts/roofline_tune.py, tests): configurations used instead of the table.
FORCE_FWD: FwdConfig | None = None
FORCE_BWD: BwdConfig | None = None


def fwd_config(op: str, N: int) -> FwdConfig:
    if FORCE_FWD is not None:
        return FORCE_FWD
    # The module constants are arguments of the cached function so that changing them (tests,
    # tuning scripts) takes effect.
    return _fwd_config(op, N, MAX_FUSED_N, WIDE_BLOCK)


def bwd_config(op: str, N: int, M: int | None = None) -> BwdConfig:
    """The backward's configuration for rows of N elements; M (the number of rows), when given,
    picks the FEW_ROWS entries of the table below M_FEW."""
    if FORCE_BWD is not None:
        return FORCE_BWD
    return _bwd_config(op, N, M is not None and M < M_FEW, MAX_FUSED_N, WIDE_BLOCK)


def _default_warps(elements: int, per_thread: int, cap: int) -> int:
    return min(cap, max(1, triton.next_power_of_2(max(1, elements // (32 * per_thread)))))


def _tuned(op: str, N: int, block: int, few: bool = False):
    if few and (op, block, 4 * N <= 3 * block) in FEW_ROWS:
        return FEW_ROWS[(op, block, 4 * N <= 3 * block)]
    part = TUNED.get((op, block, "part")) if 4 * N <= 3 * block else None
    return part if part is not None else TUNED.get((op, block))


@functools.cache
def _fwd_config(op: str, N: int, max_fused_n: int, wide_block: int) -> FwdConfig:
    if N > max_fused_n:
        return FwdConfig(1, wide_block, False, _default_warps(wide_block, 16, 16))
    block = triton.next_power_of_2(N)
    tuned = _tuned(op, N, block)
    if tuned is not None:
        rows, warps, chunk = tuned[:3]
        return FwdConfig(1, chunk, False, warps) if chunk else FwdConfig(rows, block, True, warps)
    # Narrow rows (below the table): several rows per program, about 16 elements per thread.
    rows = max(1, 1024 // block)
    return FwdConfig(rows, block, True, _default_warps(rows * block, 16, 16))


@functools.cache
def _bwd_config(op: str, N: int, few: bool, max_fused_n: int, wide_block: int) -> BwdConfig:
    if N > max_fused_n:
        return BwdConfig(1, wide_block, PATH_WIDE, _default_warps(wide_block, 8, 16), 2)
    block = triton.next_power_of_2(N)
    tuned = _tuned(op, N, block, few)
    if tuned is not None:
        rows, warps, path, programs_per_sm, reload_w, *extra = tuned[3:]
        tail, apart = (*extra, 0, APART_NONE)[:2]
        if tail:  # two register blocks: the largest power of two <= N, then the rest
            block //= 2
            tail = triton.next_power_of_2(N - block)
        return BwdConfig(rows, block, path, warps, programs_per_sm, reload_w, tail, apart)
    rows = max(1, 1024 // block)
    num_warps = _default_warps(rows * block, 8, 16)
    return BwdConfig(rows, block, PATH_REGS, num_warps, max(1, 32 // num_warps))


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def persistent_programs(tiles: int, programs_per_sm: int, device: torch.device) -> int:
    """Number of programs of a persistent kernel: enough to fill the GPU, at most one per tile."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        programs = _sm_count(index) * programs_per_sm
    else:
        programs = INTERPRETER_PROGRAMS
    return max(1, min(tiles, programs))


def partial_buffer(P: int, N: int, device: torch.device) -> torch.Tensor:
    """A P x N fp32 buffer of weight-gradient partials. Every path writes each partial row in
    full (the memory paths store on their first tile, then add), so it needs no zeroing: under
    the harness it starts as NaN, and a row left out fails."""
    return empty((P, N), torch.float32, device)


# (BLOCK_P, BLOCK_N, num_warps) of the partial-sum kernel.
SUM_CONFIG = (256, 16, 8)
# (BLOCK_M, BLOCK_N, num_warps, programs per SM) of the column kernels ("apart" gradients).
COL_CONFIG = (32, 128, 4, 8)


def column_splits(M: int, N: int, device: torch.device) -> int:
    """Row ranges of a column kernel: about COL_CONFIG's programs per SM in all, each range at
    least BLOCK_M rows. Each range writes one partial row."""
    block_m, block_n, _, per_sm = COL_CONFIG
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        target = _sm_count(index) * per_sm
    else:
        target = INTERPRETER_PROGRAMS
    return max(1, min(cdiv(M, block_m), cdiv(target, cdiv(N, block_n))))


def sum_partials(partial: torch.Tensor, out: torch.Tensor, partial2=None, out2=None) -> None:
    """out (1-D, any float dtype) = partial.sum(0), with one fp32 accumulation per column; and
    the same for (partial2, out2) in the same launch when given (its own number of rows)."""
    P, N = partial.shape
    block_p, block_n, num_warps = SUM_CONFIG
    second = partial2 is not None
    _sum_partials_kernel[(cdiv(N, block_n), 2 if second else 1)](
        partial,
        out,
        partial2 if second else partial,
        out2 if second else out,
        P,
        partial2.shape[0] if second else P,
        N,
        SOFT_BF16=soft_bf16(out),
        BLOCK_P=block_p,
        BLOCK_N=block_n,
        num_warps=num_warps,
    )


def num_rows(x: torch.Tensor) -> int:
    return math.prod(x.shape[:-1])


def num_tiles(M: int, rows: int) -> int:
    return cdiv(M, rows)


def row_limit_reasons(x: torch.Tensor, **_) -> list[str]:
    """The norms' supports(): the only inputs they refuse are beyond their index ranges."""
    reasons = []
    if x.shape[-1] >= 2**31:
        reasons.append(f"x: rows of {x.shape[-1]} elements; the kernels index columns with int32")
    if num_rows(x) >= 2**31:
        reasons.append(f"x: {num_rows(x)} rows; the forward launches one program per row (< 2^31)")
    return reasons
