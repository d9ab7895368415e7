"""RMSNorm in Triton: the norm kernel family (_norm_kernels.py) without mean and bias, its
launchers, torch.library ops, autograd and registration.

Semantics are those of `lmkernels.ops.rms_norm.rms_norm_reference`, casting modes included (the
kernels' MODE, _norm_kernels.py).
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
from lmkernels.backends.triton._norm_kernels import MODES
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


def rms_norm_forward(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, casting_mode: str, cfg: FwdConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns y (x's shape and dtype, contiguous) and rstd (fp32, one per row), launched as cfg
    says."""
    y, _, rstd = norm_forward(x, weight, None, eps, offset, MODES[casting_mode], False, cfg)
    return y, rstd


def rms_norm_backward_into(dy, x, weight, rstd, offset, casting_mode, dx, cfg: BwdConfig) -> torch.Tensor:
    """Writes dx and returns dw (empty when weight is None), launched as cfg says. dy and dx are
    contiguous; dx may be dy itself (in-place backward)."""
    dw, _ = norm_backward_into(dy, x, weight, None, rstd, offset, MODES[casting_mode], None, dx, cfg)
    return dw


def rms_norm_backward(
    dy, x, weight, rstd, offset, casting_mode, cfg: BwdConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns dx (x's shape and dtype) and dw (empty when weight is None), launched as cfg says."""
    dx = empty(x.shape, x.dtype, x.device)
    dw = rms_norm_backward_into(dy.contiguous(), x, weight, rstd, offset, casting_mode, dx, cfg)
    return dx, dw


# The custom ops' bodies: the launch configurations of the device's tables (configs.tables_for).


def _rms_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, casting_mode: str
) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = fwd_config(tables_for(x.device).norms, "rms_norm", x.shape[-1])
    return rms_norm_forward(x, weight, eps, offset, casting_mode, cfg)


def _rms_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    offset: float,
    casting_mode: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = bwd_config(tables_for(x.device).norms, "rms_norm", x.shape[-1])
    return rms_norm_backward(dy, x, weight, rstd, offset, casting_mode, cfg)


# --- torch.library ops -----------------------------------------------------------------------

rms_norm_fwd = torch.library.custom_op("lmkernels::rms_norm_fwd", _rms_norm_fwd, mutates_args=())
rms_norm_bwd = torch.library.custom_op("lmkernels::rms_norm_bwd", _rms_norm_bwd, mutates_args=())


@rms_norm_fwd.register_fake
def _(x, weight, eps, offset, casting_mode):
    return x.new_empty(x.shape), x.new_empty((num_rows(x),), dtype=torch.float32)


@rms_norm_bwd.register_fake
def _(dy, x, weight, rstd, offset, casting_mode):
    dw_shape = (0,) if weight is None else weight.shape
    dw_dtype = x.dtype if weight is None else weight.dtype
    return x.new_empty(x.shape), x.new_empty(dw_shape, dtype=dw_dtype)


# --- autograd ----------------------------------------------------------------------------------


def _setup_context(ctx, inputs, output):
    x, weight, eps, offset, casting_mode = inputs
    _, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(x, weight, rstd)
    ctx.offset = offset
    ctx.casting_mode = casting_mode
    # Autograd would materialize a zero gradient for rstd (an allocation and a fill kernel per
    # backward) that nothing reads.
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, drstd):
    if dy is None:  # y got no gradient (grads are not materialized)
        return None, None, None, None, None
    x, weight, rstd = ctx.saved_tensors
    args = (x, weight, rstd, ctx.offset, ctx.casting_mode)
    dx, dw = _run_bwd(dy, *args)
    dx = dx if ctx.needs_input_grad[0] else None
    dw = dw if weight is not None and ctx.needs_input_grad[1] else None
    return dx, dw, None, None, None


def _setup_context_transforms(ctx, inputs, output):
    _setup_context(ctx, inputs, output)
    ctx.save_for_forward(inputs[0], inputs[1])  # x, weight
    ctx.eps = inputs[2]


def _jvp(ctx, dx, dweight, *_):
    """The tangent of y = x * rstd * (weight + offset), in fp32 (the casting modes differ only
    in where they round, and a rounding's tangent is the identity); rstd has none. rstd is
    recomputed from x, not read from the forward's output: an outer grad transform
    differentiates this tangent, through x."""
    refuse_nested_jvp("rms_norm")
    x, weight = ctx.saved_tensors
    dtype, x = x.dtype, x.float()
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + ctx.eps)
    xhat = x * rstd
    dy = None
    if dx is not None:
        dx = dx.float()
        dy = rstd * (dx - xhat * (xhat * dx).mean(-1, keepdim=True))
        if weight is not None:
            dy = dy * (weight.float() + ctx.offset)
    if dweight is not None:
        dy = xhat * dweight.float() if dy is None else dy + xhat * dweight.float()
    return dy.to(dtype), None


_run_bwd = op_or_raw(rms_norm_bwd, _rms_norm_bwd, "rms_norm")
rms_norm_fwd.register_autograd(_backward, setup_context=_setup_context)
_RMSNormFunction = eager_function(
    "_RMSNormFunction",
    _rms_norm_fwd,
    _setup_context,
    _backward,
    transforms_function(
        "_RMSNormTransforms",
        rms_norm_fwd,
        _rms_norm_fwd,
        _setup_context_transforms,
        _backward,
        _jvp,
        vmap_over_rows((0,), stats=1),
    ),
)


# --- the impl ----------------------------------------------------------------------------------


def rms_norm_triton(x, weight=None, eps=1e-6, offset=0.0, casting_mode="llama"):
    y, _ = call(rms_norm_fwd, _RMSNormFunction, x, weight, float(eps), float(offset), casting_mode)
    return y


register(
    "rms_norm",
    "triton",
    rms_norm_triton,
    priority=100,
    devices=triton_devices(),
    auto_devices=("cuda",),
    available=triton_unavailable_reason,
    supports=row_limit_reasons,
    forward_ad=True,
    compiled_transforms=False,
    description="Triton: row tiles forward, persistent backward with fp32 dw partials",
)
