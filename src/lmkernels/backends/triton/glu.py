"""SwiGLU and GeGLU in Triton: out = act(gate) * up, act = silu or gelu (tanh or exact erf).

Elementwise over the flattened inputs: a 1-D grid of programs, each over BLOCK contiguous
elements, math in fp32 with one rounding of each output (as the eager reference).

The backward saves only gate and up and recomputes the activation and its derivative from gate
(cheaper than reading a saved activation back). Each element of grad, gate and up is read by
the program that then writes d_gate and d_up at the same element, so the results may be written
over any of those three buffers.

Where the gradients go (eager calls; torch.compile'd code calls the functional custom ops, and
under torch.func transforms the functional backward runs):
- consume_inputs=True (the caller hands gate and up over for good: the nn modules and the
  transformers integration, which create them in the MLP's forward): d_gate is written over
  gate and d_up over up, as Liger Kernel does, and the backward allocates nothing. The saved
  gate and up then get their autograd version bumped, so a later backward that would read them
  (retain_graph=True, or another node that saved them) fails with autograd's "modified by an
  inplace operation" error instead of computing with gradients. Not over a strided input
  (chunk(2, dim=-1) of a fused gate_up projection: the other half and the caller's buffer live
  there; the backward's contiguous copy takes the result instead), not over up when it shares
  memory with gate, not where the incoming gradient shares memory with either.
- consume_inputs=False (the default, a plain call on the caller's tensors): gate and up are
  never written; the results go into the contiguous copies the backward makes of strided
  inputs or of an expanded gradient (its own), else into fresh tensors.
The incoming gradient itself is never written: nothing here knows who else holds it.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from lmkernels.backends.triton import triton_devices, triton_unavailable_reason
from lmkernels.backends.triton.common import (
    cdiv,
    device_guard,
    gpu_capabilities,
    launch,
    op_or_raw,
    pdl,
    pdl_enter,
    refuse_nested_jvp,
    soft_bf16,
    to_dtype,
    traced,
    transforming,
    transforms_function,
    vmap_over_rows,
)
from lmkernels.registry.core import ConsumedInputsError, register
from lmkernels.types import GeluApproximation
from lmkernels.utils import empty

# Activation names in the custom op schemas -> the constexpr the kernels branch on.
_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "gelu": 2}
_GELU_BY_APPROXIMATE = {"tanh": "gelu_tanh", "none": "gelu"}

# Large contiguous blocks: 4096 elements over 8 warps is 16 per thread, i.e. whole 16-byte
# vectors for 16-bit dtypes, and few enough programs that launch overhead per block is noise.
BLOCK = 4096
NUM_WARPS = 8

# Globals read inside @triton.jit functions must be tl.constexpr.
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_GELU_CUBIC = tl.constexpr(0.044715)
_INV_SQRT_2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


@triton.jit
def _activation(a, ACT: tl.constexpr):
    """act(a) and act'(a) in fp32."""
    if ACT == 0:
        s = tl.sigmoid(a)
        return a * s, s * (1.0 + a * (1.0 - s))
    elif ACT == 1:
        # 0.5 * a * (1 + tanh(y)) == a * sigmoid(2y): no tanh needed, and no cancellation in
        # 1 + tanh(y) for very negative a.
        inner = _SQRT_2_OVER_PI * (a + _GELU_CUBIC * a * a * a)
        s = tl.sigmoid(2.0 * inner)
        # d/da [a * s] = s + a * 2 s (1 - s) * d inner / da
        d_inner = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_CUBIC * a * a)
        return a * s, s + 2.0 * a * s * (1.0 - s) * d_inner
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(a * _INV_SQRT_2))
        return a * cdf, cdf + a * _INV_SQRT_2PI * tl.exp(-0.5 * a * a)


