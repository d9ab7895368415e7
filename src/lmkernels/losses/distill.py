"""Knowledge distillation through both lm_heads: a thin layer over
lmkernels.fused_linear_distillation (TRL's GKD generalized JSD, forward and reverse KL)."""

from __future__ import annotations

import torch

import lmkernels
from lmkernels.losses.logps import masked_mean, token_logps
from lmkernels.utils import fail


def distillation_loss(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    target: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    *,
    divergence: str = "jsd",
    beta: float = 0.5,
    temperature: float = 1.0,
    hard_weight: float = 0.0,
    soft_weight: float = 1.0,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | float | None = None,
    student_entropy: bool = False,
    ignore_index: int = -100,
    backend: str | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Distillation loss of a student against a teacher, no (tokens x V) logits built.

    Per token i that counts (target != ignore_index and mask != 0; every token without either),
    with p_s = softmax(z_s / T), p_t = softmax(z_t / T) of both lm_heads' logits:

        forward_kl  KL(p_t || p_s)            reverse_kl  KL(p_s || p_t)
        jsd         beta KL(p_t || m) + (1 - beta) KL(p_s || m),  m = (1 - beta) p_s + beta p_t
                    (beta 0 / 1: forward / reverse KL, TRL's GKD convention)
        loss_i = soft_weight D_i + hard_weight (-log softmax(z_s)[target_i])   (hard: needs target)

    loss = sum_i loss_i / (number of tokens that count), or / num_items_in_batch when given (the
    gradient-accumulation-correct count, as TRL's GKD and DistillationTrainer). The teacher gets no
    gradient (its tensors are detached). Shapes: student_hidden (..., Hs), student_weight (V, Hs),
    teacher_hidden (..., Ht), teacher_weight (V, Ht), target / mask (...).

    Returns (loss, metrics): "entropy" (the student's mean entropy at temperature T over the
    tokens that count, TRL DistillationTrainer's metric) when student_entropy=True, at the cost of
    one more forward pass over the student's lm_head (no gradient).
    """
    if mask is not None:
        if target is None:
            fail("mask: needs a target (the mask selects target tokens)")
        target = torch.where(mask.bool(), target, ignore_index)
    reduction = "mean" if num_items_in_batch is None else "sum"
    teacher_b = None if teacher_bias is None else teacher_bias.detach()
    loss = lmkernels.fused_linear_distillation(
        student_hidden,
        student_weight,
        teacher_hidden.detach(),
        teacher_weight.detach(),
        target,
        student_bias=student_bias,
        teacher_bias=teacher_b,
        divergence=divergence,
        beta=beta,
        temperature=temperature,
        ignore_index=ignore_index,
        hard_weight=hard_weight,
        soft_weight=soft_weight,
        reduction=reduction,
        backend=backend,
    )
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    metrics: dict[str, torch.Tensor] = {}
    if student_entropy:
        with torch.no_grad():
            probe = target
            if probe is None:
                probe = torch.zeros(student_hidden.shape[:-1], dtype=torch.long, device=student_hidden.device)
            t = token_logps(
                student_hidden.detach(),
                student_weight.detach(),
                probe,
                bias=None if student_bias is None else student_bias.detach(),
                temperature=temperature,
                ignore_index=ignore_index,
                stats=True,
                backend=backend,
            )
            assert t.entropy is not None  # (stats=True)
            metrics["entropy"] = masked_mean(t.entropy, t.mask)
    return loss, metrics
