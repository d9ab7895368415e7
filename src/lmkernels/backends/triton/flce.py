"""Fused linear cross entropy, Triton backend.

The (tokens x V) logits are never materialized: the tokens are cut into chunks and, per chunk,

1. cuBLAS computes the chunk's logits with fp32 output (bf16/fp16 inputs, fp32 accumulation).
   They must stay fp32: rounding logits to bf16 before the softmax shifts every probability by
   up to |z| * 2^-9 and the gradients by ~2%, far outside the correctness policy.
2. ONE Triton kernel per chunk (one program per token) reads its row of logits twice: pass 1
   is an online max / sum-exp for the logsumexp, the target logit, the label-smoothing sum and
   the loss; pass 2 writes d loss / d logits, already multiplied by the token's upstream
   gradient, in the input dtype over the logits buffer (in place, see the kernel).
3. cuBLAS again: grad_hidden[chunk] = dlogits @ W, grad_W (+)= dlogits.T @ h[chunk],
   grad_bias (+)= column sums of dlogits.

reduction "mean"/"sum" with gradients needed: the upstream gradient is one scalar, so the
forward computes every gradient (3 GEMMs in all, no logits recomputed) with the per-token scale
1/denominator (mean) or 1 (sum) computed on the device; the backward multiplies them by the
scalar upstream gradient in place. reduction "none" (a gradient per token) or no gradient
needed: the forward keeps only the logsumexp and the backward recomputes each chunk's logits.

grad_accum_dtype None / fp32 accumulates grad_W across chunks in an fp32 buffer (cuBLAS adds
each chunk's bf16 x bf16 product into it with fp32 output), converted once at the end and then
freed; weight.dtype accumulates straight into the result (lean: saves V*H*4 bytes, one rounding
per chunk). Peak memory above the inputs, + O(tokens + V) floats, reached in the chunk loop
(the forward's for "mean"/"sum", the backward's for "none"): lean: grad_hidden + grad_W + one
chunk of fp32 logits; fp32 accumulator: grad_hidden + the accumulator + the larger of one chunk
and grad_W (the final conversion). Nothing else of those sizes is allocated: the backward of
"mean"/"sum" only scales, and grad_W and grad_hidden become weight.grad and hidden.grad as they
are (tests/test_triton_flce.py counts the allocations).

Chunk size (tokens): at most CHUNK_BYTES = 1 GiB of fp32 logits, i.e. CHUNK_BYTES / (4 V)
tokens rounded down to a multiple of 128 (cuBLAS tile height), at least 128 and never more than
the tokens present: 2048 for Llama 3 (V = 128256), 8320 for V = 32000. Measured on an H200
(torch 2.11, triton 3.6), BT = 8192, H = 4096, V = 128256, bf16, forward + backward kernel
time / peak memory above the inputs:

    chunk   fp32 accumulation   lean (grad_accum_dtype=bf16)
     512                        55   ms               (the previous lean default)
    1024    47.6 ms, 3070 MiB   43.7 ms, 2132 MiB *
    2048    44.5 ms, 3070 MiB   42.2 ms, 2132 MiB *
    4096    43.2 ms, 4072 MiB   42.3 ms, 3070 MiB
    torch.compile of the eager reference 40.2 ms, 3070 MiB; Liger (lean) 55.0 ms, 1129 MiB;
    CCE 137 ms, 1067 MiB.
    * measured while the backward still received zero-filled gradients for the gradient
      outputs (see _setup_context); by the rule above the lean peak is now 1567 MiB at 1024
      and 2068 MiB at 2048 (computed, not yet re-measured).

Every chunk's logits and dlogits @ W GEMMs read all of W, and its dlogits.T @ h GEMM reads and
writes all of grad_W, so the traffic grows with the number of chunks: 55 ms at 512 tokens
against 42-45 ms at 2048. Past 2048 a doubling saves at most 3% for one more GiB; with the fp32
accumulator 1024 does not even lower the peak (the final conversion sets it). Smaller chunks
trade time for memory: set the module constant CHUNK_TOKENS or the environment variable
LMKERNELS_FLCE_CHUNK_TOKENS (tests use tiny chunks so that several run).

Not done, to measure first: at chunk 1024 the fp32 addmm into the accumulator took 15.5 ms
against 11.2 ms for the logits GEMM of the same size. One plain fp32-output mm per chunk into a
temporary and an add would cost another V*H*4 bytes and move more bytes (write the temporary,
then read it and the accumulator, write the accumulator), so it can only win if cuBLAS's
beta = 1 kernel is slow rather than the read of C.

fp16 dlogits are kept in fp16's normal range (>= 6.1e-5). Unscaled they are a probability
(~1/V: 1e-5 at V = 128k) times the token's gradient scale (1/tokens for "mean": 1e-4), far
below it: subnormal or zero, which made the fp16 gradients several times less accurate than
eager's. So the kernel gets the upstream gradient times K = FP16_DLOGITS_SCALE / 2^e, with 2^e
the power of two of max |upstream| (one device scalar for "mean"/"sum", the batch's max for
"none"; no host sync), and grad_hidden, grad_W and grad_bias are multiplied by 1/K after the
chunk loop: a power of two, so exact. Every |dlogit| is then at most about
FP16_DLOGITS_SCALE * (2 (1-e) w_t + (e/V) sum(w) + 2 s |lse|), far below fp16's 65504 for
sane class weights. Not with a grad_W accumulated in fp16 (grad_accum_dtype=fp16): it sums
dlogits over all tokens, so there the scale is 1 (K = 1/2^e, about the token count for "mean",
leaving room for |grad_W| up to 65504 / tokens before overflow). bf16 has fp32's exponent
range and fp32 needs neither.

Backward twice (retain_graph=True) with reduction "mean"/"sum": the first backward scaled the
stored gradients in place, so autograd's saved-tensor version check raises on the second.

Eager calls run the launchers through a plain autograd.Function (_common.call); only code that
torch.compile traces calls the torch.library custom ops, which share its context and backward.

No host synchronization anywhere: denominators, scales and the logsumexp stay on the device.
Out-of-range targets (possible only when LMKERNELS_CHECK_VALUES=0 skipped the input check) are
never read: their loss, and the gradients, are nan.
"""

