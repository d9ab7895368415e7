"""Type aliases for the ops' string options, for code that passes them through::

    from lmkernels.types import CastingMode

    def make_norm(casting_mode: CastingMode = "llama") -> lmkernels.nn.RMSNorm: ...

Each is the Literal of the op's parameter of that name (a test holds them to the ops' checks).
"""

from __future__ import annotations

from typing import Literal

__all__ = ["CastingMode", "GeluApproximation", "GluKind", "Reduction", "RopeLayout"]

# rms_norm(casting_mode=...): where the result is rounded to the input dtype.
CastingMode = Literal["llama", "gemma", "none"]
# rope(layout=...): which dims rotate together.
RopeLayout = Literal["neox", "interleaved"]
# geglu(approximate=...): the GELU.
GeluApproximation = Literal["tanh", "none"]
# fused_linear_cross_entropy(reduction=...).
Reduction = Literal["mean", "sum", "none"]
# A gated MLP's activation: ("swiglu", None) or ("geglu", approximate).
GluKind = tuple[Literal["swiglu"], None] | tuple[Literal["geglu"], GeluApproximation]
