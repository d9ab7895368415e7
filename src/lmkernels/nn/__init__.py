"""nn.Module wrappers around the lmkernels ops, for models written from scratch.

Each module owns its parameters and calls the public op, so dispatch (the `backend` argument,
use_backend(), LMKERNELS_BACKEND, auto) works as for the functions. Attribute names follow
transformers (weight, gate_proj/up_proj/down_proj) so state dicts load into either.
"""

from __future__ import annotations

import torch
from torch import nn

import lmkernels
from lmkernels.nn.recompute import glu_down
from lmkernels.ops.flce import REDUCTIONS
from lmkernels.ops.glu import GELU_APPROXIMATIONS
from lmkernels.ops.rms_norm import CASTING_MODES
from lmkernels.types import CastingMode, GeluApproximation, Reduction
from lmkernels.utils import check_choice, fail

__all__ = ["GeGLUMLP", "LayerNorm", "LinearCrossEntropyLoss", "RMSNorm", "SwiGLUMLP"]


def _check_size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        fail(f"{name}: expected a positive int, got {value!r}")
    return value


def _check_eps(eps: object) -> float:
    if not isinstance(eps, (int, float)) or not eps >= 0:
        fail(f"eps: expected a non-negative number, got {eps!r}")
    return float(eps)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * (weight + offset) over the last dim (lmkernels.rms_norm).

    Args:
        hidden_size: N, the size of the last dim (and of the weight).
        eps: Added to the mean of squares before the square root.
        offset: Added to the weight: 1.0 for Gemma's (1 + weight). The weight starts at
            1 - offset, so the initial scale is 1 (ones for Llama; zeros for Gemma, as Gemma
            initializes it).
        casting_mode: Where the result is rounded to x's dtype ("llama", "gemma", "none"): see
            lmkernels.rms_norm.
        elementwise_affine: False for no weight (``weight`` is None).
        backend: Passed to every call (None: dispatch chooses, see lmkernels.rms_norm).
        device, dtype: Of the weight.

    forward(x) takes x (..., hidden_size) and returns y, x's shape and dtype.
    """

    weight: nn.Parameter | None

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        offset: float = 0.0,
        casting_mode: CastingMode = "llama",
        elementwise_affine: bool = True,
        backend: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size = _check_size("hidden_size", hidden_size)
        self.eps = _check_eps(eps)
        check_choice("casting_mode", casting_mode, CASTING_MODES)
        self.offset = float(offset)
        self.casting_mode = casting_mode
        self.backend = backend
        if elementwise_affine:
            self.weight = nn.Parameter(
                torch.full((hidden_size,), 1.0 - self.offset, device=device, dtype=dtype)
            )
        else:
            self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """lmkernels.rms_norm of x (..., hidden_size) with this module's weight and options."""
        return lmkernels.rms_norm(
            x,
            self.weight,
            eps=self.eps,
            offset=self.offset,
            casting_mode=self.casting_mode,
            backend=self.backend,
        )

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, offset={self.offset}, casting_mode={self.casting_mode!r}"


class LayerNorm(nn.Module):
    """LayerNorm over the last dim, with optional weight (ones) and bias (zeros) (lmkernels.layer_norm).

    Args:
        hidden_size: N, the size of the last dim (and of the weight and bias).
        eps: Added to the variance before the square root.
        elementwise_affine: False for neither weight nor bias (both None).
        bias: False for a weight without a bias.
        backend: Passed to every call (None: dispatch chooses, see lmkernels.layer_norm).
        device, dtype: Of the weight and bias.

    forward(x) takes x (..., hidden_size) and returns y, x's shape and dtype.
    """

    weight: nn.Parameter | None
    bias: nn.Parameter | None

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        backend: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size = _check_size("hidden_size", hidden_size)
        self.eps = _check_eps(eps)
        self.backend = backend
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
            self.bias = nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype)) if bias else None
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """lmkernels.layer_norm of x (..., hidden_size) with this module's weight, bias and eps."""
        return lmkernels.layer_norm(x, self.weight, self.bias, eps=self.eps, backend=self.backend)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class _GLUMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        backend: str | None,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        _check_size("hidden_size", hidden_size)
        _check_size("intermediate_size", intermediate_size)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, device=device, dtype=dtype)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, device=device, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias, device=device, dtype=dtype)
        self.backend = backend


