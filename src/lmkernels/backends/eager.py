"""The eager backend: each op's fp32-upcasting PyTorch reference, run as is."""

from lmkernels.registry.core import _OPS, register

for _spec in list(_OPS.values()):
    register(
        _spec.name,
        "eager",
        _spec.reference,
        priority=0,
        double_backward=True,  # plain PyTorch ops: differentiable to any order,
        forward_ad=True,  # in forward mode too
        description="the op's eager PyTorch reference (fp32 inside)",
    )