import contextlib
import os

import torch
import triton
import triton.language as tl

from lmkernels.backends.triton import triton_devices, triton_unavailable_reason
from lmkernels.backends.triton._common import call, eager_function, op_or_raw, traced
from lmkernels.registry.core import register
from lmkernels.utils import empty

CHUNK_BYTES = 1 << 30
CHUNK_TOKENS: int | None = None  # overrides CHUNK_BYTES when set
CHUNK_ENV = "LMKERNELS_FLCE_CHUNK_TOKENS"
FP16_DLOGITS_SCALE = 2.0**8  # fp16 dlogits are scaled up by this (module docstring)


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
def _to_output_dtype(x, dtype: tl.constexpr):
    if dtype == tl.bfloat16:
        # Round to nearest even by hand: the CPU interpreter truncates fp32 -> bf16 casts, which
        # doubles the error of the dlogits (the GPU rounds; for it the final cast is then exact).
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # keep nans nan
    return x.to(dtype)


@triton.jit
def _flce_rows_kernel(
    logits_ptr,  # (rows, V) fp32, row stride stride_logits
    dlogits_ptr,  # the same memory seen in the gradient dtype, row stride stride_dlogits
    target_ptr,
    bias_ptr,
    class_weight_ptr,
    class_weight_sum_ptr,  # 0-dim fp32: sum of the class weights
    grad_ptr,  # upstream gradient per token; grad_stride 0 broadcasts one scalar
    lse_ptr,  # written (LSE_GIVEN False) or read (True)
    loss_ptr,  # per-token loss, written when LSE_GIVEN is False
    V,
    stride_logits,
    stride_dlogits,
    grad_stride,
    ignore_index,
    label_smoothing,
    softcap,
    z_loss_scale,
    HAS_BIAS: tl.constexpr,
    HAS_CLASS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    LSE_GIVEN: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
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
        # Pass 1: online max and sum of exp over blocks of the row.
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        zw = tl.zeros((), tl.float32)  # sum_c w_c z_c for label smoothing
        for start in range(0, V, BLOCK_V):
            c = start + cols
            mask = c < V
            z = tl.load(z_row + c, mask=mask, other=0.0)
            if HAS_BIAS:
                z += tl.load(bias_ptr + c, mask=mask, other=0.0).to(tl.float32)
            if HAS_SOFTCAP:
                z = softcap * _tanh(z / softcap)
            if HAS_SMOOTHING:
                if HAS_CLASS_WEIGHT:
                    w_c = tl.load(class_weight_ptr + c, mask=mask, other=0.0).to(tl.float32)
                    zw += tl.sum(tl.where(mask, w_c * z, 0.0), 0)
                else:
                    zw += tl.sum(tl.where(mask, z, 0.0), 0)
            z = tl.where(mask, z, float("-inf"))
            m_new = tl.maximum(m, tl.max(z, 0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
            m = m_new
        lse = m + tl.log(s)

        z_t = tl.load(z_row + t, mask=t_ok, other=0.0)
        if HAS_BIAS:
            z_t += tl.load(bias_ptr + t, mask=t_ok, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            z_t = softcap * _tanh(z_t / softcap)
        loss = (1.0 - label_smoothing) * w_t * (lse - z_t)
        if HAS_SMOOTHING:
            loss += smooth_v * (w_sum * lse - zw)
        if HAS_Z_LOSS:
            loss += z_loss_scale * lse * lse
        tl.store(loss_ptr + row, tl.where(valid, loss, 0.0))
        tl.store(lse_ptr + row, lse)

    if WRITE_GRAD:
        # Pass 2: d loss / d z_c = g * (p_c * coef - (1-e) w_t [c == t] - (e/V) w_c), with
        # coef = (1-e) w_t + (e/V) sum(w) + 2 s lse, times 1 - tanh^2 through the softcap.
        g = tl.load(grad_ptr + row * grad_stride).to(tl.float32)
        g = tl.where(valid, g, 0.0)
        coef = (1.0 - label_smoothing) * w_t
        if HAS_SMOOTHING:
            coef += smooth_v * w_sum
        if HAS_Z_LOSS:
            coef += 2.0 * z_loss_scale * lse
        a = coef * g
        b = (1.0 - label_smoothing) * w_t * g
        d_row = dlogits_ptr + row * stride_dlogits
        for start in range(0, V, BLOCK_V):
            c = start + cols
            mask = c < V
            z = tl.load(z_row + c, mask=mask, other=0.0)
            # dlogits overwrite the logits in place. With a 2-byte dtype, column c lands on the
            # bytes of fp32 column c // 2, which another warp loads: wait until every warp has
            # loaded this block (and so all earlier ones) before any store. Pass 1's
            # reductions already synchronize the warps before pass 2 starts.
            tl.debug_barrier()
            if HAS_BIAS:
                z += tl.load(bias_ptr + c, mask=mask, other=0.0).to(tl.float32)
            if HAS_SOFTCAP:
                th = _tanh(z / softcap)
                z = softcap * th
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
            tl.store(d_row + c, _to_output_dtype(d, dlogits_ptr.dtype.element_ty), mask=mask)


# --- launchers -----------------------------------------------------------------------------------


def flce_chunk_tokens(BT: int, V: int) -> int:
    """Tokens per chunk: see the module docstring."""
    override = CHUNK_TOKENS or int(os.environ.get(CHUNK_ENV, "0") or 0)
    rows = override if override > 0 else max(128, CHUNK_BYTES // (4 * V) // 128 * 128)
    return max(1, min(rows, BT))


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
def _precise_matmuls(dtype: torch.dtype, device: torch.device):
    """cuBLAS as precise as the correctness policy needs, whatever the global settings.

    fp32 inputs get IEEE fp32 GEMMs (no TF32). bf16/fp16 GEMMs reduce split-K partial sums in
    fp32: PyTorch's default lets cuBLAS round them to 16 bits, an extra rounding per split of
    the K = V sum of dlogits @ W. Restored on exit.
    """
    if device.type != "cuda":
        yield
        return
    m = torch.backends.cuda.matmul
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


def _mean_scale(target, class_weight, ignore_index, V):
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


def _fp16_grad_factor(grad, headroom):
    """(grad * K, 1 / K) with K = headroom / 2^e, max |grad| = m * 2^e (m in [0.5, 1)): powers of
    two, so the unscaling is exact. A zero or non-finite max gives e = 0."""
    _, e = torch.frexp(grad.abs().max())
    e = e.clamp(-100, 100)  # K and 1 / K stay finite in fp32
    one = torch.ones((), dtype=torch.float32, device=grad.device)
    return grad * torch.ldexp(one * headroom, -e), torch.ldexp(one / headroom, e)


def _run_chunks(
    hidden,
    weight,
    target,
    bias,
    class_weight,
    ignore_index,
    label_smoothing,
    softcap,
    z_loss_scale,
    grad,
    lse_given,
    need_hidden,
    need_weight,
    need_bias,
    accum_fp32,
):
    """The chunk loop shared by the forward and the recomputing backward.

    grad: upstream gradient per token ((BT,), or 0-dim for one value for all), or None: no
    gradients. lse_given: the forward's logsumexp (backward: skip pass 1, write no loss) or None.
    Returns loss (BT,) or None, lse (BT,), and grad hidden / weight / bias (None where not asked).
    """
    BT, H = hidden.shape
    V = weight.shape[0]
    dtype, device = hidden.dtype, hidden.device
    target = target.contiguous()
    bias = bias.contiguous() if bias is not None else None
    class_weight = class_weight.contiguous() if class_weight is not None else None
    cw_sum = class_weight.float().sum() if class_weight is not None else None
    write_grad = grad is not None and (need_hidden or need_weight or need_bias)

    if lse_given is None:
        loss = empty((BT,), torch.float32, device)
        lse = empty((BT,), torch.float32, device)
    else:
        loss, lse = None, lse_given
    grad_h = empty((BT, H), dtype, device) if write_grad and need_hidden else None
    grad_w = None
    if write_grad and need_weight:
        grad_w = empty((V, H), torch.float32 if accum_fp32 else weight.dtype, device)
    grad_b = torch.zeros(V, dtype=torch.float32, device=device) if write_grad and need_bias else None

    unscale = None  # fp16: the factor taken out of the dlogits (module docstring)
    if write_grad and dtype == torch.float16:
        headroom = 1.0 if need_weight and not accum_fp32 else FP16_DLOGITS_SCALE
        grad, unscale = _fp16_grad_factor(grad, headroom)

    chunk = flce_chunk_tokens(BT, V)
    buffer = torch.empty((chunk, V), dtype=torch.float32, device=device)
    # Without fp32-output GEMMs for low-precision inputs (CPU) upcast the weight once, not per chunk.
    w_fp32 = weight if dtype == torch.float32 or _cuda_fp32_out(hidden) else weight.float()
    block_v = min(4096, triton.next_power_of_2(V))
    dummy = lse  # stands in for absent optional pointers (never read: constexpr flags)

    with _precise_matmuls(dtype, device):
        for start in range(0, BT, chunk):
            stop = min(start + chunk, BT)
            h = hidden[start:stop]
            logits = buffer[: stop - start]
            _mm_fp32(h, w_fp32.T, out=logits)
            # dlogits in the input dtype over the logits: same bytes per row start, so a bf16
            # row has stride 2V elements; cuBLAS takes that leading dimension as is.
            dlogits = logits if dtype == torch.float32 else logits.view(dtype)[:, :V]
            g = grad if grad is None or grad.dim() == 0 else grad[start:stop]
            _flce_rows_kernel[(stop - start,)](
                logits,
                dlogits,
                target[start:stop],
                bias if bias is not None else dummy,
                class_weight if class_weight is not None else dummy,
                cw_sum if cw_sum is not None else dummy,
                g if g is not None else dummy,
                lse[start:stop],
                loss[start:stop] if loss is not None else dummy,
                V,
                logits.stride(0),
                dlogits.stride(0),
                g.stride(0) if g is not None and g.dim() else 0,
                ignore_index,
                label_smoothing,
                softcap if softcap is not None else 1.0,
                z_loss_scale,
                HAS_BIAS=bias is not None,
                HAS_CLASS_WEIGHT=class_weight is not None,
                HAS_SMOOTHING=label_smoothing != 0.0,
                HAS_SOFTCAP=softcap is not None,
                HAS_Z_LOSS=z_loss_scale != 0.0,
                LSE_GIVEN=lse_given is not None,
                WRITE_GRAD=write_grad,
                BLOCK_V=block_v,
                num_warps=8 if block_v >= 2048 else 4,
            )
            if not write_grad:
                continue
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
    buffer = logits = dlogits = None  # free the chunk before grad_W's conversion below
    if grad_w is not None and BT == 0:
        grad_w.zero_()
    if unscale is not None:
        for x in (grad_h, grad_w, grad_b):
            if x is not None:
                x.mul_(unscale)
    if grad_w is not None:
        grad_w = grad_w.to(weight.dtype)  # the fp32 accumulator is freed on return
    return loss, lse, grad_h, grad_w, grad_b


# --- torch.library registration ------------------------------------------------------------------


def _grads_in_forward(reduction, grad_hidden, grad_weight, grad_bias):
    return reduction != "none" and (grad_hidden or grad_weight or grad_bias)


def _forward_raw(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    softcap: float | None,
    z_loss_scale: float,
    grad_hidden: bool,
    grad_weight: bool,
    grad_bias: bool,
    accum_fp32: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, lse, grad_hidden, grad_weight, grad_bias) for hidden (BT, H), target (BT,).

    loss is (BT,) for reduction "none", else 0-dim. The gradients (of the reduced loss, for an
    upstream gradient of 1) are computed only for "mean"/"sum" and only where asked; the others
    are empty (0,) tensors.
    """
    V = weight.shape[0]
    grads_now = _grads_in_forward(reduction, grad_hidden, grad_weight, grad_bias)
    scale = None
    if reduction == "mean":
        scale = _mean_scale(target, class_weight, ignore_index, V)
    elif grads_now:
        scale = torch.ones((), dtype=torch.float32, device=hidden.device)
    loss, lse, gh, gw, gb = _run_chunks(
        hidden,
        weight,
        target,
        bias,
        class_weight,
        ignore_index,
        label_smoothing,
        softcap,
        z_loss_scale,
        scale if grads_now else None,
        None,
        grad_hidden,
        grad_weight,
        grad_bias and bias is not None,
        accum_fp32,
    )
    if reduction == "sum":
        loss = loss.sum()
    elif reduction == "mean":
        loss = loss.sum() * scale
    nothing = hidden.new_empty(0)
    gh = gh if gh is not None else nothing
    gw = gw if gw is not None else nothing.clone()
    gb = gb.to(bias.dtype) if gb is not None else nothing.clone()
    return loss, lse, gh, gw, gb


_forward_op = torch.library.custom_op("lmkernels::flce_triton_forward", _forward_raw, mutates_args=())


@_forward_op.register_fake
def _forward_fake(
    hidden,
    weight,
    target,
    bias,
    class_weight,
    ignore_index,
    reduction,
    label_smoothing,
    softcap,
    z_loss_scale,
    grad_hidden,
    grad_weight,
    grad_bias,
    accum_fp32,
):
    BT = hidden.shape[0]
    grads_now = _grads_in_forward(reduction, grad_hidden, grad_weight, grad_bias)
    loss = hidden.new_empty((BT,) if reduction == "none" else (), dtype=torch.float32)
    lse = hidden.new_empty((BT,), dtype=torch.float32)
    gh = torch.empty_like(hidden) if grads_now and grad_hidden else hidden.new_empty(0)
    gw = torch.empty_like(weight) if grads_now and grad_weight else hidden.new_empty(0)
    has_gb = grads_now and grad_bias and bias is not None
    gb = torch.empty_like(bias) if has_gb else hidden.new_empty(0)
    return loss, lse, gh, gw, gb


def _backward_raw(
    grad_loss: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    lse: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    softcap: float | None,
    z_loss_scale: float,
    grad_hidden: bool,
    grad_weight: bool,
    grad_bias: bool,
    accum_fp32: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of sum_i grad_loss[i] * loss_i, recomputing the logits chunk by chunk from lse.

    Gradients not asked for are empty (0,) tensors.
    """
    _, _, gh, gw, gb = _run_chunks(
        hidden,
        weight,
        target,
        bias,
        class_weight,
        ignore_index,
        label_smoothing,
        softcap,
        z_loss_scale,
        grad_loss.float(),
        lse,
        grad_hidden,
        grad_weight,
        grad_bias and bias is not None,
        accum_fp32,
    )
    nothing = hidden.new_empty(0)
    gh = gh if gh is not None else nothing
    gw = gw if gw is not None else nothing.clone()
    gb = gb.to(bias.dtype) if gb is not None else nothing.clone()
    return gh, gw, gb


_backward_op = torch.library.custom_op("lmkernels::flce_triton_backward", _backward_raw, mutates_args=())


@_backward_op.register_fake
def _backward_fake(
    grad_loss,
    hidden,
    weight,
    target,
    bias,
    class_weight,
    lse,
    ignore_index,
    label_smoothing,
    softcap,
    z_loss_scale,
    grad_hidden,
    grad_weight,
    grad_bias,
    accum_fp32,
):
    gh = torch.empty_like(hidden) if grad_hidden else hidden.new_empty(0)
    gw = torch.empty_like(weight) if grad_weight else hidden.new_empty(0)
    gb = torch.empty_like(bias) if grad_bias and bias is not None else hidden.new_empty(0)
    return gh, gw, gb


# The backward's chunk loop for reduction "none": the custom op when traced, else the launcher.
_recompute = op_or_raw(_backward_op, _backward_raw)


def _setup_context(ctx, inputs, output):
    hidden, weight, target, bias, class_weight, ignore_index, reduction = inputs[:7]
    label_smoothing, softcap, z_loss_scale, grad_h, grad_w, grad_b, accum_fp32 = inputs[7:]
    loss, lse, gh, gw, gb = output
    ctx.mark_non_differentiable(lse, gh, gw, gb)
    # Autograd would otherwise hand the backward zero-filled gradients for the four outputs
    # nothing differentiates: zeros the size of grad_W and grad_hidden, allocated while the real
    # ones are alive (on the H200 that doubled grad_W + grad_hidden: the lean mode's peak).
    ctx.set_materialize_grads(False)
    ctx.flags = (grad_h, grad_w, grad_b and bias is not None)
    ctx.precomputed = reduction != "none"
    if ctx.precomputed:
        ctx.save_for_backward(gh, gw, gb)
    else:
        ctx.save_for_backward(hidden, weight, target, bias, class_weight, lse)
        ctx.options = (ignore_index, label_smoothing, softcap, z_loss_scale, accum_fp32)


def _backward(ctx, grad_loss, _lse, _gh, _gw, _gb):
    if ctx.precomputed:
        # The forward computed the gradients of the reduced loss; only the upstream scalar is
        # missing. Eagerly they are scaled in place: the buffers are ours (the impl drops the
        # forward's outputs) and the unpacked saved tensors are their only references, so
        # AccumulateGrad adopts them as .grad without a copy. A traced graph (torch.compile,
        # opcheck: fake or functional tensors) must not mutate the op's outputs: out of place.
        gh, gw, gb = ctx.saved_tensors
        in_place = not traced((gh, gw, gb, grad_loss))
        grads = [g.mul_(grad_loss) if in_place else g * grad_loss for g in (gh, gw, gb)]
    else:
        hidden, weight, target, bias, class_weight, lse = ctx.saved_tensors
        ignore_index, label_smoothing, softcap, z_loss_scale, accum_fp32 = ctx.options
        grads = _recompute(
            grad_loss,
            hidden,
            weight,
            target,
            bias,
            class_weight,
            lse,
            ignore_index,
            label_smoothing,
            softcap,
            z_loss_scale,
            *ctx.flags,
            accum_fp32,
        )
    gh, gw, gb = (g if flag else None for g, flag in zip(grads, ctx.flags))
    return gh, gw, None, gb, None, None, None, None, None, None, None, None, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)
# Eager calls: the same forward, context and backward, without the custom op's per-call cost.
_FlceFunction = eager_function("FlceTritonFunction", _forward_raw, _setup_context, _backward)


# --- the impl ------------------------------------------------------------------------------------


def fused_linear_cross_entropy_triton(
    hidden,
    weight,
    target,
    bias=None,
    ignore_index=-100,
    reduction="mean",
    label_smoothing=0.0,
    softcap=None,
    z_loss_scale=0.0,
    class_weight=None,
    return_lse=False,
    grad_accum_dtype=None,
):
    H = weight.shape[1]
    grad_on = torch.is_grad_enabled()
    # The gradient outputs are dropped here: the backward's saved tensors are their only owners.
    loss, lse, _, _, _ = call(
        _forward_op,
        _FlceFunction,
        hidden.reshape(-1, H),
        weight,
        target.reshape(-1),
        bias,
        class_weight,
        int(ignore_index),
        reduction,
        float(label_smoothing),
        None if softcap is None else float(softcap),
        float(z_loss_scale),
        grad_on and hidden.requires_grad,
        grad_on and weight.requires_grad,
        grad_on and bias is not None and bias.requires_grad,
        grad_accum_dtype in (None, torch.float32),
    )
    if reduction == "none":
        loss = loss.view(target.shape)
    if return_lse:
        return loss, lse.view(target.shape)
    return loss


def _supports(class_weight=None, **inputs) -> list[str]:
    reasons = []
    if class_weight is not None and class_weight.requires_grad and torch.is_grad_enabled():
        reasons.append("no gradient for class_weight (it requires grad)")
    return reasons


register(
    "fused_linear_cross_entropy",
    "triton",
    fused_linear_cross_entropy_triton,
    priority=100,
    devices=triton_devices(),
    auto_devices=("cuda",),
    available=triton_unavailable_reason,
    supports=_supports,
    description="chunked cuBLAS GEMMs (fp32 logits) + one Triton softmax/loss/dlogits kernel per chunk",
)
