"""Fused linear distillation (ops/distill.py), Triton backend: kernel, chunk loop, torch.library
registration, autograd and the registry entry, top to bottom.

The (tokens x V) logits are never materialized. Tokens go in chunks; per chunk cuBLAS writes the
student's and the teacher's logits (fp32 accumulation and output, biases left to the kernel) into
two fp32 buffers, one Triton program per row turns them into the token's loss and, when
gradients are wanted, d loss / d student logits (in the student's dtype, written over the
student's logits), and cuBLAS takes grad_student_hidden (dlogits @ W_s), grad_student_weight
(+= dlogits.T @ h_s) and grad_student_bias (column sums) from those. Peak beyond the inputs and
the gradients: the two chunk buffers, together at most CHUNK_BYTES (1 GiB) whatever the number
of tokens, plus an fp32 grad_W accumulator where one is needed (below); or, where chunks larger
than that let grad_W sum in bf16, those chunks, whose buffers then take at most the accumulator's
2 V H bytes more (chunk_tokens). LMKERNELS_DISTILL_CHUNK_TOKENS fixes the tokens per chunk
(tests, tuning).

The row kernel, per token, reads both rows in blocks of BLOCK_V columns:
- pass 1, online: max and sum of exp of both scaled rows (their logsumexps), and for the two
  KLs the expectation they need, rescaled as the max moves (sum_c p_t (b_c - a_c) for the forward
  KL, sum_c p_s (a_c - b_c) for the reverse, a and b the student's and the teacher's logits over
  the temperature); with a hard loss at a temperature other than 1, the raw student row's
  logsumexp too;
- pass 2, jsd only: the mixture's log m_c needs both final logsumexps, so the two KLs against
  the mixture are summed in a second pass;
- the last pass writes d loss / d x_s. With p_s = softmax(a), T the temperature:
  forward KL (p_s - p_t) / T; reverse KL p_s (log p_s - log p_t - KL) / T, computed as
  p_s ((a - b) - E_s[a - b]) / T; jsd (1 - beta) p_s (log p_s - log m - KL(p_s || m)) / T; the
  hard loss softmax(x_s) - onehot(t); all times the token's upstream gradient (0 for ignored
  tokens). Each is computed from the same rounded terms as the row sum it subtracts (the KL,
  the expectation), so its rounding errors nearly sum to 0 over the row as the exact gradient
  does, and do not add up in grad_hidden = dlogits @ W, a sum over V that cancels.

Reductions "mean"/"sum" with gradients wanted: the forward computes them (the upstream gradient
is one scalar), and the backward scales them in place by it (as FLCE's fast mode: a second
backward through the same graph raises ConsumedInputsError). Reduction "none" (an upstream
gradient per token) and forwards without gradients keep nothing of the chunks: the backward
runs the loop again with the per-token gradients (the logits matmuls twice).

grad_W sums its chunks in the weight's own dtype where there are at most MAX_SUPER_CHUNKS (8)
of them (one rounding each, the FLCE default's rule), else, and always for fp16 weights, in an
fp32 V x H accumulator rounded once. fp16 dlogits are scaled into fp16's normal range and the
gradients unscaled by the same power of two (FLCE's _fp16_scaling).

The teacher gets no gradient here: a teacher tensor that requires grad is refused (supports),
eager and compile differentiate it. No host syncs: the mean's denominator stays on the device.
"""

from __future__ import annotations

import math
from typing import Any, NoReturn

import torch
import triton
import triton.language as tl

from lmkernels.backends.triton import triton_devices, triton_unavailable_reason
from lmkernels.backends.triton.common import (
    call,
    eager_function,
    gpu_capabilities,
    launch,
    next_power_of_2,
    op_or_raw,
    pdl,
    pdl_enter,
    soft_bf16,
    to_dtype,
    traced,
    transforming,
    transforms_function,
)
from lmkernels.backends.triton.flce_kernels import (
    MAX_SUPER_CHUNKS,
    _addmm_fp32_,
    _cuda_fp32_out,
    _dlogits_view,
    _finish,
    _fp16_scaling,
    _gemm_ready,
    _mm_fp32,
    _precise_matmuls,
    mean_scale,
    scale_,
)
from lmkernels.ops.distill import DistillOptions, effective_divergence
from lmkernels.registry.core import ConsumedInputsError, forward_ad_error, higher_order_error, register
from lmkernels.utils import empty, env_sizes

