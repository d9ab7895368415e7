"""SwiGLU and GeGLU in Triton: out = act(gate) * up, act = silu or gelu (tanh or exact erf).

Elementwise over the flattened inputs: a 1-D grid of programs, each over BLOCK contiguous
elements, math in fp32 with one rounding of each output (as the eager reference).

The backward saves only gate and up and recomputes the activation and its derivative from gate
(cheaper than reading a saved activation back). It writes d_gate and d_up into fresh tensors, so
its peak is the two gradients and nothing else (no intermediate is kept).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmkernels.backends.triton import triton_devices, triton_unavailable_reason
from lmkernels.backends.triton._common import call, cdiv, device_guard, eager_function, op_or_raw
from lmkernels.registry.core import register
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
    tl.store(d_up_ptr + offs, (g * act).to(d_up_ptr.dtype.element_ty), mask=mask)
    tl.store(d_gate_ptr + offs, (g * b * d_act).to(d_gate_ptr.dtype.element_ty), mask=mask)


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


def _glu_backward(
    grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_gate, d_up) of act(gate) * up for the upstream gradient grad, in fresh tensors."""
    act = _ACTIVATIONS[activation]
    # Autograd may hand an expanded (stride 0) gradient: make everything flat-indexable.
    grad, gate, up = grad.contiguous(), gate.contiguous(), up.contiguous()
    d_gate = empty(gate.shape, gate.dtype, gate.device)
    d_up = empty(up.shape, up.dtype, up.device)
    n = gate.numel()
    if n:
        with device_guard(gate):
            _glu_bwd_kernel[_grid(n)](
                grad, gate, up, d_gate, d_up, n, ACT=act, BLOCK=BLOCK, num_warps=NUM_WARPS
            )
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
    gate, up = ctx.saved_tensors
    d_gate, d_up = op_or_raw(glu_backward, _glu_backward)(grad, gate, up, ctx.activation)
    return d_gate, d_up, None


glu_forward.register_autograd(_backward, setup_context=_setup_context)
_GLUFunction = eager_function("_GLUFunction", _glu_forward, _setup_context, _backward)


# --- lmkernels impls -------------------------------------------------------------------------------


def swiglu_triton(gate, up):
    return call(glu_forward, _GLUFunction, gate, up, "silu")


def geglu_triton(gate, up, approximate="tanh"):
    return call(glu_forward, _GLUFunction, gate, up, _GELU_BY_APPROXIMATE[approximate])


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
