"""Fused linear cross entropy when the lm_head weight (or the hidden states) are DTensors.

Layouts on a 1-D device mesh (tensor parallel; an FSDP2-managed weight never gets here, see
integrations/lm_head_loss.py):

- weight Shard(0) (vocabulary-sharded, ColwiseParallel / transformers' "colwise_gather_output"):
  the vocab-parallel loss on the local shard (distributed/vocab_parallel.py);
- weight Replicate: the local copy through `lmkernels.fused_linear_cross_entropy`.

Hidden states that are DTensors (sequence parallel: Shard(1)) are gathered to Replicate first;
plain hidden states must be the same on every rank of the mesh (what tensor parallel gives the
lm_head). Any other layout gets an error naming it.
"""

from __future__ import annotations

from typing import Any, TypeGuard, overload

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import lmkernels
from lmkernels.distributed.vocab_parallel import vocab_parallel_cross_entropy
from lmkernels.registry import LMKernelsError
from lmkernels.registry.dispatch import canonical_op, requested_backend
from lmkernels.types import Reduction
from lmkernels.utils import data_checks_enabled


def is_dtensor(t: object) -> TypeGuard[DTensor]:
    """Whether t is a DTensor (torch.distributed.tensor)."""
    return isinstance(t, DTensor)


def _mesh_of(*tensors: torch.Tensor | None) -> DeviceMesh:
    # Equal meshes compare equal (DeviceMesh.__eq__: ranks, layout, dim names); they need not be
    # one object (FSDP2's unsharded TP parameter and an activation of the same tp mesh can differ).
    meshes: list[DeviceMesh] = []
    for t in tensors:
        if is_dtensor(t) and not any(t.device_mesh == m for m in meshes):
            meshes.append(t.device_mesh)
    if len(meshes) != 1:
        raise LMKernelsError(
            f"hidden, weight, bias: DTensors on different device meshes are not supported ({meshes})"
        )
    mesh = meshes[0]
    if mesh.ndim != 1:
        raise LMKernelsError(
            f"weight: a DTensor on a {mesh.ndim}-D device mesh ({mesh}) is not supported; the loss "
            f"takes 1-D tensor-parallel meshes (with FSDP2 on another dim, call lm_head through "
            f"fully_shard so that it unshards the data-parallel dim first)"
        )
    return mesh


@overload
def _replicated_local(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor: ...
@overload
def _replicated_local(t: None, mesh: DeviceMesh) -> None: ...
def _replicated_local(t: torch.Tensor | None, mesh: DeviceMesh) -> torch.Tensor | None:
    """The local tensor of a DTensor made Replicate (differentiable; a sequence-sharded hidden
    is all-gathered and its gradient sliced back), or t itself."""
    if not isinstance(t, DTensor):
        return t
    return t.redistribute(mesh, [Replicate()]).to_local()


def _check_same_labels(target: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Vocab-parallel needs the same tokens on every rank; a data-parallel shard of the weight
    (e.g. an FSDP2 shard read outside its module's forward) has different ones. One tiny
    all-reduce and a host sync, skipped with LMKERNELS_CHECK_VALUES=0."""
    t = target.reshape(-1).double()
    pos = torch.arange(1, t.numel() + 1, dtype=torch.float64, device=t.device)
    sig = torch.stack([t.sum(), (t * pos).sum()])
    both = torch.cat([sig, -sig])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(both[:2], -both[2:]):
        raise LMKernelsError(
            "weight: a vocabulary-sharded DTensor, but the ranks of its mesh hold different labels: "
            "this is a data-parallel shard, not tensor parallel. With FSDP2 the weight must be read "
            "while its owner is unsharded: wrap lm_head with fully_shard (or keep it in a group whose "
            "forward runs the loss) and do not tie it to an embedding sharded on its own"
        )


def dtensor_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    z_loss_scale: float = 0.0,
    temperature: float = 1.0,
    backend: str | None = None,
) -> torch.Tensor:
    """`lmkernels.fused_linear_cross_entropy` for DTensor inputs (layouts in the module docstring).
    `backend` applies where the local op runs (Replicate weight); the vocab-parallel loss has its
    own implementation (see vocab_parallel.py), in its lean mode when the FLCE backend asked for (by
    argument, use_backend or the environment) is "triton_lean", else in its fast mode."""
    mesh = _mesh_of(hidden, weight, bias)
    if isinstance(target, DTensor):
        target = target.full_tensor()
    h = _replicated_local(hidden, mesh)
    opts: dict[str, Any] = dict(
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
        softcap=softcap,
        z_loss_scale=z_loss_scale,
        temperature=temperature,
    )
    if not isinstance(weight, DTensor) or isinstance(weight.placements[0], Replicate):
        w = _replicated_local(weight, mesh)
        b = _replicated_local(bias, mesh)
        return lmkernels.fused_linear_cross_entropy(h, w, target, bias=b, backend=backend, **opts)
    w_place = weight.placements[0]
    if not (isinstance(w_place, Shard) and w_place.dim == 0):
        raise LMKernelsError(
            f"weight: DTensor placements {weight.placements} are not supported by the loss; expected "
            f"Shard(0) (vocabulary-parallel lm_head) or Replicate()"
        )
    if isinstance(bias, DTensor) and bias.placements != weight.placements:
        raise LMKernelsError(
            f"bias: expected placements {weight.placements} like weight's, got {bias.placements}"
        )
    if bias is not None and not isinstance(bias, DTensor):
        raise LMKernelsError(
            "bias: expected a DTensor sharded like the vocabulary-sharded weight, got a plain tensor"
        )
    group = mesh.get_group()
    if data_checks_enabled():
        _check_same_labels(target, group)
    lean = requested_backend(canonical_op("flce"), backend).backend == "triton_lean"
    return vocab_parallel_cross_entropy(
        h,
        weight.to_local(),
        target,
        vocab_size=weight.shape[0],
        group=group,
        bias_shard=None if bias is None else bias.to_local(),
        lean=lean,
        **opts,
    )
