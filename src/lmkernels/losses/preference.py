"""Preference losses (DPO family, ORPO, CPO, SimPO, KTO) through the fused lm_head.

Batches follow TRL's concatenation: `hidden` (2B, T, H) holds the B chosen sequences first, then
the B rejected ones (pair j is rows j and B + j); `target` (2B, T) their token ids aligned with
`hidden` (losses/logps.py), prompt and padding set to ignore_index or masked out by `mask`.
The sequence log-probs come from one fused_linear_cross_entropy(reduction="none",
return_stats=True) call (fp32, no logits built); every loss is then a function of them, as in
TRL 1.16 (DPOTrainer, KTOTrainer, trl.experimental CPOTrainer / ORPOTrainer), whose formulas
and metric names these follow. A reference model enters as its sequence log-probs (`ref_logps`,
precomputed) or as its last hidden states and lm_head (`ref_hidden`, `ref_weight`: computed
under no_grad through the same fused call).

Metrics are 0-dim fp32 tensors of the local batch (no host sync, no cross-process gather):
rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen,
logps/rejected, logits/chosen and logits/rejected (the mean logit over the counted tokens), and
per loss its own (entropy, mean_token_accuracy, nll_loss, log_odds_ratio, kl, ...).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

import lmkernels
from lmkernels.losses.logps import TokenStats, masked_mean, mean_logits, reduce_sequences, token_logps
from lmkernels.utils import fail

DPO_LOSS_TYPES = (
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
)
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")
KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.shape[0] % 2:
        fail(f"hidden: expected 2B rows (B chosen, then B rejected), got {x.shape[0]}")
    chosen, rejected = x.chunk(2, dim=0)
    return chosen, rejected


def _policy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    softcap: float | None,
    ignore_index: int,
    backend: str | None,
) -> TokenStats:
    return token_logps(
        hidden,
        weight,
        target,
        mask,
        bias=bias,
        softcap=softcap,
        ignore_index=ignore_index,
        stats=True,
        backend=backend,
    )


@torch.no_grad()
def _reference_tokens(
    ref_hidden: torch.Tensor,
    ref_weight: torch.Tensor,
    target: torch.Tensor,
    mask: torch.Tensor,
    ref_bias: torch.Tensor | None,
    softcap: float | None,
    ignore_index: int,
    backend: str | None,
) -> torch.Tensor:
    return token_logps(
        ref_hidden,
        ref_weight,
        target,
        mask,
        bias=ref_bias,
        softcap=softcap,
        ignore_index=ignore_index,
        backend=backend,
    ).logps


def _need_reference(
    ref_logps: torch.Tensor | None, ref_hidden: torch.Tensor | None, ref_weight: torch.Tensor | None
) -> None:
    if ref_logps is None and (ref_hidden is None or ref_weight is None):
        fail("ref_logps: expected the reference's sequence log-probs, or ref_hidden and ref_weight")
    if ref_logps is not None and ref_hidden is not None:
        fail("ref_logps: give either ref_logps or ref_hidden / ref_weight, not both")


def _logit_metrics(
    metrics: dict[str, torch.Tensor],
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    softcap: float | None,
    mask: torch.Tensor,
    chosen_rows: torch.Tensor,
    prefix: str = "logits",
) -> None:
    """logits/chosen and logits/rejected: the mean logit over the counted tokens of each side
    (TRL's DPO and KTO metrics)."""
    with torch.no_grad():
        z = mean_logits(hidden.detach(), weight.detach(), None if bias is None else bias.detach(), softcap)
        chosen = chosen_rows[:, None] & mask
        rejected = ~chosen_rows[:, None] & mask
        metrics[f"{prefix}/chosen"] = masked_mean(z, chosen)
        metrics[f"{prefix}/rejected"] = masked_mean(z, rejected)


def _detached_mean(x: torch.Tensor) -> torch.Tensor:
    return x.detach().float().mean()


# --- DPO ------------------------------------------------------------------------------------------


def _f_scores(logratios: torch.Tensor, f_divergence_type: str, alpha: float) -> torch.Tensor:
    if f_divergence_type == "reverse_kl":
        return logratios
    if f_divergence_type == "forward_kl":  # f'(t) = 1 - 1/t
        return 1 - torch.exp(-logratios)
    if f_divergence_type == "js_divergence":  # f'(t) = log(2t / (t + 1))
        return math.log(2) + F.logsigmoid(logratios)
    if abs(alpha - 1.0) < 1e-6:  # alpha-divergence at alpha = 1: reverse KL
        return logratios
    t = torch.clamp((alpha - 1.0) * logratios.float(), max=80.0)
    return (torch.exp(t) - 1.0) / (alpha - 1.0)


def dpo_loss_from_logps(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    loss_type: str | Sequence[str] = "sigmoid",
    loss_weights: Sequence[float] | None = None,
    label_smoothing: float = 0.0,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
    discopop_tau: float = 0.05,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
    chosen_nll: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DPO family from sequence log-probs (B,) of the policy and the reference, as TRL 1.16's
    DPOTrainer computes it. With r_c = chosen - ref_chosen, r_r = rejected - ref_rejected (log
    ratios), s = f'(exp r) per f_divergence_type (reverse_kl: s = r; forward_kl: 1 - e^-r;
    js_divergence: log 2 + log sigmoid(r); alpha_divergence: (e^((a-1) r) - 1) / (a-1)) and
    d = s_c - s_r, per pair (e = label_smoothing):

        sigmoid       -log sigmoid(beta d)                                   (DPO)
        hinge         relu(1 - beta d)                                       (SLiC)
        ipo           (s_c / n_c - s_r / n_r - 1 / (2 beta))^2               (n: completion lengths)
        robust        (-(1-e) log sigmoid(beta d) + e log sigmoid(-beta d)) / (1 - 2e)
        exo_pair      q_w (log q_w - log(1-e)) + q_l (log q_l - log e),  q_w = sigmoid(beta d)
        nca_pair      -log sigmoid(beta r_c) - (log sigmoid(-beta r_c) + log sigmoid(-beta r_r)) / 2
        bco_pair      -log sigmoid(beta r_c) - log sigmoid(-beta r_r)
        sppo_hard     (r_c - 1 / (2 beta))^2 + (r_r + 1 / (2 beta))^2
        aot           (1-e) (-log sigmoid(beta D)) + e (-log sigmoid(-beta D)),
                      D = sort(chosen - rejected) - sort(ref_chosen - ref_rejected) over the batch
        aot_unpaired  the same with D = sort(r_c) - sort(r_r)
        apo_zero      (1 - sigmoid(beta r_c)) + sigmoid(beta r_r)
        apo_down      sigmoid(beta r_c) + (1 - sigmoid(beta (r_c - r_r)))
        discopop      (1 - m) (-log sigmoid(beta d)) + m e^(-beta d),  m = sigmoid(beta d / tau)
        sft           the chosen tokens' mean negative log-likelihood (`chosen_nll`)
        sigmoid_norm  -log sigmoid(beta (s_c / n_c - s_r / n_r))

    The loss is sum_k w_k mean_pairs(loss_k) over loss_type (a name or a list; loss_weights w
    default to 1). chosen_lengths / rejected_lengths (ipo, sigmoid_norm) are clamped to >= 1.
    Returns (loss, metrics): rewards/chosen = mean beta r_c, rewards/rejected, rewards/accuracies
    (beta r_c > beta r_r), rewards/margins, logps/chosen, logps/rejected.
    """
    types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    weights = [1.0] * len(types) if loss_weights is None else list(loss_weights)
    if len(weights) != len(types):
        fail(f"loss_weights: expected {len(types)} weights (one per loss_type), got {len(weights)}")
    for t in types:
        if t not in DPO_LOSS_TYPES:
            fail(f"loss_type: expected names among {DPO_LOSS_TYPES}, got {t!r}")
    if f_divergence_type not in F_DIVERGENCES:
        fail(f"f_divergence_type: expected one of {F_DIVERGENCES}, got {f_divergence_type!r}")
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    chosen_scores = _f_scores(chosen_logratios, f_divergence_type, f_alpha_divergence_coef)
    rejected_scores = _f_scores(rejected_logratios, f_divergence_type, f_alpha_divergence_coef)
    delta = chosen_scores - rejected_scores
    e = label_smoothing

    def lengths(name: str, x: torch.Tensor | None) -> torch.Tensor:
        if x is None:
            fail(f"{name}: loss_type {types} needs the completion lengths")
        return x.to(chosen_scores.dtype).clamp(min=1.0)

    loss = chosen_logps.new_zeros((), dtype=torch.float32)
    for loss_type_k, w in zip(types, weights):
        if loss_type_k == "sigmoid":
            per = -F.logsigmoid(beta * delta)
        elif loss_type_k == "hinge":
            per = torch.relu(1 - beta * delta)
        elif loss_type_k in ("ipo", "sigmoid_norm"):
            avg = chosen_scores / lengths("chosen_lengths", chosen_lengths) - rejected_scores / lengths(
                "rejected_lengths", rejected_lengths
            )
            per = (avg - 1 / (2 * beta)) ** 2 if loss_type_k == "ipo" else -F.logsigmoid(beta * avg)
        elif loss_type_k == "exo_pair":
            eps = torch.tensor(e, device=delta.device, dtype=delta.dtype)
            per = torch.sigmoid(beta * delta) * (
                F.logsigmoid(beta * delta) - torch.log1p(-eps)
            ) + torch.sigmoid(-beta * delta) * (F.logsigmoid(-beta * delta) - torch.log(eps))
        elif loss_type_k == "nca_pair":
            rc, rr = beta * chosen_logratios, beta * rejected_logratios
            per = -F.logsigmoid(rc) - 0.5 * F.logsigmoid(-rc) - 0.5 * F.logsigmoid(-rr)
        elif loss_type_k == "robust":
            per = (-(1 - e) * F.logsigmoid(beta * delta) + e * F.logsigmoid(-beta * delta)) / (1 - 2 * e)
        elif loss_type_k == "bco_pair":
            per = -F.logsigmoid(beta * chosen_logratios) - F.logsigmoid(-beta * rejected_logratios)
        elif loss_type_k == "sppo_hard":
            per = (chosen_logratios - 0.5 / beta) ** 2 + (rejected_logratios + 0.5 / beta) ** 2
        elif loss_type_k in ("aot", "aot_unpaired"):
            if loss_type_k == "aot":
                a = torch.sort(chosen_logps - rejected_logps, dim=0).values
                b = torch.sort(ref_chosen_logps - ref_rejected_logps, dim=0).values
            else:
                a = torch.sort(chosen_logratios, dim=0).values
                b = torch.sort(rejected_logratios, dim=0).values
            d = a - b
            per = -F.logsigmoid(beta * d) * (1 - e) - F.logsigmoid(-beta * d) * e
        elif loss_type_k == "apo_zero":
            per = (1 - torch.sigmoid(beta * chosen_logratios)) + torch.sigmoid(beta * rejected_logratios)
        elif loss_type_k == "apo_down":
            per = torch.sigmoid(beta * chosen_logratios) + (
                1 - torch.sigmoid(beta * (chosen_logratios - rejected_logratios))
            )
        elif loss_type_k == "discopop":
            logits = beta * delta
            m = torch.sigmoid(logits / discopop_tau)
            per = -F.logsigmoid(logits) * (1 - m) + torch.exp(-logits) * m
        else:  # sft
            if chosen_nll is None:
                fail("chosen_nll: loss_type 'sft' needs the chosen tokens' mean negative log-likelihood")
            per = chosen_nll.expand(chosen_logps.shape[0])
        loss = loss + per.mean() * w
    chosen_rewards = beta * chosen_logratios.detach()
    rejected_rewards = beta * rejected_logratios.detach()
    metrics = {
        "rewards/chosen": chosen_rewards.float().mean(),
        "rewards/rejected": rejected_rewards.float().mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).float().mean(),
        "logps/chosen": _detached_mean(chosen_logps),
        "logps/rejected": _detached_mean(rejected_logps),
    }
    return loss, metrics


def _ld_logps(per_token: torch.Tensor, mask: torch.Tensor, ld_alpha: float | None) -> torch.Tensor:
    """Sequence log-probs, with TRL's length desensitization (LD-DPO) when ld_alpha is set: the
    tokens past the shorter completion of each pair count ld_alpha times."""
    if ld_alpha is None:
        return (per_token * mask).sum(-1)
    pos = mask.long().cumsum(-1)
    lens = mask.sum(-1)
    chosen, rejected = _halves(lens)
    shared = torch.minimum(chosen, rejected).repeat(2)[:, None]
    shared_mask = (pos > 0) & (pos <= shared) & mask
    tail_mask = (pos > shared) & mask
    return (per_token * shared_mask).sum(-1) + ld_alpha * (per_token * tail_mask).sum(-1)


def dpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    ref_logps: torch.Tensor | None = None,
    ref_hidden: torch.Tensor | None = None,
    ref_weight: torch.Tensor | None = None,
    ref_bias: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    beta: float = 0.1,
    loss_type: str | Sequence[str] = "sigmoid",
    loss_weights: Sequence[float] | None = None,
    label_smoothing: float = 0.0,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
    discopop_tau: float = 0.05,
    ld_alpha: float | None = None,
    softcap: float | None = None,
    ignore_index: int = -100,
    backend: str | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO and its variants through the fused lm_head (TRL's DPOTrainer loss; math in
    dpo_loss_from_logps).

    Args:
        hidden: (2B, T, H) the policy's last hidden states, chosen rows first (module docstring).
        weight: (V, H) the policy's lm_head weight (bias: (V,) or None).
        target: (2B, T) token ids aligned with hidden; mask: optional (2B, T) completion mask.
        ref_logps: (2B,) the reference's sequence log-probs (precomputed), or ref_hidden (2B, T,
            Hr) / ref_weight (V, Hr) / ref_bias: the reference model's, run under no_grad.
        beta, loss_type, loss_weights, label_smoothing, f_divergence_type,
        f_alpha_divergence_coef, discopop_tau: as TRL's DPOConfig.
        ld_alpha: LD-DPO's weight of the tokens past the shorter completion of a pair.
        softcap: the lm_head's final logit softcap (Gemma), or None.

    WPO weighting (TRL's use_weighting) reads sum_v p_v^2 per token, not a function of the
    sequence log-probs: not here.

    Returns (loss, metrics): dpo_loss_from_logps' metrics plus entropy (mean over the completion
    tokens), mean_token_accuracy (top-1 of the chosen completions), logits/chosen,
    logits/rejected (mean logit over the completion tokens).
    """
    _need_reference(ref_logps, ref_hidden, ref_weight)
    t = _policy(hidden, weight, target, mask, bias, softcap, ignore_index, backend)
    logps = _ld_logps(t.logps, t.mask, ld_alpha)
    if ref_logps is None:
        assert ref_hidden is not None and ref_weight is not None  # (_need_reference)
        ref_tokens = _reference_tokens(
            ref_hidden, ref_weight, target, t.mask, ref_bias, softcap, ignore_index, backend
        )
        ref_logps = _ld_logps(ref_tokens, t.mask, ld_alpha)
    chosen_mask, _ = _halves(t.mask)
    lengths = t.mask.sum(-1)
    chosen_tokens, _ = _halves(t.logps)
    chosen_nll = -(chosen_tokens * chosen_mask).sum() / chosen_mask.sum().clamp(min=1)
    loss, metrics = dpo_loss_from_logps(
        *_halves(logps),
        *_halves(ref_logps),
        beta=beta,
        loss_type=loss_type,
        loss_weights=loss_weights,
        label_smoothing=label_smoothing,
        f_divergence_type=f_divergence_type,
        f_alpha_divergence_coef=f_alpha_divergence_coef,
        discopop_tau=discopop_tau,
        chosen_lengths=_halves(lengths)[0],
        rejected_lengths=_halves(lengths)[1],
        chosen_nll=chosen_nll,
    )
    assert t.entropy is not None and t.is_top1 is not None  # (stats=True)
    metrics["entropy"] = masked_mean(t.entropy.detach(), t.mask)
    metrics["mean_token_accuracy"] = masked_mean(_halves(t.is_top1)[0], chosen_mask)
    rows = torch.arange(t.mask.shape[0], device=t.mask.device) < t.mask.shape[0] // 2
    _logit_metrics(metrics, hidden, weight, bias, softcap, t.mask, rows)
    return loss, metrics


# --- ORPO, CPO, SimPO (reference-free) --------------------------------------------------------------


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate on both sides of -log 2."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def _chosen_nll(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    mask: torch.Tensor | None,
    nll_target: torch.Tensor | None,
    bias: torch.Tensor | None,
    softcap: float | None,
    ignore_index: int,
    backend: str | None,
    t: TokenStats,
) -> torch.Tensor:
    """The chosen rows' mean cross entropy over their counted tokens: from the policy's token
    log-probs `t`, or over nll_target (another labelling: ORPO's prompt + completion) by one more
    fused call."""
    if nll_target is None:
        tokens, counted = _halves(t.logps)[0], _halves(t.mask)[0]
        return -(tokens * counted).sum() / counted.sum().clamp(min=1)
    B = hidden.shape[0] // 2
    return lmkernels.fused_linear_cross_entropy(
        hidden[:B],
        weight,
        nll_target[:B],
        bias=bias,
        ignore_index=ignore_index,
        reduction="mean",
        softcap=softcap,
        backend=backend,
    )


def orpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    nll_target: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    beta: float = 0.1,
    softcap: float | None = None,
    ignore_index: int = -100,
    backend: str | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ORPO (Hong et al. 2024; TRL's trl.experimental ORPOTrainer): no reference model.

    With the length-normalized log-probs l_c, l_r (mean over each completion's tokens):

        log_odds = (l_c - l_r) - (log(1 - e^l_c) - log(1 - e^l_r))
        loss = NLL_chosen - beta * mean_pairs(log sigmoid(log_odds))

    NLL_chosen: the chosen rows' mean cross entropy over `nll_target` (TRL: the whole prompt +
    completion, aligned with hidden, ignore_index on padding), or over target when None.
    Arguments otherwise as dpo_loss. Metrics: rewards/* (rewards = beta * l), logps/chosen,
    logps/rejected, logits/* (mean logit over the completion tokens; TRL's ORPO averages its
    full logits over every position instead), nll_loss, log_odds_ratio (mean log sigmoid),
    log_odds_chosen (mean log_odds).
    """
    t = _policy(hidden, weight, target, mask, bias, softcap, ignore_index, backend)
    chosen, rejected = _halves(reduce_sequences(t.logps, t.mask, average=True))
    nll = _chosen_nll(hidden, weight, target, mask, nll_target, bias, softcap, ignore_index, backend, t)
    log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
    ratio = F.logsigmoid(log_odds)
    loss = nll - (beta * ratio).mean()
    chosen_rewards, rejected_rewards = beta * chosen.detach(), beta * rejected.detach()
    metrics = {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "logps/chosen": _detached_mean(chosen),
        "logps/rejected": _detached_mean(rejected),
        "nll_loss": nll.detach(),
        "log_odds_ratio": _detached_mean(ratio),
        "log_odds_chosen": _detached_mean(log_odds),
    }
    rows = torch.arange(t.mask.shape[0], device=t.mask.device) < t.mask.shape[0] // 2
    _logit_metrics(metrics, hidden, weight, bias, softcap, t.mask, rows)
    return loss, metrics


def cpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    cpo_alpha: float = 1.0,
    alpha: float = 0.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    backend: str | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CPO (Xu et al. 2024) and SimPO (Meng et al. 2024), reference-free, as TRL's
    trl.experimental CPOTrainer.

    l_c, l_r: sequence log-probs, length-normalized (mean over the completion) for ipo and simpo,
    summed otherwise. Rewards r = l, or AlphaPO's r = (1 - e^(-alpha l)) / alpha when alpha != 0;
    d = r_c - r_r, e = label_smoothing:

        sigmoid  -(1-e) log sigmoid(beta d) - e log sigmoid(-beta d)
        simpo    the same with d - simpo_gamma / beta (a target margin gamma)
        hinge    relu(1 - beta d)
        ipo      (d - 1 / (2 beta))^2

    loss = mean_pairs(loss) + cpo_alpha * NLL_chosen (the chosen completions' mean cross entropy;
    SimPO proper: cpo_alpha = 0, see simpo_loss). Metrics: rewards/* (beta * r), logps/*,
    logits/* (mean logit over the completion tokens; TRL's CPO averages its full logits over every
    position instead), nll_loss.
    """
    if loss_type not in CPO_LOSS_TYPES:
        fail(f"loss_type: expected one of {CPO_LOSS_TYPES}, got {loss_type!r}")
    t = _policy(hidden, weight, target, mask, bias, softcap, ignore_index, backend)
    chosen, rejected = _halves(reduce_sequences(t.logps, t.mask, average=loss_type in ("ipo", "simpo")))
    if alpha != 0.0:
        chosen_r = (1 - torch.exp(chosen).pow(-alpha)) / alpha
        rejected_r = (1 - torch.exp(rejected).pow(-alpha)) / alpha
    else:
        chosen_r, rejected_r = chosen, rejected
    d = chosen_r - rejected_r
    e = label_smoothing
    if loss_type in ("sigmoid", "simpo"):
        if loss_type == "simpo":
            d = d - simpo_gamma / beta
        per = -F.logsigmoid(beta * d) * (1 - e) - F.logsigmoid(-beta * d) * e
    elif loss_type == "hinge":
        per = torch.relu(1 - beta * d)
    else:
        per = (d - 1 / (2 * beta)) ** 2
    if cpo_alpha == 0:
        nll = per.new_zeros(())
    else:
        nll = _chosen_nll(hidden, weight, target, mask, None, bias, softcap, ignore_index, backend, t)
    loss = per.mean() + cpo_alpha * nll
    chosen_rewards, rejected_rewards = beta * chosen_r.detach(), beta * rejected_r.detach()
    metrics = {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "logps/chosen": _detached_mean(chosen),
        "logps/rejected": _detached_mean(rejected),
        "nll_loss": nll.detach(),
    }
    rows = torch.arange(t.mask.shape[0], device=t.mask.device) < t.mask.shape[0] // 2
    _logit_metrics(metrics, hidden, weight, bias, softcap, t.mask, rows)
    return loss, metrics


def simpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    beta: float = 2.0,
    gamma: float = 1.0,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    backend: str | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SimPO (Meng et al. 2024): -log sigmoid(beta (l_c - l_r) - gamma) with l the mean log-prob
    over each completion (length-normalized), no reference model and no NLL term: cpo_loss with
    loss_type="simpo", simpo_gamma=gamma, cpo_alpha=0 (TRL's recipe). The defaults are in the
    paper's range (beta 2.0-2.5, gamma 0.5-1.6)."""
    return cpo_loss(
        hidden,
        weight,
        target,
        mask,
        bias=bias,
        beta=beta,
        loss_type="simpo",
        label_smoothing=label_smoothing,
        simpo_gamma=gamma,
        cpo_alpha=0.0,
        softcap=softcap,
        ignore_index=ignore_index,
        backend=backend,
    )


# --- KTO ------------------------------------------------------------------------------------------


def kto_kl(policy_kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> torch.Tensor:
    """KTO's reference point z_0, as TRL estimates it: the mean over a batch of mismatched
    (prompt, completion) pairs of log pi(y|x) - log pi_ref(y|x), detached, clamped at 0. (TRL also
    averages it over processes before the clamp: all_reduce it yourself for that.)"""
    return (policy_kl_logps - ref_kl_logps).mean().detach().clamp(min=0)


def kto_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    desirable: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    ref_logps: torch.Tensor | None = None,
    ref_hidden: torch.Tensor | None = None,
    ref_weight: torch.Tensor | None = None,
    ref_bias: torch.Tensor | None = None,
    kl: torch.Tensor | float | None = None,
    bias: torch.Tensor | None = None,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    loss_type: str = "kto",
    softcap: float | None = None,
    ignore_index: int = -100,
    backend: str | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KTO (Ethayarajh et al. 2024) through the fused lm_head, as TRL's KTOTrainer.

    Unpaired: hidden (N, T, H), target (N, T), desirable (N,) bool. With r = log pi(y|x) - log
    pi_ref(y|x) per sequence and z_0 = kl (the reference point; kto_kl() estimates it as TRL does
    from mismatched pairs; None: 0, TRL without a KL batch):

        kto:               desirable 1 - sigmoid(beta (r - z_0)),  undesirable 1 - sigmoid(beta (z_0 - r))
        apo_zero_unpaired: desirable 1 - sigmoid(beta r),          undesirable sigmoid(beta r)

    loss = mean over sequences of desirable_weight * (desirable losses) and undesirable_weight *
    (undesirable ones). Reference: ref_logps (N,) or ref_hidden / ref_weight (no_grad).
    Metrics: kl, rewards/chosen and rewards/rejected (mean beta r of each side), logps/chosen,
    logps/rejected, rewards/margins, logits/chosen, logits/rejected, entropy; a side with no
    sequence in the batch has no metrics (as TRL).
    """
    if loss_type not in KTO_LOSS_TYPES:
        fail(f"loss_type: expected one of {KTO_LOSS_TYPES}, got {loss_type!r}")
    _need_reference(ref_logps, ref_hidden, ref_weight)
    desirable = desirable.to(torch.bool)
    if desirable.shape != hidden.shape[:1]:
        fail(
            f"desirable: expected shape ({hidden.shape[0]},) (one flag per sequence), got {tuple(desirable.shape)}"
        )
    t = _policy(hidden, weight, target, mask, bias, softcap, ignore_index, backend)
    logps = reduce_sequences(t.logps, t.mask)
    if ref_logps is None:
        assert ref_hidden is not None and ref_weight is not None  # (_need_reference)
        ref_tokens = _reference_tokens(
            ref_hidden, ref_weight, target, t.mask, ref_bias, softcap, ignore_index, backend
        )
        ref_logps = reduce_sequences(ref_tokens, t.mask)
    z0 = logps.new_zeros(()) if kl is None else torch.as_tensor(kl, dtype=logps.dtype, device=logps.device)
    logratios = logps - ref_logps
    if loss_type == "kto":
        chosen_losses = 1 - torch.sigmoid(beta * (logratios - z0))
        rejected_losses = 1 - torch.sigmoid(beta * (z0 - logratios))
    else:
        chosen_losses = 1 - torch.sigmoid(beta * logratios)
        rejected_losses = torch.sigmoid(beta * logratios)
    per = torch.where(desirable, desirable_weight * chosen_losses, undesirable_weight * rejected_losses)
    loss = per.mean()
    rewards = beta * logratios.detach()
    metrics: dict[str, torch.Tensor] = {"kl": z0.detach().float()}
    n_chosen, n_rejected = int(desirable.sum()), int((~desirable).sum())
    if n_chosen:
        metrics["rewards/chosen"] = rewards[desirable].sum() / n_chosen
        metrics["logps/chosen"] = logps.detach()[desirable].sum() / n_chosen
    if n_rejected:
        metrics["rewards/rejected"] = rewards[~desirable].sum() / n_rejected
        metrics["logps/rejected"] = logps.detach()[~desirable].sum() / n_rejected
    if n_chosen and n_rejected:
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    assert t.entropy is not None  # (stats=True)
    metrics["entropy"] = masked_mean(t.entropy.detach(), t.mask)
    with torch.no_grad():
        z = mean_logits(hidden.detach(), weight.detach(), None if bias is None else bias.detach(), softcap)
        if n_chosen:
            metrics["logits/chosen"] = masked_mean(z, desirable[:, None] & t.mask)
        if n_rejected:
            metrics["logits/rejected"] = masked_mean(z, ~desirable[:, None] & t.mask)
    return loss, metrics
