"""Fused linear cross entropy, Triton backend: the op, its autograd and registration (the plan,
the row kernel and the GEMM loops: flce_kernels.py).

The (tokens x V) logits are never materialized. cuBLAS computes logits in pieces (fp32
accumulation; fp32 output, or for bf16 inputs in the default fast mode bf16 output, rounded as
the model's own lm_head and the eager reference round them), and one Triton kernel turns each
row of a piece into logsumexp, loss and d loss / d logits (written in the input dtype over the
logits). Two impls trade memory for time:

- backend "triton_lean", the lean mode: the forward computes only the logsumexp and the loss
  (token chunks of fp32 logits no larger than the backward's own peak). The backward recomputes the logits in
  blocks of (token super-chunk x vocabulary columns) sized by a budget of LEAN_EXTRA_FRACTION
  (8%) of the gradients' bytes: per block, grad_W's rows come from one GEMM over the
  super-chunk's tokens and grad_hidden accumulates in fp32. Peak memory above the inputs:
  grad_W + grad_hidden + the budget, i.e. about Cut Cross-Entropy's (its gradients alone).
  Cost: the logits are computed twice, 8*BT*H*V flops instead of 6 (the GEMMs are cuBLAS's).
- backend "triton", the fast mode (the default): for "mean"/"sum" the forward computes every
  gradient (the upstream gradient is one scalar, applied in the backward by scaling in place):
  6*BT*H*V flops, with a chunk of logits live at the peak (at most CHUNK_BYTES, 1 GiB).

grad_accum_dtype: fp32 means grad_W rounded once (lean: one super-chunk of all tokens, so the
fp32 grad_hidden accumulator holds BT x H floats; fast: a V x H fp32 accumulator). weight.dtype
lets the lean mode split the tokens into at most MAX_SUPER_CHUNKS (8) super-chunks whose grad_W
rows are summed in the weight's dtype (one rounding each: 8 of them stay within the policy's 3x
eager's error) and the fast mode accumulate in it (one rounding per chunk). None, the
default: both modes sum at most 8 chunks in the weight's dtype; the fast mode takes 8 token
chunks when each holds at most CHUNK_BYTES of logits: bf16 logits for bf16 inputs
(kernels.bf16_logits_chunk: about the time of fp32 chunks or less, at a lower peak; on long
batches, where 8 chunks would pass 2048 tokens each, up to 16 chunks of at least 2048 tokens:
the same time at a lower peak), fp32 ones for fp16
(BT * V <= 2^31); otherwise (or for fp16 weights) CHUNK_BYTES chunks into an fp32 V x H
accumulator (chunks never pass CHUNK_BYTES, so more of them would sum grad_W in 16 bits more
often than the policy allows).
The fast mode is the default because in a training step the FLCE's own peak sits below the step's
peak: end to end both modes reach the same peak memory, and the fast mode trains faster
(docs/performance.md, "Design decisions and their measurements"). Choose the lean mode like any backend,
where the loss's own peak matters: backend="triton_lean", or
LMKERNELS_BACKEND="triton,flce=triton_lean".

memory_budget (the op's option, a fraction f of the gradients' bytes) makes either backend one
point of the range between the two (kernels.plan): the triton default wherever it fits f x
the gradients beside them (no other plan is faster), else its bf16 chunks made smaller (16
chunks of at least 1024 tokens), else the fast mode with the largest chunks of fp32
logits that fit (grad_W summed in its own dtype over at most 8 of them, or else in an fp32
accumulator that the budget pays for too), and where none fits, the lean mode with blocks
within it. None keeps each backend's default above.

reduction "none" (a gradient per token) or no gradient needed: both modes keep only the
logsumexp and the backward recomputes (the budget is CHUNK_BYTES in fast mode). So does
return_stats=True whenever a gradient is needed, whatever the reduction: the entropy's upstream
gradient is per token and unknown in the forward. The forward then keeps the entropy too (BT
floats), and when a loss differentiates it the backward's row kernel adds its term
-g_H p_c (z_c - lse + H) to the loss's dlogits in the same pass (ENTROPY_GRAD): no other GEMM
or buffer. Without return_stats the plan, the kernels and the results are those of the plain loss.

temperature T: the row kernel multiplies the fp32 logits by 1/T after the softcap, and the
upstream gradients by 1/T (the chain factor; every dlogits term is linear in them).

fp16 dlogits are kept in fp16's normal range (>= 6.1e-5). Unscaled they are a probability
(~1/V: 1e-5 at V = 128k) times the token's gradient scale (1/tokens for "mean": 1e-4), far
below it: subnormal or zero. So the kernel gets the upstream gradient times
K = FP16_DLOGITS_SCALE / 2^e, with 2^e the power of two of max |upstream| (a device scalar, no
host sync), and the gradients are multiplied by 1/K afterwards: a power of two, so exact (the
lean backward unscales each grad_W block in fp32 before storing it in fp16). Not with a grad_W
accumulated in fp16 in fast mode (grad_accum_dtype=fp16): there the scale is 1, leaving room for
|grad_W| up to 65504 / tokens. bf16 has fp32's exponent range and fp32 needs neither.

Backward twice (retain_graph=True) after a fast "mean"/"sum" forward: the first backward scaled
the stored gradients in place, so the second raises ConsumedInputsError naming the backends that
recompute. A backward with create_graph=True raises HigherOrderGradientError (no double backward).
Eager calls run the launchers through a plain autograd.Function (_common.call); only code that
torch.compile traces calls the torch.library custom ops, which share its context and backward.
Under torch.func transforms (grad, vjp, vmap) the forward computes no gradient and the backward
recomputes them, for what autograd asks (a tensor batched by vmap inside grad reports
requires_grad=False to the forward); the recomputing launcher's own derivatives are refused
(HigherOrderGradientError: grad of grad). Forward-mode AD (jvp) raises ForwardADError.
Out-of-range targets (possible only when LMKERNELS_CHECK_VALUES=0 skipped the input check) are
never read: their loss, and the gradients, are nan.
"""

