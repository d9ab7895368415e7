"""The torch.compile backend.

Every op except FLCE is its eager reference under torch.compile: the references are short
fp32-upcasting elementwise/reduction code, exactly what inductor fuses well.

FLCE is hand-written: compiling the naive reference would still materialize the (tokens x V)
logits. Here the tokens are cut into chunks and only one chunk's logits exist at a time:

- reduction "mean"/"sum" with gradients needed: each chunk's gradients are computed during the
  forward (3 matmuls per chunk: logits, grad_hidden, grad_weight), the backward only scales
  them by the upstream gradient. No logits are recomputed.
- reduction "none" (the upstream gradient differs per token) or no gradients needed: the
  forward stores only the per-token logsumexp and the backward recomputes each chunk's logits.

Chunk size: about BT * H / V tokens (so a chunk's fp32 logits are about as large as the fp32
hidden states), rounded up to a multiple of 64 and at least 64. For Llama 3 (H 4096, V 128256)
and BT 8192 that is 320 tokens, 164 MB of fp32 logits per chunk.

Under torch.func transforms (grad, vjp, jvp, vmap) and forward-mode AD every op runs its eager
reference: torch.compile does not compile there (dynamo runs such frames eagerly), and the
reference's plain PyTorch has every derivative, to any order, and every batching rule. FLCE then
holds the (tokens x V) logits, as the eager backend does. A backward with create_graph=True
outside them is refused (HigherOrderGradientError): AOTAutograd's compiled backward has no
derivative of its own.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch

from lmkernels.ops.flce import FlceOptions, fused_linear_cross_entropy_reference
from lmkernels.ops.rope import rope_apply, rope_reference, rope_tables_at
from lmkernels.registry.core import _OPS, higher_order_error, register
from lmkernels.types import RopeLayout
from lmkernels.utils import transforms_active

# Compiled functions are built on first use: torch.compile imports dynamo and inductor (seconds),
# which `import lmkernels` and the other backends must not pay for.
_COMPILED: dict[Callable[..., Any], Callable[..., Any]] = {}

# Each op's compiled reference is one code object for dynamo, recompiled per dtype, rank and
# option set (casting mode, layout, ...): a validation grid needs a few dozen variants, more
# than dynamo's default limit of 8, past which it silently runs the function eagerly. Raised
# (never lowered) for the whole process when the first compiled function is built; a training
# job compiles a handful of variants.
_RECOMPILE_LIMIT = 64


def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    if torch.compiler.is_compiling():
        return fn  # already inside a graph being compiled: traced inline, as a compiled fn would be
    compiled = _COMPILED.get(fn)
    if compiled is None:
        import torch._dynamo as dynamo  # binds only `dynamo`: `torch` stays the global here

        if dynamo.config.recompile_limit < _RECOMPILE_LIMIT:
            dynamo.config.recompile_limit = _RECOMPILE_LIMIT
        compiled = _COMPILED[fn] = torch.compile(fn, dynamic=None)
    return compiled


def _refusing_double_backward(op: str) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
    """A pre-hook for the backward node of a compiled function: AOTAutograd's compiled backward
    is not differentiable, so a backward with create_graph=True (grad mode on inside it) gets
    lmkernels' error, naming the backends that can, before any gradient is computed."""

    def prehook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        if torch.is_grad_enabled():
            raise higher_order_error(op, "compile")

    return prehook