OP = "fused_linear_distillation"
CHUNK_BYTES = 1 << 30  # both fp32 logits buffers of a chunk together
CHUNK_ENV = "LMKERNELS_DISTILL_CHUNK_TOKENS"
# The row kernel's launch: BLOCK_V columns of two rows per loop step. Not tuned on a GPU yet;
# FLCE's narrow entry (configs/default.py), which reads one row, at half its block.
BLOCK_V = 2048
NUM_WARPS = 8
NARROW_WARPS = 4  # blocks under 1024 columns

# The kernel's DIVERGENCE codes.
FORWARD_KL = tl.constexpr(0)
REVERSE_KL = tl.constexpr(1)
JSD = tl.constexpr(2)
_DIVERGENCE_CODES = {"forward_kl": FORWARD_KL.value, "reverse_kl": REVERSE_KL.value, "jsd": JSD.value}


# --- the row kernel -------------------------------------------------------------------------------


@triton.jit
def _online(m, s, x):
    """Running max m and sum s of exp(x - m) updated with the block x (masked entries -inf):
    (new m, the factor the previous sums are rescaled by, exp(x - new m), new s)."""
    m_new = tl.maximum(m, tl.max(x, 0))
    # While every value so far is -inf, shift by 0 (not -inf - -inf = nan): the sums stay 0.
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    rescale = tl.exp(m - shift)
    e = tl.exp(x - shift)
    return m_new, rescale, e, s * rescale + tl.sum(e, 0)


@triton.jit
def _log_mixture(ls, lt, log_1mb, log_b):
    """log((1 - beta) e^ls + beta e^lt), computed in log space (no underflow to log 0)."""
    u = ls + log_1mb
    v = lt + log_b
    hi = tl.maximum(u, v)
    return hi + tl.log(1.0 + tl.exp(tl.minimum(u, v) - hi))