from typing import Any, NoReturn

import torch

from lmkernels.backends.triton import flce_kernels as kernels
from lmkernels.backends.triton import triton_devices, triton_unavailable_reason
from lmkernels.backends.triton.common import (
    call,
    eager_function,
    gpu_capabilities,
    op_or_raw,
    traced,
    transforming,
    transforms_function,
)
from lmkernels.backends.triton.configs import tables_for
from lmkernels.ops.flce import FlceOptions
from lmkernels.registry.core import ConsumedInputsError, forward_ad_error, higher_order_error, register

# --- torch.library registration ------------------------------------------------------------------


def _grads_in_forward(
    reduction: str, grad_hidden: bool, grad_weight: bool, grad_bias: bool, lean: bool, stats: bool
) -> bool:
    """Whether the forward computes the gradients (fast mode): a reduced loss without the
    return_stats entropy, whose upstream gradient (per token) the forward cannot know."""
    return not lean and reduction != "none" and not stats and (grad_hidden or grad_weight or grad_bias)


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
    lean: bool,
    chunk_bytes: int,
    fp32_logits: bool,
    block_bytes: int,
    stats: bool,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, lse, grad_hidden, grad_weight, grad_bias, entropy, top1) for hidden (BT, H), target (BT,).

    loss is (BT,) for reduction "none", else 0-dim. The gradients (of the reduced loss, for an
    upstream gradient of 1) are computed only in fast mode for "mean"/"sum" and only where
    asked; the others are empty (0,) tensors, as are entropy (fp32) and top1 (int8) without
    `stats`.
    """
    BT, H = hidden.shape
    V = weight.shape[0]
    grads_now = _grads_in_forward(reduction, grad_hidden, grad_weight, grad_bias, lean, stats)
    scale = None
    if reduction == "mean":
        scale = kernels.mean_scale(target, class_weight, ignore_index, V)
    elif grads_now:
        scale = torch.ones((), dtype=torch.float32, device=hidden.device)
    table = tables_for(hidden.device).flce
    rows = kernels.Rows(
        target,
        bias,
        class_weight,
        ignore_index,
        label_smoothing,
        softcap,
        z_loss_scale,
        V,
        table,
        temperature,
    )
    # The plan's chunk (kernels.plan): lean, the backward's own peak; fast, the budget's.
    max_bytes = chunk_bytes or None
    loss, lse, gh, gw, gb, entropy, top1 = kernels.run_chunks(
        hidden,
        weight,
        rows,
        scale if grads_now else None,
        grad_hidden,
        grad_weight,
        grad_bias and bias is not None,
        accum_fp32,
        max_bytes,
        stats,
        fp32_logits,
    )
    if reduction == "sum":
        loss = loss.sum()
    elif reduction == "mean":
        assert scale is not None  # (mean_scale's)
        loss = loss.sum() * scale
    if not stats:
        entropy, top1 = hidden.new_empty(0, dtype=torch.float32), hidden.new_empty(0, dtype=torch.int8)
    assert entropy is not None and top1 is not None  # (run_chunks' with stats)
    return (loss, lse, *_or_empty(hidden, bias, gh, gw, gb), entropy, top1)


def _or_empty(
    hidden: torch.Tensor,
    bias: torch.Tensor | None,
    gh: torch.Tensor | None,
    gw: torch.Tensor | None,
    gb: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients not computed become empty (0,) tensors (custom ops return no None)."""
    nothing = hidden.new_empty(0)
    gh = gh if gh is not None else nothing
    gw = gw if gw is not None else nothing.clone()
    gb = gb.to(bias.dtype) if gb is not None and bias is not None else nothing.clone()
    return gh, gw, gb


