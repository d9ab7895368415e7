"""Post-training losses for plain PyTorch, built on lmkernels' fused primitives: no (tokens x V)
logits are built in the fused backends. Each loss takes the model's last hidden states and its
lm_head weight and returns (loss, metrics), the metrics named as TRL logs them.

    from lmkernels.losses import dpo_loss, grpo_loss, distillation_loss, sequence_logps

Alignment (every function): hidden[..., i, :] predicts target[..., i]; see losses/logps.py.
docs/losses.md has an example of each family.
"""

from lmkernels.losses.distill import distillation_loss
from lmkernels.losses.logps import TokenStats, mean_logits, sequence_logps, token_logps
from lmkernels.losses.policy import grpo_advantages, grpo_loss, rloo_advantages, rloo_loss
from lmkernels.losses.preference import (
    cpo_loss,
    dpo_loss,
    dpo_loss_from_logps,
    kto_kl,
    kto_loss,
    orpo_loss,
    simpo_loss,
)

__all__ = [
    "TokenStats",
    "cpo_loss",
    "distillation_loss",
    "dpo_loss",
    "dpo_loss_from_logps",
    "grpo_advantages",
    "grpo_loss",
    "kto_kl",
    "kto_loss",
    "mean_logits",
    "orpo_loss",
    "rloo_advantages",
    "rloo_loss",
    "sequence_logps",
    "simpo_loss",
    "token_logps",
]
