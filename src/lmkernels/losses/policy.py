"""Policy-gradient losses (GRPO family, RLOO) through the fused lm_head.

A batch is B completions: `hidden` (B, T, H) the policy's last hidden states at the positions
that predict the completion tokens `target` (B, T) (losses/logps.py), `mask` (B, T) the
completion mask (padding and tokens after EOS 0). Per token, one fused_linear_cross_entropy(
reduction="none", return_stats=True, temperature=T) call gives log pi(t_i) (differentiable)
and the entropy H_i of the temperature-scaled next-token distribution (differentiable: the
entropy bonus's gradient runs through it), fp32, no logits built. The rest follows TRL 1.16's
GRPOTrainer / RLOOTrainer and their metric names.

Gradient accumulation: TRL divides the grpo / bnpo / dr_grpo / sapo / luspo losses (and the
entropy bonus) by the number of accumulated micro-batches; these functions do not (divide the
loss yourself), and dapo / cispo divide by `num_items_in_batch` (the accumulation window's
completion tokens) as given.

Metrics are 0-dim fp32 tensors of the local batch (no host sync, no cross-process gather).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lmkernels.losses.logps import masked_mean, token_logps
from lmkernels.utils import fail

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo")
_CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


def _per_sequence(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per sequence: x itself when it is (B, 1), else its mean over the mask (nan when empty)."""
    if x.shape[-1] == 1:
        return x[:, 0].float()
    mask = mask.float()
    return (x.float() * mask).sum(-1) / mask.sum(-1)


def _global_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] == 1:
        return x.float().mean()
    return masked_mean(x, mask)


