"""Gated linear units, the MLP activations of Llama (SwiGLU) and Gemma (GeGLU).

swiglu(gate, up) = silu(gate) * up
geglu(gate, up, approximate) = gelu(gate, approximate) * up   ("tanh" for Gemma, "none" exact)
Computed in fp32, one rounding to the inputs' dtype. gate and up have one shape and dtype.
Gradients: gate and up.

consume_inputs is not part of the math: it is who owns gate and up. True means the caller
hands them over for good (an MLP's forward that has just created them), so a backward may
write d_gate and d_up over their memory instead of allocating; the caller must not read gate
or up afterwards. False (the default) promises the caller's tensors are never written.
References and backends that have no use for it ignore it. What cannot be handed over is kept
even with True: leaves (parameters: their .grad would alias them), views (their memory is their
base's) and tensors that get no gradient. A backend that wrote over gate or up bumps their
version counters, so a second backward through the op, or another autograd node that saved
them, raises (ConsumedInputsError, or autograd's in-place modification error) instead of
reading gradients as values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lmkernels.ops._common import ROW_COUNTS, WIDE, WIDTHS, generator, op_function, randn, upcast
from lmkernels.registry.core import ErrorInput, OpSpec, register_op
from lmkernels.types import GeluApproximation
from lmkernels.utils import check_choice, check_same_device, check_same_dtype, check_tensor, fail

GELU_APPROXIMATIONS = ("tanh", "none")


def swiglu_reference(gate, up, consume_inputs=False):
    return (F.silu(upcast(gate)) * upcast(up)).to(gate.dtype)


def geglu_reference(gate, up, approximate="tanh", consume_inputs=False):
    return (F.gelu(upcast(gate), approximate=approximate) * upcast(up)).to(gate.dtype)


def _check_pair(gate, up, consume_inputs):
    if not isinstance(consume_inputs, bool):
        fail(f"consume_inputs: expected a bool, got {consume_inputs!r}")
    check_tensor("gate", gate)
    check_tensor("up", up)
    if gate.shape != up.shape:
        fail(f"up: expected the same shape as gate {tuple(gate.shape)}, got {tuple(up.shape)}")
    check_same_dtype(gate=gate, up=up)
    check_same_device(gate=gate, up=up)


def check_swiglu(gate, up, consume_inputs=False):
    _check_pair(gate, up, consume_inputs)


def check_geglu(gate, up, approximate="tanh", consume_inputs=False):
    _check_pair(gate, up, consume_inputs)
    check_choice("approximate", approximate, GELU_APPROXIMATIONS)


def make_inputs(shape, dtype, device, seed=0, **options):
    g = generator(seed)
    size = (shape["M"], shape["N"])
    return {"gate": randn(size, dtype, device, g, 2.0), "up": randn(size, dtype, device, g), **options}


def sample_swiglu(draw):
    N = draw.sampled_from((0, *WIDTHS))
    M = draw.integers(0, 3) if N > WIDE else draw.sampled_from(ROW_COUNTS)
    return {"M": M, "N": N}, {"consume_inputs": draw.booleans()}


def sample_geglu(draw):
    shape, options = sample_swiglu(draw)
    return shape, {**options, "approximate": draw.sampled_from(GELU_APPROXIMATIONS)}


def _error_inputs(device):
    g = torch.randn(4, 8, device=device)
    return [
        ErrorInput({"gate": g, "up": None}, "up: expected a torch.Tensor, got NoneType"),
        ErrorInput(
            {"gate": g, "up": torch.randn(4, 9, device=device)}, "up: expected the same shape as gate"
        ),
        ErrorInput({"gate": g, "up": g.bfloat16()}, "up: expected dtype torch.float32"),
        ErrorInput({"gate": g.long(), "up": g.long()}, "gate: expected a float32, bfloat16 or float16"),
        ErrorInput({"gate": g, "up": torch.randn(4, 8, device="meta")}, f"up: expected device {device}"),
        ErrorInput({"gate": g, "up": g, "consume_inputs": 1}, "consume_inputs: expected a bool"),
    ]


def error_inputs_geglu(device):
    g = torch.randn(4, 8, device=device)
    return [
        *_error_inputs(device),
        ErrorInput({"gate": g, "up": g, "approximate": "erf"}, "approximate: expected one of"),
    ]


GLU_SHAPES = {
    "tiny": [{"M": 2, "N": 3}],
    "quick": [{"M": 37, "N": 96}, {"M": 3, "N": 1001}],
    "full": [
        {"M": 37, "N": 96},
        {"M": 3, "N": 1001},
        {"M": 2048, "N": 8192},
        {"M": 1023, "N": 11008},
        {"M": 8192, "N": 14336},
    ],
}


def _glu_bytes(s, dtype):
    return 8 * s["M"] * s["N"] * dtype.itemsize


SWIGLU = register_op(
    OpSpec(
        name="swiglu",
        reference=swiglu_reference,
        make_inputs=make_inputs,
        check_inputs=check_swiglu,
        grad_inputs=("gate", "up"),
        shapes=GLU_SHAPES,
        # consume_inputs=True: the harness checks values and gradients as usual and allows the
        # inputs to change (their memory may hold the gradients).
        cases=[{}, {"consume_inputs": True}],
        bytes_moved=_glu_bytes,
        error_inputs=_error_inputs,
        sample=sample_swiglu,
        description="silu(gate) * up",
    )
)

GEGLU = register_op(
    OpSpec(
        name="geglu",
        reference=geglu_reference,
        make_inputs=make_inputs,
        check_inputs=check_geglu,
        grad_inputs=("gate", "up"),
        shapes=GLU_SHAPES,
        cases=[{}, {"approximate": "none"}, {"consume_inputs": True}],
        bytes_moved=_glu_bytes,
        error_inputs=error_inputs_geglu,
        sample=sample_geglu,
        description="gelu(gate) * up, tanh or exact gelu",
    )
)


@op_function("swiglu")  # writes the body: check the inputs, pick the backend, call it
def swiglu(
    gate: torch.Tensor,
    up: torch.Tensor,
    *,
    consume_inputs: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """SwiGLU, the Llama MLP's activation: ``silu(gate) * up``.

    Computed in fp32, rounded once to the inputs' dtype.

    Args:
        gate: The gate projection's output, any shape; float32, bfloat16 or float16.
        up: The up projection's output, gate's shape, dtype and device.
        consume_inputs: True hands gate and up over for good: the backward may write the
            gradients over their memory instead of allocating. Set it only on tensors that
            nothing reads afterwards (an MLP's forward that has just created them). Leaves,
            views and tensors that get no gradient are never written. False (the default):
            the caller's tensors are never written.
        backend: The backend that runs the op ("triton", "compile", "eager", ...). None: the
            choice of ``use_backend()`` / ``set_backend()``, else of LMKERNELS_BACKEND, else the
            highest-priority backend that can take the inputs. A backend asked for that cannot
            take them raises BackendNotSupportedError (never a silent fallback).

    Returns:
        The product, with gate's shape and dtype. Differentiable with respect to gate and up.

    Raises:
        LMKernelsError: An input of the wrong type, shape, dtype or device, or an option out of
            range; the message names the argument.
    """


@op_function("geglu")  # writes the body: check the inputs, pick the backend, call it
def geglu(
    gate: torch.Tensor,
    up: torch.Tensor,
    approximate: GeluApproximation = "tanh",
    *,
    consume_inputs: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """GeGLU, the Gemma MLP's activation: ``gelu(gate, approximate) * up``.

    Computed in fp32, rounded once to the inputs' dtype.

    Args:
        gate: The gate projection's output, any shape; float32, bfloat16 or float16.
        up: The up projection's output, gate's shape, dtype and device.
        approximate: The GELU: "tanh" (Gemma's gelu_pytorch_tanh) or "none" (exact, erf).
        consume_inputs: True hands gate and up over for good: the backward may write the
            gradients over their memory instead of allocating. Set it only on tensors that
            nothing reads afterwards (an MLP's forward that has just created them). Leaves,
            views and tensors that get no gradient are never written. False (the default):
            the caller's tensors are never written.
        backend: The backend that runs the op ("triton", "compile", "eager", ...). None: the
            choice of ``use_backend()`` / ``set_backend()``, else of LMKERNELS_BACKEND, else the
            highest-priority backend that can take the inputs. A backend asked for that cannot
            take them raises BackendNotSupportedError (never a silent fallback).

    Returns:
        The product, with gate's shape and dtype. Differentiable with respect to gate and up.

    Raises:
        LMKernelsError: An input of the wrong type, shape, dtype or device, or an option out of
            range; the message names the argument.
    """
