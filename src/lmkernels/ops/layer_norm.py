"""LayerNorm over the last dim: y = (x - mean) / sqrt(var + eps) * weight + bias.

Computed in fp32 with one rounding to x.dtype at the end (as torch's CUDA kernel does); weight
and bias are optional and independent. Gradients: x, weight, bias.
"""

from __future__ import annotations

import torch

from lmkernels.ops._common import generator, op_function, randn
from lmkernels.registry.core import OpSpec, register_op
from lmkernels.utils import check_same_device, check_tensor, fail


def layer_norm_reference(x, weight=None, bias=None, eps=1e-5):
    x32 = x.float()
    mean = x32.mean(-1, keepdim=True)
    var = (x32 - mean).pow(2).mean(-1, keepdim=True)
    y = (x32 - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
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
    if not eps >= 0:
        fail(f"eps: expected a non-negative number, got {eps}")


def make_inputs(shape, dtype, device, seed=0, **options):
    g = generator(seed)
    x = randn((shape["M"], shape["N"]), dtype, device, g) + 0.5
    weight = randn((shape["N"],), dtype, device, g, scale=0.5) + 1.0
    bias = randn((shape["N"],), dtype, device, g, scale=0.5)
    return {"x": x, "weight": weight, "bias": bias, **options}


SPEC = register_op(
    OpSpec(
        name="layer_norm",
        reference=layer_norm_reference,
        make_inputs=make_inputs,
        check_inputs=check_inputs,
        grad_inputs=("x", "weight", "bias"),
        shapes={
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
        description="LayerNorm over the last dim, optional weight and bias",
    )
)


@op_function("layer_norm")  # writes the body: check the inputs, pick the backend, call it
def layer_norm(x, weight=None, bias=None, eps=1e-5, *, backend=None):
    """LayerNorm over the last dim of x. See the module docstring for the semantics."""
