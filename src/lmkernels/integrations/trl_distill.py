"""TRL's distillation trainers on lmkernels.fused_linear_distillation (or kept, saying why).

- GKDTrainer (trl.experimental.gkd, TRL 1.16) computes its loss from both models' full logits:
  `generalized_jsd_loss(student_logits, teacher_logits, labels, beta)` at temperature 1 (its
  `temperature` only samples the on-policy generations), sum over the labelled tokens divided by
  their count (or by num_items_in_batch). `route_gkd(trainer)` sets, on that trainer instance
  only, a compute_loss that runs the same divergence through both lm_heads with
  fused_linear_distillation(divergence="jsd", beta=trainer.beta) (its beta 0 / 1 special cases
  are GKD's), no logits built. The student runs through its wrapped forward (DDP, accelerate's
  autocast), which lmkernels' patched forward answers (trl.REDIRECT with a callable), as TRL's
  DistillationTrainer does with its _forward_redirection. compute_loss(return_outputs=True)
  (evaluation with logits) stays TRL's.
- DistillationTrainer (trl, TRL 1.16) computes its loss with its own chunked kernel,
  `trl.trainer.distillation_trainer._chunked_divergence_loss` (generalized JSD at the trainer's
  temperature, logit scale and softcap per model, mask, num_items_in_batch; plus the student's
  entropy for its metric). `route_distillation(trainer)` registers the trainer's student head: a
  wrapper of that module function (installed once, transparent for every student not
  registered) runs the registered ones on fused_linear_distillation, the entropy from one more
  lmkernels.fused_linear_cross_entropy forward (no gradient).

Kept, with the reason: a final logit softcap (Gemma 2; the distillation op has none), DeepSpeed
ZeRO-3 (the partitioned heads), "flce" not patched on the student, a lm_head PEFT adapts (TRL
refuses it too for DistillationTrainer).
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

import lmkernels
from lmkernels.integrations import peft as lk_peft
from lmkernels.integrations.lm_head_loss import _any_dtensor, _flce_dtype
from lmkernels.integrations.transformers.record import RECORD
from lmkernels.integrations.transformers.replacements import mark

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

_GKD_ATTR = "_lmkernels_gkd_compute_loss"


def logit_scale(config: Any) -> float:
    """The multiplier of a model's logits, read from its text config as TRL reads it."""
    config = config.get_text_config()
    scale = getattr(config, "logit_scale", None)
    if scale is None:
        scale = getattr(config, "output_multiplier", None)
    if scale is None:
        scale = getattr(config, "lm_head_multiplier", None)
    if scale is None and getattr(config, "logits_scaling", None) is not None:
        s = config.logits_scaling
        scale = s if config.model_type == "hyperclovax" else 1 / s
    return 1.0 if scale is None else float(scale)


def _softcap(model: Any) -> float | None:
    return getattr(model.config.get_text_config(), "final_logit_softcapping", None)


def _distill_backend(flce_backend: str | None) -> str | None:
    """The distillation op's backend of the same name as the FLCE one, if it has one."""
    if flce_backend is None:
        return None
    names = {i.backend for i in lmkernels.impls("fused_linear_distillation")}
    return flce_backend if flce_backend in names else None


def keep_reason(student: nn.Module, teacher: nn.Module | None) -> str:
    """Why a distillation trainer keeps TRL's loss ("" if lmkernels can run it)."""
    from lmkernels.integrations.trl import _zero3

    patch = vars(student).get(RECORD)
    if patch is None or "flce" not in patch.report.patched_ops():
        return "flce is not patched on the student"
    if patch.hints.get("prefer") == "trl":
        return "trl_head='trl'"
    if teacher is None:
        return "no teacher model"
    if _softcap(student) is not None or _softcap(teacher) is not None:
        return "a final logit softcap (fused_linear_distillation has none)"
    if _zero3():
        return "DeepSpeed ZeRO-3: TRL gathers the partitioned lm_heads itself"
    for name, model in (("student", student), ("teacher", teacher)):
        causal_lm: Any = model  # a transformers causal LM
        problem = lk_peft.head_problem(causal_lm.get_output_embeddings())
        if problem:
            return f"{name}: {problem}"
        if lk_peft.head_describe(causal_lm.get_output_embeddings()):
            return f"{name}: a PEFT-adapted lm_head"
    return ""


def _unwrap(trainer: Any, model: nn.Module) -> Any:
    """The transformers causal LM inside the trainer's (accelerate's, PEFT's) wrappers."""
    return lk_peft.inner_model(trainer.accelerator.unwrap_model(model))


