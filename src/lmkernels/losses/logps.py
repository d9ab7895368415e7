"""Per-token and per-sequence log-probabilities through the fused lm_head + cross entropy.

Every post-training loss of this package starts from the log-probability of each target token
under the policy, log p(t_i | h_i) = z_i[t_i] - logsumexp(z_i) with logits

    z_i = softcap(h_i @ W.T + b) / T          (softcap c: c * tanh(y / c); temperature T)

which is -fused_linear_cross_entropy(..., reduction="none"): fp32 whatever the inputs' dtype,
differentiable, and no (tokens x V) logits are built in the fused backends. The same call gives
the entropy of each next-token distribution, H_i = -sum_c p_c log p_c (differentiable, for an
entropy bonus) and whether the target is the top-1 token, and `mean_logits` the mean logit
(1/V) sum_c z_c (metrics only).

Alignment: `hidden[..., i, :]` is the state that predicts `target[..., i]`. For a causal LM's
last hidden states h (B, L, H) and its input ids x (B, L): hidden = h[:, :-1], target = x[:, 1:]
with prompt and padding positions set to ignore_index (or given as a mask).
"""

from __future__ import annotations

import typing

import torch

import lmkernels
from lmkernels.utils import fail


class TokenStats(typing.NamedTuple):
    """Per token of a (..., T) target: logps (fp32, differentiable; 0 where not counted), entropy
    (fp32, differentiable where the backend has its gradient; 0 where not counted; None unless
    asked for), is_top1 (bool; None unless asked for) and mask (bool: the tokens that count)."""

    logps: torch.Tensor
    entropy: torch.Tensor | None
    is_top1: torch.Tensor | None
    mask: torch.Tensor


def token_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    stats: bool = False,
    backend: str | None = None,
) -> TokenStats:
    """log p(target_i) per token (and with stats=True the entropy and top-1 of each token's
    distribution) from one `lmkernels.fused_linear_cross_entropy(reduction="none")` call.

    Args:
        hidden: (..., T, H) states predicting `target` (see the module docstring).
        weight: (V, H) lm_head weight; bias: (V,) or None.
        target: (..., T) int token ids; ignore_index marks tokens that do not count.
        mask: (..., T) optional 0/1 or bool; a token counts where mask != 0 and target !=
            ignore_index.
        temperature, softcap: the logits are softcap(h @ W.T + b) / temperature.
        stats: also return the entropy and top-1 (same call, no extra pass over the logits).
        backend: the FLCE backend (None: lmkernels' dispatch).
    """
    if mask is not None:
        if mask.shape != target.shape:
            fail(f"mask: expected shape {tuple(target.shape)} (target's), got {tuple(mask.shape)}")
        target = torch.where(mask.bool(), target, ignore_index)
    out = lmkernels.fused_linear_cross_entropy(
        hidden,
        weight,
        target,
        bias=bias,
        ignore_index=ignore_index,
        reduction="none",
        softcap=softcap,
        temperature=temperature,
        return_stats=stats,
        backend=backend,
    )
    counted = target != ignore_index
    if isinstance(out, torch.Tensor):  # stats=False: the per-token loss alone
        return TokenStats(-out, None, None, counted)
    nll, _, entropy, is_top1 = out
    return TokenStats(-nll, torch.where(counted, entropy, 0.0), is_top1 & counted, counted)


def sequence_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    average: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """log p(sequence) = sum_i log p(target_i) over the tokens that count, per sequence (the last
    dim is the sequence): shape target.shape[:-1], fp32, differentiable. average=True divides by
    the number of tokens that count (at least 1): the length-normalized log-prob of SimPO, IPO
    and ORPO. Arguments as token_logps."""
    t = token_logps(
        hidden,
        weight,
        target,
        mask,
        bias=bias,
        temperature=temperature,
        softcap=softcap,
        ignore_index=ignore_index,
        backend=backend,
    )
    return reduce_sequences(t.logps, t.mask, average)


def reduce_sequences(per_token: torch.Tensor, mask: torch.Tensor, average: bool = False) -> torch.Tensor:
    """sum over the last dim of per_token where mask, divided by the count (min 1) if average."""
    total = (per_token * mask).sum(-1)
    return total / mask.sum(-1).clamp(min=1) if average else total


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """mean of x over mask (0 where nothing counts), in fp32."""
    mask = mask.to(torch.float32)
    return (x.float() * mask).sum() / mask.sum().clamp(min=1.0)


def mean_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """(1/V) sum_c z_c per token (shape hidden.shape[:-1], fp32, no gradient): TRL's mean_logits
    metric, without the logits (lmkernels.flce_mean_logits)."""
    return lmkernels.flce_mean_logits(hidden, weight, bias=bias, softcap=softcap, temperature=temperature)
