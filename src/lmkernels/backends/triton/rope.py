"""Rotary position embedding of q and k in Triton: both tensors in one launch.

Two kernels, same arithmetic (_rotate_rows). The position kernel, grid (B*T, splits):
program (p, s) handles position p = b*T + t and every `splits`-th group of BLOCK_H of its
Hq + Hkv head rows (q's, then k's; a group may hold both). cos/sin for the position are loaded
once per program; with splits == 1 (long sequences) one program rotates all Hq + Hkv heads of
its position. The tile kernel, grid (B * T/BLOCK_T, splits): BLOCK_T positions x every
`splits`-th head, a (positions x head dims) tile per head; it runs where a head's positions are
contiguous in memory and the device's table has a tile entry for the rotary width (rope_config).
The launch configurations (configs.records: RopePosConfig, RopeTileConfig) and the tables they
come from (configs.tables_for) are data passed in: see rope_rotate_with.

Each head's first R = rotary_dim dims are split into the two halves of the rotation pairs
(x_a, x_b): neox pairs j with j + R/2 (two contiguous loads), interleaved pairs 2i with 2i+1
(one contiguous load, viewed as (heads, R/2, 2) and split in registers). With the
full-width tables (c_a, c_b, s_a, s_b) at the pair's two dims, as in the reference:

    forward:  o_a = x_a c_a - x_b s_a        o_b = x_b c_b + x_a s_b
    backward: o_a = x_a c_a + x_b s_b        o_b = x_b c_b - x_a s_a   (the transpose)

so the backward is the forward with (s_a, s_b) -> (-s_b, -s_a): the same kernel, one flag.
The head and rotary dims are compile-time constants (one compile per head layout, as the
blocks already are): the masks of the dims are then known when the kernel is compiled.
Dims R..D are copied. q and k are read through their strides (e.g. the transpose of a
(B, T, H, D) projection is not copied); outputs are fresh tensors in the layout of the
inputs (see _rope_rotate).
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import torch
import triton
import triton.language as tl

from lmkernels.backends.triton import _version, triton_devices, triton_unavailable_reason
from lmkernels.backends.triton.common import (
    call,
    cdiv,
    device_guard,
    eager_function,
    gpu_capabilities,
    launch,
    next_power_of_2,
    pdl,
    pdl_enter,
    refuse_nested_jvp,
    soft_bf16,
    to_dtype,
    traced,
    transforming,
    transforms_function,
)
from lmkernels.backends.triton.configs import tables_for
from lmkernels.backends.triton.configs.records import RopePosConfig, RopeTable, RopeTileConfig
from lmkernels.registry.core import BackendNotSupportedError, forward_ad_error, register
from lmkernels.types import RopeLayout
from lmkernels.utils import empty, empty_strided


@triton.jit
def _rotate_rows(
    x_rows,
    o_rows,
    row_mask,
    cos_a,
    cos_b,
    sin_a,
    sin_b,
    half: tl.constexpr,
    rot_dim: tl.constexpr,
    head_dim: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_REST: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_REST: tl.constexpr,
    SOFT_BF16: tl.constexpr,
):
    """Rotate BLOCK_R rows of head dims, the row starts x_rows (masked by row_mask), into the
    rows o_rows: the heads of one position (_rope_kernel) or the positions of one head
    (_rope_tile_kernel), whose row offsets are 64-bit (they can pass 2^31 for long sequences).
    The tables are (1, BLOCK_HALF) (one position) or (BLOCK_R, BLOCK_HALF) (a row each)."""
    if INTERLEAVED:
        # Load the rows contiguously (vector loads along D), then view each row as
        # (BLOCK_HALF, 2) pairs (2i, 2i+1) and split them in registers.
        d = tl.arange(0, 2 * BLOCK_HALF)
        mask = row_mask[:, None] & (d < 2 * half)[None, :]
        x = tl.load(x_rows[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
        x_a, x_b = tl.split(tl.reshape(x, (BLOCK_R, BLOCK_HALF, 2)))
        o_a = x_a * cos_a - x_b * sin_a
        o_b = x_b * cos_b + x_a * sin_b
        out = tl.reshape(tl.join(o_a, o_b), (BLOCK_R, 2 * BLOCK_HALF))
        tl.store(o_rows[:, None] + d[None, :], to_dtype(out, o_rows.dtype.element_ty, SOFT_BF16), mask=mask)
    else:
        i = tl.arange(0, BLOCK_HALF)
        mask = row_mask[:, None] & (i < half)[None, :]
        x_a = tl.load(x_rows[:, None] + i[None, :], mask=mask, other=0.0).to(tl.float32)
        x_b = tl.load(x_rows[:, None] + (i + half)[None, :], mask=mask, other=0.0).to(tl.float32)
        o_a = x_a * cos_a - x_b * sin_a
        o_b = x_b * cos_b + x_a * sin_b
        tl.store(o_rows[:, None] + i[None, :], to_dtype(o_a, o_rows.dtype.element_ty, SOFT_BF16), mask=mask)
        tl.store(
            o_rows[:, None] + (i + half)[None, :],
            to_dtype(o_b, o_rows.dtype.element_ty, SOFT_BF16),
            mask=mask,
        )
    if HAS_REST:
        # Dims rot_dim .. head_dim are not rotated: copied as they are.
        r = rot_dim + tl.arange(0, BLOCK_REST)
        mask = row_mask[:, None] & (r < head_dim)[None, :]
        rest = tl.load(x_rows[:, None] + r[None, :], mask=mask, other=0.0)
        tl.store(o_rows[:, None] + r[None, :], rest.to(o_rows.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    T,
    n_table,
    n_q_heads,
    n_k_heads,
    head_dim: tl.constexpr,
    half: tl.constexpr,
    stride_oqb,
    stride_oqh,
    stride_oqt,
    stride_okb,
    stride_okh,
    stride_okt,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_cb,
    stride_ct,
    stride_sb,
    stride_st,
    stride_pb,
    stride_pt,
    splits,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_REST: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_POS: tl.constexpr,
    HAS_REST: tl.constexpr,
    BACKWARD: tl.constexpr,
    SOFT_BF16: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    pos = tl.program_id(0).to(tl.int64)
    b = pos // T
    t = pos % T
    # Row of the cos/sin tables for this position: position_ids[b, t] into a (P, R) table, or
    # (b, t) into (B, T, R), or t into (T, R) (stride_cb == 0).
    if HAS_POS:
        # A position outside the table's n_table rows is never read: row 0 instead, then nan.
        row = tl.load(pos_ptr + b * stride_pb + t * stride_pt).to(tl.int64)
        row_ok = (row >= 0) & (row < n_table)
        row = tl.where(row_ok, row, 0)
        cos_row = cos_ptr + row * stride_ct
        sin_row = sin_ptr + row * stride_st
    else:
        cos_row = cos_ptr + b * stride_cb + t * stride_ct
        sin_row = sin_ptr + b * stride_sb + t * stride_st
    if INTERLEAVED:
        d = tl.arange(0, 2 * BLOCK_HALF)
        m = d < 2 * half
        cos_a, cos_b = tl.split(tl.reshape(tl.load(cos_row + d, mask=m, other=0.0), (BLOCK_HALF, 2)))
        sin_a, sin_b = tl.split(tl.reshape(tl.load(sin_row + d, mask=m, other=0.0), (BLOCK_HALF, 2)))
        cos_a, cos_b = cos_a.to(tl.float32), cos_b.to(tl.float32)
        sin_a, sin_b = sin_a.to(tl.float32), sin_b.to(tl.float32)
    else:
        i = tl.arange(0, BLOCK_HALF)
        m = i < half
        cos_a = tl.load(cos_row + i, mask=m, other=0.0).to(tl.float32)
        cos_b = tl.load(cos_row + half + i, mask=m, other=0.0).to(tl.float32)
        sin_a = tl.load(sin_row + i, mask=m, other=0.0).to(tl.float32)
        sin_b = tl.load(sin_row + half + i, mask=m, other=0.0).to(tl.float32)
    if HAS_POS:
        cos_a = tl.where(row_ok, cos_a, float("nan"))
        cos_b = tl.where(row_ok, cos_b, float("nan"))
        sin_a = tl.where(row_ok, sin_a, float("nan"))
        sin_b = tl.where(row_ok, sin_b, float("nan"))
    if BACKWARD:
        # The transpose of the rotation (see the module docstring).
        sin_a, sin_b = -sin_b, -sin_a
    cos_a, cos_b, sin_a, sin_b = cos_a[None, :], cos_b[None, :], sin_a[None, :], sin_b[None, :]
    rot_dim = 2 * half
    # Outputs are dense with unit stride along D, laid out (B, H, T, D) or (B, T, H, D) (see
    # _rope_rotate); their strides come from the host (64-bit if need be). The position's
    # Hq + Hkv head rows, q's then k's, in groups of BLOCK_H: a group may hold rows of both, so
    # that no group is left mostly masked where Hkv (or Hq) is not a multiple of BLOCK_H
    # (Hkv = 4 in a group of its own fills a quarter of a group of 16; mixing the rows pays most
    # with few kv heads: docs/performance.md, "Design decisions and their measurements").
    q_in = q_ptr + b * stride_qb + t * stride_qt
    k_in = k_ptr + b * stride_kb + t * stride_kt
    q_out = q_out_ptr + b * stride_oqb + t * stride_oqt
    k_out = k_out_ptr + b * stride_okb + t * stride_okt
    n_rows = n_q_heads + n_k_heads
    for g in range(tl.program_id(1), tl.cdiv(n_rows, BLOCK_H), splits):
        r = g * BLOCK_H + tl.arange(0, BLOCK_H)
        is_q = r < n_q_heads
        head = tl.where(is_q, r, r - n_q_heads).to(tl.int64)
        x_rows = tl.where(is_q, q_in + head * stride_qh, k_in + head * stride_kh)
        o_rows = tl.where(is_q, q_out + head * stride_oqh, k_out + head * stride_okh)
        _rotate_rows(
            x_rows, o_rows, r < n_rows, cos_a, cos_b, sin_a, sin_b, half, rot_dim, head_dim,
            BLOCK_H, BLOCK_HALF, BLOCK_REST, INTERLEAVED, HAS_REST, SOFT_BF16,
        )  # fmt: skip


@triton.jit
def _load_tables(cos_rows, sin_rows, row_mask, row_ok, half: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_HALF: tl.constexpr, INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr,
                 HAS_POS: tl.constexpr):  # fmt: skip
    """(c_a, c_b, s_a, s_b) in fp32, (BLOCK_R, BLOCK_HALF), for BLOCK_R table row pointers; nan in
    the rows where row_ok is False (HAS_POS: a position outside the table, not read)."""
    if INTERLEAVED:
        d = tl.arange(0, 2 * BLOCK_HALF)
        m = row_mask[:, None] & (d < 2 * half)[None, :]
        c = tl.load(cos_rows[:, None] + d[None, :], mask=m, other=0.0).to(tl.float32)
        s = tl.load(sin_rows[:, None] + d[None, :], mask=m, other=0.0).to(tl.float32)
        cos_a, cos_b = tl.split(tl.reshape(c, (BLOCK_R, BLOCK_HALF, 2)))
        sin_a, sin_b = tl.split(tl.reshape(s, (BLOCK_R, BLOCK_HALF, 2)))
    else:
        i = tl.arange(0, BLOCK_HALF)
        m = row_mask[:, None] & (i < half)[None, :]
        cos_a = tl.load(cos_rows[:, None] + i[None, :], mask=m, other=0.0).to(tl.float32)
        cos_b = tl.load(cos_rows[:, None] + (half + i)[None, :], mask=m, other=0.0).to(tl.float32)
        sin_a = tl.load(sin_rows[:, None] + i[None, :], mask=m, other=0.0).to(tl.float32)
        sin_b = tl.load(sin_rows[:, None] + (half + i)[None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_POS:
        ok = row_ok[:, None]
        cos_a = tl.where(ok, cos_a, float("nan"))
        cos_b = tl.where(ok, cos_b, float("nan"))
        sin_a = tl.where(ok, sin_a, float("nan"))
        sin_b = tl.where(ok, sin_b, float("nan"))
    if BACKWARD:
        sin_a, sin_b = -sin_b, -sin_a
    return cos_a, cos_b, sin_a, sin_b


@triton.jit
def _rope_tile_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    T,
    n_table,
    n_t_blocks,
    n_q_heads,
    n_k_heads,
    head_dim: tl.constexpr,
    half: tl.constexpr,
    stride_oqb,
    stride_oqh,
    stride_oqt,
    stride_okb,
    stride_okh,
    stride_okt,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_cb,
    stride_ct,
    stride_sb,
    stride_st,
    stride_pb,
    stride_pt,
    splits,
    BLOCK_T: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_REST: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_POS: tl.constexpr,
    HAS_REST: tl.constexpr,
    BACKWARD: tl.constexpr,
    SOFT_BF16: tl.constexpr,
    HEAD_STAGES: tl.constexpr = 1,
    PDL: tl.constexpr = False,
):
    """Program (p, s): BLOCK_T positions of one sequence x every `splits`-th head (q's, then
    k's), one (positions x head dims) tile per head: where a head's positions are contiguous
    rows ((B, H, T, D) memory), each tile is one contiguous stretch of BLOCK_T * D elements.
    The tables are per position row, loaded once and kept in registers for the whole head
    loop."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    b = (pid // n_t_blocks).to(tl.int64)
    t0 = (pid % n_t_blocks) * BLOCK_T
    t = t0 + tl.arange(0, BLOCK_T)
    t_mask = t < T
    t = t.to(tl.int64)
    if HAS_POS:
        row = tl.load(pos_ptr + b * stride_pb + t * stride_pt, mask=t_mask, other=0).to(tl.int64)
        row_ok = (row >= 0) & (row < n_table)
        row = tl.where(row_ok, row, 0)
        cos_rows = cos_ptr + row * stride_ct
        sin_rows = sin_ptr + row * stride_st
    else:
        row_ok = t_mask
        cos_rows = cos_ptr + b * stride_cb + t * stride_ct
        sin_rows = sin_ptr + b * stride_sb + t * stride_st
    cos_a, cos_b, sin_a, sin_b = _load_tables(
        cos_rows, sin_rows, t_mask, row_ok, half, BLOCK_T, BLOCK_HALF, INTERLEAVED, BACKWARD, HAS_POS
    )
    rot_dim = 2 * half
    # q's heads, then k's: the tensor is selected, not branched on, so that the loop body is
    # one block of loads that HEAD_STAGES > 1 software-pipelines (the next head's loads in
    # flight while this one is rotated).
    for h in tl.range(tl.program_id(1), n_q_heads + n_k_heads, splits, num_stages=HEAD_STAGES):
        is_q = h < n_q_heads
        head = tl.where(is_q, h, h - n_q_heads).to(tl.int64)
        x_base = b * tl.where(is_q, stride_qb, stride_kb) + head * tl.where(is_q, stride_qh, stride_kh)
        out_base = b * tl.where(is_q, stride_oqb, stride_okb) + head * tl.where(is_q, stride_oqh, stride_okh)
        x_rows = tl.where(is_q, q_ptr, k_ptr) + x_base + t * tl.where(is_q, stride_qt, stride_kt)
        o_rows = tl.where(is_q, q_out_ptr, k_out_ptr) + out_base + t * tl.where(is_q, stride_oqt, stride_okt)
        _rotate_rows(
            x_rows, o_rows, t_mask, cos_a, cos_b, sin_a, sin_b, half, rot_dim, head_dim,
            BLOCK_T, BLOCK_HALF, BLOCK_REST, INTERLEAVED, HAS_REST, SOFT_BF16,
        )  # fmt: skip


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    # The kernels assume stride 1 along the last dim (contiguous vector loads); any other
    # stride (rare: an expanded gradient, a column slice) is copied once.
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def is_bthd(t: torch.Tensor) -> bool:
    """t (B, H, T, D) is the transpose of a contiguous (B, T, H, D) tensor: the layout of
    q_proj(x).view(B, T, H, D).transpose(1, 2) in transformers' attention."""
    return t.dim() == 4 and not t.is_contiguous() and t.transpose(1, 2).is_contiguous()


def _empty_in_layout(shape: tuple[int, ...], bthd: bool, like: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) output, stored as (B, T, H, D) when bthd (see _rope_rotate)."""
    B, H, T, D = shape
    if bthd:  # one call: empty() + transpose(1, 2) cost twice the host time
        return empty_strided((B, H, T, D), (T * H * D, D, H * D, 1), like.dtype, like.device)
    return empty((B, H, T, D), like.dtype, like.device)


def rope_config(
    table: RopeTable, T: int, rotary_dim: int, head_dim: int, rows: bool
) -> RopePosConfig | RopeTileConfig:
    """The entry of `table` that RoPE runs for these inputs: the tile kernel's where the table
    has one for the rotary width, each head's positions are contiguous rows (`rows`) and the
    sequence fills a tile; else the position kernel's. Decoding and short sequences (most of a
    tile masked off) and (B, T, H, D) memory (the position kernel reads it contiguously) take
    the position kernel."""
    partial = head_dim > rotary_dim
    tile = table.tile_config(rotary_dim // 2, partial)
    if tile is not None and rows and T >= _block_t(tile, head_dim):
        return tile
    return table.position_config(next_power_of_2(rotary_dim // 2), partial)


def _block_t(cfg: RopeTileConfig, head_dim: int) -> int:
    return max(1, cfg.tile_elements // next_power_of_2(head_dim))


# A launch plan (_plan): the tile kernel's, or the position kernel's.
Plan = tuple[Literal[True], int, int, int, int, int] | tuple[Literal[False], int, int, int]


# The launch plan of an entry for a shape, cached: the helpers' host cost on every launch. Per
# table (hashed by identity) where the table chooses, per configuration where one is given.
@functools.lru_cache(maxsize=1024)
def _table_plan(
    table: RopeTable,
    B: int,
    T: int,
    n_q_heads: int,
    n_k_heads: int,
    rotary_dim: int,
    head_dim: int,
    rows: bool,
) -> Plan:
    cfg = rope_config(table, T, rotary_dim, head_dim, rows)
    return _plan(cfg, B, T, n_q_heads, n_k_heads, rotary_dim, head_dim)


@functools.lru_cache(maxsize=1024)
def _plan(
    cfg: RopePosConfig | RopeTileConfig,
    B: int,
    T: int,
    n_q_heads: int,
    n_k_heads: int,
    rotary_dim: int,
    head_dim: int,
) -> Plan:
    """(True, BLOCK_T, n_t_blocks, splits, warps, head_stages) for the tile kernel, (False,
    BLOCK_H, splits, warps) for the position kernel."""
    if isinstance(cfg, RopeTileConfig):
        block_t = min(_block_t(cfg, head_dim), next_power_of_2(T))
        n_t_blocks = cdiv(T, block_t)
        splits = max(1, min(n_q_heads + n_k_heads, cdiv(cfg.min_programs, max(B * n_t_blocks, 1))))
        return True, block_t, n_t_blocks, splits, cfg.num_warps, cfg.head_stages
    block_half = next_power_of_2(rotary_dim // 2)
    max_heads = next_power_of_2(n_q_heads + n_k_heads)
    block_h = max(1, min(max_heads, cfg.tile_elements // (2 * block_half)))
    n_groups = cdiv(n_q_heads + n_k_heads, block_h)
    splits = max(1, min(n_groups, cdiv(cfg.min_programs, max(B * T, 1))))
    return False, block_h, splits, cfg.num_warps


def rope_rotate_with(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
    interleaved: bool,
    rotary_dim: int,
    inverse: bool,
    q_bthd: bool,
    k_bthd: bool,
    cfg: RopePosConfig | RopeTileConfig | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (B, Hq, T, D) and k (B, Hkv, T, D); inverse=True applies the transpose.

    cfg: the launch to run. A RopeTileConfig runs the tile kernel and a RopePosConfig the
    position kernel, whatever the memory layout; None: the entry of the device's table for these
    inputs (rope_config), which depends on the layout worked out here.

    Returns fresh tensors in q's dtype, (B, H, T, D) views of contiguous (B, T, H, D) memory
    where q_bthd / k_bthd, contiguous (B, H, T, D) otherwise. The forward passes the layout of
    its inputs (is_bthd) and the backward the same flags, so that in transformers' attention
    (q_proj output viewed and transposed) the gradient reaches the projection's view without the
    strided copy that a contiguous (B, H, T, D) gradient costs there. The backward of the rotation is the inverse rotation, so gradients
    (of any order) go through this same launcher.
    """
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    q, k, cos, sin = (_unit_last_stride(t) for t in (q, k, cos, sin))
    q_out = _empty_in_layout((B, Hq, T, D), q_bthd, q)
    k_out = _empty_in_layout((B, Hkv, T, D), k_bthd, k)
    n_pos = B * T
    if n_pos == 0 or (Hq == 0 and Hkv == 0) or D == 0:
        return q_out, k_out
    if cos.dim() == 3:
        stride_cb, stride_ct, stride_sb, stride_st = (
            cos.stride(0),
            cos.stride(1),
            sin.stride(0),
            sin.stride(1),
        )
    else:  # (T, R) or a (P, R) table: no batch stride
        stride_cb, stride_ct, stride_sb, stride_st = 0, cos.stride(0), 0, sin.stride(0)
    has_pos = position_ids is not None
    stride_pb, stride_pt = position_ids.stride() if position_ids is not None else (0, 0)
    n_table = cos.shape[0] if has_pos else 0
    block_half = next_power_of_2(rotary_dim // 2)
    block_rest = next_power_of_2(D - rotary_dim) if rotary_dim < D else 1
    # One stride() call per tensor (each call is host time on every launch).
    sq, sk, sqo, sko = q.stride(), k.stride(), q_out.stride(), k_out.stride()
    rows = sq[2] == D and sk[2] == D and sqo[2] == D and sko[2] == D
    if cfg is None:
        plan = _table_plan(tables_for(q.device).rope, B, T, Hq, Hkv, rotary_dim, D, rows)
    else:
        plan = _plan(cfg, B, T, Hq, Hkv, rotary_dim, D)
    common = (
        q, k, q_out, k_out, cos, sin, position_ids if has_pos else cos,
    )  # fmt: skip
    strides = (
        *sqo[:3], *sko[:3], *sq[:3], *sk[:3],
        stride_cb, stride_ct, stride_sb, stride_st, stride_pb, stride_pt,
    )  # fmt: skip
    flags = dict(
        BLOCK_HALF=block_half, BLOCK_REST=block_rest, INTERLEAVED=interleaved, HAS_POS=has_pos,
        HAS_REST=rotary_dim < D, BACKWARD=inverse, SOFT_BF16=soft_bf16(q), **pdl(q),
    )  # fmt: skip
    with device_guard(q):
        if plan[0]:
            _, block_t, n_t_blocks, splits, num_warps, head_stages = plan
            launch(_rope_tile_kernel, (B * n_t_blocks, splits),
                *common, T, n_table, n_t_blocks, Hq, Hkv, D, rotary_dim // 2, *strides, splits,
                BLOCK_T=block_t, HEAD_STAGES=head_stages, num_warps=num_warps,
                **flags,
            )  # fmt: skip
        else:
            _, block_h, splits, num_warps = plan
            launch(_rope_kernel, (n_pos, splits),
                *common, T, n_table, Hq, Hkv, D, rotary_dim // 2, *strides, splits,
                BLOCK_H=block_h, num_warps=num_warps, **flags,
            )  # fmt: skip
    return q_out, k_out


def _rope_rotate(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
    interleaved: bool,
    rotary_dim: int,
    inverse: bool,
    q_bthd: bool,
    k_bthd: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The custom op's body: rope_rotate_with the device's table choosing the launch."""
    return rope_rotate_with(
        q, k, cos, sin, position_ids, interleaved, rotary_dim, inverse, q_bthd, k_bthd, None
    )


# --- torch.library op and autograd ----------------------------------------------------------------

rope_rotate = torch.library.custom_op("lmkernels::rope_rotate", _rope_rotate, mutates_args=())


@rope_rotate.register_fake
def _(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
    interleaved: bool,
    rotary_dim: int,
    inverse: bool,
    q_bthd: bool,
    k_bthd: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _empty_in_layout(q.shape, q_bthd, q), _empty_in_layout(k.shape, k_bthd, k)


def _setup_context(ctx: Any, inputs: tuple, output: tuple[torch.Tensor, torch.Tensor]) -> None:
    q, k, cos, sin, position_ids, interleaved, rotary_dim, inverse, q_bthd, k_bthd = inputs
    ctx.save_for_backward(cos, sin, position_ids)
    ctx.options = (interleaved, rotary_dim, inverse, q_bthd, k_bthd)


def _setup_context_eager(ctx: Any, inputs: tuple, output: tuple[torch.Tensor, torch.Tensor]) -> None:
    """The eager Function's: the tables are kept as plain attributes, not saved tensors, which
    autograd frees after the node's first backward. q_out and k_out share this node, so a
    backward through q_out alone must leave k_out's for later (two backward calls work, as
    with eager PyTorch). Nothing is lost: the tables are inputs, never written."""
    q, k, cos, sin, position_ids, interleaved, rotary_dim, inverse, q_bthd, k_bthd = inputs
    ctx.tables = (cos, sin, position_ids)
    ctx.options = (interleaved, rotary_dim, inverse, q_bthd, k_bthd)


def _backward(
    ctx: Any, grad_q: torch.Tensor | None, grad_k: torch.Tensor | None
) -> tuple[torch.Tensor | None, ...]:
    if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
        raise BackendNotSupportedError("rope: backend 'triton' has no gradients for cos and sin")
    if grad_q is None or grad_k is None:  # not materialized (_setup_context_transforms)
        q_shape, k_shape = ctx.shapes
        if grad_q is None:
            assert grad_k is not None  # (the backward runs for a gradient of q_out or of k_out)
            grad_q = grad_k.new_zeros(q_shape)
        else:
            grad_k = grad_q.new_zeros(k_shape)
    cos, sin, position_ids = ctx.tables if hasattr(ctx, "tables") else ctx.saved_tensors
    interleaved, rotary_dim, inverse, q_bthd, k_bthd = ctx.options
    # dq, dk in the layouts of q and k (see _rope_rotate).
    args = (grad_q, grad_k, cos, sin, position_ids, interleaved, rotary_dim, not inverse, q_bthd, k_bthd)
    # The inverse rotation, itself differentiable (create_graph=True): run like the forward, or
    # with grad mode on outside a transform (torch.func.vjp's function, after its transform has
    # ended: the tables may be functorch's tensors) by the transforms' Function.
    if torch.is_grad_enabled() and not (transforming() or traced(args)):
        dq, dk = _RopeFunction.transforms.apply(*args)  # type: ignore[attr-defined]
    else:
        dq, dk = call(rope_rotate, _RopeFunction, *args)
    return dq, dk, None, None, None, None, None, None, None, None


def _setup_context_transforms(ctx: Any, inputs: tuple, output: tuple[torch.Tensor, torch.Tensor]) -> None:
    _setup_context(ctx, inputs, output)
    ctx.save_for_forward(*inputs[:5])  # q, k, cos, sin, position_ids
    # The jvp must see which inputs have no tangent (None, not zeros: cos and sin are refused).
    ctx.set_materialize_grads(False)
    ctx.shapes = (inputs[0].shape, inputs[1].shape)


def _jvp(
    ctx: Any,
    dq: torch.Tensor | None,
    dk: torch.Tensor | None,
    dcos: torch.Tensor | None,
    dsin: torch.Tensor | None,
    *_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation is linear in q and k: their tangents, rotated like them (the same launcher).
    Both outputs get one (zeros for an input without): a None among them fails an internal
    assert of torch's forward AD under an outer grad transform."""
    if dcos is not None or dsin is not None:
        raise forward_ad_error("rope", "triton", "for cos and sin")
    refuse_nested_jvp("rope")
    q, k, cos, sin, position_ids = ctx.saved_tensors
    tq = dq if dq is not None else torch.zeros_like(q)
    tk = dk if dk is not None else torch.zeros_like(k)
    return call(rope_rotate, _RopeFunction, tq, tk, cos, sin, position_ids, *ctx.options)


rope_rotate.register_autograd(_backward, setup_context=_setup_context)
_RopeFunction = eager_function(
    "_RopeFunction",
    _rope_rotate,
    _setup_context_eager,
    _backward,
    transforms_function(
        "_RopeTransforms", rope_rotate, _rope_rotate, _setup_context_transforms, _backward, _jvp
    ),
)


# --- lmkernels impl --------------------------------------------------------------------------------


def rope_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    layout: RopeLayout = "neox",
    rotary_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    rdim = q.shape[-1] if rotary_dim is None else rotary_dim
    return call(
        rope_rotate,
        _RopeFunction,
        q,
        k,
        cos,
        sin,
        position_ids,
        layout == "interleaved",
        rdim,
        False,
        is_bthd(q),
        is_bthd(k),
    )


def _supports(
    q: torch.Tensor | None = None,
    k: torch.Tensor | None = None,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    **options: Any,
) -> list[str]:
    reasons = []
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (cos, sin)):
        reasons.append("gradients for cos/sin are not implemented (they require grad)")
    return reasons