_forward_op = torch.library.custom_op("lmkernels::flce_triton_forward", _forward_raw, mutates_args=())


@_forward_op.register_fake
def _forward_fake(
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
    lean: bool,
    chunk_bytes: int,
    fp32_logits: bool,
    block_bytes: int,
    stats: bool,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    BT = hidden.shape[0]
    grads_now = _grads_in_forward(reduction, grad_hidden, grad_weight, grad_bias, lean, stats)
    loss = hidden.new_empty((BT,) if reduction == "none" else (), dtype=torch.float32)
    lse = hidden.new_empty((BT,), dtype=torch.float32)
    gh = torch.empty_like(hidden) if grads_now and grad_hidden else hidden.new_empty(0)
    gw = torch.empty_like(weight) if grads_now and grad_weight else hidden.new_empty(0)
    gb = torch.empty_like(bias) if grads_now and grad_bias and bias is not None else hidden.new_empty(0)
    entropy = hidden.new_empty((BT,) if stats else (0,), dtype=torch.float32)
    top1 = hidden.new_empty((BT,) if stats else (0,), dtype=torch.int8)
    return loss, lse, gh, gw, gb, entropy, top1


def _backward_raw(
    grad_loss: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    lse: torch.Tensor,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    softcap: float | None,
    z_loss_scale: float,
    grad_hidden: bool,
    grad_weight: bool,
    grad_bias: bool,
    accum_fp32: bool,
    block_bytes: int,
    temperature: float,
    grad_entropy: torch.Tensor | None,
    entropy: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the loss for upstream gradient grad_loss (0-dim, or (BT,) for "none"), plus
    the entropy's for its upstream gradient grad_entropy ((BT,), or None: not differentiated;
    entropy: the forward's), recomputing the logits block by block from lse within block_bytes.
    Gradients not asked for are empty (0,)."""
    BT, H = hidden.shape
    V = weight.shape[0]
    grad = grad_loss.float()
    if reduction == "mean":
        grad = grad * kernels.mean_scale(target, class_weight, ignore_index, V)
    table = tables_for(hidden.device).flce
    rows = kernels.Rows(
        target,
        bias,
        class_weight,
        ignore_index,
        label_smoothing,
        softcap,
        z_loss_scale,
        V,
        table,
        temperature,
    )
    entropy_grad = None
    if grad_entropy is not None:
        assert entropy is not None  # (the forward's, saved with return_stats)
        entropy_grad = (grad_entropy.reshape(-1).float().contiguous(), entropy)
    gh, gw, gb = kernels.run_blocks(
        hidden,
        weight,
        rows,
        lse,
        grad,
        grad_hidden,
        grad_weight,
        grad_bias and bias is not None,
        accum_fp32,
        block_bytes,
        entropy_grad,
    )
    return _or_empty(hidden, bias, gh, gw, gb)


_backward_op = torch.library.custom_op("lmkernels::flce_triton_backward", _backward_raw, mutates_args=())


@_backward_op.register_fake
def _backward_fake(
    grad_loss: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    lse: torch.Tensor,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    softcap: float | None,
    z_loss_scale: float,
    grad_hidden: bool,
    grad_weight: bool,
    grad_bias: bool,
    accum_fp32: bool,
    block_bytes: int,
    temperature: float,
    grad_entropy: torch.Tensor | None,
    entropy: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gh = torch.empty_like(hidden) if grad_hidden else hidden.new_empty(0)
    gw = torch.empty_like(weight) if grad_weight else hidden.new_empty(0)
    gb = torch.empty_like(bias) if grad_bias and bias is not None else hidden.new_empty(0)
    return gh, gw, gb


# The recomputing backward: the custom op when traced, else the launcher (per backend, for the
# errors' names).
_RECOMPUTE = {
    backend: op_or_raw(_backward_op, _backward_raw, "fused_linear_cross_entropy", backend)
    for backend in ("triton", "triton_lean")
}


def _setup_context(ctx: Any, inputs: tuple, output: tuple[torch.Tensor, ...]) -> None:
    hidden, weight, target, bias, class_weight, ignore_index, reduction = inputs[:7]
    (
        label_smoothing,
        softcap,
        z_loss_scale,
        grad_h,
        grad_w,
        grad_b,
        accum_fp32,
        lean,
        _,
        _,
        block_bytes,
        stats,
        temperature,
    ) = inputs[7:]
    loss, lse, gh, gw, gb, entropy, top1 = output
    ctx.mark_non_differentiable(lse, gh, gw, gb, top1)
    # Autograd would otherwise hand the backward zero-filled gradients for the four outputs
    # nothing differentiates: zeros the size of grad_W and grad_hidden, allocated while the real
    # ones are alive (doubling grad_W + grad_hidden: the lean mode's peak).
    ctx.set_materialize_grads(False)
    ctx.flags = (grad_h, grad_w, grad_b and bias is not None)
    ctx.backend = "triton_lean" if lean else "triton"
    ctx.precomputed = _grads_in_forward(reduction, grad_h, grad_w, grad_b, lean, stats)
    ctx.scaled = False  # whether a backward scaled the precomputed gradients in place
    if ctx.precomputed:
        ctx.save_for_backward(gh, gw, gb)
    else:
        # With return_stats the entropy too (BT floats), for its gradient's term: a copy, so that
        # the caller may write over the output it got (masking it in place, say).
        saved_entropy = entropy.detach().clone() if stats else None
        ctx.save_for_backward(hidden, weight, target, bias, class_weight, lse, saved_entropy)
        ctx.options = (
            ignore_index,
            reduction,
            label_smoothing,
            softcap,
            z_loss_scale,
            accum_fp32,
            block_bytes,
            temperature,
        )


_SECOND_BACKWARD = (
    "fused_linear_cross_entropy: the Triton fast mode (backend 'triton', or a memory_budget that "
    "fits it) computed the gradients in the forward and the first backward handed them to "
    "autograd (scaled in place), so there is nothing left for a second backward through this "
    "graph (retain_graph=True). What recomputes instead: backend 'triton_lean' without a "
    "memory_budget (or one below the fast mode's need), 'compile', 'eager'."
)


def _backward(
    ctx: Any,
    grad_loss: torch.Tensor | None,
    _lse: torch.Tensor | None,
    _gh: torch.Tensor | None,
    _gw: torch.Tensor | None,
    _gb: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    _top1: torch.Tensor | None,
) -> tuple[torch.Tensor | None, ...]:
    present = tuple(g for g in (grad_loss, grad_entropy) if g is not None)
    # create_graph=True: the gradients the forward computed carry no second-order term, so they
    # are refused; the recomputing path's launchers refuse only a derivative of their results.
    if ctx.precomputed and torch.is_grad_enabled() and not (traced(present) or transforming()):
        raise higher_order_error("fused_linear_cross_entropy", ctx.backend)
    flags = ctx.flags
    if ctx.precomputed:
        # (no return_stats: the entropy output is an empty placeholder nothing differentiates)
        if ctx.scaled:
            raise ConsumedInputsError(_SECOND_BACKWARD)
        assert grad_loss is not None  # (the loss is the one output differentiated here)
        # The forward computed the gradients of the reduced loss; only the upstream scalar is
        # missing. Eagerly they are scaled in place: the buffers are ours (the impl drops the
        # forward's outputs) and the unpacked saved tensors are their only references, so
        # AccumulateGrad adopts them as .grad without a copy. A traced graph (torch.compile,
        # opcheck: fake or functional tensors) must not mutate the op's outputs: out of place,
        # with scale_'s rounding (the product in fp32, rounded once; inductor fuses the casts).
        gh, gw, gb = ctx.saved_tensors
        if traced((gh, gw, gb, grad_loss)):
            grads = [(g.float() * grad_loss).to(g.dtype) for g in (gh, gw, gb)]
        else:
            grads = [kernels.scale_(g, grad_loss) for g in (gh, gw, gb)]
            ctx.scaled = True
    else:
        hidden, weight, target, bias, class_weight, lse, entropy = ctx.saved_tensors
        (
            ignore_index,
            reduction,
            label_smoothing,
            softcap,
            z_loss_scale,
            accum_fp32,
            block_bytes,
            temperature,
        ) = ctx.options
        # What autograd asks for (the forward's flags, except under torch.func transforms).
        needs = ctx.needs_input_grad
        flags = (needs[0], needs[1], needs[3] and bias is not None)
        if grad_loss is None:  # only the entropy is differentiated
            grad_loss = lse.new_zeros(())
        grads = _RECOMPUTE[ctx.backend](
            grad_loss,
            hidden,
            weight,
            target,
            bias,
            class_weight,
            lse,
            ignore_index,
            reduction,
            label_smoothing,
            softcap,
            z_loss_scale,
            *flags,
            accum_fp32,
            block_bytes,
            temperature,
            grad_entropy,
            entropy if grad_entropy is not None else None,
        )
    gh, gw, gb = (g if flag else None for g, flag in zip(grads, flags))
    return gh, gw, None, gb, *[None] * 16


def _jvp(ctx: Any, *tangents: Any) -> NoReturn:
    raise forward_ad_error("fused_linear_cross_entropy", ctx.backend)


def _functions(backend: str) -> type[torch.autograd.Function]:
    """Eager calls: the same forward, context and backward, without the custom op's per-call
    cost (and their Function under torch.func transforms). One per backend, whose context names
    it for the errors, whatever mode its plan chose."""

    def setup_context(ctx: Any, inputs: tuple, output: tuple[torch.Tensor, ...]) -> None:
        _setup_context(ctx, inputs, output)
        ctx.backend = backend

    return eager_function(
        "FlceTritonFunction",
        _forward_raw,
        setup_context,
        _backward,
        transforms_function(
            "FlceTritonTransforms", _forward_op, _forward_raw, setup_context, _backward, _jvp
        ),
    )


_forward_op.register_autograd(_backward, setup_context=_setup_context)
_FUNCTIONS = {False: _functions("triton"), True: _functions("triton_lean")}  # by lean_default


# --- the impls -----------------------------------------------------------------------------------


def _flce(
    lean_default: bool, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, **options: Any
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    o = FlceOptions(**options)
    H = weight.shape[1]
    # Under torch.func transforms no gradient is computed in the forward (module docstring).
    grad_on = torch.is_grad_enabled() and (torch.compiler.is_compiling() or not transforming())
    needs = (
        grad_on and hidden.requires_grad,
        grad_on and weight.requires_grad,
        grad_on and o.bias is not None and o.bias.requires_grad,
    )
    BT = hidden.numel() // H if H else 0
    # return_stats: the recomputing backward (it has the entropy's term), as for "none"
    grads_now = o.reduction != "none" and not o.return_stats and any(needs)
    plan = kernels.plan(
        BT, H, weight.shape[0], hidden.element_size(), weight.dtype, o.grad_accum_dtype, lean_default,
        o.memory_budget, grads_now, needs[1],
    )  # fmt: skip
    # The gradient outputs are dropped here: the backward's saved tensors are their only owners.
    loss, lse, _, _, _, entropy, top1 = call(
        _forward_op,
        _FUNCTIONS[lean_default],
        hidden.reshape(-1, H),
        weight,
        target.reshape(-1),
        o.bias,
        o.class_weight,
        int(o.ignore_index),
        o.reduction,
        float(o.label_smoothing),
        None if o.softcap is None else float(o.softcap),
        float(o.z_loss_scale),
        *needs,
        plan.accum_fp32,
        plan.lean,
        plan.chunk_bytes,
        plan.fp32_logits,
        plan.block_bytes,
        o.return_stats,
        float(o.temperature),
    )
    if o.reduction == "none":
        loss = loss.view(target.shape)
    if o.return_stats:
        shape = target.shape
        return loss, lse.view(shape), entropy.view(shape), top1.view(shape).bool()
    if o.return_lse:
        return loss, lse.view(target.shape)
    return loss


def fused_linear_cross_entropy_triton(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, **options: Any
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """The fast mode (module docstring): gradients in the forward, a chunk of logits held."""
    return _flce(False, hidden, weight, target, **options)


def fused_linear_cross_entropy_triton_lean(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, **options: Any
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """The lean mode (module docstring): memory about the gradients alone."""
    return _flce(True, hidden, weight, target, **options)


def _supports(class_weight: torch.Tensor | None = None, **inputs: Any) -> list[str]:
    reasons = []
    if class_weight is not None and class_weight.requires_grad and torch.is_grad_enabled():
        reasons.append("no gradient for class_weight (it requires grad)")
    return reasons


_CAPABILITIES = dict(
    devices=triton_devices(),
    auto_devices=("cuda",),
    available=triton_unavailable_reason,
    **gpu_capabilities("fused_linear_cross_entropy", _supports),
    compiled_transforms=False,
)
register(
    "fused_linear_cross_entropy",
    "triton",
    fused_linear_cross_entropy_triton,
    priority=100,
    description="fast: gradients computed in the forward from chunks of logits (<= 1 GiB)",
    **_CAPABILITIES,
)
register(
    "fused_linear_cross_entropy",
    "triton_lean",
    fused_linear_cross_entropy_triton_lean,
    priority=90,
    description="lean: logsumexp forward, blocked recomputing backward; peak ~ the gradients + 8%",
    **_CAPABILITIES,
)
