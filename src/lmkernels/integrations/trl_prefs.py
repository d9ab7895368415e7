"""TRL's reference-free preference trainers (trl.experimental CPOTrainer, which also runs SimPO
and AlphaPO, and ORPOTrainer, TRL 1.16) on lmkernels' fused head.

Both compute their loss in `concatenated_forward(model, batch)` from the model's full logits:
the chosen and rejected sequences' log-probs (summed, or averaged for ORPO and CPO's ipo /
simpo), the chosen rows' cross entropy (CPO: the completion labels, when cpo_alpha != 0; ORPO:
prompt + completion), and the logits themselves for two metrics, `logits/chosen` and
`logits/rejected` (their mean over every position and the vocabulary; ORPO's without the last
position). `route(trainer)` sets, on that trainer instance only, a concatenated_forward that
returns the same from one lmkernels.fused_linear_cross_entropy(reduction="none") call (plus one
more, differentiable, for ORPO's prompt + completion cross entropy), the mean logits from
lmkernels.losses.mean_logits (no pass over the logits), in place of each half's logits a
one-element tensor holding their mean: what the trainer reads of them (`.detach().mean()`). It
runs inside the model's wrapped forward (trl.REDIRECT with a callable), so DDP, FSDP2 and
ZeRO-3 see the head where they expect it.

Kept, with the reason: encoder-decoder models, MoE auxiliary losses (output_router_logits),
"flce" not patched, a lm_head the fused loss cannot compute, trl_head="trl".
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from lmkernels.integrations import peft as lk_peft
from lmkernels.integrations.lm_head_loss import _fsdp_call, lm_head_loss, lm_head_token_stats
from lmkernels.integrations.transformers.record import RECORD
from lmkernels.integrations.transformers.replacements import mark
from lmkernels.integrations.trl_distill import logit_scale
from lmkernels.losses import logps as losses_logps

_ATTR = "_lmkernels_concatenated_forward"
KINDS = {
    "trl.experimental.cpo.cpo_trainer.CPOTrainer": "cpo",
    "trl.experimental.orpo.orpo_trainer.ORPOTrainer": "orpo",
}


def kind(trainer: object) -> str | None:
    names = {c.__module__ + "." + c.__qualname__ for c in type(trainer).__mro__}
    return next((k for n, k in KINDS.items() if n in names), None)


def keep_reason(trainer: Any, model: nn.Module) -> str:
    patch = vars(model).get(RECORD)
    if patch is None or "flce" not in patch.report.patched_ops():
        return "flce is not patched on the model"
    if patch.hints.get("prefer") == "trl":
        return "trl_head='trl'"
    if getattr(trainer, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    if getattr(trainer, "aux_loss_enabled", False):
        return "an MoE auxiliary loss (output_router_logits)"
    causal_lm: Any = model  # a transformers causal LM
    problem = lk_peft.head_problem(causal_lm.get_output_embeddings())
    return problem or ""


def route(trainer: Any) -> str:
    """Run `trainer`'s (a CPOTrainer or ORPOTrainer) concatenated_forward on lmkernels; returns
    "" or why not."""
    which = kind(trainer)
    model = lk_peft.inner_model(trainer.accelerator.unwrap_model(trainer.model))
    why = keep_reason(trainer, model)
    if why or _ATTR in vars(trainer):
        return why
    backend = vars(model)[RECORD].flce_backend
    original = trainer.concatenated_forward

    @mark
    @functools.wraps(original)
    def concatenated_forward(model_: nn.Module, batch: dict[str, Any]) -> Any:
        from lmkernels.integrations.trl import REDIRECT

        padding = trainer.pad_token_id if which == "cpo" else trainer.padding_value
        cat = trainer.concatenated_inputs(
            batch, is_encoder_decoder=False, padding_value=padding, device=trainer.accelerator.device
        )
        n_chosen = batch["chosen_labels"].shape[0]

        def heads(self: Any, kwargs: dict[str, Any]) -> tuple[torch.Tensor, ...]:
            return _heads(self, trainer, which, cat, n_chosen, backend)

        return model_(
            cat["concatenated_input_ids"],
            attention_mask=cat["concatenated_attention_mask"],
            use_cache=False,
            **{REDIRECT: heads},
        )

    setattr(trainer, _ATTR, original)
    trainer.concatenated_forward = concatenated_forward
    return ""


def unroute(trainer: Any) -> None:
    if _ATTR in vars(trainer):
        del trainer.concatenated_forward
        delattr(trainer, _ATTR)


def _mean(lm_head: nn.Module, hidden: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    def fn(head: nn.Module, h: torch.Tensor) -> torch.Tensor:
        h, w, b = lk_peft.head_parts(head, h)
        if scale != 1.0:
            h, b = h * scale, None if b is None else b * scale
        return losses_logps.mean_logits(h.to(w.dtype), w, b, softcap)

    with torch.no_grad():
        return _fsdp_call(lm_head, fn, hidden)


def _heads(
    self: Any,
    trainer: Any,
    which: str | None,
    cat: dict[str, torch.Tensor],
    n_chosen: int,
    backend: str | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen_logps, rejected_logps, chosen "logits", rejected "logits", nll_loss), as TRL's
    concatenated_forward returns them, from the backbone's hidden states and lmkernels' head."""
    ids, mask = cat["concatenated_input_ids"], cat["concatenated_attention_mask"]
    hidden = self.base_model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    lm_head = self.get_output_embeddings()
    config = self.config.get_text_config()
    softcap = getattr(config, "final_logit_softcapping", None)
    scale = logit_scale(self.config)
    labels = cat["concatenated_labels"]
    targets = labels[:, 1:]
    stats = lm_head_token_stats(
        lm_head, hidden[:, :-1], targets, scale=scale, softcap=softcap, backend=backend
    )
    counted = targets != -100
    logps = -(stats.nll * counted).sum(-1)
    average = which == "orpo" or trainer.loss_type in ("ipo", "simpo")
    if average:
        logps = logps / counted.sum(-1)
    if which == "orpo":  # the chosen rows' cross entropy over prompt + completion
        nll_labels = torch.where(mask == 1, ids, -100)[:n_chosen]
        nll = lm_head_loss(
            lm_head,
            hidden[:n_chosen],
            nll_labels,
            softcap=softcap,
            logit_scale=None if scale == 1.0 else scale,
            backend=backend,
        )
        positions = hidden[:, :-1]  # ORPO's logits metric: every position but the last
    else:
        if trainer.cpo_alpha == 0:
            nll = torch.tensor(0.0, device=hidden.device)
        else:  # nn.CrossEntropyLoss over the chosen rows' completion labels (shifted)
            chosen = counted[:n_chosen]
            nll = (stats.nll[:n_chosen] * chosen).sum() / chosen.sum()
        positions = hidden
    means = _mean(lm_head, positions, scale, softcap)
    chosen_logits, rejected_logits = (m.mean().reshape(1) for m in (means[:n_chosen], means[n_chosen:]))
    return logps[:n_chosen], logps[n_chosen:], chosen_logits, rejected_logits, nll