# Triton before 3.8 cannot compile _rope_kernel for AMD GPUs: its AMD backend's pointer
# canonicalization pass (TritonAMDGPUCanonicalizePointers) fails on the select between q's and
# k's row pointers (`lmkernels compile-check --target gfx942` shows it). There the op refuses
# the Triton backend by name, and `auto` picks another.
AMD_MIN_TRITON = (3, 8)


def amd_compile_failure(triton_version: str) -> str | None:
    """Why Triton `triton_version` cannot compile the RoPE kernels for an AMD GPU, or None."""
    if _version(triton_version) < AMD_MIN_TRITON:
        return f"the AMD backend of triton {triton_version} cannot compile the RoPE kernel (needs >= 3.8)"
    return None


def _available() -> str | None:
    reason = triton_unavailable_reason()
    if reason is None and torch.version.hip is not None:
        reason = amd_compile_failure(triton.__version__)
    return reason


register(
    "rope", "triton", rope_triton, priority=100, devices=triton_devices(), auto_devices=("cuda",),
    available=_available, **gpu_capabilities("rope", _supports),
    double_backward=True,  # the backward is the inverse rotation, itself differentiable
    forward_ad=True,  # and the tangent the rotation of the tangents (of q and k: cos/sin refused)
    compiled_transforms=False,
    description="Triton, q and k in one launch, programs per position or per tile of positions",
)  # fmt: skip
