"""SwiGLU and GeGLU in Triton: out = act(gate) * up, act = silu or gelu (tanh or exact erf).

Elementwise over the flattened inputs: a 1-D grid of programs, each over BLOCK contiguous
elements, math in fp32 with one rounding of each output (as the eager reference).

The backward saves only gate and up and recomputes the activation and its derivative from gate
(cheaper than reading a saved activation back). Each element of grad, gate and up is read by
the program that then writes d_gate and d_up at the same element, so the results may be written
over any of those three buffers.

Memory of the backward. Out of place, d_gate and d_up are fresh tensors: the peak is the two
gradients on top of grad, gate and up (plus contiguous copies of strided inputs). In place
(IN_PLACE_BACKWARD, on by default; the environment variable LMKERNELS_GLU_INPLACE_BWD=0 at
import turns it off), eager calls write d_gate over the saved gate and d_up over the saved up
when nobody else can see them, as Liger Kernel does: in a Llama MLP,
down(swiglu(gate_proj(x), up_proj(x))), gate and up are temporaries only autograd holds, also
under non-reentrant activation checkpointing (the recomputed ones), and the backward allocates
nothing. Otherwise a result goes into the contiguous copy the backward made of a strided input
(chunk(2, dim=-1) of a fused gate_up), or into the incoming gradient when that one is exclusive
(not a view, e.g.), or into a fresh tensor. Exclusivity is proved from reference counts
(_exclusive.py): the caller's tensors, leaves, tensors other nodes saved, views of a larger
buffer and the saved tensors of a retained graph (retain_graph=True: a later backward reads gate
and up again) are never written. torch.compile'd code calls the functional custom ops.
last_backward_buffers() says where the last eager backward wrote.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from lmkernels.backends.triton import triton_devices, triton_unavailable_reason
from lmkernels.backends.triton._common import cdiv, device_guard, op_or_raw, traced
from lmkernels.backends.triton._exclusive import (
    excess_holders,
    grad_is_exclusive,
    graph_is_retained,
    saved_is_exclusive,
    saved_tensors_and_counts,
)
from lmkernels.registry.core import register
from lmkernels.utils import empty


def in_place_backward_from_env() -> bool:
    return os.environ.get("LMKERNELS_GLU_INPLACE_BWD", "1").strip().lower() not in ("0", "false", "no")


# Write d_gate and d_up over buffers the backward received when that is provably safe (see the
# module docstring). On by default: it only engages where nobody else can see the memory.
IN_PLACE_BACKWARD = in_place_backward_from_env()

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
def _glu_fwd_kernel(gate_ptr, up_ptr, out_ptr, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    # 64-bit offsets: n may pass 2^31 elements.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    act, _ = _activation(a, ACT)
    tl.store(out_ptr + offs, (act * b).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _glu_bwd_kernel(
    grad_ptr, gate_ptr, up_ptr, d_gate_ptr, d_up_ptr, n, ACT: tl.constexpr, BLOCK: tl.constexpr
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    act, d_act = _activation(a, ACT)
    # d_gate_ptr / d_up_ptr may equal gate_ptr, up_ptr or grad_ptr (in-place backward): this
    # program has loaded every element it overwrites.
    tl.store(d_gate_ptr + offs, (g * b * d_act).to(d_gate_ptr.dtype.element_ty), mask=mask)
    tl.store(d_up_ptr + offs, (g * act).to(d_up_ptr.dtype.element_ty), mask=mask)


def _grid(n: int):
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
            _glu_fwd_kernel[_grid(n)](gate, up, out, n, ACT=act, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return out


def _glu_backward_into(grad, gate, up, activation, d_gate, d_up) -> None:
    """Writes d_gate and d_up (contiguous; each may be grad, gate or up itself)."""
    act = _ACTIVATIONS[activation]
    n = gate.numel()
    if n:
        with device_guard(gate):
            _glu_bwd_kernel[_grid(n)](
                grad, gate, up, d_gate, d_up, n, ACT=act, BLOCK=BLOCK, num_warps=NUM_WARPS
            )


def _glu_backward(
    grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_gate, d_up) of act(gate) * up for the upstream gradient grad, in fresh tensors."""
    # Autograd may hand an expanded (stride 0) gradient: make everything flat-indexable.
    grad, gate, up = grad.contiguous(), gate.contiguous(), up.contiguous()
    d_gate = empty(gate.shape, gate.dtype, gate.device)
    d_up = empty(up.shape, up.dtype, up.device)
    _glu_backward_into(grad, gate, up, activation, d_gate, d_up)
    return d_gate, d_up


# --- torch.library ops and autograd ----------------------------------------------------------------

glu_forward = torch.library.custom_op("lmkernels::glu_forward", _glu_forward, mutates_args=())
glu_backward = torch.library.custom_op("lmkernels::glu_backward", _glu_backward, mutates_args=())


@glu_forward.register_fake
def _(gate, up, activation):
    return gate.new_empty(gate.shape)


@glu_backward.register_fake
def _(grad, gate, up, activation):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _setup_context(ctx, inputs, output):
    gate, up, activation = inputs
    # Only the inputs are saved; the backward recomputes the activation from gate.
    ctx.save_for_backward(gate, up)
    ctx.activation = activation