@triton.jit
def _distill_rows_kernel(
    xs_ptr,  # (rows, V) fp32 student logits without bias, row stride stride_xs
    dxs_ptr,  # the same memory in the student's dtype: d loss / d student logits, row stride stride_dxs
    xt_ptr,  # (rows, V) fp32 teacher logits without bias, row stride stride_xt
    target_ptr,
    s_bias_ptr,
    t_bias_ptr,
    grad_ptr,  # upstream gradient per token; grad_stride 0 broadcasts one scalar
    loss_ptr,  # per-token loss, written
    V,
    stride_xs,
    stride_dxs,
    stride_xt,
    grad_stride,
    ignore_index,
    temperature,
    beta,
    log_1mb,  # log(1 - beta), log(beta): jsd's mixture weights in log space
    log_b,
    soft_weight,
    hard_weight,
    DIVERGENCE: tl.constexpr,  # FORWARD_KL, REVERSE_KL or JSD (0 < beta < 1)
    HAS_TARGET: tl.constexpr,
    HAS_HARD: tl.constexpr,
    SHARED_LSE: tl.constexpr,  # temperature 1: the hard loss's logsumexp is the soft one's
    HAS_S_BIAS: tl.constexpr,
    HAS_T_BIAS: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
    SOFT_BF16: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    xs_row = xs_ptr + row * stride_xs
    xt_row = xt_ptr + row * stride_xt
    cols = tl.arange(0, BLOCK_V)

    t = tl.full((), -1, tl.int64)
    valid = t == t  # every token counts without a target
    nan_if_bad = 1.0
    if HAS_TARGET:
        t = tl.load(target_ptr + row).to(tl.int64)
        valid = t != ignore_index
        bad = valid & ((t < 0) | (t >= V))
        # An out-of-range target is never read: its token's loss and gradients are nan.
        nan_if_bad = tl.where(bad, float("nan"), 1.0)

    # Pass 1: online logsumexps of a = x_s / T and b = x_t / T (and x_s for the hard loss), and
    # the expectation each KL needs.
    ms = tl.full((), float("-inf"), tl.float32)
    ss = tl.zeros((), tl.float32)
    mt = tl.full((), float("-inf"), tl.float32)
    st = tl.zeros((), tl.float32)
    m1 = tl.full((), float("-inf"), tl.float32)
    s1 = tl.zeros((), tl.float32)
    acc = tl.zeros((), tl.float32)  # forward: sum e^(b - mt) (b - a); reverse: sum e^(a - ms) (a - b)
    for start in range(0, V, BLOCK_V):
        c = start + cols
        mask = c < V
        xs = tl.load(xs_row + c, mask=mask, other=0.0)
        if HAS_S_BIAS:
            xs += tl.load(s_bias_ptr + c, mask=mask, other=0.0).to(tl.float32)
        xt = tl.load(xt_row + c, mask=mask, other=0.0)
        if HAS_T_BIAS:
            xt += tl.load(t_bias_ptr + c, mask=mask, other=0.0).to(tl.float32)
        a = xs / temperature
        b = xt / temperature
        ms, rs, es, ss = _online(ms, ss, tl.where(mask, a, float("-inf")))
        mt, rt, et, st = _online(mt, st, tl.where(mask, b, float("-inf")))
        # Masked columns: a = b = 0 and e = 0, so their terms are 0 (no inf - inf).
        if DIVERGENCE == FORWARD_KL:
            acc = acc * rt + tl.sum(et * (b - a), 0)
        if DIVERGENCE == REVERSE_KL:
            acc = acc * rs + tl.sum(es * (a - b), 0)
        if HAS_HARD and not SHARED_LSE:
            m1, _, _, s1 = _online(m1, s1, tl.where(mask, xs, float("-inf")))
    # Log-probabilities are taken as (x - max) - log(sum): the rounding of each is that of
    # its own size, not of the logsumexp's (as torch's log_softmax has it). The KLs' expectations
    # E[b - a] need only lse_s - lse_t, the difference of the maxima plus that of the logs.
    log_ss = tl.log(ss)
    log_st = tl.log(st)
    d_lse = (ms - mt) + (log_ss - log_st)  # lse_s - lse_t
    if DIVERGENCE == FORWARD_KL:
        div = acc / st + d_lse  # E_t[b - a] - (lse_t - lse_s)
    if DIVERGENCE == REVERSE_KL:
        mean_u = acc / ss  # E_s[a - b]
        div = mean_u - d_lse
    if DIVERGENCE == JSD:
        # Pass 2: KL(p_s || m) and KL(p_t || m), m the mixture (needs both logsumexps). The last
        # pass computes every term as here, so its gradient's KL(p_s || m) is these terms' sum.
        kl_s = tl.zeros((), tl.float32)
        kl_t = tl.zeros((), tl.float32)
        for start in range(0, V, BLOCK_V):
            c = start + cols
            mask = c < V
            xs = tl.load(xs_row + c, mask=mask, other=0.0)
            if HAS_S_BIAS:
                xs += tl.load(s_bias_ptr + c, mask=mask, other=0.0).to(tl.float32)
            xt = tl.load(xt_row + c, mask=mask, other=0.0)
            if HAS_T_BIAS:
                xt += tl.load(t_bias_ptr + c, mask=mask, other=0.0).to(tl.float32)
            ls = (xs / temperature - ms) - log_ss
            lt = (xt / temperature - mt) - log_st
            lm = _log_mixture(ls, lt, log_1mb, log_b)
            kl_s += tl.sum(tl.where(mask, tl.exp(ls) * (ls - lm), 0.0), 0)
            kl_t += tl.sum(tl.where(mask, tl.exp(lt) * (lt - lm), 0.0), 0)
        div = beta * kl_t + (1.0 - beta) * kl_s

    loss = soft_weight * div
    if HAS_HARD:
        if SHARED_LSE:  # temperature 1: the soft logsumexp is the hard one
            m1 = ms
            s1 = ss
        log_s1 = tl.log(s1)
        t_ok = valid & (t >= 0) & (t < V)
        x_t = tl.load(xs_row + t, mask=t_ok, other=0.0)
        if HAS_S_BIAS:
            x_t += tl.load(s_bias_ptr + t, mask=t_ok, other=0.0).to(tl.float32)
        loss += hard_weight * ((m1 - x_t) + log_s1)
    tl.store(loss_ptr + row, tl.where(valid, loss * nan_if_bad, 0.0))

    if WRITE_GRAD:
        # Every warp has read the target's logit (x_t) before any warp overwrites it below.
        tl.debug_barrier()
        g = tl.load(grad_ptr + row * grad_stride).to(tl.float32)
        g = tl.where(valid, g * nan_if_bad, 0.0)
        g_soft = g * soft_weight / temperature
        g_hard = g * hard_weight
        d_row = dxs_ptr + row * stride_dxs
        for start in range(0, V, BLOCK_V):
            c = start + cols
            mask = c < V
            xs = tl.load(xs_row + c, mask=mask, other=0.0)
            xt = tl.load(xt_row + c, mask=mask, other=0.0)
            # dlogits overwrite the student's logits in place. Over fp32 logits a 2-byte column c
            # lands on the bytes of fp32 column c // 2, which another warp loads: wait until
            # every warp has loaded this block (and so all earlier ones) before any store.
            if xs_ptr.dtype.element_ty != dxs_ptr.dtype.element_ty:
                tl.debug_barrier()
            if HAS_S_BIAS:
                xs += tl.load(s_bias_ptr + c, mask=mask, other=0.0).to(tl.float32)
            if HAS_T_BIAS:
                xt += tl.load(t_bias_ptr + c, mask=mask, other=0.0).to(tl.float32)
            a = xs / temperature
            b = xt / temperature
            ls = (a - ms) - log_ss
            ps = tl.exp(ls)
            if DIVERGENCE == FORWARD_KL:
                d_soft = ps - tl.exp((b - mt) - log_st)
            if DIVERGENCE == REVERSE_KL:
                # p_s (log p_s - log p_t - KL) = p_s ((a - b) - E_s[a - b]): the logsumexps cancel.
                d_soft = ps * ((a - b) - mean_u)
            if DIVERGENCE == JSD:
                lt = (b - mt) - log_st
                d_soft = (1.0 - beta) * ps * (ls - _log_mixture(ls, lt, log_1mb, log_b) - kl_s)
            d = g_soft * d_soft
            if HAS_HARD:
                if SHARED_LSE:
                    d += g_hard * ps
                else:
                    d += g_hard * tl.exp((xs - m1) - log_s1)
                d = tl.where(c == t, d - g_hard, d)
            tl.store(d_row + c, to_dtype(d, dxs_ptr.dtype.element_ty, SOFT_BF16), mask=mask)


# --- the chunk loop ------------------------------------------------------------------------------


def chunk_tokens(BT: int, V: int, H: int = 0, bf16_weight_grad: bool = False) -> int:
    """Tokens per chunk: a multiple of 128 (cuBLAS tile height), at least 128, at most BT, both
    fp32 logits buffers within CHUNK_BYTES except as below (LMKERNELS_DISTILL_CHUNK_TOKENS fixes
    it).

    With a bf16 weight gradient to sum (bf16_weight_grad; H: the student's hidden size), more
    than MAX_SUPER_CHUNKS chunks would need grad_W's fp32 accumulator, 2 V H bytes more than
    summing in bf16: chunks few enough to sum in bf16 are taken instead where their buffers
    grow by no more than those bytes, so the peak never rises and fewer matmuls run."""
    fixed = env_sizes(CHUNK_ENV, 1)
    if fixed:
        return max(1, min(fixed[0], BT))
    rows = max(128, CHUNK_BYTES // (8 * V) // 128 * 128)
    if bf16_weight_grad and -(-BT // rows) > MAX_SUPER_CHUNKS:
        per_chunk = -(-BT // MAX_SUPER_CHUNKS)
        fewer = -(-per_chunk // 128) * 128
        if 8 * V * fewer <= 8 * V * rows + 2 * V * H:
            rows = fewer
    return max(1, min(rows, BT))


def _fp32_weight(weight: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The weight as _mm_fp32 wants it for fp32 logits: itself where cuBLAS gives fp32 output for
    its dtype, else (the CPU) an fp32 copy made once per call, not per chunk."""
    return weight if weight.dtype == torch.float32 or _cuda_fp32_out(hidden) else weight.float()


def _run_chunks(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    target: torch.Tensor | None,
    student_bias: torch.Tensor | None,
    teacher_bias: torch.Tensor | None,
    o: DistillOptions,
    grad: torch.Tensor | None,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
    tokens: int,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Per-token loss (BT,) and, given the upstream gradient `grad` (0-dim, or (BT,)), the
    gradients of sum_i grad[i] * loss_i with respect to the student's hidden, weight and bias
    (None where not asked). o: DistillOptions; tokens: per chunk."""
    BT, H = student_hidden.shape
    V = student_weight.shape[0]
    dtype, device = student_hidden.dtype, student_hidden.device
    # The kernel reads these with unit stride (a caller's may be a strided view).
    target = target.contiguous() if target is not None else None
    student_bias = student_bias.contiguous() if student_bias is not None else None
    teacher_bias = teacher_bias.contiguous() if teacher_bias is not None else None
    write_grad = grad is not None and (need_hidden or need_weight or need_bias)
    grad = grad if write_grad else None
    loss = empty((BT,), torch.float32, device)
    grad_h = empty((BT, H), dtype, device) if write_grad and need_hidden else None
    n_chunks = -(-BT // tokens)
    accum_fp32 = dtype == torch.float16 or (dtype != torch.float32 and n_chunks > MAX_SUPER_CHUNKS)
    grad_w = None
    if write_grad and need_weight:
        grad_w = empty((V, H), torch.float32 if accum_fp32 else dtype, device)
    grad_b = torch.zeros(V, dtype=torch.float32, device=device) if write_grad and need_bias else None
    grad, unscale = _fp16_scaling(grad, dtype, need_weight, accum_fp32)

    divergence = effective_divergence(o.divergence, o.beta)
    jsd = divergence == "jsd"
    has_target = target is not None
    block = min(BLOCK_V, next_power_of_2(V))
    # (the chunks' buffers and their views are let go before grad_W's conversion)
    xs_buffer: torch.Tensor | None
    xt_buffer: torch.Tensor | None
    xs: torch.Tensor | None
    xt: torch.Tensor | None
    dxs: torch.Tensor | None
    xs_buffer = torch.empty((tokens, V), dtype=torch.float32, device=device)
    xt_buffer = torch.empty((tokens, V), dtype=torch.float32, device=device)
    ws = _fp32_weight(student_weight, student_hidden)
    wt = _fp32_weight(teacher_weight, teacher_hidden)
    dummy = loss  # stands in for absent optional pointers (never read: constexpr flags)
    with _precise_matmuls(dtype, device), _precise_matmuls(teacher_hidden.dtype, device):
        for start in range(0, BT, tokens):
            stop = min(start + tokens, BT)
            hs = student_hidden[start:stop]
            xs = xs_buffer[: stop - start]
            xt = xt_buffer[: stop - start]
            _mm_fp32(hs, ws.T, out=xs)
            _mm_fp32(teacher_hidden[start:stop], wt.T, out=xt)
            dxs = _dlogits_view(xs, dtype)
            g = grad if grad is None or grad.dim() == 0 else grad[start:stop]
            launch(
                _distill_rows_kernel,
                (stop - start,),
                xs,
                dxs,
                xt,
                target[start:stop] if target is not None else dummy,
                student_bias if student_bias is not None else dummy,
                teacher_bias if teacher_bias is not None else dummy,
                g if g is not None else dummy,
                loss[start:stop],
                V,
                xs.stride(0),
                dxs.stride(0),
                xt.stride(0),
                g.stride(0) if g is not None and g.dim() else 0,
                int(o.ignore_index),
                float(o.temperature),
                float(o.beta),
                math.log1p(-o.beta) if jsd else 0.0,
                math.log(o.beta) if jsd else 0.0,
                float(o.soft_weight),
                float(o.hard_weight),
                DIVERGENCE=_DIVERGENCE_CODES[divergence],
                HAS_TARGET=has_target,
                HAS_HARD=has_target and o.hard_weight != 0.0,
                SHARED_LSE=o.temperature == 1.0,
                HAS_S_BIAS=student_bias is not None,
                HAS_T_BIAS=teacher_bias is not None,
                WRITE_GRAD=write_grad,
                BLOCK_V=block,
                SOFT_BF16=soft_bf16(xs),
                num_warps=NUM_WARPS if block >= 1024 else NARROW_WARPS,
                **pdl(xs),
            )
            if not write_grad:
                continue
            dxs = _gemm_ready(dxs)
            if grad_h is not None:
                torch.mm(dxs, student_weight, out=grad_h[start:stop])
            if grad_w is not None:
                if start == 0:  # the first chunk writes grad_W: no zero fill
                    if accum_fp32:
                        _mm_fp32(dxs.T, hs, out=grad_w)
                    else:
                        torch.mm(dxs.T, hs, out=grad_w)
                elif accum_fp32:
                    _addmm_fp32_(grad_w, dxs.T, hs)
                else:
                    grad_w.addmm_(dxs.T, hs)
            if grad_b is not None:
                grad_b += dxs.sum(0, dtype=torch.float32)
    xs_buffer = xt_buffer = xs = xt = dxs = None  # free the chunks before grad_W's conversion
    if grad_w is not None and BT == 0:
        grad_w.zero_()
    return loss, *_finish(grad_h, grad_w, grad_b, unscale, student_weight.dtype)


def _mean_scale(
    target: torch.Tensor | None, ignore_index: int, BT: int, V: int, device: torch.device
) -> torch.Tensor:
    """1 / (the number of tokens that count, or 1 if none) as a 0-dim fp32 device tensor."""
    if target is None:
        return torch.full((), 1.0 / max(BT, 1), dtype=torch.float32, device=device)
    return mean_scale(target, None, ignore_index, V)


# --- torch.library registration ------------------------------------------------------------------


def _grads_in_forward(reduction: str, grad_hidden: bool, grad_weight: bool, grad_bias: bool) -> bool:
    return reduction != "none" and (grad_hidden or grad_weight or grad_bias)


def _or_empty(
    like: torch.Tensor,
    bias: torch.Tensor | None,
    gh: torch.Tensor | None,
    gw: torch.Tensor | None,
    gb: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients not computed become empty (0,) tensors (custom ops return no None)."""
    nothing = like.new_empty(0)
    gh = gh if gh is not None else nothing
    gw = gw if gw is not None else nothing.clone()
    gb = gb.to(bias.dtype) if gb is not None and bias is not None else nothing.clone()
    return gh, gw, gb


def _forward_raw(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    target: torch.Tensor | None,
    student_bias: torch.Tensor | None,
    teacher_bias: torch.Tensor | None,
    divergence: str,
    beta: float,
    temperature: float,
    ignore_index: int,
    hard_weight: float,
    soft_weight: float,
    reduction: str,
    grad_hidden: bool,
    grad_weight: bool,
    grad_bias: bool,
    tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, grad_hidden, grad_weight, grad_bias) for 2-D hidden states and a 1-D target.

    loss is (BT,) for reduction "none", else 0-dim. The gradients (of the reduced loss, for an
    upstream gradient of 1) are computed for "mean"/"sum" and only where asked; the others are
    empty (0,) tensors.
    """
    BT = student_hidden.shape[0]
    V = student_weight.shape[0]
    o = DistillOptions(
        student_bias,
        teacher_bias,
        divergence,
        beta,
        temperature,
        ignore_index,
        hard_weight,
        soft_weight,
        reduction,
    )
    grads_now = _grads_in_forward(reduction, grad_hidden, grad_weight, grad_bias)
    scale = None
    if reduction == "mean":
        scale = _mean_scale(target, ignore_index, BT, V, student_hidden.device)
    elif grads_now:
        scale = torch.ones((), dtype=torch.float32, device=student_hidden.device)
    loss, gh, gw, gb = _run_chunks(
        student_hidden, student_weight, teacher_hidden, teacher_weight, target, student_bias, teacher_bias, o,
        scale if grads_now else None, grad_hidden, grad_weight, grad_bias and student_bias is not None, tokens,
    )  # fmt: skip
    if reduction == "sum":
        loss = loss.sum()
    elif reduction == "mean":
        assert scale is not None  # (_mean_scale's)
        loss = loss.sum() * scale
    return (loss, *_or_empty(student_hidden, student_bias, gh, gw, gb))


_forward_op = torch.library.custom_op("lmkernels::distill_triton_forward", _forward_raw, mutates_args=())


@_forward_op.register_fake
def _forward_fake(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    target: torch.Tensor | None,
    student_bias: torch.Tensor | None,
    teacher_bias: torch.Tensor | None,
    divergence: str,
    beta: float,
    temperature: float,
    ignore_index: int,
    hard_weight: float,
    soft_weight: float,
    reduction: str,
    grad_hidden: bool,
    grad_weight: bool,
    grad_bias: bool,
    tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    BT = student_hidden.shape[0]
    now = _grads_in_forward(reduction, grad_hidden, grad_weight, grad_bias)
    nothing = student_hidden.new_empty(0)
    loss = student_hidden.new_empty((BT,) if reduction == "none" else (), dtype=torch.float32)
    gh = torch.empty_like(student_hidden) if now and grad_hidden else nothing
    gw = torch.empty_like(student_weight) if now and grad_weight else nothing.clone()
    gb = torch.empty_like(student_bias) if now and grad_bias and student_bias is not None else nothing.clone()
    return loss, gh, gw, gb


def _backward_raw(
    grad_loss: torch.Tensor,
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    target: torch.Tensor | None,
    student_bias: torch.Tensor | None,
    teacher_bias: torch.Tensor | None,
    divergence: str,
    beta: float,
    temperature: float,
    ignore_index: int,
    hard_weight: float,
    soft_weight: float,
    reduction: str,
    grad_hidden: bool,
    grad_weight: bool,
    grad_bias: bool,
    tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the loss for upstream gradient grad_loss (0-dim, or (BT,) for "none"),
    recomputing both logits chunk by chunk. Gradients not asked for are empty (0,)."""
    BT = student_hidden.shape[0]
    V = student_weight.shape[0]
    o = DistillOptions(
        student_bias,
        teacher_bias,
        divergence,
        beta,
        temperature,
        ignore_index,
        hard_weight,
        soft_weight,
        reduction,
    )
    grad = grad_loss.float()
    if reduction == "mean":
        grad = grad * _mean_scale(target, ignore_index, BT, V, student_hidden.device)
    _, gh, gw, gb = _run_chunks(
        student_hidden, student_weight, teacher_hidden, teacher_weight, target, student_bias, teacher_bias, o,
        grad, grad_hidden, grad_weight, grad_bias and student_bias is not None, tokens,
    )  # fmt: skip
    return _or_empty(student_hidden, student_bias, gh, gw, gb)


_backward_op = torch.library.custom_op("lmkernels::distill_triton_backward", _backward_raw, mutates_args=())


@_backward_op.register_fake
def _backward_fake(
    grad_loss: torch.Tensor,
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    target: torch.Tensor | None,
    student_bias: torch.Tensor | None,
    teacher_bias: torch.Tensor | None,
    divergence: str,
    beta: float,
    temperature: float,
    ignore_index: int,
    hard_weight: float,
    soft_weight: float,
    reduction: str,
    grad_hidden: bool,
    grad_weight: bool,
    grad_bias: bool,
    tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    nothing = student_hidden.new_empty(0)
    gh = torch.empty_like(student_hidden) if grad_hidden else nothing
    gw = torch.empty_like(student_weight) if grad_weight else nothing.clone()
    gb = torch.empty_like(student_bias) if grad_bias and student_bias is not None else nothing.clone()
    return gh, gw, gb


# The recomputing backward: the custom op when traced, else the launcher.
_recompute = op_or_raw(_backward_op, _backward_raw, OP)


def _setup_context(ctx: Any, inputs: tuple, output: tuple[torch.Tensor, ...]) -> None:
    student_bias = inputs[5]
    reduction = inputs[13]
    grad_h, grad_w, grad_b = inputs[14:17]
    _, gh, gw, gb = output
    ctx.mark_non_differentiable(gh, gw, gb)
    # Autograd would otherwise hand the backward zero-filled gradients, the size of the
    # gradients themselves, for the three outputs nothing differentiates.
    ctx.set_materialize_grads(False)
    ctx.flags = (grad_h, grad_w, grad_b and student_bias is not None)
    ctx.precomputed = _grads_in_forward(reduction, grad_h, grad_w, grad_b)
    ctx.scaled = False  # whether a backward scaled the precomputed gradients in place
    if ctx.precomputed:
        ctx.save_for_backward(gh, gw, gb)
    else:
        ctx.save_for_backward(*inputs[:7])
        ctx.options = inputs[7:14]
        ctx.tokens = inputs[17]


_SECOND_BACKWARD = (
    f"{OP}: the Triton backend computed the gradients of the reduced loss in the forward and the "
    "first backward handed them to autograd (scaled in place), so there is nothing left for a "
    "second backward through this graph (retain_graph=True). What recomputes instead: "
    "reduction='none', or the backends 'compile' and 'eager'."
)


def _backward(
    ctx: Any,
    grad_loss: torch.Tensor,
    _gh: torch.Tensor | None,
    _gw: torch.Tensor | None,
    _gb: torch.Tensor | None,
) -> tuple[torch.Tensor | None, ...]:
    # create_graph=True: as FLCE's backward, the forward's gradients are refused.
    if ctx.precomputed and torch.is_grad_enabled() and not (traced((grad_loss,)) or transforming()):
        raise higher_order_error(OP, "triton")
    if ctx.precomputed:
        if ctx.scaled:
            raise ConsumedInputsError(_SECOND_BACKWARD)
        # Only the upstream scalar is missing. Eagerly the gradients are scaled in place (the
        # buffers are ours: the impl drops the forward's gradient outputs); a traced graph must
        # not mutate the op's outputs: out of place there, with scale_'s rounding.
        gh, gw, gb = ctx.saved_tensors
        if traced((gh, gw, gb, grad_loss)):
            grads = [(g.float() * grad_loss).to(g.dtype) for g in (gh, gw, gb)]
        else:
            grads = [scale_(g, grad_loss) for g in (gh, gw, gb)]
            ctx.scaled = True
        flags = ctx.flags
    else:
        # What autograd asks for (the forward's flags, except under torch.func transforms).
        needs = ctx.needs_input_grad
        flags = (needs[0], needs[1], needs[5] and ctx.saved_tensors[5] is not None)
        grads = _recompute(grad_loss, *ctx.saved_tensors, *ctx.options, *flags, ctx.tokens)
    gh, gw, gb = (g if flag else None for g, flag in zip(grads, flags))
    return gh, gw, None, None, None, gb, *[None] * 12


def _jvp(ctx: Any, *tangents: Any) -> NoReturn:
    raise forward_ad_error(OP, "triton")


_forward_op.register_autograd(_backward, setup_context=_setup_context)
# Eager calls: the same forward, context and backward, without the custom op's per-call cost;
# under torch.func transforms, their Function (no tangent: refused by name).
_DistillFunction = eager_function(
    "DistillTritonFunction",
    _forward_raw,
    _setup_context,
    _backward,
    transforms_function(
        "DistillTritonTransforms", _forward_op, _forward_raw, _setup_context, _backward, _jvp
    ),
)


# --- the impl ------------------------------------------------------------------------------------


def fused_linear_distillation_triton(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    target: torch.Tensor | None = None,
    **options: Any,
) -> torch.Tensor:
    o = DistillOptions(**options)
    Hs, Ht = student_weight.shape[1], teacher_weight.shape[1]
    # Under torch.func transforms no gradient is computed in the forward (as FLCE's).
    grad_on = torch.is_grad_enabled() and (torch.compiler.is_compiling() or not transforming())
    needs = (
        grad_on and student_hidden.requires_grad,
        grad_on and student_weight.requires_grad,
        grad_on and o.student_bias is not None and o.student_bias.requires_grad,
    )
    sh = student_hidden.reshape(-1, Hs)
    # The gradient outputs are dropped here: the backward's saved tensors are their only owners.
    loss, _, _, _ = call(
        _forward_op,
        _DistillFunction,
        sh,
        student_weight,
        teacher_hidden.reshape(-1, Ht),
        teacher_weight,
        None if target is None else target.reshape(-1),
        o.student_bias,
        o.teacher_bias,
        o.divergence,
        float(o.beta),
        float(o.temperature),
        int(o.ignore_index),
        float(o.hard_weight),
        float(o.soft_weight),
        o.reduction,
        *needs,
        chunk_tokens(sh.shape[0], student_weight.shape[0], Hs, needs[1] and sh.dtype == torch.bfloat16),
    )
    if o.reduction == "none":
        loss = loss.view(student_hidden.shape[:-1])
    return loss


def _supports(
    teacher_hidden: torch.Tensor | None = None,
    teacher_weight: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    **_: Any,
) -> list[str]:
    if not torch.is_grad_enabled():
        return []
    named = {"teacher_hidden": teacher_hidden, "teacher_weight": teacher_weight, "teacher_bias": teacher_bias}
    wanting = [n for n, t in named.items() if isinstance(t, torch.Tensor) and t.requires_grad]
    if not wanting:
        return []
    return [
        f"no gradient for the teacher ({', '.join(wanting)} requires grad): detach it, or use "
        "'eager' or 'compile', which differentiate it"
    ]


register(
    OP,
    "triton",
    fused_linear_distillation_triton,
    priority=100,
    devices=triton_devices(),
    auto_devices=("cuda",),
    available=triton_unavailable_reason,
    **gpu_capabilities(OP, _supports),
    compiled_transforms=False,
    description="chunks of both logits (<= 1 GiB), one row kernel; student gradients in the forward",
)
