"""The lm_head + cross entropy of a torchtitan decoder as one lmkernels call.

torchtitan's trainer hands a ChunkedLossWrapper the model's lm_head and runs the model with
`_skip_lm_head`, so the loss receives the final hidden states. FusedLinearCrossEntropyLoss is
such a wrapper: instead of chunking the sequence and materializing each chunk's logits, it
calls `lmkernels.fused_linear_cross_entropy` (through lmkernels.integrations.lm_head_loss) on
all hidden states at once; the logits are never built, and the hidden states' gradient flows
back through the decoder by autograd.

Loss semantics are torchtitan's cross_entropy_loss: labels already shifted by the dataloader,
ignore index -100, sum over tokens divided by `global_valid_tokens` (the valid tokens of the
whole step across ranks and micro-batches), fp32.

Sharded lm_head weights: under FSDP2 (torchtitan shards lm_head together with the final norm)
the loss runs as a registered FSDP forward method of lm_head, so FSDP unshards the weight
before the kernel and reduce-scatters its gradient after, as for lm_head's own forward (see
lmkernels.integrations.lm_head_loss); a tensor-parallel (DTensor) weight goes to lmkernels'
vocab-parallel loss. A DTensor weight is never mixed with plain tensors in one kernel call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.loss import IGNORE_INDEX, ChunkedLossWrapper, CrossEntropyLoss

from lmkernels.integrations.lm_head_loss import lm_head_loss
from lmkernels.registry import LMKernelsError, parse_backend_spec


class FusedLinearCrossEntropyLoss(ChunkedLossWrapper):
    """torchtitan's chunked lm_head + cross entropy, computed by lmkernels in one fused call."""

    @dataclass(kw_only=True, slots=True)
    class Config(ChunkedLossWrapper.Config):
        backend: str | None = None
        """lmkernels backend of the fused loss (None: lmkernels' dispatch chooses)."""

    def __init__(self, config: Config, *, compile_config: Any = None) -> None:
        if type(config.loss_fn) is not CrossEntropyLoss.Config:
            raise LMKernelsError(
                f"loss.loss_fn: the fused loss computes cross entropy; got {type(config.loss_fn).__name__}"
            )
        if config.backend is not None:
            parse_backend_spec(config.backend, where="loss.backend")
        self.backend = config.backend
        self.lm_head = None
        # num_chunks and compile_config do not apply: nothing is chunked, and the lmkernels ops
        # choose their own kernels (a compiled inner loss has no logits to work on).

    def __call__(
        self,
        pred: torch.Tensor,
        labels: torch.Tensor,
        global_valid_tokens: torch.Tensor | None = None,
        **loss_inputs: Any,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """pred: the final hidden states (batch, seq, dim) (the trainer sets _skip_lm_head);
        labels: (batch, seq), already shifted. Returns the summed loss / global_valid_tokens."""
        if self.lm_head is None:
            raise LMKernelsError(
                "the fused loss needs set_lm_head(model.lm_head) first (torchtitan's trainer does it)"
            )
        loss = lm_head_loss(  # the sum over tokens (fp32) / global_valid_tokens
            self.lm_head,
            pred,
            None,
            shift_labels=labels,
            num_items_in_batch=1 if global_valid_tokens is None else global_valid_tokens,
            ignore_index=IGNORE_INDEX,
            backend=self.backend,
        )
        return loss, {}


def fused_loss_config(loss_config: Any, backend: str | None = None) -> FusedLinearCrossEntropyLoss.Config:
    """The fused loss config for a torchtitan loss config computing cross entropy on the
    logits: ChunkedLossWrapper.Config around CrossEntropyLoss.Config, or CrossEntropyLoss.Config
    itself. Anything else raises (a loss lmkernels cannot fuse)."""
    if (
        type(loss_config) is ChunkedLossWrapper.Config
        and type(loss_config.loss_fn) is CrossEntropyLoss.Config
    ):
        inner = loss_config.loss_fn
    elif type(loss_config) is CrossEntropyLoss.Config:
        inner = loss_config
    elif type(loss_config) is FusedLinearCrossEntropyLoss.Config:
        return loss_config
    else:
        raise LMKernelsError(
            f"loss: {type(loss_config).__qualname__} is not torchtitan's cross entropy (alone or "
            f"in ChunkedLossWrapper); lmkernels can fuse only that one"
        )
    return FusedLinearCrossEntropyLoss.Config(loss_fn=inner, backend=backend)