def _cast(
    dtype: torch.dtype, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    return hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


# --- GKDTrainer --------------------------------------------------------------------------------------


def route_gkd(trainer: Any) -> str:
    """Run `trainer`'s (a GKDTrainer) loss on fused_linear_distillation; returns "" or why not."""
    student = _unwrap(trainer, trainer.model)
    teacher = _unwrap(trainer, trainer.teacher_model)
    why = keep_reason(student, teacher)
    if why or _GKD_ATTR in vars(trainer):
        return why
    backend = _distill_backend(vars(student)[RECORD].flce_backend)
    original = trainer.compute_loss

    @mark
    @functools.wraps(original)
    def compute_loss(
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        if return_outputs:  # the logits are asked for (evaluation): TRL's own path
            return original(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        from lmkernels.integrations.trl import REDIRECT

        def loss(self: nn.Module, kwargs: dict[str, Any]) -> torch.Tensor:
            return _gkd_loss(self, teacher, inputs, trainer.beta, num_items_in_batch, backend)

        return model(
            input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], **{REDIRECT: loss}
        )

    setattr(trainer, _GKD_ATTR, original)
    trainer.compute_loss = compute_loss
    return ""


def unroute_gkd(trainer: Any) -> None:
    if _GKD_ATTR in vars(trainer):
        del trainer.compute_loss
        delattr(trainer, _GKD_ATTR)


def _gkd_loss(
    student: Any,
    teacher: Any,
    inputs: dict[str, Any],
    beta: float,
    num_items_in_batch: torch.Tensor | int | None,
    backend: str | None,
) -> torch.Tensor:
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    hs = student.base_model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state[:, :-1]
    with torch.no_grad():
        teacher.eval()
        ht = teacher.base_model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state[:, :-1]
    labels = inputs["labels"][:, 1:].to(hs.device)
    loss = _distill(student, teacher, hs, ht, labels, beta, 1.0, num_items_in_batch, backend)
    return loss


def _distill(
    student: Any,
    teacher: Any,
    hs: torch.Tensor,
    ht: torch.Tensor,
    target: torch.Tensor,
    beta: float,
    temperature: float,
    num_items_in_batch: torch.Tensor | int | None,
    backend: str | None,
) -> torch.Tensor:
    """sum / num_items_in_batch, or mean over the counted tokens, of the generalized JSD of both
    models' logits (each model's logit scale applied), no logits built."""
    s_head, t_head = student.get_output_embeddings(), teacher.get_output_embeddings()
    hs, ws, bs = lk_peft.head_parts(s_head, hs)
    wt, bt = t_head.weight.detach(), None if t_head.bias is None else t_head.bias.detach()
    hs = hs.to(ws.device) * logit_scale(student.config)
    bs = None if bs is None else bs * logit_scale(student.config)
    ht = ht.to(wt.device).detach() * logit_scale(teacher.config)
    bt = None if bt is None else bt * logit_scale(teacher.config)
    device_type = hs.device.type
    s_dtype, t_dtype = _flce_dtype(ws, device_type), _flce_dtype(wt, device_type)
    hs, ws, bs = _cast(s_dtype, hs, ws, bs)
    ht, wt, bt = _cast(t_dtype, ht, wt, bt)
    with torch.autocast(device_type, enabled=False):
        loss = lmkernels.fused_linear_distillation(
            hs,
            ws,
            ht,
            wt,
            target.to(hs.device),
            student_bias=bs,
            teacher_bias=bt,
            divergence="jsd",
            beta=float(beta),
            temperature=float(temperature),
            reduction="mean" if num_items_in_batch is None else "sum",
            backend=backend,
        )
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


# --- DistillationTrainer ----------------------------------------------------------------------------

# id(student lm_head weight) -> (weakref to it, weakref to the student model, the distillation
# backend, the FLCE backend)
_ROUTED: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[nn.Module], str | None, str | None]] = {}


def route_distillation(trainer: Any) -> str:
    """Run `trainer`'s (a DistillationTrainer) chunked divergence on fused_linear_distillation;
    returns "" or why not."""
    student = _unwrap(trainer, trainer.model)
    teacher = None if trainer.teacher_model is None else _unwrap(trainer, trainer.teacher_model)
    why = keep_reason(student, teacher)
    if why:
        return why
    module: Any = sys.modules.get("trl.trainer.distillation_trainer")  # TRL's module (or None)
    fn = getattr(module, "_chunked_divergence_loss", None)
    if fn is None:
        return "this TRL has no trl.trainer.distillation_trainer._chunked_divergence_loss"
    if not getattr(fn, "_lmkernels_patch", False):
        module._chunked_divergence_loss = _dispatcher(fn)
    weight = student.get_output_embeddings().weight
    backend = _distill_backend(vars(student)[RECORD].flce_backend)
    flce = vars(student)[RECORD].flce_backend
    _ROUTED[id(weight)] = (weakref.ref(weight), weakref.ref(student), backend, flce)
    weakref.finalize(weight, _ROUTED.pop, id(weight), None)
    return ""


