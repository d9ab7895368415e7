"""The ops: one file each with its OpSpec, eager reference and public function."""

from lmkernels.ops.distill import fused_linear_distillation, fused_linear_distillation_reference
from lmkernels.ops.flce import (
    flce_mean_logits,
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_reference,
)
from lmkernels.ops.glu import geglu, geglu_reference, swiglu, swiglu_reference
from lmkernels.ops.layer_norm import layer_norm, layer_norm_reference
from lmkernels.ops.rms_norm import rms_norm, rms_norm_reference
from lmkernels.ops.rope import rope, rope_reference

__all__ = [
    "flce_mean_logits",
    "fused_linear_cross_entropy",
    "fused_linear_cross_entropy_reference",
    "fused_linear_distillation",
    "fused_linear_distillation_reference",
    "geglu",
    "geglu_reference",
    "layer_norm",
    "layer_norm_reference",
    "rms_norm",
    "rms_norm_reference",
    "rope",
    "rope_reference",
    "swiglu",
    "swiglu_reference",
]
