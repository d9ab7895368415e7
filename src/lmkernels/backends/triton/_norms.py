"""What the RMSNorm and LayerNorm kernels share: exact bf16 rounding, the launch configurations,
the size of the persistent backward grid and the reduction of its weight-gradient partials.

Both norms lay the work out the same way:
- forward: a tile of `rows` rows per program, in registers; or (rows wider than the table's
  max_fused_n, and where the table says so) one row per program in chunks, x read again from
  L2 (with eviction `hints` that keep it there between the passes).
- backward (PATH_REGS): a persistent grid (a few programs per SM); each program loops over row
  tiles pid, pid + P, ... and sums its weight (and bias) gradient contributions in fp32
  registers, one partial row written at the end. A second small kernel sums the P partial rows
  (deterministic, no atomics). `stages` > 1 software-pipelines the loop over row tiles: the
  next rows' loads are in flight (through shared memory) while a row is reduced, which is what
  lets one row per SM reach the copy bandwidth.
- PATH_WIDE (rows wider than max_fused_n): tiles of rows in column blocks, two passes (the
  second from L2), the column loops pipelined; the backward kernel writes dx only, and a column
  kernel, one program per (column block, row range), sums the weight (and bias) gradients from
  x and dy read again. That costs two more reads, and saves the per-row accumulators that make
  the wide backward spill.
- rows that fill at most 3/4 of their power-of-two block (5120, 11008) may be held as two
  register blocks, `block` (a power of two <= N) and `tail` (e.g. 4096 + 1024): fewer padding
  lanes, hence fewer registers per thread and more rows in flight per SM.
- `reload_x`: the backward reads a row's x and dy a second time after the row sums, one
  register block at a time, from L1 / L2, instead of holding them. That frees the registers the
  gradient sums of a wide row need (LayerNorm's two), without the column kernel's HBM reads.
- `prefetch`: a backward with one program per SM and one row in flight asks L2 for its next
  row as soon as the current row's loads are issued (prefetch_tile), so that HBM streams
  through the row's reductions.
- `hold_x` (RMSNorm): the backward holds a bf16 row's x and dy as loaded across the row sums,
  then widens them to fp32 a second time (widen) instead of reading them again (reload_x) or
  keeping fp32 copies.

The launchers take their configuration (FwdConfig, BwdConfig) as an argument; the op bodies
resolve it (fwd_config, bwd_config) from the table of the device's GPU generation
(configs.tables_for), whose entries and fields configs.records describes.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from lmkernels.backends.triton._common import cdiv, pdl, pdl_enter, sm90_ptx, soft_bf16, to_dtype
from lmkernels.backends.triton._launch import launch
from lmkernels.backends.triton.configs.records import PATH_REGS as PATH_REGS
from lmkernels.backends.triton.configs.records import PATH_WIDE as PATH_WIDE
from lmkernels.backends.triton.configs.records import BwdConfig as BwdConfig
from lmkernels.backends.triton.configs.records import ColumnConfig, NormTable, SumConfig
from lmkernels.backends.triton.configs.records import FwdConfig as FwdConfig
from lmkernels.utils import empty

# Programs of the backward under the CPU interpreter: few, so each one loops over several tiles.
INTERPRETER_PROGRAMS = 3


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
# index and 1-D blocks. The computation is the same, the code Triton makes of it is not: with
# the row width a constant (const_n), the RMSNorm backward kernel at 65536 x 16384 took 1705 us
# in the 1-D form against 2066 us as a [1, 16384] tile (2048 us without const_n), on an H200.
# The helpers give the kernels one text for both.


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


@triton.jit
def row_sums2(a, b, ROWS: tl.constexpr):
    """row_sums of two tiles in one reduction. Two tl.sum calls are two reductions, each with
    its own exchange through shared memory and barriers, and the second waits for the first;
    one reduction of both exchanges both values at once (sm_90 PTX: one barrier fewer)."""
    if ROWS == 1:
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
    shared = dict(column=table.column, sums=table.sums)
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


# Shared memory a kernel needs besides its pipeline buffers (cross-warp reductions): measured
# 40-90 bytes for the norm backwards (their sm_90 cubins); this leaves room to spare.
SHARED_MARGIN = 4096


def pipeline_stages(cfg: BwdConfig, x: torch.Tensor, weight: torch.Tensor | None, iterations: int = 2) -> int:
    """cfg.stages, lowered until the pipeline buffers fit the device's shared memory; 1 where
    each program's loop over row tiles runs once (`iterations`): nothing to overlap there, and
    the pipeline's copies through shared memory only add to the one pass.

    Triton keeps stages - 1 copies of a loop iteration's pipelined loads in shared memory: x and
    dy, and the weight where it is reloaded per tile. The table's stages were chosen on an H200
    (227 KiB per block) for bf16; fp32 inputs need twice the bytes, and other GPUs have less
    (A100 163 KiB, consumer parts ~100 KiB), where the table's stages would fail to launch."""
    if cfg.stages <= 1 or x.device.type != "cuda":
        return cfg.stages
    if iterations <= 1:
        return 1
    index = _device_index(x.device)
    reload_w = weight is not None and (cfg.reload_w or cfg.path != PATH_REGS)
    w_bytes = weight.element_size() if reload_w else 0
    return _fit_stages(cfg, x.element_size(), w_bytes, reloads_x(cfg, x), index)


@functools.cache
def _fit_stages(cfg: BwdConfig, x_bytes: int, w_bytes: int, reload_x: bool, device_index: int) -> int:
    # reload_x (reloads_x: cfg.reload_x unless the row is held as loaded): the second reads of x
    # and dy are pipelined as well, with buffers of their own.
    per_stage = cfg.rows * (cfg.block + cfg.tail) * ((4 if reload_x else 2) * x_bytes + w_bytes)
    limit = _max_shared_bytes(device_index) - SHARED_MARGIN
    stages = cfg.stages
    while stages > 1 and (stages - 1) * per_stage > limit:
        stages -= 1
    return stages


def holds_x(cfg: BwdConfig, x: torch.Tensor) -> bool:
    """The backward kernel's HOLD_X: cfg.hold_x for bf16 inputs, whose second widening is a
    shift (widen); other dtypes keep the entry's reload_x or fp32 registers."""
    return cfg.hold_x and x.dtype == torch.bfloat16


def reloads_x(cfg: BwdConfig, x: torch.Tensor) -> bool:
    """The backward kernel's RELOAD_X: cfg.reload_x, unless it holds x as loaded instead."""
    return cfg.reload_x and not holds_x(cfg, x)


def can_prefetch(cfg: BwdConfig, x: torch.Tensor) -> bool:
    """The backward kernel's PREFETCH: cfg.prefetch on NVIDIA devices of sm_90 and later; never
    in the interpreter or on ROCm, which run no PTX."""
    return cfg.prefetch and x.device.type == "cuda" and sm90_ptx(_device_index(x.device))


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


def sum_partials(partial: torch.Tensor, out: torch.Tensor, sums: SumConfig, partial2=None, out2=None) -> None:
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
        partial2.shape[0] if second else P,
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


def row_limit_reasons(x: torch.Tensor, **_) -> list[str]:
    """The norms' supports(): the only inputs they refuse are beyond their index ranges."""
    reasons = []
    if x.shape[-1] >= 2**31:
        reasons.append(f"x: rows of {x.shape[-1]} elements; the kernels index columns with int32")
    if num_rows(x) >= 2**31:
        reasons.append(f"x: {num_rows(x)} rows; the forward launches one program per row (< 2^31)")
    return reasons
