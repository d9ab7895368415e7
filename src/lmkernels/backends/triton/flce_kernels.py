"""Fused linear cross entropy, Triton backend: the plan (the mode of a call, its chunk and block
sizes), the row kernel and the GEMM loops around it. flce.py holds the op, its autograd and the
design notes.

Two loops:

- `run_chunks`: token chunks over the whole vocabulary. Per chunk cuBLAS writes the logits
  (fp32, or bf16 as the model's lm_head rounds them: the plan's choice), `_flce_rows_kernel`
  turns each row into logsumexp + loss and (when a gradient is given) d loss / d logits in the
  input dtype over the logits, and cuBLAS takes grad_hidden / grad_W / grad_bias from those.
  The forward uses it: the "fast" mode computes every gradient here (6*BT*H*V flops in all),
  the "lean" mode only the logsumexp.
- `run_blocks`: the recomputing backward, blocked over (token super-chunk x vocabulary block)
  so that its memory is a budget, not a function of V: each block's logits are recomputed,
  turned into dlogits with the saved logsumexp, and cuBLAS writes that block's grad_W rows
  once (one fp32-accumulated GEMM over the super-chunk's tokens) and adds its share of
  grad_hidden into an fp32 accumulator of the super-chunk.

No host synchronization: denominators, scales and the logsumexp stay on the device. Two
environment variables fix the sizes (tests, tuning): LMKERNELS_FLCE_CHUNK_TOKENS the tokens per
forward chunk, LMKERNELS_FLCE_BLOCKS="TOKENS,COLUMNS" the recomputing backward's super-chunk
tokens and vocabulary block.
"""

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any, overload

import torch
import triton
import triton.language as tl
from torch.autograd.graph import increment_version

from lmkernels.backends.triton.common import cdiv, launch, pdl, pdl_enter, soft_bf16, to_dtype
from lmkernels.backends.triton.configs.records import FlceTable
from lmkernels.utils import empty, env_sizes

# --- the plan ------------------------------------------------------------------------------------

# Token chunks of run_chunks: at most CHUNK_BYTES of logits (fp32, or bf16 in the default fast
# mode for bf16 inputs), or the lean budget below when that is smaller; CHUNK_ENV overrides it.
CHUNK_BYTES = 1 << 30
CHUNK_ENV = "LMKERNELS_FLCE_CHUNK_TOKENS"
BLOCKS_ENV = "LMKERNELS_FLCE_BLOCKS"
# Memory the lean mode may use beyond the gradients it returns, as a fraction of their bytes
# (grad_W + grad_hidden): the recomputed logits block plus the fp32 grad_hidden accumulator.
LEAN_EXTRA_FRACTION = 0.08
# Smallest blocks the budget may shrink to: below these the GEMMs lose their efficiency, and
# narrower blocks cost far more time than the little memory they save (docs/performance.md,
# "Design decisions and their measurements").
MIN_SUPER_CHUNK = 256
MIN_VOCAB_BLOCK = 2048
# grad_W rows summed over super-chunks in the weight's dtype round once per super-chunk: at most
# this many, which keeps grad_W's error within the accuracy policy's 3x eager's with a margin
# (docs/performance.md, "Design decisions and their measurements").
MAX_SUPER_CHUNKS = 8
MIN_FAST_CHUNK_TOKENS = 1024  # see fast_weight_dtype_chunk
# The default's bf16 chunks on long batches (see bf16_logits_chunk): where 8 chunks would pass
# LONG_CHUNK_TOKENS tokens each, up to LONG_MAX_CHUNKS chunks of at least LONG_CHUNK_TOKENS.
LONG_CHUNK_TOKENS = 2048
LONG_MAX_CHUNKS = 16


def _round_down(x: int, multiple: int) -> int:
    return x // multiple * multiple