def _nan_extreme(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    ok = ~torch.isnan(x)
    if x.numel() == 0:
        return x.new_full((), float("nan"))
    fill = float("inf") if fn is torch.amin else float("-inf")
    out = fn(torch.where(ok, x, fill))
    return torch.where(ok.any(), out, float("nan"))


def _advantages(advantages: torch.Tensor, B: int) -> torch.Tensor:
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    if advantages.shape[0] != B:
        fail(f"advantages: expected ({B},) or ({B}, T), got {tuple(advantages.shape)}")
    return advantages


def grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    ref_hidden: torch.Tensor | None = None,
    ref_weight: torch.Tensor | None = None,
    ref_bias: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    loss_type: str = "dapo",
    importance_sampling_level: str = "token",
    entropy_coef: float = 0.0,
    use_bias_correction_kl: bool = True,
    importance_sampling_ratio: torch.Tensor | None = None,
    max_completion_length: int | None = None,
    num_items_in_batch: torch.Tensor | float | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    ignore_index: int = -100,
    backend: str | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO (Shao et al. 2024) and its variants, TRL's GRPOTrainer loss, through the fused lm_head.

    Per completion token i (mask m_i), with lp_i = log pi(t_i) at temperature T, old_i the
    sampling policy's (old_logps; None: lp_i detached, one update per generation), A the
    advantage of the completion (advantages (B,) or per token (B, T)):

        w_i = exp(lp_i - old_i)                (token level; sequence level: exp(mean_i (lp_i - old_i)))
        grpo/bnpo/dr_grpo/dapo/luspo:  l_i = -min(w_i A, clip(w_i, 1 - eps_low, 1 + eps_high) A)
                                       (w_i capped at delta first when delta is set: two-sided)
        cispo:  l_i = -sg(min(w_i, eps_high)) A lp_i
        sapo:   l_i = -(4 / tau) sigmoid(tau (w_i - 1)) A,  tau = sapo_temperature_pos if A > 0 else _neg
        l_i *= importance_sampling_ratio_i (vLLM's correction, when given)
        + beta * k3_i,  k3_i = exp(ref_i - lp_i) - (ref_i - lp_i) - 1   (x w_i if use_bias_correction_kl)

    reduced by loss_type:

        grpo, sapo  mean over completions of (sum_i m_i l_i / sum_i m_i)
        bnpo        sum m l / sum m
        dr_grpo     sum m l / (B * max_completion_length)         (default: T)
        dapo, cispo sum m l / num_items_in_batch                  (default: sum m)
        luspo       mean over completions of sum_i m_i l_i

    minus entropy_coef * (sum m H / sum m) (the entropy bonus; its gradient flows through the
    fused entropy: a backend without that gradient refuses the backward by name).

    Reference (beta != 0): ref_logps (B, T) per token, or ref_hidden / ref_weight / ref_bias run
    under no_grad at the same temperature.

    Returns (loss, metrics): kl, entropy, policy_loss (the loss before the entropy bonus),
    clip_ratio/low_mean, clip_ratio/high_mean, clip_ratio/region_mean, clip_ratio/low_min,
    clip_ratio/high_max (clipped loss types), cispo_clip_ratio (cispo).
    """
    if loss_type not in GRPO_LOSS_TYPES:
        fail(f"loss_type: expected one of {GRPO_LOSS_TYPES}, got {loss_type!r}")
    if importance_sampling_level not in ("token", "sequence"):
        fail(f"importance_sampling_level: expected 'token' or 'sequence', got {importance_sampling_level!r}")
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    t = token_logps(
        hidden,
        weight,
        target,
        mask,
        bias=bias,
        temperature=temperature,
        softcap=softcap,
        ignore_index=ignore_index,
        stats=True,
        backend=backend,
    )
    assert t.entropy is not None  # (stats=True)
    m, lp = t.mask, t.logps
    mf = m.float()
    B = lp.shape[0]
    adv = _advantages(advantages, B)
    old = lp.detach() if old_logps is None else old_logps
    log_ratio = torch.where(m, lp - old, 0.0)
    if importance_sampling_level == "token":
        log_w = log_ratio
    else:
        log_w = ((log_ratio * mf).sum(-1) / mf.sum(-1).clamp(min=1.0))[:, None]
    coef_1 = torch.exp(log_w)
    metrics: dict[str, torch.Tensor] = {}
    if beta != 0.0:
        if ref_logps is None:
            if ref_hidden is None or ref_weight is None:
                fail(
                    "ref_logps: beta != 0 needs the reference's per-token log-probs, or ref_hidden and ref_weight"
                )
            with torch.no_grad():
                ref_logps = token_logps(
                    ref_hidden,
                    ref_weight,
                    target,
                    m,
                    bias=ref_bias,
                    temperature=temperature,
                    softcap=softcap,
                    ignore_index=ignore_index,
                    backend=backend,
                ).logps
        d = torch.where(m, ref_logps - lp, 0.0)
        per_token_kl = torch.exp(d) - d - 1
        if use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1
    if loss_type == "cispo":
        per_token_loss = -torch.clamp(coef_1, max=eps_high).detach() * adv * lp
    elif loss_type in _CLIPPED:
        coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + eps_high)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
    else:  # sapo
        tau = torch.where(adv > 0, sapo_temperature_pos, sapo_temperature_neg)
        per_token_loss = -torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau * adv
    if importance_sampling_ratio is not None:
        per_token_loss = per_token_loss * importance_sampling_ratio
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    masked = per_token_loss * mf
    if loss_type in ("grpo", "sapo"):
        loss = (masked.sum(-1) / mf.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = masked.sum() / mf.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        length = lp.shape[-1] if max_completion_length is None else max_completion_length
        loss = masked.sum() / (per_token_loss.shape[0] * length)
    elif loss_type in ("dapo", "cispo"):
        count = mf.sum().clamp(min=1.0) if num_items_in_batch is None else num_items_in_batch
        loss = masked.sum() / count
    else:  # luspo
        loss = masked.sum(-1).mean()
    metrics["policy_loss"] = loss.detach()
    if entropy_coef != 0.0:
        loss = loss - entropy_coef * (t.entropy * mf).sum() / mf.sum().clamp(min=1.0)
    with torch.no_grad():
        if beta != 0.0:
            metrics["kl"] = _global_mean(per_token_kl, m)
        metrics["entropy"] = masked_mean(t.entropy, m)
        if loss_type in _CLIPPED:
            low = ((coef_1 < 1 - epsilon_low) & (adv < 0)).float()
            high = ((coef_1 > 1 + eps_high) & (adv > 0)).float()
            region = torch.maximum(low, high)
            metrics["clip_ratio/low_mean"] = _global_mean(low, m)
            metrics["clip_ratio/high_mean"] = _global_mean(high, m)
            metrics["clip_ratio/region_mean"] = _global_mean(region, m)
            metrics["clip_ratio/low_min"] = _nan_extreme(_per_sequence(low, m), torch.amin)
            metrics["clip_ratio/high_max"] = _nan_extreme(_per_sequence(high, m), torch.amax)
        elif loss_type == "cispo":
            metrics["cispo_clip_ratio"] = _global_mean(((coef_1 > eps_high) & (adv > 0)).float(), m)
    return loss, metrics


def rloo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    old_logps: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    entropy_coef: float = 0.0,
    ignore_index: int = -100,
    backend: str | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """RLOO (Ahmadian et al. 2024), TRL's RLOOTrainer loss: a sequence-level clipped surrogate.

    With lp = sum_i m_i log pi(t_i) per completion (temperature T), old its value under the
    sampling policy (old_logps (B,); None: lp detached), w = exp(lp - old) and A the
    leave-one-out advantage (rloo_advantages(); the KL to the reference enters there, as a
    reward penalty, as TRL does):

        loss = mean_completions(-min(w A, clip(w, 1 - eps_low, 1 + eps_high) A))
               - entropy_coef * (sum m H / sum m)

    (TRL's RLOO has no entropy bonus: entropy_coef = 0 is TRL's loss.) Returns (loss, metrics):
    entropy, clip_ratio/low_mean, clip_ratio/low_min, clip_ratio/high_mean, clip_ratio/high_max,
    clip_ratio/region_mean (over completions).
    """
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    t = token_logps(
        hidden,
        weight,
        target,
        mask,
        bias=bias,
        temperature=temperature,
        softcap=softcap,
        ignore_index=ignore_index,
        stats=True,
        backend=backend,
    )
    assert t.entropy is not None  # (stats=True)
    mf = t.mask.float()
    lp = (t.logps * mf).sum(-1)
    if advantages.shape != lp.shape:
        fail(
            f"advantages: expected shape {tuple(lp.shape)} (one per completion), got {tuple(advantages.shape)}"
        )
    old = lp.detach() if old_logps is None else old_logps
    coef_1 = torch.exp(lp - old)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + eps_high)
    loss = (-torch.min(coef_1 * advantages, coef_2 * advantages)).mean()
    metrics = {"policy_loss": loss.detach()}
    if entropy_coef != 0.0:
        loss = loss - entropy_coef * (t.entropy * mf).sum() / mf.sum().clamp(min=1.0)
    with torch.no_grad():
        low = ((coef_1 < 1 - epsilon_low) & (advantages < 0)).float()
        high = ((coef_1 > 1 + eps_high) & (advantages > 0)).float()
        metrics["entropy"] = masked_mean(t.entropy, t.mask)
        metrics["clip_ratio/low_mean"] = low.mean()
        metrics["clip_ratio/low_min"] = _nan_extreme(low, torch.amin)
        metrics["clip_ratio/high_mean"] = high.mean()
        metrics["clip_ratio/high_max"] = _nan_extreme(high, torch.amax)
        metrics["clip_ratio/region_mean"] = torch.maximum(low, high).mean()
    return loss, metrics


def grpo_advantages(
    rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group"
) -> torch.Tensor:
    """GRPO's group-relative advantages (TRL): r - mean of its group of num_generations
    completions, divided by the group's std (+ 1e-4) for scale_rewards="group", by the batch's
    for "batch", not for "none". rewards (N,), consecutive groups."""
    if scale_rewards not in ("group", "batch", "none"):
        fail(f"scale_rewards: expected 'group', 'batch' or 'none', got {scale_rewards!r}")
    grouped = rewards.view(-1, num_generations)
    adv = (grouped - grouped.mean(1, keepdim=True)).reshape(-1)
    if scale_rewards == "group":
        std = grouped.std(1, keepdim=True).expand_as(grouped).reshape(-1) if num_generations > 1 else 0.0
        adv = adv / (std + 1e-4)
    elif scale_rewards == "batch":
        adv = adv / ((rewards.std() if rewards.numel() > 1 else 0.0) + 1e-4)
    return adv


def rloo_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    *,
    kl: torch.Tensor | None = None,
    beta: float = 0.0,
    normalize: bool = False,
) -> torch.Tensor:
    """RLOO's leave-one-out advantages (TRL): with r' = rewards - beta * kl (kl (N,): the
    sequence KL estimate sum_i m_i (old_i - ref_i), TRL's first-order one), each completion's
    baseline is the mean r' of the other num_generations - 1 completions of its group; normalize:
    (A - mean A) / (std A + 1e-4) over the batch."""
    if kl is not None and beta != 0.0:
        rewards = rewards - beta * kl
    if num_generations < 2:
        return torch.zeros_like(rewards)
    grouped = rewards.view(-1, num_generations)
    baseline = (grouped.sum(1, keepdim=True) - grouped) / (num_generations - 1)
    adv = (grouped - baseline).reshape(-1)
    if normalize:
        adv = (adv - adv.mean()) / (adv.std() + 1e-4)
    return adv
