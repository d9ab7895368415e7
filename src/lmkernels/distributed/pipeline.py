"""A transformers decoder-only causal LM cut into pipeline stages for torch.distributed.pipelining.

`DecoderStage(model, index, count)` holds stage `index` of `count`: layers [k L/N, (k+1) L/N)
(the last stage the rest too); stage 0 also embeds the token ids, the last stage also applies
the final norm and holds lm_head, returning the final hidden states. The loss then runs on the
last stage as the schedule's loss_fn, on those hidden states and `stage.lm_head.weight`
(lmkernels.fused_linear_cross_entropy or integrations.lm_head_loss.causal_lm_loss): the logits
never exist on any stage. Layers run as the model's own forward runs them, without an attention
mask (SDPA runs causal, as transformers does for an unpadded batch).

A patched model's modules hold their patched forwards as bound methods (reference cycles): the
layers of the other stages are freed by Python's cycle collector, not when the model is
dropped. Drop it and run gc.collect() after cutting, as the benchmark's pipeline runs do.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class DecoderStage(nn.Module):
    """Stage `index` of `count` of a transformers decoder-only causal LM (`model.model.layers`,
    `.rotary_emb`, `.embed_tokens`, `.norm`, `model.lm_head`): see the module docstring. Its
    forward takes the token ids (stage 0) or the previous stage's hidden states and returns
    hidden states (the last stage's after the final norm)."""

    def __init__(self, model: nn.Module, index: int, count: int) -> None:
        super().__init__()
        causal_lm: Any = model  # duck-typed: a transformers causal LM
        base = causal_lm.model
        per = len(base.layers) // count
        stop = (index + 1) * per if index < count - 1 else len(base.layers)
        self.first, self.last = index == 0, index == count - 1
        self.layers = nn.ModuleList(base.layers[index * per : stop])
        self.rotary_emb = base.rotary_emb
        self.embed_tokens: nn.Module | None = base.embed_tokens if self.first else None
        self.norm: nn.Module | None = base.norm if self.last else None
        self.lm_head: nn.Module | None = causal_lm.lm_head if self.last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (stage 0) or the previous stage's hidden states -> this stage's output."""
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        b, t = h.shape[:2]
        positions = torch.arange(t, device=h.device).unsqueeze(0).expand(b, -1)
        cos_sin = self.rotary_emb(h, position_ids=positions)
        for layer in self.layers:
            out = layer(h, attention_mask=None, position_ids=positions, position_embeddings=cos_sin)
            h = out[0] if isinstance(out, tuple) else out
        return self.norm(h) if self.norm is not None else h


def schedule_step(schedule: Any, ids: torch.Tensor, first: bool) -> list[torch.Tensor]:
    """One step of a torch.distributed.pipelining schedule on this rank's stage: the first stage
    takes the token ids as input, the others as the targets of the last stage's loss_fn. Returns
    the micro-batches' losses (filled on the last stage only)."""
    losses: list[torch.Tensor] = []
    if first:
        schedule.step(ids)
    else:
        schedule.step(target=ids, losses=losses)
    return losses