def unroute_distillation(trainer: Any) -> None:
    student = _unwrap(trainer, trainer.model)
    _ROUTED.pop(id(student.get_output_embeddings().weight), None)


def _dispatcher(original: Callable[..., Any]) -> Callable[..., Any]:
    @mark
    @functools.wraps(original)
    def chunked_divergence_loss(
        student_hidden_states: torch.Tensor,
        teacher_hidden_states: torch.Tensor,
        student_lm_head_weight: torch.Tensor,
        teacher_lm_head_weight: torch.Tensor,
        completion_mask: torch.Tensor,
        beta: float,
        num_items_in_batch: torch.Tensor | int | None = None,
        student_lm_head_bias: torch.Tensor | None = None,
        teacher_lm_head_bias: torch.Tensor | None = None,
        student_logit_scale: float = 1.0,
        teacher_logit_scale: float = 1.0,
        student_final_logit_softcapping: float | None = None,
        teacher_final_logit_softcapping: float | None = None,
        temperature: float = 1.0,
    ) -> Any:
        entry = _ROUTED.get(id(student_lm_head_weight))
        ours = (
            entry is not None
            and entry[0]() is student_lm_head_weight
            and student_final_logit_softcapping is None
            and teacher_final_logit_softcapping is None
        )
        if not ours:
            return original(
                student_hidden_states,
                teacher_hidden_states,
                student_lm_head_weight,
                teacher_lm_head_weight,
                completion_mask,
                beta,
                num_items_in_batch=num_items_in_batch,
                student_lm_head_bias=student_lm_head_bias,
                teacher_lm_head_bias=teacher_lm_head_bias,
                student_logit_scale=student_logit_scale,
                teacher_logit_scale=teacher_logit_scale,
                student_final_logit_softcapping=student_final_logit_softcapping,
                teacher_final_logit_softcapping=teacher_final_logit_softcapping,
                temperature=temperature,
            )
        assert entry is not None  # (ours)
        _, _, backend, flce = entry
        return _chunked(
            student_hidden_states,
            teacher_hidden_states,
            student_lm_head_weight,
            teacher_lm_head_weight,
            completion_mask,
            beta,
            num_items_in_batch,
            student_lm_head_bias,
            teacher_lm_head_bias,
            student_logit_scale,
            teacher_logit_scale,
            temperature,
            backend,
            flce,
        )

    return chunked_divergence_loss


def _full(t: torch.Tensor) -> torch.Tensor:
    return cast("DTensor", t).full_tensor() if _any_dtensor(t) else t


def _chunked(
    hs: torch.Tensor,
    ht: torch.Tensor,
    ws: torch.Tensor,
    wt: torch.Tensor,
    completion_mask: torch.Tensor,
    beta: float,
    num_items: torch.Tensor | int | None,
    bs: torch.Tensor | None,
    bt: torch.Tensor | None,
    s_scale: float,
    t_scale: float,
    temperature: float,
    backend: str | None,
    flce: str | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL's _chunked_divergence_loss (loss, student entropy sum, valid count) on lmkernels."""
    ws, bs = _full(ws), None if bs is None else _full(bs)
    wt, bt = _full(wt), None if bt is None else _full(bt)
    valid = completion_mask.reshape(-1) != 0
    target = torch.where(valid, 0, -100).view(completion_mask.shape).to(hs.device)
    h = hs * s_scale
    b = None if bs is None else bs * s_scale
    device_type = h.device.type
    s_dtype, t_dtype = _flce_dtype(ws, device_type), _flce_dtype(wt, device_type)
    h, w, b = _cast(s_dtype, h, ws, b)
    ht_, wt_, bt_ = _cast(
        t_dtype, ht.detach() * t_scale, wt.detach(), None if bt is None else bt.detach() * t_scale
    )
    with torch.autocast(device_type, enabled=False):
        loss = lmkernels.fused_linear_distillation(
            h,
            w,
            ht_,
            wt_,
            target,
            student_bias=b,
            teacher_bias=bt_,
            divergence="jsd",
            beta=float(beta),
            temperature=float(temperature),
            reduction="mean" if num_items is None else "sum",
            backend=backend,
        )
        with torch.no_grad():  # the student's entropy (TRL's metric): one more forward, no gradient
            _, _, entropy, _ = lmkernels.fused_linear_cross_entropy(
                h.detach() / temperature,
                w.detach(),
                target,
                bias=None if b is None else b.detach() / temperature,
                reduction="none",
                return_stats=True,
                backend=flce,
            )
    if num_items is not None:
        if torch.is_tensor(num_items):
            num_items = num_items.to(loss.device)
        loss = loss / num_items
    entropy_sum = torch.where(target != -100, entropy, 0.0).sum()
    return loss, entropy_sum, valid.sum()
