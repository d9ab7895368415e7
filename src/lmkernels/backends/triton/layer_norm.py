"""LayerNorm in Triton: the norm kernel family (_norm_kernels.py) with mean and bias, its
launchers, torch.library ops, autograd and registration.

Semantics are those of `lmkernels.ops.layer_norm.layer_norm_reference`: fp32 math, one rounding
of y to x.dtype; weight and bias are optional and independent.
"""

from __future__ import annotations

import torch

from lmkernels.backends.triton import triton_devices, triton_unavailable_reason
from lmkernels.backends.triton._common import (
    call,
    eager_function,
    op_or_raw,
    refuse_nested_jvp,
    transforms_function,
    vmap_over_rows,
)
from lmkernels.backends.triton._norm_kernels import LAYER_NORM_MODE
from lmkernels.backends.triton._norm_launchers import norm_backward_into, norm_forward
from lmkernels.backends.triton._norms import (
    BwdConfig,
    FwdConfig,
    bwd_config,
    fwd_config,
    num_rows,
    row_limit_reasons,
)
from lmkernels.backends.triton.configs import tables_for
from lmkernels.registry.core import register
from lmkernels.utils import empty

# --- launchers -------------------------------------------------------------------------------


def layer_norm_forward(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, cfg: FwdConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns y (x's shape and dtype, contiguous), mean and rstd (fp32, one per row), launched
    as cfg says."""
    return norm_forward(x, weight, bias, eps, None, LAYER_NORM_MODE, True, cfg)


def layer_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    bias_dtype: torch.dtype | None,
    cfg: BwdConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns dx, dw and db, launched as cfg says; dw is empty without weight, db is empty when
    bias_dtype is None."""
    dx = empty(x.shape, x.dtype, x.device)
    dw, db = norm_backward_into(dy, x, weight, mean, rstd, None, LAYER_NORM_MODE, bias_dtype, dx, cfg)
    return dx, dw, db


# The custom ops' bodies: the launch configurations of the device's tables (configs.tables_for).


def _layer_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cfg = fwd_config(tables_for(x.device).norms, "layer_norm", x.shape[-1])
    return layer_norm_forward(x, weight, bias, eps, cfg)


def _layer_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    bias_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cfg = bwd_config(tables_for(x.device).norms, "layer_norm", x.shape[-1])
    return layer_norm_backward(dy, x, weight, mean, rstd, bias_dtype, cfg)


# --- torch.library ops -----------------------------------------------------------------------

layer_norm_fwd = torch.library.custom_op("lmkernels::layer_norm_fwd", _layer_norm_fwd, mutates_args=())
layer_norm_bwd = torch.library.custom_op("lmkernels::layer_norm_bwd", _layer_norm_bwd, mutates_args=())


@layer_norm_fwd.register_fake
def _(x, weight, bias, eps):
    stats = (num_rows(x),)
    return (
        x.new_empty(x.shape),
        x.new_empty(stats, dtype=torch.float32),
        x.new_empty(stats, dtype=torch.float32),
    )


@layer_norm_bwd.register_fake
def _(dy, x, weight, mean, rstd, bias_dtype):
    N = x.shape[-1]
    dw = x.new_empty((0,)) if weight is None else x.new_empty((N,), dtype=weight.dtype)
    db = x.new_empty((0,)) if bias_dtype is None else x.new_empty((N,), dtype=bias_dtype)
    return x.new_empty(x.shape), dw, db


# --- autograd ----------------------------------------------------------------------------------


def _setup_context(ctx, inputs, output):
    x, weight, bias, eps = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.bias_dtype = bias.dtype if bias is not None else None
    # No zero gradients for mean and rstd, which the backward never reads (an allocation and a
    # fill kernel each per backward otherwise).
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, dmean, drstd):
    if dy is None:  # y got no gradient
        return None, None, None, None
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = _run_bwd(dy, x, weight, mean, rstd, ctx.bias_dtype)
    return (
        dx if ctx.needs_input_grad[0] else None,
        dw if weight is not None and ctx.needs_input_grad[1] else None,
        db if ctx.bias_dtype is not None and ctx.needs_input_grad[2] else None,
        None,
    )


def _setup_context_transforms(ctx, inputs, output):
    _setup_context(ctx, inputs, output)
    ctx.save_for_forward(inputs[0], inputs[1])  # x, weight
    ctx.eps = inputs[3]


def _jvp(ctx, dx, dweight, dbias, _):
    """The tangent of y = (x - mean) * rstd * weight + bias, in fp32; mean and rstd have none.
    They are recomputed from x, not read from the forward's outputs: an outer grad transform
    differentiates this tangent, through x."""
    refuse_nested_jvp("layer_norm")
    x, weight = ctx.saved_tensors
    dtype, x = x.dtype, x.float()
    centered = x - x.mean(-1, keepdim=True)
    rstd = torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + ctx.eps)
    xhat = centered * rstd
    terms = []
    if dx is not None:
        dx = dx.float()
        dxhat = rstd * (dx - dx.mean(-1, keepdim=True) - xhat * (xhat * dx).mean(-1, keepdim=True))
        terms.append(dxhat if weight is None else dxhat * weight.float())
    if dweight is not None:
        terms.append(xhat * dweight.float())
    if dbias is not None:
        terms.append(dbias.float().expand(x.shape))
    return sum(terms[1:], terms[0]).to(dtype), None, None


_run_bwd = op_or_raw(layer_norm_bwd, _layer_norm_bwd, "layer_norm")
layer_norm_fwd.register_autograd(_backward, setup_context=_setup_context)
_LayerNormFunction = eager_function(
    "_LayerNormFunction",
    _layer_norm_fwd,
    _setup_context,
    _backward,
    transforms_function(
        "_LayerNormTransforms",
        layer_norm_fwd,
        _layer_norm_fwd,
        _setup_context_transforms,
        _backward,
        _jvp,
        vmap_over_rows((0,), stats=2),
    ),
)


# --- the impl ----------------------------------------------------------------------------------


def layer_norm_triton(x, weight=None, bias=None, eps=1e-5):
    y, _, _ = call(layer_norm_fwd, _LayerNormFunction, x, weight, bias, float(eps))
    return y


register(
    "layer_norm",
    "triton",
    layer_norm_triton,
    priority=100,
    devices=triton_devices(),
    auto_devices=("cuda",),
    available=triton_unavailable_reason,
    supports=row_limit_reasons,
    forward_ad=True,
    compiled_transforms=False,
    description="Triton: row tiles forward, persistent backward with fp32 dw/db partials",
)
