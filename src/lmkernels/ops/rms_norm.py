"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * (weight + offset), over the last dim.

casting_mode says where the result is rounded to the input dtype, as in transformers:
- "llama": normalize in fp32, round to x.dtype, then multiply by (weight + offset) and round.
- "gemma": everything in fp32, a single rounding at the end (offset=1.0 gives Gemma's 1 + w).
- "none": every step in x.dtype, no upcast (for parity with models that never upcast).
The output has x's dtype and shape. Gradients: x and weight.
"""

from __future__ import annotations

import torch

from lmkernels.ops._common import NORM_WIDTHS, ROW_COUNTS, WIDE, generator, op_function, randn, upcast
from lmkernels.registry.core import ErrorInput, OpSpec, register_op
from lmkernels.types import CastingMode
from lmkernels.utils import check_choice, check_number, check_same_device, check_tensor, fail

CASTING_MODES = ("llama", "gemma", "none")


def rms_norm_reference(x, weight=None, eps=1e-6, offset=0.0, casting_mode="llama"):
    if casting_mode == "none":
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return y if weight is None else y * (weight.to(x.dtype) + offset)
    x32 = upcast(x)
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if casting_mode == "llama":
        y = upcast(y.to(x.dtype))
    if weight is not None:
        y = y * (upcast(weight) + offset)
    return y.to(x.dtype)


def check_inputs(x, weight=None, eps=1e-6, offset=0.0, casting_mode="llama"):
    check_tensor("x", x)
    if x.dim() < 1 or x.shape[-1] == 0:
        fail(f"x: expected at least 1 dim with a non-empty last dim, got shape {tuple(x.shape)}")
    if weight is not None:
        check_tensor("weight", weight, ndim=1)
        if weight.shape[0] != x.shape[-1]:
            fail(f"weight: expected shape ({x.shape[-1]},) to match x's last dim, got {tuple(weight.shape)}")
        check_same_device(x=x, weight=weight)
    check_choice("casting_mode", casting_mode, CASTING_MODES)
    check_number("eps", eps, low=0, what="a non-negative number")
    check_number("offset", offset)


def make_inputs(shape, dtype, device, seed=0, **options):
    g = generator(seed)
    x = randn((shape["M"], shape["N"]), dtype, device, g)
    weight = randn((shape["N"],), dtype, device, g, scale=0.5) + 1.0
    return {"x": x, "weight": weight, **options}


def sample(draw):
    N = draw.sampled_from(NORM_WIDTHS)
    M = draw.integers(0, 3) if N > WIDE else draw.sampled_from(ROW_COUNTS)
    options = {
        "casting_mode": draw.sampled_from(CASTING_MODES),
        "offset": draw.sampled_from((0.0, 1.0)),
        "eps": draw.sampled_from((1e-6, 1e-5, 0.1)),
    }
    if draw.booleans():
        options["weight"] = None
    return {"M": M, "N": N}, options


def error_inputs(device):
    x = torch.randn(4, 8, device=device)
    return [
        ErrorInput({"x": [[1.0] * 8] * 4}, "x: expected a torch.Tensor, got list"),
        ErrorInput({"x": x.long()}, "x: expected a float32, bfloat16 or float16 tensor"),
        ErrorInput({"x": x.double()}, "x: expected a float32, bfloat16 or float16 tensor"),
        ErrorInput({"x": x[:, :0]}, "x: expected at least 1 dim with a non-empty last dim"),
        ErrorInput({"x": x, "weight": torch.randn(7, device=device)}, r"weight: expected shape \(8,\)"),
        ErrorInput({"x": x, "weight": torch.randn(1, 8, device=device)}, "weight: expected 1 dims"),
        ErrorInput({"x": x, "weight": torch.randn(8, device="meta")}, f"weight: expected device {device}"),
        ErrorInput({"x": x, "casting_mode": "mistral"}, "casting_mode: expected one of"),
        ErrorInput({"x": x, "eps": -1e-6}, "eps: expected a non-negative number"),
        ErrorInput({"x": x, "eps": "1e-6"}, "eps: expected a non-negative number"),
        ErrorInput({"x": x, "offset": float("nan")}, "offset: expected a number"),
    ]


SPEC = register_op(
    OpSpec(
        name="rms_norm",
        reference=rms_norm_reference,
        make_inputs=make_inputs,
        check_inputs=check_inputs,
        grad_inputs=("x", "weight"),
        shapes={
            "tiny": [{"M": 3, "N": 5}],
            "quick": [{"M": 37, "N": 96}, {"M": 5, "N": 1000}],
            "full": [
                {"M": 37, "N": 96},
                {"M": 5, "N": 1000},
                {"M": 2048, "N": 4096},
                {"M": 4096, "N": 5120},
                {"M": 1023, "N": 8191},
                {"M": 16384, "N": 4096},
                {"M": 256, "N": 16384},
            ],
        },
        cases=[
            {},
            {"casting_mode": "gemma", "offset": 1.0},
            {"casting_mode": "none"},
            {"weight": None},
        ],
        bytes_moved=lambda s, dtype: 5 * s["M"] * s["N"] * dtype.itemsize,
        error_inputs=error_inputs,
        sample=sample,
        description="RMSNorm over the last dim (Llama, Gemma offset/casting modes)",
    )
)


@op_function("rms_norm")  # writes the body: check the inputs, pick the backend, call it
def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting_mode: CastingMode = "llama",
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """RMSNorm over the last dim: ``y = x / sqrt(mean(x**2, -1) + eps) * (weight + offset)``.

    Args:
        x: Input, shape (..., N) with N > 0; float32, bfloat16 or float16.
        weight: Scale, shape (N,), on x's device; None for no scale (not even ``offset``).
        eps: Added to the mean of squares before the square root; a number >= 0.
        offset: Added to the weight: 1.0 gives Gemma's ``(1 + weight)`` scale.
        casting_mode: Where the result is rounded to x's dtype, as in transformers.
            "llama": normalize in fp32, round to x's dtype, then scale by (weight + offset)
            and round again. "gemma": everything in fp32, one rounding at the end. "none":
            every step in x's dtype, no upcast.
        backend: The backend that runs the op ("triton", "compile", "eager", ...). None: the
            choice of ``use_backend()`` / ``set_backend()``, else of LMKERNELS_BACKEND, else the
            highest-priority backend that can take the inputs. A backend asked for that cannot
            take them raises BackendNotSupportedError (never a silent fallback).

    Returns:
        y, with x's shape and dtype. Differentiable with respect to x and weight.

    Raises:
        LMKernelsError: An input of the wrong type, shape, dtype or device, or an option out of
            range; the message names the argument.
    """