class SwiGLUMLP(_GLUMLP):
    """down_proj(silu(gate_proj(x)) * up_proj(x)), the Llama/Mistral/Qwen2 MLP (lmkernels.swiglu).

    Args:
        hidden_size: The input and output size.
        intermediate_size: The GLU's size (gate_proj's and up_proj's outputs).
        bias: Whether the three nn.Linear projections have a bias.
        backend: Passed to every GLU call (None: dispatch chooses, see lmkernels.swiglu).
        device, dtype: Of the projections.

    forward(x) takes x (..., hidden_size) and returns (..., hidden_size). The outputs of
    gate_proj and up_proj are handed over to the GLU (consume_inputs=True): its backward may
    write the gradients over them (a forward hook that keeps them sees that). down_proj's input
    is recomputed for its backward rather than saved (lmkernels.nn.recompute).
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        backend: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(hidden_size, intermediate_size, bias, backend, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down_proj(swiglu(gate_proj(x), up_proj(x))) for x (..., hidden_size)."""
        # gate and up are created here and read by nothing else: handed over to the GLU, whose
        # backward may then write the gradients over them (see lmkernels.swiglu).
        gate, up = self.gate_proj(x), self.up_proj(x)
        return glu_down(self.down_proj, self._glu, gate, up)

    def _glu(self, gate: torch.Tensor, up: torch.Tensor, consume_inputs: bool) -> torch.Tensor:
        return lmkernels.swiglu(gate, up, consume_inputs=consume_inputs, backend=self.backend)


class GeGLUMLP(_GLUMLP):
    """down_proj(gelu(gate_proj(x), approximate) * up_proj(x)), the Gemma MLP (lmkernels.geglu).

    Args:
        hidden_size: The input and output size.
        intermediate_size: The GLU's size (gate_proj's and up_proj's outputs).
        approximate: The GELU: "tanh" (Gemma) or "none" (exact).
        bias: Whether the three nn.Linear projections have a bias.
        backend: Passed to every GLU call (None: dispatch chooses, see lmkernels.geglu).
        device, dtype: Of the projections.

    forward(x) takes x (..., hidden_size) and returns (..., hidden_size); gate_proj's and
    up_proj's outputs are handed over as in SwiGLUMLP.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        approximate: GeluApproximation = "tanh",
        bias: bool = False,
        backend: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        check_choice("approximate", approximate, GELU_APPROXIMATIONS)
        super().__init__(hidden_size, intermediate_size, bias, backend, device, dtype)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down_proj(geglu(gate_proj(x), up_proj(x), approximate)) for x (..., hidden_size)."""
        gate, up = self.gate_proj(x), self.up_proj(x)  # handed over: see SwiGLUMLP.forward
        return glu_down(self.down_proj, self._glu, gate, up)

    def _glu(self, gate: torch.Tensor, up: torch.Tensor, consume_inputs: bool) -> torch.Tensor:
        return lmkernels.geglu(
            gate, up, self.approximate, consume_inputs=consume_inputs, backend=self.backend
        )

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class LinearCrossEntropyLoss(nn.Module):
    """loss = cross_entropy(softcap(hidden @ weight.T + bias), target) without the logits.

    Like nn.CrossEntropyLoss, the options are set once here; forward(hidden, weight, target,
    bias=None) takes the lm_head weight (V, H) so the module can be used with a tied embedding,
    and returns the loss, or (loss, lse) with return_lse=True. class_weight (V,) is kept as a
    buffer (moves with .to()). The options, and the loss's semantics, are those of
    lmkernels.fused_linear_cross_entropy.
    """

    class_weight: torch.Tensor | None

    def __init__(
        self,
        ignore_index: int = -100,
        reduction: Reduction = "mean",
        label_smoothing: float = 0.0,
        softcap: float | None = None,
        z_loss_scale: float = 0.0,
        class_weight: torch.Tensor | None = None,
        return_lse: bool = False,
        grad_accum_dtype: torch.dtype | None = None,
        memory_budget: float | None = None,
        backend: str | None = None,
    ) -> None:
        super().__init__()
        check_choice("reduction", reduction, REDUCTIONS)
        if not isinstance(label_smoothing, (int, float)) or not 0.0 <= label_smoothing <= 1.0:
            fail(f"label_smoothing: expected a number in [0, 1], got {label_smoothing!r}")
        if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0):
            fail(f"softcap: expected None or a positive number, got {softcap!r}")
        if not isinstance(z_loss_scale, (int, float)) or not z_loss_scale >= 0:
            fail(f"z_loss_scale: expected a non-negative number, got {z_loss_scale!r}")
        if class_weight is not None and not isinstance(class_weight, torch.Tensor):
            fail(f"class_weight: expected None or a tensor, got {type(class_weight).__name__}")
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = float(label_smoothing)
        self.softcap = softcap
        self.z_loss_scale = float(z_loss_scale)
        self.return_lse = return_lse
        self.grad_accum_dtype = grad_accum_dtype
        self.memory_budget = memory_budget
        self.backend = backend
        self.register_buffer("class_weight", class_weight)

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The loss of hidden (..., H) against target (...) with the lm_head weight (V, H) and an
        optional bias (V,): a tensor, or (loss, lse) with return_lse=True."""
        return lmkernels.fused_linear_cross_entropy(
            hidden,
            weight,
            target,
            bias=bias,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            label_smoothing=self.label_smoothing,
            softcap=self.softcap,
            z_loss_scale=self.z_loss_scale,
            class_weight=self.class_weight,
            return_lse=self.return_lse,
            grad_accum_dtype=self.grad_accum_dtype,
            memory_budget=self.memory_budget,
            backend=self.backend,
        )

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, softcap={self.softcap}"
