"""Run a row-local op (RMSNorm, LayerNorm, RoPE, SwiGLU, GeGLU) on DTensor inputs.

Tensor/sequence-parallel plans hand the patched modules DTensors: a sequence-sharded activation
(Shard(1)) with a Replicate weight (torch's SequenceParallel), or head-sharded q/k. The math of
these ops is local to a row, so each rank runs the op (any backend, Triton custom ops included,
which have no DTensor sharding rules) on its local shard and the output gets the input's layout.

Gradients: a weight that is Replicate while the activation is sharded gets a local gradient that
is only this rank's part of the sum over rows, so it leaves as Partial (the same placement
DTensor's own ops give it; the optimizer step or clip_grad_norm reduces it). Layouts where the
local math would be wrong get an error: the reduced (last) dimension sharded, Partial inputs,
activations on different layouts, or a plain-tensor weight next to a sharded activation (its
gradient could not be reduced).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from lmkernels.registry import LMKernelsError


def local_call(
    fn: Callable[..., Any],
    activations: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor | None] = (),
    *,
    op: str,
    reduced_dims: Sequence[int] = (-1,),
) -> Any:
    """fn(*local_activations, *local_weights) -> tensor or tuple, each output wrapped as a DTensor
    with the first activation's layout. `reduced_dims`: dims the op mixes (must not be sharded).
    Activations must share one layout; weights are Replicate DTensors, or plain tensors when the
    activations are Replicate too."""
    lead = next(a for a in activations if isinstance(a, DTensor))
    mesh, placements = lead.device_mesh, lead.placements
    shards: list[DTensor] = []
    for i, a in enumerate(activations):
        if not isinstance(a, DTensor) or a.device_mesh != mesh or a.placements != placements:
            got = a.placements if isinstance(a, DTensor) else "a plain tensor"
            raise LMKernelsError(f"{op}: input {i} is {got}, expected DTensor {placements} like input 0")
        shards.append(a)
    ndim = lead.dim()
    reduced = {d % ndim for d in reduced_dims}
    for p in placements:
        if isinstance(p, Partial) or (isinstance(p, Shard) and p.dim % ndim in reduced):
            raise LMKernelsError(
                f"{op}: inputs with placements {placements} are not supported (the op reduces over dim "
                f"{sorted(reduced)}); redistribute them to a sequence/batch/head shard or Replicate first"
            )
    sharded = any(isinstance(p, Shard) for p in placements)
    local_weights: list[torch.Tensor | None] = []
    for w in weights:
        if not isinstance(w, DTensor):
            if w is not None and sharded and w.requires_grad:
                raise LMKernelsError(
                    f"{op}: weight is a plain tensor while the input is sharded ({placements}); its "
                    f"gradient would miss the other ranks' rows. Make it a Replicate DTensor (as "
                    f"SequenceParallel does)"
                )
            local_weights.append(w)
            continue
        if w.device_mesh != mesh or any(not isinstance(p, Replicate) for p in w.placements):
            raise LMKernelsError(
                f"{op}: weight placements {w.placements} are not supported, expected Replicate"
            )
        grad_placements = [Partial() if sharded else Replicate()] * mesh.ndim
        local_weights.append(w.to_local(grad_placements=grad_placements))
    out = fn(*(a.to_local() for a in shards), *local_weights)

    def wrap(y: torch.Tensor, like: torch.Tensor) -> DTensor:
        # The global shape of an output is its input's (uneven shards need it spelled out).
        stride = torch.empty(like.shape, device="meta").stride()
        return DTensor.from_local(y, mesh, placements, run_check=False, shape=like.shape, stride=stride)

    if isinstance(out, tuple):
        return tuple(wrap(y, a) for y, a in zip(out, activations))
    return wrap(out, lead)