def _backward(ctx, grad):
    """The custom op's backward (compiled code): functional, fresh d_gate and d_up."""
    gate, up = ctx.saved_tensors
    d_gate, d_up = op_or_raw(glu_backward, _glu_backward)(grad, gate, up, ctx.activation)
    return d_gate, d_up, None


glu_forward.register_autograd(_backward, setup_context=_setup_context)


# --- eager autograd, with the in-place backward ------------------------------------------------------

_OVERWRITTEN = (
    "lmkernels GLU: this backward already wrote its gradients over the saved gate and up (the "
    "in-place backward), so it cannot run again. Set LMKERNELS_GLU_INPLACE_BWD=0 to keep them."
)

# Where the last eager backward wrote (d_gate, d_up): see last_backward_buffers().
_last_buffers: tuple[str, str] | None = None


def last_backward_buffers() -> tuple[str, str] | None:
    """(where d_gate went, where d_up went) in the last eager GLU backward: "gate" / "up" (over
    the saved input), "grad" (over the incoming gradient), "copy" (over the contiguous copy of
    a strided saved input) or "new" (a fresh tensor)."""
    return _last_buffers


class _GLUFunction(torch.autograd.Function):
    """The eager path: the forward launcher and a backward that may work in place.

    With IN_PLACE_BACKWARD the forward also returns a non-differentiable empty `control`, whose
    gradient autograd materializes next to grad: the reference for grad's holders (see
    _exclusive.excess_holders). Otherwise it returns (out,) and materializes nothing.
    """

    @staticmethod
    def forward(ctx, gate, up, activation):
        out = _glu_forward(gate, up, activation)
        _setup_context(ctx, (gate, up, activation), out)
        ctx.set_materialize_grads(IN_PLACE_BACKWARD)
        if not IN_PLACE_BACKWARD:
            return (out,)
        control = out.new_empty((0,))
        ctx.mark_non_differentiable(control)
        return out, control

    @staticmethod
    def backward(ctx, grad, control=None):
        global _last_buffers
        # First, before anything else takes a reference to grad.
        excess = excess_holders(grad, control) if control is not None else None
        if getattr(ctx, "overwritten", False):
            raise RuntimeError(_OVERWRITTEN)
        if not IN_PLACE_BACKWARD or grad is None:
            gate, up = ctx.saved_tensors
            if grad is None:  # out got no gradient (grads are not materialized)
                return None, None, None
            d_gate, d_up = op_or_raw(glu_backward, _glu_backward)(grad, gate, up, ctx.activation)
            _last_buffers = ("new", "new")
            return d_gate, d_up, None
        (gate, up), counts = saved_tensors_and_counts(ctx)
        args = (grad, gate, up)
        if torch.is_grad_enabled() or traced(args):  # create_graph=True, or tracing: functional
            d_gate, d_up = op_or_raw(glu_backward, _glu_backward)(grad, gate, up, ctx.activation)
            _last_buffers = ("new", "new")
            return d_gate, d_up, None

        # Candidate buffers: the saved inputs (only while the graph is not retained: a later
        # backward would read them) and the incoming gradient.
        retained = graph_is_retained() is not False
        gate_free = not retained and saved_is_exclusive(gate, counts[0])
        up_free = not retained and gate is not up and saved_is_exclusive(up, counts[1])
        if grad.is_contiguous():
            grad_free = grad_is_exclusive(excess, grad.device)
        else:  # an expanded gradient (out.sum()): the contiguous copy is ours
            grad, grad_free = grad.contiguous(), True
        # A strided saved input is copied for the kernel: the copy is ours to write into.
        gate_c, up_c = gate.contiguous(), up.contiguous()
        gate_free, up_free = gate_free or gate_c is not gate, up_free or up_c is not up

        def target(own_free, own, saved, own_name):
            nonlocal grad_free
            if own_free:
                return own.detach(), own_name if own is saved else "copy"
            if grad_free and grad.dtype == own.dtype and grad.shape == own.shape:
                grad_free = False
                return grad, "grad"
            return empty(own.shape, own.dtype, own.device), "new"

        d_gate, gate_to = target(gate_free, gate_c, gate, "gate")
        d_up, up_to = target(up_free, up_c, up, "up")
        if gate_to == "gate" or up_to == "up":
            ctx.overwritten = True  # see _OVERWRITTEN; the graph is not retained anyway
        _glu_backward_into(grad, gate_c, up_c, ctx.activation, d_gate, d_up)
        _last_buffers = (gate_to, up_to)
        return d_gate, d_up, None


# --- lmkernels impls -------------------------------------------------------------------------------


def _glu(gate, up, activation):
    """As _common.call, for the eager Function's extra control output."""
    args = (gate, up, activation)
    if traced(args):
        return glu_forward(*args)
    if torch.is_grad_enabled() and torch._C._any_requires_grad(gate, up):
        return _GLUFunction.apply(*args)[0]
    return _glu_forward(*args)


def swiglu_triton(gate, up):
    return _glu(gate, up, "silu")


def geglu_triton(gate, up, approximate="tanh"):
    return _glu(gate, up, _GELU_BY_APPROXIMATE[approximate])


def _supports(**inputs) -> list[str]:
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
    supports=_supports,
)
register(
    "geglu",
    "triton",
    geglu_triton,
    priority=100,
    devices=triton_devices(),
    auto_devices=("cuda",),
    available=triton_unavailable_reason,
    supports=_supports,
)