@triton.jit
def _glu_fwd_kernel(
    gate_ptr, up_ptr, out_ptr, n, ACT: tl.constexpr, BLOCK: tl.constexpr, SOFT_BF16: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_enter(PDL)
    # 64-bit offsets: n may pass 2^31 elements.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    act, _ = _activation(a, ACT)
    tl.store(out_ptr + offs, to_dtype(act * b, out_ptr.dtype.element_ty, SOFT_BF16), mask=mask)


@triton.jit
def _glu_bwd_kernel(
    grad_ptr,
    gate_ptr,
    up_ptr,
    d_gate_ptr,
    d_up_ptr,
    n,
    ACT: tl.constexpr,
    BLOCK: tl.constexpr,
    SOFT_BF16: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    act, d_act = _activation(a, ACT)
    # d_gate_ptr / d_up_ptr may equal gate_ptr, up_ptr or grad_ptr (in-place backward): this
    # program has loaded every element it overwrites.
    tl.store(d_gate_ptr + offs, to_dtype(g * b * d_act, d_gate_ptr.dtype.element_ty, SOFT_BF16), mask=mask)
    tl.store(d_up_ptr + offs, to_dtype(g * act, d_up_ptr.dtype.element_ty, SOFT_BF16), mask=mask)


def _grid(n: int) -> tuple[int]:
    return (cdiv(n, BLOCK),)


# --- launchers -------------------------------------------------------------------------------------


def _glu_forward(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up, contiguous, in gate's dtype. activation: silu, gelu_tanh or gelu."""
    act = _ACTIVATIONS[activation]
    # The kernel indexes flat memory: strided inputs are copied (a no-op when contiguous).
    gate, up = gate.contiguous(), up.contiguous()
    out = empty(gate.shape, gate.dtype, gate.device)
    n = gate.numel()
    if n:
        with device_guard(gate):
            launch(
                _glu_fwd_kernel, _grid(n), gate, up, out, n,
                ACT=act, BLOCK=BLOCK, SOFT_BF16=soft_bf16(gate), num_warps=NUM_WARPS, **pdl(gate),
            )  # fmt: skip
    return out


def _glu_backward_into(
    grad: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    d_gate: torch.Tensor,
    d_up: torch.Tensor,
) -> None:
    """Writes d_gate and d_up (contiguous; each may be grad, gate or up itself)."""
    act = _ACTIVATIONS[activation]
    n = gate.numel()
    if n:
        with device_guard(gate):
            launch(
                _glu_bwd_kernel, _grid(n), grad, gate, up, d_gate, d_up, n,
                ACT=act, BLOCK=BLOCK, SOFT_BF16=soft_bf16(gate), num_warps=NUM_WARPS, **pdl(gate),
            )  # fmt: skip


def _glu_backward_to(
    grad: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    d_gate: torch.Tensor | None = None,
    d_up: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_gate, d_up) of act(gate) * up for the upstream gradient grad.

    d_gate / d_up, when given, are written over: contiguous, gate's shape and dtype, each gate,
    up or memory nobody reads afterwards. The missing ones go into the contiguous copies made
    here of strided arguments (ours: chunk() halves of a fused projection, an expanded
    gradient), else into fresh tensors.
    """
    # The kernel indexes flat memory: strided arguments are copied (a no-op when contiguous).
    copies = []
    flat = []
    for t in (gate, up, grad):
        c = t.contiguous()
        flat.append(c)
        if c is not t:
            copies.append(c)
    if d_gate is None:
        d_gate = copies.pop(0) if copies else empty(gate.shape, gate.dtype, gate.device)
    if d_up is None:
        d_up = copies.pop(0) if copies else empty(up.shape, up.dtype, up.device)
    gate, up, grad = flat
    _glu_backward_into(grad, gate, up, activation, d_gate, d_up)
    return d_gate, d_up


def _glu_backward(
    grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_gate, d_up) of act(gate) * up for the upstream gradient grad; gate, up and grad are
    left as they are."""
    return _glu_backward_to(grad, gate, up, activation)


# --- torch.library ops and autograd ----------------------------------------------------------------

glu_forward = torch.library.custom_op("lmkernels::glu_forward", _glu_forward, mutates_args=())
glu_backward = torch.library.custom_op("lmkernels::glu_backward", _glu_backward, mutates_args=())


@glu_forward.register_fake
def _(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    return gate.new_empty(gate.shape)


@glu_backward.register_fake
def _(
    grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    gate, up, activation = inputs
    # Only the inputs are saved; the backward recomputes the activation from gate.
    ctx.save_for_backward(gate, up)
    ctx.activation = activation


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    """The custom op's backward (compiled code): functional, gate and up are never written."""
    gate, up = ctx.saved_tensors
    d_gate, d_up = _RUN_BWD[ctx.activation](grad, gate, up, ctx.activation)
    return d_gate, d_up, None


# The backward launcher per activation, named by the op it belongs to (for its errors).
_RUN_BWD = {
    act: op_or_raw(glu_backward, _glu_backward, "swiglu" if act == "silu" else "geglu")
    for act in _ACTIVATIONS
}
glu_forward.register_autograd(_backward, setup_context=_setup_context)


# --- torch.func transforms and forward-mode AD ---------------------------------------------------


def _setup_context_transforms(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    _setup_context(ctx, inputs, output)
    ctx.save_for_forward(inputs[0], inputs[1])  # gate, up


def _activation_torch(a: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """act(a) and act'(a) in fp32, as the kernels' _activation computes them."""
    if activation == "silu":
        s = torch.sigmoid(a)
        return a * s, s * (1.0 + a * (1.0 - s))
    if activation == "gelu_tanh":
        c = _SQRT_2_OVER_PI.value
        s = torch.sigmoid(2.0 * c * (a + _GELU_CUBIC.value * a * a * a))
        return a * s, s + 2.0 * a * s * (1.0 - s) * c * (1.0 + 3.0 * _GELU_CUBIC.value * a * a)
    cdf = 0.5 * (1.0 + torch.erf(a * _INV_SQRT_2.value))
    return a * cdf, cdf + a * _INV_SQRT_2PI.value * torch.exp(-0.5 * a * a)


def _jvp(ctx: Any, d_gate: torch.Tensor | None, d_up: torch.Tensor | None, _: None) -> torch.Tensor:
    """The tangent of act(gate) * up, in fp32."""
    refuse_nested_jvp("swiglu" if ctx.activation == "silu" else "geglu")
    gate, up = ctx.saved_tensors
    act, d_act = _activation_torch(gate.float(), ctx.activation)
    terms = []
    if d_gate is not None:
        terms.append(d_act * d_gate.float() * up.float())
    if d_up is not None:
        terms.append(act * d_up.float())
    return sum(terms[1:], terms[0]).to(gate.dtype)


_GLUTransforms = transforms_function(
    "_GLUTransforms",
    glu_forward,
    _glu_forward,
    _setup_context_transforms,
    _backward,
    _jvp,
    vmap_over_rows((0, 1)),
)


# --- eager autograd, with the consuming backward -----------------------------------------------------

_CONSUMED = (
    "lmkernels GLU: this backward already wrote its gradients over gate and up, which the caller "
    "handed over with consume_inputs=True, so it cannot run again (e.g. with retain_graph=True). "
    "Call it with consume_inputs=False to keep them."
)


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Conservative: any two tensors on one storage count as sharing memory."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _handed_over(t: torch.Tensor) -> bool:
    """Whether consume_inputs=True may give t's memory to its gradient: only a tensor the caller
    can hand over. Never a leaf (a parameter's .grad would alias the parameter, overwritten by
    its own gradient), a view (its memory belongs to its base, e.g. a leaf it was sliced from)
    or a tensor that gets no gradient (it would be overwritten for nothing): those are kept."""
    return t.requires_grad and not t.is_leaf and t._base is None


def _consumed_targets(
    grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, handed_over: tuple[bool, bool]
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Which of gate and up the consuming backward may write its results over (None: not that
    one): handed over (_handed_over, judged in the forward on the caller's tensors), contiguous
    (the kernel's flat indexing is their own elements, nothing else of the storage), up not
    sharing memory with gate (both results would land on the same elements), and neither
    sharing memory with the incoming gradient."""
    gate_ok, up_ok = handed_over
    d_gate = gate if gate_ok and gate.is_contiguous() and not _shares_memory(gate, grad) else None
    d_up = up if up_ok and up.is_contiguous() and not _shares_memory(up, grad) else None
    if d_up is not None and _shares_memory(up, gate):
        d_up = None
    return d_gate, d_up


class _GLUFunction(torch.autograd.Function):
    """The eager path: the forward launcher, and a backward that writes over gate and up when
    the caller handed them over (consume_inputs)."""

    @staticmethod
    def forward(
        ctx: Any, gate: torch.Tensor, up: torch.Tensor, activation: str, consume_inputs: bool
    ) -> torch.Tensor:
        out = _glu_forward(gate, up, activation)
        _setup_context(ctx, (gate, up, activation), out)
        ctx.consume_inputs = consume_inputs
        ctx.handed_over = (consume_inputs and _handed_over(gate), consume_inputs and _handed_over(up))
        ctx.overwritten = {}  # data_ptr -> version of each saved tensor a backward wrote over
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        # Unpacked first: after a consuming backward, a retained graph fails here with autograd's
        # version-counter error. Saved-tensor hooks skip that check: a hook handing back the
        # memory written over (same address, version counter at least the bumped one) is caught
        # below; one handing back new tensors (recomputed by non-reentrant checkpointing, copied
        # back from the CPU: version 0) runs as usual.
        gate, up = ctx.saved_tensors
        if any(ctx.overwritten.get(t.data_ptr(), float("inf")) <= t._version for t in (gate, up)):
            raise ConsumedInputsError(_CONSUMED)
        args = (grad, gate, up, ctx.activation)
        # create_graph=True or tracing: the functional op (whose missing derivative is an error).
        if not ctx.consume_inputs or torch.is_grad_enabled() or traced(args[:3]):
            d_gate, d_up = _RUN_BWD[ctx.activation](*args)
            return d_gate, d_up, None, None
        d_gate, d_up = _consumed_targets(grad, gate, up, ctx.handed_over)
        written = [t for t in (d_gate, d_up) if t is not None]
        d_gate, d_up = _glu_backward_to(*args, d_gate, d_up)
        # The kernel wrote through pointers: tell autograd, so that anything that saved gate or
        # up (this node, if its graph is retained; another node) refuses to read them again.
        for t in written:
            torch.autograd.graph.increment_version(t)
            ctx.overwritten[t.data_ptr()] = t._version
        # detach(): the same memory and version counter, without gate's autograd history.
        return d_gate.detach(), d_up.detach(), None, None


# --- lmkernels impls -------------------------------------------------------------------------------


def _glu(gate: torch.Tensor, up: torch.Tensor, activation: str, consume_inputs: bool) -> torch.Tensor:
    """As _common.call, with the eager Function's extra consume_inputs argument (not part of the
    custom op: compiled graphs are functional and plan their own buffers; nor of the transforms'
    Function: functorch's tensors are not the caller's to hand over)."""
    args = (gate, up, activation)
    if not torch.compiler.is_compiling() and transforming():
        return _GLUTransforms.apply(*args)
    if traced(args):
        return glu_forward(*args)
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _GLUFunction.apply(*args, consume_inputs)
    return _glu_forward(*args)


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor, consume_inputs: bool = False) -> torch.Tensor:
    return _glu(gate, up, "silu", consume_inputs)


def geglu_triton(
    gate: torch.Tensor,
    up: torch.Tensor,
    approximate: GeluApproximation = "tanh",
    consume_inputs: bool = False,
) -> torch.Tensor:
    return _glu(gate, up, _GELU_BY_APPROXIMATE[approximate], consume_inputs)


def _supports(**inputs: Any) -> list[str]:
    # Every shape, dtype (fp32/bf16/fp16) and both gelu approximations are implemented.
    return []


register(
    "swiglu",
    "triton",
    swiglu_triton,
    priority=100,
    devices=triton_devices(),
    auto_devices=("cuda",),
    available=triton_unavailable_reason,
    **gpu_capabilities("swiglu", _supports),
    forward_ad=True,
    compiled_transforms=False,
)
register(
    "geglu",
    "triton",
    geglu_triton,
    priority=100,
    devices=triton_devices(),
    auto_devices=("cuda",),
    available=triton_unavailable_reason,
    **gpu_capabilities("geglu", _supports),
    forward_ad=True,
    compiled_transforms=False,
)