def _guard_outputs(
    out: torch.Tensor | tuple[torch.Tensor, ...], prehook: Callable[[tuple[torch.Tensor | None, ...]], None]
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Register prehook on the backward node of each output that has one (eager calls only)."""
    for o in out if isinstance(out, tuple) else (out,):
        if o.grad_fn is not None:
            o.grad_fn.register_prehook(prehook)
    return out


def _make_generic(name: str) -> Callable[..., Any]:
    reference = _OPS[name].reference
    prehook = _refusing_double_backward(name)

    def run(*args: Any, **kwargs: Any) -> Any:
        if transforms_active():
            return reference(*args, **kwargs)
        out = _compiled(reference)(*args, **kwargs)
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            _guard_outputs(out, prehook)
        return out

    # The reference's signature, so that the dispatcher passes the inputs positionally: a
    # compiled function called by keyword costs more host time per call (its guards read the
    # kwargs; docs/performance.md, "Design decisions and their measurements").
    run.__signature__ = inspect.signature(reference)  # type: ignore[attr-defined]  # (inspect reads it)
    run.__name__ = f"{name}_compile"
    return run


# --- RoPE: q and k as two compiled calls ------------------------------------------------------------


def _rope_one(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
    layout: RopeLayout,
    rotary_dim: int,
) -> torch.Tensor:
    cos, sin = rope_tables_at(cos, sin, position_ids)
    return rope_apply(x, cos, sin, layout, rotary_dim)


_ROPE_PREHOOK = _refusing_double_backward("rope")


def rope_compile(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    layout: RopeLayout = "neox",
    rotary_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k each through its own compiled graph: one backward node per output, so q_out and
    k_out can be backpropagated separately (two backward calls), as with eager."""
    if transforms_active():
        return rope_reference(q, k, cos, sin, position_ids, layout, rotary_dim)
    rdim = q.shape[-1] if rotary_dim is None else rotary_dim
    fn = _compiled(_rope_one)
    out = fn(q, cos, sin, position_ids, layout, rdim), fn(k, cos, sin, position_ids, layout, rdim)
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        _guard_outputs(out, _ROPE_PREHOOK)
    return out


# --- chunked FLCE ------------------------------------------------------------------------------


def flce_chunk_size(BT: int, H: int, V: int) -> int:
    return max(64, math.ceil(BT * H / V / 64) * 64)


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with an fp32 result. On CUDA, a 16-bit b makes this a tensor-core matmul with fp32
    accumulation and output (a is rounded to b's dtype first): the logits are never rounded to
    16 bits (that would put ~2% errors into the probabilities). Elsewhere: an fp32 matmul."""
    if b.is_cuda and b.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(a.to(b.dtype), b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _chunk_logits(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    softcap: float | None,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(fp32 logits, tanh(logits / softcap) or None): the softcap's, then the temperature's."""
    logits = _mm_f32(h, weight.T)
    if bias is not None:
        logits = logits + bias.float()
    capped = None
    if softcap is not None:
        capped = torch.tanh(logits / softcap)
        logits = softcap * capped
    if temperature != 1.0:
        logits = logits / temperature
    return logits, capped


def _target_weights(
    target: torch.Tensor, class_weight: torch.Tensor | None, valid: torch.Tensor, V: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(target with ignored and out-of-range entries replaced by 0, weight of each token's target
    class): 1 or its class weight, nan for a target outside [0, V) (never read: a nan loss)."""
    in_range = (target >= 0) & (target < V)
    safe_t = torch.where(valid & in_range, target, 0).long()
    w_t = (
        class_weight.float()[safe_t]
        if class_weight is not None
        else torch.ones_like(safe_t, dtype=torch.float32)
    )
    return safe_t, torch.where(in_range | ~valid, w_t, float("nan"))


def _loss_from_logits(
    logits: torch.Tensor,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    z_loss_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss (0 on ignored tokens) and logsumexp of one chunk."""
    V = logits.shape[1]
    lse = torch.logsumexp(logits, dim=-1)
    valid = target != ignore_index
    safe_t, w_t = _target_weights(target, class_weight, valid, V)
    nll = lse - logits.gather(1, safe_t[:, None])[:, 0]
    if class_weight is None:
        smooth = V * lse - logits.sum(-1)
    else:
        smooth = class_weight.float().sum() * lse - logits @ class_weight.float()
    loss = (1.0 - label_smoothing) * w_t * nll
    if label_smoothing:
        loss = loss + (label_smoothing / V) * smooth
    if z_loss_scale:
        loss = loss + z_loss_scale * lse.square()
    return torch.where(valid, loss, 0.0), lse


def _grads_from_logits(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    logits: torch.Tensor,
    capped: torch.Tensor | None,
    lse: torch.Tensor,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    grad_tok: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    softcap: float | None,
    z_loss_scale: float,
    temperature: float,
    grad_ent: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients of sum_i grad_tok[i] * loss_i (+ grad_ent[i] * entropy_i) for one chunk.

    d loss_i / d z_c = p_c * ((1-e) w_t + (e/V) sum(w) + 2 s lse) - (1-e) w_t [c == t] - (e/V) w_c,
    d H_i / d z_c = -p_c (z_c - lse + H), then times 1 - tanh^2 through the softcap and 1 / T
    through the temperature.
    """
    V = logits.shape[1]
    valid = target != ignore_index
    safe_t, w_t = _target_weights(target, class_weight, valid, V)
    probs = torch.exp(logits - lse[:, None])
    w_sum = float(V) if class_weight is None else class_weight.float().sum()
    coef = (1.0 - label_smoothing) * w_t + (label_smoothing / V) * w_sum + 2.0 * z_loss_scale * lse
    g = torch.where(valid, grad_tok.float(), 0.0)
    dlogits = probs * (coef * g)[:, None]
    dlogits = dlogits.scatter_add(1, safe_t[:, None], (-(1.0 - label_smoothing) * w_t * g)[:, None])
    if label_smoothing:
        smooth_w = class_weight.float() if class_weight is not None else torch.ones_like(logits[0])
        dlogits = dlogits - (label_smoothing / V) * g[:, None] * smooth_w[None, :]
    if grad_ent is not None:
        assert entropy is not None  # (given with its gradient)
        term = probs * (logits - (lse - entropy)[:, None])
        dlogits = dlogits - torch.where(probs > 0, term, 0.0) * grad_ent.float()[:, None]
    if softcap is not None:
        assert capped is not None  # (_chunk_logits' tanh, with a softcap)
        dlogits = dlogits * (1.0 - capped.square())
    if temperature != 1.0:
        dlogits = dlogits / temperature
    grad_h = _mm_f32(dlogits, weight)
    grad_w = _mm_f32(dlogits.T, h)
    grad_b = dlogits.sum(0) if bias is not None else None
    return grad_h, grad_w, grad_b


def _stats_from_logits(
    logits: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, ignore_index: int, stats: bool
) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
    """(entropy, is_top1) per token of one chunk (see the op's docstring), or (None, None)."""
    if not stats:
        return None, None
    V = logits.shape[1]
    valid = (target != ignore_index) & (target >= 0) & (target < V)
    safe_t = torch.where(valid, target, 0).long()
    # sum_c p_c (lse - z_c): every term >= 0, so large logits cancel nothing (lse - sum p z
    # subtracts two numbers of the logits' size)
    gap = lse[:, None] - logits
    entropy = (torch.exp(-gap) * gap).nan_to_num(nan=0.0).sum(-1)
    top = logits.gather(1, safe_t[:, None])[:, 0] >= logits.amax(-1)
    return entropy, valid & top


def _chunk_loss(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    softcap: float | None,
    z_loss_scale: float,
    temperature: float,
    stats: bool,
) -> tuple[torch.Tensor | None, ...]:
    logits, _ = _chunk_logits(h, weight, bias, softcap, temperature)
    loss, lse = _loss_from_logits(logits, target, class_weight, ignore_index, label_smoothing, z_loss_scale)
    return loss, lse, *_stats_from_logits(logits, lse, target, ignore_index, stats)


def _chunk_loss_and_grads(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    grad_tok: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    softcap: float | None,
    z_loss_scale: float,
    temperature: float,
    stats: bool,
) -> tuple[torch.Tensor | None, ...]:
    """Loss, logsumexp (and stats) and gradients of one chunk from a single logits matmul."""
    logits, capped = _chunk_logits(h, weight, bias, softcap, temperature)
    loss, lse = _loss_from_logits(logits, target, class_weight, ignore_index, label_smoothing, z_loss_scale)
    entropy, top = _stats_from_logits(logits, lse, target, ignore_index, stats)
    grads = _grads_from_logits(
        h,
        weight,
        bias,
        logits,
        capped,
        lse,
        target,
        class_weight,
        grad_tok,
        ignore_index,
        label_smoothing,
        softcap,
        z_loss_scale,
        temperature,
    )
    return loss, lse, entropy, top, *grads


def _chunk_grads(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    grad_tok: torch.Tensor,
    lse: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    softcap: float | None,
    z_loss_scale: float,
    temperature: float,
    grad_ent: torch.Tensor | None,
    entropy: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Recompute one chunk's logits and return its gradients, given the stored logsumexp (and
    the entropy, whose upstream gradient grad_ent is None when nothing differentiates it)."""
    logits, capped = _chunk_logits(h, weight, bias, softcap, temperature)
    return _grads_from_logits(
        h,
        weight,
        bias,
        logits,
        capped,
        lse,
        target,
        class_weight,
        grad_tok,
        ignore_index,
        label_smoothing,
        softcap,
        z_loss_scale,
        temperature,
        grad_ent,
        entropy,
    )


class _ChunkedFLCE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        target: torch.Tensor,
        class_weight: torch.Tensor | None,
        opts: tuple[int, str, float, float | None, float, float],
        grad_accum_dtype: torch.dtype | None,
        stats: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        ignore_index, reduction, label_smoothing, softcap, z_loss_scale, temperature = opts
        H = weight.shape[1]
        h2 = hidden.reshape(-1, H)
        t = target.reshape(-1)
        BT = h2.shape[0]
        chunk = flce_chunk_size(BT, H, weight.shape[0])
        valid = t != ignore_index
        if reduction == "mean":
            _, w_t = _target_weights(t, class_weight, valid, weight.shape[0])
            denom = torch.where(valid, w_t, 0.0).sum()
            scale = 1.0 / torch.where(denom == 0, 1.0, denom)
        else:
            scale = torch.ones((), device=hidden.device)
        args = (ignore_index, label_smoothing, softcap, z_loss_scale, temperature)
        needs_grad = any(ctx.needs_input_grad[:3])
        # The entropy's upstream gradient (return_stats) is per token and unknown here: with
        # stats the backward recomputes, with both terms.
        grads_now = needs_grad and reduction != "none" and not stats
        loss = torch.empty(BT, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(BT, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(BT if stats else 0, dtype=torch.float32, device=hidden.device)
        top1 = torch.empty(BT if stats else 0, dtype=torch.bool, device=hidden.device)
        if grads_now:
            acc_dtype = grad_accum_dtype or torch.float32
            grad_h = torch.empty_like(h2)
            grad_w = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device)
            grad_b = (
                torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
                if bias is not None
                else None
            )
        for start in range(0, BT, chunk):
            sl = slice(start, min(start + chunk, BT))
            if not grads_now:
                loss[sl], lse[sl], ent, top = _compiled(_chunk_loss)(
                    h2[sl], weight, bias, t[sl], class_weight, *args, stats
                )
            else:
                g = scale.expand(sl.stop - sl.start)
                loss[sl], lse[sl], ent, top, gh, gw, gb = _compiled(_chunk_loss_and_grads)(
                    h2[sl], weight, bias, t[sl], class_weight, g, *args, stats
                )
                grad_h[sl] = gh
                grad_w += gw.to(acc_dtype)
                if gb is not None:
                    grad_b += gb
            if stats:
                entropy[sl], top1[sl] = ent, top
        ctx.opts, ctx.chunk, ctx.grads_now = opts, chunk, grads_now
        ctx.grad_accum_dtype = grad_accum_dtype
        if grads_now:
            ctx.save_for_backward(grad_h, grad_w, grad_b)
        else:
            # (a copy of the entropy: the caller may write over the output it gets)
            saved_entropy = entropy.clone() if stats else None
            ctx.save_for_backward(hidden, weight, bias, target, class_weight, lse, scale, saved_entropy)
        ctx.hidden_shape = hidden.shape
        if reduction == "none":
            out = loss.view(target.shape)
        elif reduction == "sum":
            out = loss.sum()
        else:
            out = loss.sum() * scale
        ctx.mark_non_differentiable(lse, top1)
        ctx.set_materialize_grads(False)  # (the entropy's None gradient: not differentiated)
        return out, lse.view(target.shape), entropy, top1

    @staticmethod
    def backward(
        ctx: Any,
        grad_out: torch.Tensor | None,
        _grad_lse: torch.Tensor | None,
        grad_entropy: torch.Tensor | None,
        _grad_top1: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():  # create_graph=True: these gradients are not differentiable
            raise higher_order_error("fused_linear_cross_entropy", "compile")
        ignore_index, reduction, label_smoothing, softcap, z_loss_scale, temperature = ctx.opts
        if ctx.grads_now:  # (no stats: nothing differentiates the empty entropy placeholder)
            grad_h, grad_w, grad_b = ctx.saved_tensors
            gh = (grad_h * grad_out).view(ctx.hidden_shape) if ctx.needs_input_grad[0] else None
            gw = (grad_w * grad_out) if ctx.needs_input_grad[1] else None
            gb = (grad_b * grad_out) if grad_b is not None and ctx.needs_input_grad[2] else None
            return gh, gw, gb, None, None, None, None, None
        hidden, weight, bias, target, class_weight, lse, scale, entropy = ctx.saved_tensors
        H = weight.shape[1]
        h2, t = hidden.reshape(-1, H), target.reshape(-1)
        BT = h2.shape[0]
        if grad_out is None:  # only the entropy is differentiated
            grad_tok = lse.new_zeros(()).expand(BT)
        elif reduction == "none":
            grad_tok = grad_out.reshape(-1).float()
        else:
            grad_tok = (grad_out * scale).expand(BT)
        grad_ent = None if grad_entropy is None else grad_entropy.reshape(-1).float()
        acc_dtype = ctx.grad_accum_dtype or torch.float32
        grad_h = torch.empty_like(h2)
        grad_w = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device)
        grad_b = (
            torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
            if bias is not None
            else None
        )
        args = (ignore_index, label_smoothing, softcap, z_loss_scale, temperature)
        for start in range(0, BT, ctx.chunk):
            sl = slice(start, min(start + ctx.chunk, BT))
            ent = (None, None) if grad_ent is None else (grad_ent[sl], entropy[sl])
            gh, gw, gb = _compiled(_chunk_grads)(
                h2[sl], weight, bias, t[sl], class_weight, grad_tok[sl], lse[sl], *args, *ent
            )
            grad_h[sl] = gh
            grad_w += gw.to(acc_dtype)
            if gb is not None:
                grad_b += gb
        return grad_h.view(hidden.shape), grad_w, grad_b, None, None, None, None, None


def flce_compile(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, **options: Any
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    if transforms_active():
        return fused_linear_cross_entropy_reference(hidden, weight, target, **options)
    o = FlceOptions(**options)  # memory_budget unread: the chunks follow flce_chunk_size
    opts = (o.ignore_index, o.reduction, o.label_smoothing, o.softcap, o.z_loss_scale, float(o.temperature))
    loss, lse, entropy, top1 = _ChunkedFLCE.apply(
        hidden, weight, o.bias, target, o.class_weight, opts, o.grad_accum_dtype, o.return_stats
    )
    if o.return_stats:
        return loss, lse, entropy.view(target.shape), top1.view(target.shape)
    return (loss, lse) if o.return_lse else loss


for _name in list(_OPS):
    # forward_ad: the reference runs under forward-mode AD (module docstring).
    if _name == "fused_linear_cross_entropy":
        register(
            _name,
            "compile",
            flce_compile,
            priority=50,
            forward_ad=True,
            description="chunked FLCE, compiled chunks",
        )
    elif _name == "rope":
        register(
            _name,
            "compile",
            rope_compile,
            priority=50,
            forward_ad=True,
            description="torch.compile of the reference, q and k apart",
        )
    else:
        register(
            _name,
            "compile",
            _make_generic(_name),
            priority=50,
            forward_ad=True,
            description="torch.compile of the reference",
        )
