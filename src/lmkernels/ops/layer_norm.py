"""LayerNorm over the last dim: y = (x - mean) / sqrt(var + eps) * weight + bias.

Computed in fp32 with one rounding to x.dtype at the end (as torch's CUDA kernel does); weight
and bias are optional and independent. Gradients: x, weight, bias.
"""

from __future__ import annotations

import torch

from lmkernels.ops._common import NORM_WIDTHS, ROW_COUNTS, WIDE, generator, op_function, randn, upcast
from lmkernels.registry.core import ErrorInput, OpSpec, register_op
from lmkernels.utils import check_number, check_same_device, check_tensor, fail


def layer_norm_reference(x, weight=None, bias=None, eps=1e-5):
    x32 = upcast(x)
    mean = x32.mean(-1, keepdim=True)
    var = (x32 - mean).pow(2).mean(-1, keepdim=True)
    y = (x32 - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * upcast(weight)
    if bias is not None:
        y = y + upcast(bias)
    return y.to(x.dtype)


def check_inputs(x, weight=None, bias=None, eps=1e-5):
    check_tensor("x", x)
    if x.dim() < 1 or x.shape[-1] == 0:
        fail(f"x: expected at least 1 dim with a non-empty last dim, got shape {tuple(x.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            check_tensor(name, t, ndim=1)
            if t.shape[0] != x.shape[-1]:
                fail(f"{name}: expected shape ({x.shape[-1]},) to match x's last dim, got {tuple(t.shape)}")
    check_same_device(x=x, weight=weight, bias=bias)
    check_number("eps", eps, low=0, what="a non-negative number")


def make_inputs(shape, dtype, device, seed=0, **options):
    g = generator(seed)
    x = randn((shape["M"], shape["N"]), dtype, device, g) + 0.5
    weight = randn((shape["N"],), dtype, device, g, scale=0.5) + 1.0
    bias = randn((shape["N"],), dtype, device, g, scale=0.5)
    return {"x": x, "weight": weight, "bias": bias, **options}


def sample(draw):
    N = draw.sampled_from(NORM_WIDTHS)
    M = draw.integers(0, 3) if N > WIDE else draw.sampled_from(ROW_COUNTS)
    options = {"eps": draw.sampled_from((1e-5, 1e-6, 0.1))}
    if draw.booleans():
        options["weight"] = None
    if draw.booleans():
        options["bias"] = None
    return {"M": M, "N": N}, options


def error_inputs(device):
    x = torch.randn(4, 8, device=device)
    return [
        ErrorInput({"x": 3.0}, "x: expected a torch.Tensor, got float"),
        ErrorInput({"x": x.int()}, "x: expected a float32, bfloat16 or float16 tensor"),
        ErrorInput({"x": x[:, :0]}, "x: expected at least 1 dim with a non-empty last dim"),
        ErrorInput({"x": x, "weight": torch.randn(9, device=device)}, r"weight: expected shape \(8,\)"),
        ErrorInput({"x": x, "bias": torch.randn(9, device=device)}, r"bias: expected shape \(8,\)"),
        ErrorInput({"x": x, "bias": torch.randn(8, device="meta")}, f"bias: expected device {device}"),
        ErrorInput({"x": x, "eps": float("nan")}, "eps: expected a non-negative number"),
    ]


SPEC = register_op(
    OpSpec(
        name="layer_norm",
        reference=layer_norm_reference,
        make_inputs=make_inputs,
        check_inputs=check_inputs,
        grad_inputs=("x", "weight", "bias"),
        shapes={
            "tiny": [{"M": 3, "N": 5}],
            "quick": [{"M": 37, "N": 96}, {"M": 5, "N": 1000}],
            "full": [
                {"M": 37, "N": 96},
                {"M": 5, "N": 1000},
                {"M": 2048, "N": 4096},
                {"M": 1023, "N": 8191},
                {"M": 4096, "N": 16384},
                {"M": 16384, "N": 4096},
            ],
        },
        cases=[{}, {"bias": None}, {"weight": None, "bias": None}],
        bytes_moved=lambda s, dtype: 5 * s["M"] * s["N"] * dtype.itemsize,
        error_inputs=error_inputs,
        sample=sample,
        description="LayerNorm over the last dim, optional weight and bias",
    )
)


@op_function("layer_norm")  # writes the body: check the inputs, pick the backend, call it
def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """LayerNorm over the last dim: ``y = (x - mean) / sqrt(var + eps) * weight + bias``.

    mean and the (biased) variance are taken over the last dim. Computed in fp32, rounded once
    to x's dtype at the end (as torch's CUDA kernel does).

    Args:
        x: Input, shape (..., N) with N > 0; float32, bfloat16 or float16.
        weight: Scale, shape (N,), on x's device; None for no scale.
        bias: Shift, shape (N,), on x's device; None for no shift (independent of weight).
        eps: Added to the variance before the square root; a number >= 0.
        backend: The backend that runs the op ("triton", "compile", "eager", ...). None: the
            choice of ``use_backend()`` / ``set_backend()``, else of LMKERNELS_BACKEND, else the
            highest-priority backend that can take the inputs. A backend asked for that cannot
            take them raises BackendNotSupportedError (never a silent fallback).

    Returns:
        y, with x's shape and dtype. Differentiable with respect to x, weight and bias.

    Raises:
        LMKernelsError: An input of the wrong type, shape, dtype or device, or an option out of
            range; the message names the argument.
    """
