"""Distributed training support: the vocab-parallel loss and DTensor handling.

- `vocab_parallel_cross_entropy(hidden, weight_shard, target, vocab_size=..., group=...)`: FLCE
  with the lm_head weight sharded on the vocabulary over a process group; loss and gradients
  equal one device's.
- `dtensor_linear_cross_entropy(hidden, weight, target, ...)`: FLCE for DTensor weights / hidden
  states (tensor and sequence parallel); picks the vocab-parallel loss for Shard(0) weights.
- `foreach_safe_param_groups(params)`: optimizer param groups that never mix DTensors with plain
  tensors, so torch's foreach optimizers work on tensor-parallel models (see optim.py).
- `local.local_call`: run a row-local op (norms, RoPE, GLUs) on the local shards of DTensor inputs
  (sequence parallel), weight gradients leaving as Partial.
- `sequence_parallel_plan(model)`: torch parallel styles with sequence parallel for a transformers
  Llama-style model (plans.py), for FSDP2 x TP on a 2-D mesh.
- `pipeline.DecoderStage(model, index, count)`: one pipeline stage of a transformers decoder-only
  model for torch.distributed.pipelining, lm_head kept on the last stage for a fused loss.
- `zero.call_as_forward`: DeepSpeed ZeRO-3, the loss run as lm_head's forward so that ZeRO-3's
  hooks gather its weight (integrations/lm_head_loss.py calls it for ZeRO-3 parameters).

FSDP2 needs nothing here: integrations/lm_head_loss.py runs the loss inside the lm_head's FSDP2
forward, where the weight is unsharded.
"""

from typing import TYPE_CHECKING, Any

from lmkernels.distributed.optim import foreach_safe_param_groups
from lmkernels.distributed.vocab_parallel import shard_range, vocab_parallel_cross_entropy

if TYPE_CHECKING:  # imported on first use (__getattr__ below); named here for type checkers
    from lmkernels.distributed.dtensor_loss import dtensor_linear_cross_entropy
    from lmkernels.distributed.dtensor_loss import is_dtensor as is_dtensor
    from lmkernels.distributed.plans import sequence_parallel_plan

__all__ = [
    "dtensor_linear_cross_entropy",
    "foreach_safe_param_groups",
    "sequence_parallel_plan",
    "shard_range",
    "vocab_parallel_cross_entropy",
]


def __getattr__(name: str) -> Any:
    # torch.distributed.tensor is imported on first use only: most users never need it.
    if name in ("dtensor_linear_cross_entropy", "is_dtensor"):
        from lmkernels.distributed import dtensor_loss

        return getattr(dtensor_loss, name)
    if name == "sequence_parallel_plan":
        from lmkernels.distributed.plans import sequence_parallel_plan

        return sequence_parallel_plan
    raise AttributeError(name)
