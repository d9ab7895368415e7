"""Without Triton the kernels cannot even be imported; register placeholders that say why."""

from typing import Any, NoReturn

from lmkernels.backends.triton import triton_unavailable_reason
from lmkernels.registry.core import _OPS, register


def register_placeholders() -> None:
    reason = triton_unavailable_reason()

    def missing(**inputs: Any) -> NoReturn:
        raise RuntimeError(reason)

    for name in list(_OPS):
        register(name, "triton", missing, priority=100, available=lambda: reason)