def _chunk_rows(nbytes: int, V: int) -> int:
    """Tokens of fp32 logits that fit nbytes, a multiple of 128 (cuBLAS tile height), below 2^31
    logits per chunk (0 or less: none fit)."""
    return _round_down(min(nbytes // (4 * V), 2**31 // V), 128)


def _chunk_override() -> int:
    """Tokens per forward chunk fixed by the environment (0: not fixed)."""
    fixed = env_sizes(CHUNK_ENV, 1)
    return fixed[0] if fixed else 0


def lean_budget_bytes(BT: int, H: int, V: int, itemsize: int) -> int:
    """Bytes the lean mode may use beyond its gradients (LEAN_EXTRA_FRACTION of them)."""
    return int(LEAN_EXTRA_FRACTION * (V + BT) * H * itemsize)


def flce_chunk_tokens(BT: int, V: int, max_bytes: int | None = None, logit_bytes: int = 4) -> int:
    """Tokens per run_chunks chunk: CHUNK_BYTES (or max_bytes, if smaller) of logits of
    logit_bytes each, rounded down to a multiple of 128 (cuBLAS tile height), at least 128, at
    most BT."""
    override = _chunk_override()
    if override > 0:
        rows = override
    else:
        budget = CHUNK_BYTES if max_bytes is None else min(CHUNK_BYTES, max_bytes)
        rows = max(128, _round_down(budget // (logit_bytes * V), 128))
    return max(1, min(rows, BT))


def fast_weight_dtype_chunk(BT: int, V: int, logit_bytes: int = 4) -> int | None:
    """The fast mode's default (grad_accum_dtype=None) grad_W accumulation: in the weight's own
    dtype over at most MAX_SUPER_CHUNKS token chunks (the rounding count the policy allows, as
    in the lean mode), when chunks of cdiv(BT, MAX_SUPER_CHUNKS) tokens, but at least
    MIN_FAST_CHUNK_TOKENS (smaller chunks re-read and re-write grad_W too often for their
    GEMMs to pay), fit CHUNK_BYTES of logits (of logit_bytes each). Returns those chunks'
    tokens (a multiple of 128), or None.

    Against an fp32 V x H accumulator this saves 4*V*H bytes (plus the conversion's copy) and
    holds a smaller logits chunk: about the memory of Liger's chunked loss, at the same speed
    (the bf16 read-modify-write of grad_W per chunk moves half the fp32 one's bytes)."""
    override = _chunk_override()
    if override > 0:
        return override if cdiv(BT, override) <= MAX_SUPER_CHUNKS else None
    return _even_chunks(BT, V, logit_bytes, MAX_SUPER_CHUNKS, MIN_FAST_CHUNK_TOKENS)


def _even_chunks(BT: int, V: int, logit_bytes: int, chunks: int, min_tokens: int) -> int | None:
    """Tokens per chunk for `chunks` even chunks of BT, rounded up to 128, at least min_tokens,
    where such a chunk's logits fit CHUNK_BYTES; else None."""
    tokens = max(cdiv(cdiv(BT, chunks), 128) * 128, min_tokens)
    return tokens if tokens * V * logit_bytes <= CHUNK_BYTES else None


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one FLCE call runs. lean: the forward keeps only the logsumexp and the backward
    recomputes the logits (else the forward computes every gradient: the fast mode). accum_fp32:
    grad_W summed in fp32 (rounded once), else in its own dtype over at most MAX_SUPER_CHUNKS
    chunks. chunk_bytes: the forward's logits chunk, at most (0: CHUNK_BYTES). block_bytes:
    what the recomputing backward may hold beyond the gradients (logits block + fp32 grad_hidden
    accumulator). fp32_logits: the forward's chunks hold fp32 logits, else bf16 ones, rounded as
    the model's own lm_head rounds them (see bf16_logits_chunk)."""

    lean: bool
    accum_fp32: bool
    chunk_bytes: int
    block_bytes: int
    fp32_logits: bool = True


def bf16_logits_chunk(BT: int, V: int, weight_dtype: torch.dtype, itemsize: int) -> int | None:
    """The default fast mode's chunks for bf16 inputs: bf16 logits (rounded as the model's
    lm_head and the eager reference round them, so the loss's error is eager's) in
    fast_weight_dtype_chunk's chunks of at most CHUNK_BYTES of bf16, grad_W summed in bf16.
    Against fp32 logits chunks the GEMM writes and the kernel reads half the bytes, and twice
    the tokens fit a chunk: about the time of fp32 chunks or less, at a lower peak.

    Long batches get more chunks: where 8 would pass LONG_CHUNK_TOKENS tokens each, up to
    LONG_MAX_CHUNKS of at least LONG_CHUNK_TOKENS. The grad_W update's GEMM (inner dimension:
    the chunk's tokens) keeps its rate down to 2048 tokens, so 16 chunks cost about 8's time at
    a lower peak, where smaller chunks would cost time and grad_W accuracy. The measurements
    behind both choices: docs/performance.md, "Design decisions and their measurements".
    Returns the chunk's tokens, or None."""
    if weight_dtype != torch.bfloat16 or itemsize != 2:
        return None
    if _chunk_override() > 0 or cdiv(BT, MAX_SUPER_CHUNKS) <= LONG_CHUNK_TOKENS:
        return fast_weight_dtype_chunk(BT, V, logit_bytes=2)
    return _even_chunks(BT, V, 2, LONG_MAX_CHUNKS, LONG_CHUNK_TOKENS)


def bf16_budget_chunk(
    BT: int, V: int, weight_dtype: torch.dtype, itemsize: int, max_bytes: int
) -> int | None:
    """The default's bf16 chunks made smaller for a budget below its own: one size per head, the
    smallest the rules allow: even chunks of at least MIN_FAST_CHUNK_TOKENS tokens (smaller ones
    re-read grad_W too often), at most LONG_MAX_CHUNKS of them (the most bf16 sums of grad_W
    the accuracy policy allows), smaller than the default's, within max_bytes of bf16 logits.
    Returns the chunk's tokens, or None."""
    default = bf16_logits_chunk(BT, V, weight_dtype, itemsize)
    if default is None:
        return None
    tokens = max(cdiv(cdiv(BT, LONG_MAX_CHUNKS), 128) * 128, MIN_FAST_CHUNK_TOKENS)
    fits = tokens < min(default, BT) and tokens * V * 2 <= min(max_bytes, CHUNK_BYTES)
    return tokens if fits else None


def plan(
    BT: int,
    H: int,
    V: int,
    itemsize: int,
    weight_dtype: torch.dtype,
    grad_accum_dtype: torch.dtype | None,
    lean_default: bool,
    memory_budget: float | None,
    grads_now: bool,
    need_weight: bool,
) -> Plan:
    """The mode and sizes of one call (flce.py's docstring). grads_now: a reduced loss whose
    gradients are wanted (the fast mode can compute them in the forward).

    memory_budget None: the backend's own default (triton: the fast mode with chunks of up to
    CHUNK_BYTES; triton_lean: LEAN_EXTRA_FRACTION of the gradients). A number f: at most about
    f x the gradients' bytes (grad_hidden + grad_W) beyond them: the triton default where it
    fits (fast_extra_bytes), else its bf16 chunks made smaller (bf16_budget_chunk), else the
    fast mode's largest fp32 chunks that fit, else the lean mode within it. The block floors of
    flce_blocks (accuracy and GEMM efficiency) win over a budget below them.
    """
    grad_bytes = (BT + V) * H * itemsize
    fp32_ok = grad_accum_dtype in (None, torch.float32)
    own_ok = _sums_in_own_dtype(weight_dtype, grad_accum_dtype)
    if memory_budget is None and not lean_default:
        return _fast_default(BT, V, itemsize, weight_dtype, grad_accum_dtype, grads_now, need_weight)
    extra = int((LEAN_EXTRA_FRACTION if memory_budget is None else memory_budget) * grad_bytes)
    if memory_budget is not None and grads_now:
        # The default wherever it fits: no other plan is faster, so a budget that holds it
        # runs it (docs/performance.md, "Design decisions and their measurements").
        fast = _fast_default(BT, V, itemsize, weight_dtype, grad_accum_dtype, grads_now, need_weight)
        if fast_extra_bytes(fast, BT, H, V, need_weight, weight_dtype) <= extra:
            return fast
        # Else the default's bf16 chunks, smaller.
        if need_weight and grad_accum_dtype in (None, weight_dtype):
            tokens = bf16_budget_chunk(BT, V, weight_dtype, itemsize, extra)
            if tokens is not None:
                return Plan(False, False, tokens * V * 2, extra, fp32_logits=False)
        # Else a chunk of fp32 logits (at most CHUNK_BYTES, run_chunks' cap), and grad_W summed
        # in its own dtype over at most MAX_SUPER_CHUNKS chunks, or else in an fp32 accumulator
        # that the budget pays for too.
        rows = _chunk_rows(min(extra, CHUNK_BYTES), V)
        summed = own_ok and (rows >= BT or cdiv(BT, max(rows, 1)) <= MAX_SUPER_CHUNKS)
        if rows > 0 and (not need_weight or summed):
            return Plan(False, False, rows * V * 4, extra)
        # (chunks of fewer tokens than MIN_FAST_CHUNK_TOKENS would read and write the fp32
        # accumulator so often that the recomputing backward is faster)
        acc_loop, acc_end = _fp32_accumulator_extra(V, H, weight_dtype)
        rows = _chunk_rows(min(extra - acc_loop, CHUNK_BYTES), V)
        if rows >= min(BT, MIN_FAST_CHUNK_TOKENS) and acc_end <= extra and need_weight and fp32_ok:
            return Plan(False, True, rows * V * 4, extra)
    return Plan(True, grad_accum_dtype == torch.float32, grad_bytes + extra, extra)


def _fast_default(
    BT: int,
    V: int,
    itemsize: int,
    weight_dtype: torch.dtype,
    grad_accum_dtype: torch.dtype | None,
    grads_now: bool,
    need_weight: bool,
) -> Plan:
    """The triton backend's default plan (memory_budget None): the fast mode, its chunks as
    flce.py's docstring says."""
    own_ok = _sums_in_own_dtype(weight_dtype, grad_accum_dtype)
    if grads_now and need_weight and grad_accum_dtype in (None, weight_dtype):
        tokens = bf16_logits_chunk(BT, V, weight_dtype, itemsize)
        if tokens is not None:
            return Plan(False, False, tokens * V * 2, CHUNK_BYTES, fp32_logits=False)
    tokens = fast_weight_dtype_chunk(BT, V) if need_weight else None
    accum = grad_accum_dtype == torch.float32 or (grad_accum_dtype is None and (not own_ok or tokens is None))
    chunk = tokens * V * 4 if grads_now and need_weight and not accum and tokens is not None else 0
    return Plan(False, accum, chunk, CHUNK_BYTES)


def _sums_in_own_dtype(weight_dtype: torch.dtype, grad_accum_dtype: torch.dtype | None) -> bool:
    """Whether grad_W may be summed over chunks in the weight's own dtype: asked for, or the
    default for every dtype but fp16 (whose sums keep an fp32 accumulator)."""
    return grad_accum_dtype == weight_dtype or (grad_accum_dtype is None and weight_dtype != torch.float16)


def _fp32_accumulator_extra(V: int, H: int, weight_dtype: torch.dtype) -> tuple[int, int]:
    """Bytes an fp32 grad_W accumulator holds beyond grad_W (V x H in the weight's dtype): during
    the chunks (in grad_W's place) and at the end (its conversion, both alive)."""
    if weight_dtype == torch.float32:
        return 0, 0  # the accumulator is grad_W
    return V * H * (4 - weight_dtype.itemsize), V * H * 4


def fast_extra_bytes(p: Plan, BT: int, H: int, V: int, need_weight: bool, weight_dtype: torch.dtype) -> int:
    """What a fast-mode plan holds beyond the gradients: its largest logits chunk (as run_chunks
    sizes it) beside an fp32 grad_W accumulator's extra bytes, or the accumulator at its end."""
    logit_bytes = 4 if p.fp32_logits else 2
    chunk = flce_chunk_tokens(BT, V, p.chunk_bytes or None, logit_bytes) * V * logit_bytes
    if not (p.accum_fp32 and need_weight):
        return chunk
    acc_loop, acc_end = _fp32_accumulator_extra(V, H, weight_dtype)
    return max(chunk + acc_loop, acc_end)


def flce_blocks(
    BT: int, H: int, V: int, budget: int, whole_tokens: bool, accumulate_h: bool
) -> tuple[int, int]:
    """(tokens per super-chunk, vocabulary columns per block) of run_blocks within `budget` bytes.

    The budget pays for the fp32 logits block (super-chunk x block x 4) and, with accumulate_h,
    the super-chunk's fp32 grad_hidden accumulator (super-chunk x H x 4). whole_tokens: one
    super-chunk of all BT tokens (grad_W rounded once: each block written once); otherwise the
    super-chunks split the tokens evenly, with half the budget for the accumulator, and at
    most MAX_SUPER_CHUNKS of them (accuracy wins over the budget there).
    """
    fixed = env_sizes(BLOCKS_ENV, 2)
    if fixed is not None:
        return (BT if whole_tokens else min(fixed[0], BT)), min(fixed[1], V)
    acc_per_token = 4 * H if accumulate_h else 0
    if whole_tokens or BT <= MIN_SUPER_CHUNK:
        tokens = BT
    else:
        tokens = max(MIN_SUPER_CHUNK, _round_down(budget // 2 // max(acc_per_token, 1), 128))
        tokens = min(max(tokens, cdiv(BT, MAX_SUPER_CHUNKS)), BT)
        n = cdiv(BT, tokens)
        tokens = min(BT, cdiv(cdiv(BT, n), 128) * 128)  # even super-chunks
    left = budget - tokens * acc_per_token
    cols = _round_down(max(left, 0) // (4 * max(tokens, 1)), 128)
    return max(1, tokens), max(1, min(V, max(MIN_VOCAB_BLOCK, cols)))


FP16_DLOGITS_SCALE = 2.0**8  # fp16 dlogits are scaled up by this (flce.py's docstring)
SCALE_BLOCK = 8192  # elements per program of scale_


# --- kernels -------------------------------------------------------------------------------------


@triton.jit
def _tanh(x):
    # libdevice's tanh does not run under TRITON_INTERPRET. (1 - e) / (1 + e) with e = exp(-2|x|)
    # loses relative precision as |x| -> 0 (1 - e cancels), so small |x| use the Taylor series,
    # whose first dropped term is below 1e-8 relative for |x| < 0.25.
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    far = (1.0 - e) / (1.0 + e)
    x2 = x * x
    near = ax * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
    r = tl.where(ax < 0.25, near, far)
    return tl.where(x < 0, -r, r)


@triton.jit
def _flce_rows_kernel(
    logits_ptr,  # (rows, V) fp32 or the input dtype, row stride stride_logits
    dlogits_ptr,  # the same memory seen in the gradient dtype, row stride stride_dlogits
    target_ptr,
    bias_ptr,
    class_weight_ptr,
    class_weight_sum_ptr,  # 0-dim fp32: sum of the class weights
    grad_ptr,  # upstream gradient per token; grad_stride 0 broadcasts one scalar
    lse_ptr,  # written (LSE_GIVEN False) or read (True)
    loss_ptr,  # per-token loss, written when LSE_GIVEN is False
    entropy_ptr,  # per-token entropy of the softmax, written with STATS, read with ENTROPY_GRAD
    top1_ptr,  # per token: the target's logit is the largest (int8), written with STATS
    entropy_grad_ptr,  # per-token upstream gradient of the entropy (fp32), read with ENTROPY_GRAD
    V,
    col_start,  # the window's first column in the full vocabulary
    n_cols,  # the window's width (V for a full row; pass 1 needs full rows)
    stride_logits,
    stride_dlogits,
    grad_stride,
    ignore_index,
    label_smoothing,
    softcap,
    z_loss_scale,
    inv_temperature,  # 1 / T: the logits are multiplied by it after the softcap
    HAS_BIAS: tl.constexpr,
    HAS_CLASS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    LSE_GIVEN: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    STATS: tl.constexpr,
    HAS_TEMPERATURE: tl.constexpr,
    ENTROPY_GRAD: tl.constexpr,  # pass 2 adds g_H * dH/dz (LSE_GIVEN: the recomputing backward)
    BLOCK_V: tl.constexpr,
    SOFT_BF16: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    z_row = logits_ptr + row * stride_logits
    cols = tl.arange(0, BLOCK_V)

    t = tl.load(target_ptr + row).to(tl.int64)
    valid = t != ignore_index
    t_ok = valid & (t >= 0) & (t < V)
    bad_target = valid & ((t < 0) | (t >= V))
    # Weight of the target class: 0 on ignored tokens, nan on an out-of-range target (never
    # read), which makes that token's loss and gradients nan.
    if HAS_CLASS_WEIGHT:
        w_t = tl.load(class_weight_ptr + t, mask=t_ok, other=0.0).to(tl.float32)
        w_sum = tl.load(class_weight_sum_ptr)
    else:
        w_t = tl.where(t_ok, 1.0, 0.0)
        w_sum = V * 1.0
    w_t = tl.where(bad_target, float("nan"), w_t)
    smooth_v = label_smoothing / V

    if LSE_GIVEN:
        lse = tl.load(lse_ptr + row)
    else:
        # Pass 1: online max and sum of exp over blocks of the row, last block first: pass 2
        # starts at the first block, the most recently read, so its reads find more of the row
        # in L2.
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        zw = tl.zeros((), tl.float32)  # sum_c w_c z_c for label smoothing
        pz = tl.zeros((), tl.float32)  # STATS: sum_c exp(z_c - shift) z_c, for the entropy
        n_blocks = tl.cdiv(n_cols, BLOCK_V)
        for i in range(0, n_blocks):
            start = (n_blocks - 1 - i) * BLOCK_V
            c = start + cols  # col_start is 0 here
            mask = c < n_cols
            z = tl.load(z_row + c, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS:
                z += tl.load(bias_ptr + c, mask=mask, other=0.0).to(tl.float32)
            if HAS_SOFTCAP:
                z = softcap * _tanh(z / softcap)
            if HAS_TEMPERATURE:
                z = z * inv_temperature
            if HAS_SMOOTHING:
                if HAS_CLASS_WEIGHT:
                    w_c = tl.load(class_weight_ptr + c, mask=mask, other=0.0).to(tl.float32)
                    zw += tl.sum(tl.where(mask, w_c * z, 0.0), 0)
                else:
                    zw += tl.sum(tl.where(mask, z, 0.0), 0)
            z = tl.where(mask, z, float("-inf"))
            m_new = tl.maximum(m, tl.max(z, 0))
            # While every logit so far is -inf, shift by 0 (not -inf - -inf = nan): s stays 0.
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            rescale = tl.exp(m - shift)
            e = tl.exp(z - shift)
            s = s * rescale + tl.sum(e, 0)
            if STATS:
                pz = pz * rescale + tl.sum(tl.where(e > 0, e * z, 0.0), 0)
            m = m_new
        # A +inf logit makes the logsumexp +inf, as torch.logsumexp has it (s is nan then).
        lse = tl.where(m == float("inf"), m, m + tl.log(s))

        z_t = tl.load(z_row + t, mask=t_ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            z_t += tl.load(bias_ptr + t, mask=t_ok, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            z_t = softcap * _tanh(z_t / softcap)
        if HAS_TEMPERATURE:
            z_t = z_t * inv_temperature
        loss = (1.0 - label_smoothing) * w_t * (lse - z_t)
        if HAS_SMOOTHING:
            loss += smooth_v * (w_sum * lse - zw)
        if HAS_Z_LOSS:
            loss += z_loss_scale * lse * lse
        tl.store(loss_ptr + row, tl.where(valid, loss, 0.0))
        tl.store(lse_ptr + row, lse)
        if STATS:
            tl.store(entropy_ptr + row, lse - pz / s)
            tl.store(top1_ptr + row, (t_ok & (z_t >= m)).to(tl.int8))

    if WRITE_GRAD:
        if not LSE_GIVEN:
            # Every warp has read the target's logit (z_t) before any warp overwrites it below.
            tl.debug_barrier()
        # Pass 2: d loss / d z_c = g * (p_c * coef - (1-e) w_t [c == t] - (e/V) w_c), with
        # coef = (1-e) w_t + (e/V) sum(w) + 2 s lse; with ENTROPY_GRAD plus
        # g_H * dH / d z_c = -g_H p_c (z_c - lse + H) (ignored tokens too: their entropy is an
        # output); times 1 - tanh^2 through the softcap and 1 / T through the temperature, which
        # every term is linear in g and g_H takes with them.
        g = tl.load(grad_ptr + row * grad_stride).to(tl.float32)
        g = tl.where(valid, g, 0.0)
        if HAS_TEMPERATURE:
            g = g * inv_temperature
        if ENTROPY_GRAD:
            g_h = tl.load(entropy_grad_ptr + row).to(tl.float32)
            if HAS_TEMPERATURE:
                g_h = g_h * inv_temperature
            lse_minus_h = lse - tl.load(entropy_ptr + row)  # -g_H p_c (z_c - lse + H)
        coef = (1.0 - label_smoothing) * w_t
        if HAS_SMOOTHING:
            coef += smooth_v * w_sum
        if HAS_Z_LOSS:
            coef += 2.0 * z_loss_scale * lse
        a = coef * g
        b = (1.0 - label_smoothing) * w_t * g
        d_row = dlogits_ptr + row * stride_dlogits
        for start in range(0, n_cols, BLOCK_V):
            local = start + cols
            mask = local < n_cols
            c = col_start + local  # column in the full vocabulary
            z = tl.load(z_row + local, mask=mask, other=0.0).to(tl.float32)
            # dlogits overwrite the logits in place. Over fp32 logits a 2-byte column c lands
            # on the bytes of fp32 column c // 2, which another warp loads: wait until every
            # warp has loaded this block (and so all earlier ones) before any store. In the
            # logits' own dtype each column is stored by the thread that loaded it.
            if logits_ptr.dtype.element_ty != dlogits_ptr.dtype.element_ty:
                tl.debug_barrier()
            if HAS_BIAS:
                z += tl.load(bias_ptr + c, mask=mask, other=0.0).to(tl.float32)
            if HAS_SOFTCAP:
                th = _tanh(z / softcap)
                z = softcap * th
            if HAS_TEMPERATURE:
                z = z * inv_temperature
            if ENTROPY_GRAD:
                p = tl.exp(z - lse)
                # (p = 0: no term, also where z - lse + H is not finite)
                d = tl.where(p > 0.0, p * (a + g_h * (lse_minus_h - z)), 0.0)
            else:
                d = tl.exp(z - lse) * a
            d = tl.where(c == t, d - b, d)
            if HAS_SMOOTHING:
                if HAS_CLASS_WEIGHT:
                    w_c = tl.load(class_weight_ptr + c, mask=mask, other=0.0).to(tl.float32)
                    d -= (smooth_v * g) * w_c
                else:
                    d -= smooth_v * g
            if HAS_SOFTCAP:
                d = d * (1.0 - th * th)
            tl.store(d_row + local, to_dtype(d, dlogits_ptr.dtype.element_ty, SOFT_BF16), mask=mask)


@triton.jit
def _scale_kernel(
    x_ptr, scale_ptr, n, BLOCK: tl.constexpr, SOFT_BF16: tl.constexpr, PDL: tl.constexpr = False
):
    pdl_enter(PDL)
    scale = tl.load(scale_ptr).to(tl.float32)
    # An upstream gradient of exactly 1 (loss.backward() of the loss itself) leaves every value
    # as it is, bit for bit: the product is x, which its dtype holds. Nothing is read or written.
    if scale != 1.0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask).to(tl.float32) * scale
        tl.store(x_ptr + offs, to_dtype(x, x_ptr.dtype.element_ty, SOFT_BF16), mask=mask)


def scale_(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x *= scale in place, with x contiguous and scale a 0-dim tensor on x's device (no host
    sync): the product taken in fp32 and rounded to x's dtype once.

    torch's x.mul_(scale) on CUDA treats the 0-dim device tensor as a stride-0 operand, rounds
    it to x's dtype (bf16: up to 2^-8 relative) and runs its non-vectorized elementwise kernel,
    several times slower than this one, which runs close to the time of one read and one write
    of x's bytes (docs/performance.md, "Design decisions and their measurements"). With
    scale == 1 (checked on the device: no host sync) the kernel touches nothing, and the version
    counter is still bumped."""
    n = x.numel()
    if n:
        launch(
            _scale_kernel, (cdiv(n, SCALE_BLOCK),), x, scale, n,
            BLOCK=SCALE_BLOCK, SOFT_BF16=soft_bf16(x), num_warps=8, **pdl(x),
        )  # fmt: skip
    increment_version(x)  # as an in-place torch op would: autograd's saved-tensor check sees it
    return x


# --- GEMM helpers ----------------------------------------------------------------------------------


_MM_FP32_OUT = hasattr(torch.ops.aten.mm, "dtype_out")  # torch.mm(..., out_dtype=) exists
_ADDMM_FP32_ACC: bool | None = None  # cuBLAS adds bf16 x bf16 into an fp32 C (probed once)


def _cuda_fp32_out(x: torch.Tensor) -> bool:
    """Whether torch.mm can give fp32 output for x's low-precision inputs (CUDA only)."""
    return x.is_cuda and x.dtype != torch.float32 and _MM_FP32_OUT


def _mm_fp32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out (fp32) = a @ b accumulated in fp32."""
    if a.dtype == torch.float32:
        torch.mm(a, b, out=out)
    elif _cuda_fp32_out(a):
        torch.mm(a, b, out_dtype=torch.float32, out=out)
    else:  # CPU (or an old torch): upcast; only the CPU test path and old versions get here
        torch.mm(a.float(), b.float(), out=out)


def _addmm_fp32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (fp32) += a @ b for a, b of any float dtype, without an fp32 copy of the product."""
    global _ADDMM_FP32_ACC
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
        return
    if _cuda_fp32_out(a) and _ADDMM_FP32_ACC is not False:
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            _ADDMM_FP32_ACC = True
            return
        except RuntimeError:  # older torch: self must have the inputs' dtype
            _ADDMM_FP32_ACC = False
    acc.addmm_(a.float(), b.float())


@contextlib.contextmanager
def _precise_matmuls(dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    """cuBLAS as precise as the correctness policy needs, whatever the global settings.

    fp32 inputs get IEEE fp32 GEMMs (no TF32). bf16/fp16 GEMMs reduce split-K partial sums in
    fp32: PyTorch's default lets cuBLAS round them to 16 bits, an extra rounding per split of
    the K = V sum of dlogits @ W. Restored on exit.
    """
    if device.type != "cuda":
        yield
        return
    m = torch.backends.cuda.matmul
    value: Any  # a flag, or a (reduced precision, split-K) pair of flags
    previous: Any
    if dtype == torch.float32:
        # torch >= 2.9 raises on reading the legacy flag once the new one was set: prefer the new.
        name, value = ("fp32_precision", "ieee") if hasattr(m, "fp32_precision") else ("allow_tf32", False)
        previous = getattr(m, name)
    else:
        name = f"allow_{'bf16' if dtype == torch.bfloat16 else 'fp16'}_reduced_precision_reduction"
        previous, value = getattr(m, name), False
        if hasattr(m, f"{name}_split_k"):  # (reduced precision, split-K) pairs: keep split-K
            previous = (previous, getattr(m, f"{name}_split_k"))
            value = (False, previous[1])
    setattr(m, name, value)
    try:
        yield
    finally:
        setattr(m, name, previous)


def mean_scale(
    target: torch.Tensor, class_weight: torch.Tensor | None, ignore_index: int, V: int
) -> torch.Tensor:
    """1 / (sum of the non-ignored target weights) as a 0-dim fp32 device tensor (1 if zero)."""
    valid = target != ignore_index
    if class_weight is None:
        denom = valid.sum(dtype=torch.float32)
    else:
        ok = valid & (target >= 0) & (target < V)
        w_t = class_weight.float()[torch.where(ok, target, 0)]
        w_t = torch.where(valid & ~ok, float("nan"), w_t)  # out-of-range target: nan, not a read
        denom = torch.where(valid, w_t, 0.0).sum()
    return 1.0 / torch.where(denom == 0, 1.0, denom)


@overload
def _fp16_grad_factor(grad: torch.Tensor, headroom: float) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def _fp16_grad_factor(
    grad: torch.Tensor, headroom: float, other: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...
def _fp16_grad_factor(
    grad: torch.Tensor, headroom: float, other: torch.Tensor | None = None
) -> tuple[torch.Tensor, ...]:
    """(grad * K, 1 / K) with K = headroom / 2^e, max |grad| = m * 2^e (m in [0.5, 1)): powers of
    two, so the unscaling is exact. A zero or non-finite max gives e = 0. other: a second
    upstream gradient (the entropy's) that shares K (the max is over both); then returns
    (grad * K, other * K, 1 / K)."""
    one = torch.ones((), dtype=torch.float32, device=grad.device)
    parts = [x.abs().max() for x in (grad, other) if x is not None and x.numel()]
    if not parts:  # no tokens ("none" over an empty batch): nothing to scale
        return (grad, one) if other is None else (grad, other, one)
    _, e = torch.frexp(torch.stack(parts).max() if len(parts) > 1 else parts[0])
    e = e.clamp(-100, 100)  # K and 1 / K stay finite in fp32
    k = torch.ldexp(one * headroom, -e)
    if other is None:
        return grad * k, torch.ldexp(one / headroom, e)
    return grad * k, other * k, torch.ldexp(one / headroom, e)


# --- the loops ------------------------------------------------------------------------------------


class Rows:
    """What every launch of _flce_rows_kernel shares for one FLCE call."""

    def __init__(
        self,
        target: torch.Tensor,
        bias: torch.Tensor | None,
        class_weight: torch.Tensor | None,
        ignore_index: int,
        label_smoothing: float,
        softcap: float | None,
        z_loss_scale: float,
        V: int,
        table: FlceTable,
        temperature: float = 1.0,
    ) -> None:
        self.target = target.contiguous()
        self.bias = bias.contiguous() if bias is not None else None
        self.class_weight = class_weight.contiguous() if class_weight is not None else None
        self.cw_sum = self.class_weight.float().sum() if self.class_weight is not None else None
        self.options = (int(ignore_index), float(label_smoothing), softcap, float(z_loss_scale))
        self.temperature = float(temperature)
        self.V = V
        self.table = table  # FlceTable: the launch per row width (configs.tables_for)

    def launch(
        self,
        logits: torch.Tensor,
        dlogits: torch.Tensor | None,
        rows: slice,
        lse: torch.Tensor,
        loss: torch.Tensor | None,
        grad: torch.Tensor | None,
        col_start: int,
        lse_given: bool,
        stats: tuple[torch.Tensor, torch.Tensor] | None = None,
        entropy_grad: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """One program per row of `logits` (rows = slice of the tokens, columns from col_start).
        stats: (entropy, top1) buffers of all tokens to write, or None. entropy_grad (with
        lse_given and grad): (upstream gradient of the entropy, the entropy), fp32 per token of
        all tokens, whose term the dlogits get too; or None."""
        ignore_index, label_smoothing, softcap, z_loss_scale = self.options
        n_rows, n_cols = logits.shape
        dummy = lse  # stands in for absent optional pointers (never read: constexpr flags)
        g = grad if grad is None or grad.dim() == 0 else grad[rows]
        if entropy_grad is not None:
            assert lse_given and grad is not None, "the entropy's gradient is the recomputing pass's"
            entropy_ptr, egrad_ptr = entropy_grad[1][rows], entropy_grad[0][rows]
        elif stats is not None:
            entropy_ptr, egrad_ptr = stats[0][rows], dummy
        else:
            entropy_ptr, egrad_ptr = dummy, dummy
        block_v, num_warps = self.table.rows_launch(n_cols)
        # A softcap or a temperature makes each logit a product (softcap * tanh, z / T). Fused
        # multiply-adds would take that product unrounded into z - max and lse - z_t while the
        # max keeps it rounded, so the uses would disagree by up to an ulp of the logit (with
        # one class the cross-entropy would not be 0). Unfused, every use sees one rounding.
        scaled = softcap is not None or self.temperature != 1.0
        fusion = {"enable_fp_fusion": False} if scaled else {}
        launch(
            _flce_rows_kernel,
            (n_rows,),
            logits,
            dlogits if dlogits is not None else logits,
            self.target[rows],
            self.bias if self.bias is not None else dummy,
            self.class_weight if self.class_weight is not None else dummy,
            self.cw_sum if self.cw_sum is not None else dummy,
            g if g is not None else dummy,
            lse[rows],
            loss[rows] if loss is not None else dummy,
            entropy_ptr,
            stats[1][rows] if stats is not None else dummy,
            egrad_ptr,
            self.V,
            col_start,
            n_cols,
            logits.stride(0),
            dlogits.stride(0) if dlogits is not None else logits.stride(0),
            g.stride(0) if g is not None and g.dim() else 0,
            ignore_index,
            label_smoothing,
            softcap if softcap is not None else 1.0,
            z_loss_scale,
            1.0 / self.temperature,
            HAS_BIAS=self.bias is not None,
            HAS_CLASS_WEIGHT=self.class_weight is not None,
            HAS_SMOOTHING=label_smoothing != 0.0,
            HAS_SOFTCAP=softcap is not None,
            HAS_Z_LOSS=z_loss_scale != 0.0,
            LSE_GIVEN=lse_given,
            WRITE_GRAD=grad is not None,
            STATS=stats is not None,
            HAS_TEMPERATURE=self.temperature != 1.0,
            ENTROPY_GRAD=entropy_grad is not None,
            BLOCK_V=block_v,
            SOFT_BF16=soft_bf16(logits),
            num_warps=num_warps,
            **fusion,
            **pdl(logits),
        )


def _dlogits_view(logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The input-dtype dlogits the kernel writes over `logits` (rows, n): the logits themselves
    where they have that dtype; over fp32 logits the same bytes per row start, so a 16-bit row
    has stride 2n elements (cuBLAS takes that leading dimension)."""
    return logits if logits.dtype == dtype else logits.view(dtype)[:, : logits.shape[1]]


def _gemm_ready(dlogits: torch.Tensor) -> torch.Tensor:
    """dlogits as the GEMMs take them. cuBLAS takes the in-place view's leading dimension as
    is. The CPU's bf16 GEMM reads past the end of such rows from 32 rows on (torch 2.13 on an
    AVX512-BF16 CPU): the bytes there are the rest of each fp32 row, and where they spelled
    inf or nan, whole rows of grad_hidden came out nan. The CPU path (the interpreter's) gets
    a contiguous copy."""
    return dlogits if dlogits.is_cuda or dlogits.is_contiguous() else dlogits.contiguous()


@overload
def _fp16_scaling(
    grad: torch.Tensor, dtype: torch.dtype, need_weight: bool, accum_fp32: bool
) -> tuple[torch.Tensor, torch.Tensor | None]: ...
@overload
def _fp16_scaling(
    grad: torch.Tensor | None, dtype: torch.dtype, need_weight: bool, accum_fp32: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]: ...
def _fp16_scaling(
    grad: torch.Tensor | None, dtype: torch.dtype, need_weight: bool, accum_fp32: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """fp16 only: the upstream gradient scaled into fp16's normal range and the factor to undo."""
    if grad is None or dtype != torch.float16:
        return grad, None
    headroom = 1.0 if need_weight and not accum_fp32 else FP16_DLOGITS_SCALE
    return _fp16_grad_factor(grad, headroom)


def _finish(
    grad_h: torch.Tensor | None,
    grad_w: torch.Tensor | None,
    grad_b: torch.Tensor | None,
    unscale: torch.Tensor | None,
    weight_dtype: torch.dtype,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    if unscale is not None:
        for x in (grad_h, grad_w, grad_b):
            if x is not None:
                scale_(x, unscale)
    if grad_w is not None and grad_w.dtype != weight_dtype:
        grad_w = grad_w.to(weight_dtype)  # the fp32 accumulator is freed on return
    return grad_h, grad_w, grad_b


def run_chunks(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    rows: Rows,
    grad: torch.Tensor | None,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
    accum_fp32: bool,
    max_bytes: int | None = None,
    stats: bool = False,
    fp32_logits: bool = True,
) -> tuple[
    torch.Tensor,
    torch.Tensor,
    torch.Tensor | None,
    torch.Tensor | None,
    torch.Tensor | None,
    torch.Tensor | None,
    torch.Tensor | None,
]:
    """Token chunks over the whole vocabulary (the forward; "fast" mode computes gradients).

    rows: a Rows. grad: upstream gradient per token ((BT,) or 0-dim), or None for loss and
    logsumexp only. Returns loss (BT,), lse (BT,), grad hidden / weight / bias (None where not
    asked), and with `stats` the per-token entropy and top1 (else None). fp32_logits False: the
    chunks hold logits in the input dtype (the GEMM's output rounded as a plain lm_head's is).
    Peak beyond the results: one chunk of logits (at most max_bytes), plus the fp32 grad_W
    accumulator with accum_fp32.
    """
    BT, H = hidden.shape
    V = weight.shape[0]
    dtype, device = hidden.dtype, hidden.device
    write_grad = grad is not None and (need_hidden or need_weight or need_bias)
    grad = grad if write_grad else None
    loss = empty((BT,), torch.float32, device)
    lse = empty((BT,), torch.float32, device)
    stat_buffers = (empty((BT,), torch.float32, device), empty((BT,), torch.int8, device)) if stats else None
    grad_h = empty((BT, H), dtype, device) if write_grad and need_hidden else None
    grad_w = None
    if write_grad and need_weight:
        grad_w = empty((V, H), torch.float32 if accum_fp32 else weight.dtype, device)
    grad_b = torch.zeros(V, dtype=torch.float32, device=device) if write_grad and need_bias else None
    grad, unscale = _fp16_scaling(grad, dtype, need_weight, accum_fp32)

    logits_dtype = torch.float32 if fp32_logits else dtype
    chunk = flce_chunk_tokens(BT, V, max_bytes, logits_dtype.itemsize)
    buffer: torch.Tensor | None  # (these three are let go before grad_W's conversion)
    logits: torch.Tensor | None
    dlogits: torch.Tensor | None
    buffer = torch.empty((chunk, V), dtype=logits_dtype, device=device)
    # Without fp32-output GEMMs for low-precision inputs (CPU) upcast the weight once, not per chunk.
    w_fp32 = weight if not fp32_logits or dtype == torch.float32 or _cuda_fp32_out(hidden) else weight.float()
    with _precise_matmuls(dtype, device):
        for start in range(0, BT, chunk):
            stop = min(start + chunk, BT)
            h = hidden[start:stop]
            logits = buffer[: stop - start]
            if fp32_logits:
                _mm_fp32(h, w_fp32.T, out=logits)
            else:
                torch.mm(h, weight.T, out=logits)
            dlogits = _dlogits_view(logits, dtype)
            rows.launch(logits, dlogits, slice(start, stop), lse, loss, grad, 0, False, stat_buffers)
            if not write_grad:
                continue
            dlogits = _gemm_ready(dlogits)
            if grad_h is not None:
                torch.mm(dlogits, weight, out=grad_h[start:stop])
            if grad_w is not None:
                if start == 0:  # the first chunk writes grad_W: no zero fill
                    if accum_fp32:
                        _mm_fp32(dlogits.T, h, out=grad_w)
                    else:
                        torch.mm(dlogits.T, h, out=grad_w)
                elif accum_fp32:
                    _addmm_fp32_(grad_w, dlogits.T, h)
                else:
                    grad_w.addmm_(dlogits.T, h)
            if grad_b is not None:
                grad_b += dlogits.sum(0, dtype=torch.float32)
    buffer = logits = dlogits = None  # free the chunk before grad_W's conversion
    if grad_w is not None and BT == 0:
        grad_w.zero_()
    entropy, top1 = stat_buffers if stat_buffers is not None else (None, None)
    return (loss, lse, *_finish(grad_h, grad_w, grad_b, unscale, weight.dtype), entropy, top1)


def run_blocks(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    rows: Rows,
    lse: torch.Tensor,
    grad: torch.Tensor,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
    accum_fp32: bool,
    budget: int,
    entropy_grad: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The recomputing backward: gradients of sum_i grad[i] * loss_i from the saved logsumexp,
    plus sum_i g_H[i] * H_i with entropy_grad = (g_H, H) (fp32 per token: the entropy's upstream
    gradient and the saved entropy; the kernel adds its term to the same dlogits, so the GEMMs
    are the loss's alone).

    Blocked over (token super-chunk x vocabulary block), sized by flce_blocks within `budget`
    bytes beyond the results. Per block: fp32 logits (cuBLAS), dlogits over them (the kernel,
    LSE given), grad_W rows = dlogits.T @ h (written by the super-chunk's GEMM; with several
    super-chunks, later ones add into them, one rounding each in the accumulation dtype), the
    fp32 grad_hidden accumulator += dlogits @ W rows, grad_bias += column sums. accum_fp32
    asks for grad_W rounded once: one super-chunk of all tokens, so no V x H accumulator.
    """
    BT, H = hidden.shape
    V = weight.shape[0]
    dtype, device = hidden.dtype, hidden.device
    grad_h = empty((BT, H), dtype, device) if need_hidden else None
    grad_w = empty((V, H), weight.dtype, device) if need_weight else None
    grad_b = torch.zeros(V, dtype=torch.float32, device=device) if need_bias else None
    # fp16: grad_W blocks go through an fp32 block and are unscaled there, so the dlogits can
    # keep the full headroom even though grad_W itself is stored in fp16.
    unscale: torch.Tensor | None  # (None: no scaling to undo)
    if entropy_grad is not None and dtype == torch.float16:
        g_h, entropy = entropy_grad
        grad, g_h, unscale = _fp16_grad_factor(grad, FP16_DLOGITS_SCALE, g_h)
        entropy_grad = (g_h, entropy)
    else:
        grad, unscale = _fp16_scaling(grad, dtype, False, True)
    block: torch.Tensor | None  # (these two and acc are let go before the unscaling)
    w_block: torch.Tensor | None
    w_block = torch.empty((0,), dtype=torch.float32, device=device)
    # fp32 inputs accumulate straight into grad_hidden; 16-bit ones in an fp32 accumulator.
    separate_acc = need_hidden and dtype != torch.float32
    tokens, cols = flce_blocks(BT, H, V, budget, whole_tokens=accum_fp32, accumulate_h=separate_acc)
    block = torch.empty(tokens * cols, dtype=torch.float32, device=device)
    acc = torch.empty((tokens, H), dtype=torch.float32, device=device) if separate_acc else None
    w_fp32 = weight if dtype == torch.float32 or _cuda_fp32_out(hidden) else weight.float()
    w_mm = weight if dtype == torch.float32 or _cuda_fp32_out(hidden) else w_fp32
    with _precise_matmuls(dtype, device):
        for s0 in range(0, BT, tokens):
            s1 = min(s0 + tokens, BT)
            h = hidden[s0:s1]
            h_acc = acc[: s1 - s0] if acc is not None else (grad_h[s0:s1] if grad_h is not None else None)
            for v0 in range(0, V, cols):
                v1 = min(v0 + cols, V)
                logits = block[: (s1 - s0) * (v1 - v0)].view(s1 - s0, v1 - v0)
                _mm_fp32(h, w_fp32[v0:v1].T, out=logits)
                dlogits = _dlogits_view(logits, dtype)
                rows.launch(
                    logits, dlogits, slice(s0, s1), lse, None, grad, v0, True, entropy_grad=entropy_grad
                )
                dlogits = _gemm_ready(dlogits)
                if grad_w is not None and unscale is not None:
                    w_block = w_block.new_empty((v1 - v0, H)) if w_block.shape[0] != v1 - v0 else w_block
                    _mm_fp32(dlogits.T, h, out=w_block)
                    w_block.mul_(unscale)
                    if s0 == 0:
                        grad_w[v0:v1].copy_(w_block)
                    else:
                        grad_w[v0:v1].add_(w_block)
                elif grad_w is not None:
                    if s0 == 0:
                        torch.mm(dlogits.T, h, out=grad_w[v0:v1])
                    else:
                        grad_w[v0:v1].addmm_(dlogits.T, h)
                if h_acc is not None:
                    if v0 == 0:
                        _mm_fp32(dlogits, w_mm[v0:v1], out=h_acc)
                    else:
                        _addmm_fp32_(h_acc, dlogits, w_mm[v0:v1])
                if grad_b is not None:
                    grad_b[v0:v1] += dlogits.sum(0, dtype=torch.float32)
            if separate_acc:
                assert grad_h is not None and h_acc is not None  # (need_hidden; acc's rows)
                grad_h[s0:s1].copy_(h_acc)
    block = acc = w_block = None
    if BT == 0:
        for x in (grad_h, grad_w):
            if x is not None:
                x.zero_()
    if unscale is not None:
        for x in (grad_h, grad_b):  # grad_W was unscaled block by block
            if x is not None:
                x.mul_(unscale)
    return grad_h, grad_w, grad_b
