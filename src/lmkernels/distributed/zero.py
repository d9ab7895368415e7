"""DeepSpeed ZeRO-3: the fused loss runs as lm_head's forward, where ZeRO-3 gathers its weight.

ZeRO-3 partitions every parameter over the data-parallel ranks (a parameter between uses is an
empty tensor, shape (0,), its rank's flat slice in `ds_tensor`) and gathers a module's own
parameters in hooks around that module's call: before its forward, released after it, gathered
again before its backward (a hook on its outputs) and released once the gradients reach its
inputs; the gradient of the gathered parameter is reduce-scattered into the partitions.

A patched causal LM never calls lm_head: the loss reads lm_head.weight. So, as for FSDP2
(integrations/lm_head_loss.py), the loss runs *as* lm_head's forward (`call_as_forward`): lm_head
is called through nn.Module.__call__ with the loss as its forward for that one call, so ZeRO-3's
hooks gather, release and re-gather the weight exactly as for `lm_head(hidden)` in plain
transformers, and DeepSpeed's prefetch trace sees lm_head where plain training has it.

Without this, DeepSpeed still gathers the weight when the patched forward runs inside the
engine's forward: ZeRO-3's parameter getter registers a partitioned parameter read there as an
"external parameter" of the running module (the whole causal LM), which then holds the full
weight from the start of every forward to the end of every backward, and the getter gathers
nothing where it is not marked as in a forward. Calling through lm_head's own hooks does not
depend on either.

ZeRO-1 and ZeRO-2 keep whole parameters on every rank (only gradients and optimizer states are
partitioned): nothing to do. A ZeRO-3 weight that is still partitioned inside the call (a model
built under `deepspeed.zero.Init` and called before `deepspeed.initialize` registered the hooks)
gets an error that says so.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, TypeVar

from torch import nn

from lmkernels.registry import LMKernelsError

_R = TypeVar("_R")


def zero3_partitioned(module: nn.Module) -> bool:
    """Whether DeepSpeed ZeRO-3 partitions `module`'s own parameters (they carry a `ds_id`).
    Reads them without ZeRO's getter, which would gather them."""
    return any(hasattr(p, "ds_id") for p in module._parameters.values() if p is not None)


def _check_gathered(module: nn.Module, name: str) -> None:
    for pname, param in module._parameters.items():
        p: Any = param  # a ZeRO-3 parameter carries DeepSpeed's attributes (ds_id, ds_numel, ds_shape)
        if p is not None and hasattr(p, "ds_id") and p.numel() != p.ds_numel:
            raise LMKernelsError(
                f"{name}.{pname}: a DeepSpeed ZeRO-3 partition that was not gathered (shape "
                f"{tuple(p.shape)}, full shape {tuple(p.ds_shape)}): call the model through the "
                f"engine that deepspeed.initialize returned (or the Trainer / Accelerator that "
                f"wraps it), which registers the hooks that gather {name}'s parameters"
            )


def call_as_forward(
    module: nn.Module,
    fn: Callable[..., _R],
    *args: Any,
    name: str = "lm_head",
    **kwargs: Any,
) -> _R:
    """fn(module, *args, **kwargs), run as `module`'s forward for this one call: module's forward
    hooks run around it (ZeRO-3's gather before, release after, re-gather for fn's backward,
    release when the gradients reach the positional tensor args). The module's own forward is
    restored afterwards, whatever happens."""

    def forward(self: nn.Module, *a: Any, **k: Any) -> _R:
        _check_gathered(self, name)
        return fn(self, *a, **k)

    missing = object()
    own = module.__dict__.get("forward", missing)
    module.forward = types.MethodType(forward, module)
    try:
        return module(*args, **kwargs)
    finally:
        if own is missing:
            del module.forward
        else:
            module.forward = own
