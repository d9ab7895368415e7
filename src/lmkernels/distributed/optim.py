"""Optimizer parameter groups that torch's foreach / fused optimizer paths can take.

On CUDA, torch's optimizers (SGD, Adam, AdamW, ...) default to their foreach implementation,
which updates each parameter group's tensors with list ops such as `torch._foreach_add_`. DTensor
runs those ops only when every tensor of the list is a DTensor on the same mesh: a plain tensor in
the list raises "got mixed torch.Tensor and DTensor", a second mesh raises a cross-mesh error.
Tensor-parallel models hold both kinds: transformers' `tp_plan="auto"` and torch's parallel
styles turn the sharded linears into DTensors and leave the norms and embeddings plain. This is
torch's behaviour, independent of lmkernels (plain transformers with AdamW hits it) and of the
torch version (2.11 on GPUs; 2.13 with `foreach=True`); on the CPU the default is the per-tensor
loop, which takes any mix, so CPU runs do not show it.

`foreach_safe_param_groups` splits the parameters into groups that each hold one kind (plain
tensors, or DTensors of one mesh); the optimizer then runs its foreach path per group.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def foreach_safe_param_groups(params: Iterable[torch.Tensor | dict[str, Any]]) -> list[dict[str, Any]]:
    """`params` (tensors, or param-group dicts whose options are kept) regrouped so that no group
    mixes plain tensors with DTensors or DTensors of different meshes. Pass the result to any
    torch optimizer: `torch.optim.AdamW(foreach_safe_param_groups(model.parameters()), lr=...)`."""
    dtensor: type[DTensor] | None = None
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor as dtensor
    items = list(params)
    groups: list[Any] = items if items and isinstance(items[0], dict) else [{"params": items}]
    out: list[dict[str, Any]] = []
    for group in groups:
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError(
                f"params: expected tensors or param-group dicts with 'params', got {type(group).__name__}"
            )
        options = {k: v for k, v in group.items() if k != "params"}
        members = group["params"]
        members = [members] if isinstance(members, torch.Tensor) else list(members)
        by_kind: dict[Any, list[torch.Tensor]] = {}
        for p in members:
            mesh = p.device_mesh if dtensor is not None and isinstance(p, dtensor) else None
            by_kind.setdefault(mesh, []).append(p)
        out += [{"params": ps, **options} for ps in by_kind.values()]
    return out
