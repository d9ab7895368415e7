"""lmkernels: fused training kernels for LLMs, each proven against an eager reference.

import lmkernels as lk
loss = lk.fused_linear_cross_entropy(hidden, lm_head.weight, labels)
y = lk.rms_norm(x, weight, backend="triton")
with lk.use_backend("triton", flce="compile"): ...
"""

from lmkernels.ops import (
    flce_mean_logits,
    fused_linear_cross_entropy,
    fused_linear_distillation,
    geglu,
    layer_norm,
    rms_norm,
    rope,
    swiglu,
)
from lmkernels.registry import (
    BackendNotSupportedError,
    ConsumedInputsError,
    ForwardADError,
    HigherOrderGradientError,
    LMKernelsError,
    UnknownBackendError,
    UnknownOpError,
    backend_names,
    explain,
    get_impl,
    get_op,
    impls,
    ops,
    register,
    reset_backend,
    resolve,
    set_backend,
    use_backend,
)
from lmkernels.registry.core import add_loader

__version__ = "0.1.0"


def _load_backends() -> None:
    """The registry's loader: built-in backends, then third-party entry points. Run on the first
    impl lookup, so that importing lmkernels imports neither triton nor the compiler."""
    from lmkernels.backends import load_builtin
    from lmkernels.registry.plugins import load_entry_points

    load_builtin()
    load_entry_points()


add_loader(_load_backends)

__all__ = [
    "BackendNotSupportedError",
    "ConsumedInputsError",
    "ForwardADError",
    "HigherOrderGradientError",
    "LMKernelsError",
    "UnknownBackendError",
    "UnknownOpError",
    "backend_names",
    "explain",
    "flce_mean_logits",
    "fused_linear_cross_entropy",
    "fused_linear_distillation",
    "geglu",
    "get_impl",
    "get_op",
    "impls",
    "layer_norm",
    "ops",
    "register",
    "reset_backend",
    "resolve",
    "rms_norm",
    "rope",
    "set_backend",
    "swiglu",
    "use_backend",
]
