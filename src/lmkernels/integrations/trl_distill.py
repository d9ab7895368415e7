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

import torch
from torch import nn

import lmkernels
from lmkernels.integrations import peft as lk_peft
from lmkernels.integrations.lm_head_loss import _flce_dtype
from lmkernels.integrations.transformers.record import RECORD

_GKD_ATTR = "_lmkernels_gkd_compute_loss"


def logit_scale(config) -> float:
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


def _softcap(model) -> float | None:
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
        problem = lk_peft.head_problem(model.get_output_embeddings())
        if problem:
            return f"{name}: {problem}"
        if lk_peft.head_describe(model.get_output_embeddings()):
            return f"{name}: a PEFT-adapted lm_head"
    return ""


def _unwrap(trainer, model):
    return lk_peft.inner_model(trainer.accelerator.unwrap_model(model))


def _cast(dtype, *tensors):
    return tuple(None if t is None else t.to(dtype) for t in tensors)


# --- GKDTrainer --------------------------------------------------------------------------------------


def route_gkd(trainer) -> str:
    """Run `trainer`'s (a GKDTrainer) loss on fused_linear_distillation; returns "" or why not."""
    student = _unwrap(trainer, trainer.model)
    teacher = _unwrap(trainer, trainer.teacher_model)
    why = keep_reason(student, teacher)
    if why or _GKD_ATTR in vars(trainer):
        return why
    backend = _distill_backend(vars(student)[RECORD].flce_backend)
    original = trainer.compute_loss

    @functools.wraps(original)
    def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:  # the logits are asked for (evaluation): TRL's own path
            return original(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        from lmkernels.integrations.trl import REDIRECT

        def loss(self, kwargs):
            return _gkd_loss(self, teacher, inputs, trainer.beta, num_items_in_batch, backend)

        return model(
            input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], **{REDIRECT: loss}
        )

    compute_loss._lmkernels_patch = True
    setattr(trainer, _GKD_ATTR, original)
    trainer.compute_loss = compute_loss
    return ""


def unroute_gkd(trainer) -> None:
    if _GKD_ATTR in vars(trainer):
        del trainer.compute_loss
        delattr(trainer, _GKD_ATTR)


def _gkd_loss(student, teacher, inputs, beta, num_items_in_batch, backend):
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    hs = student.base_model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state[:, :-1]
    with torch.no_grad():
        teacher.eval()
        ht = teacher.base_model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state[:, :-1]
    labels = inputs["labels"][:, 1:].to(hs.device)
    loss = _distill(student, teacher, hs, ht, labels, beta, 1.0, num_items_in_batch, backend)
    return loss


def _distill(student, teacher, hs, ht, target, beta, temperature, num_items_in_batch, backend):
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

# id(student lm_head weight) -> (weakref to it, the student model, the teacher model, backend)
_ROUTED: dict[int, tuple] = {}


def route_distillation(trainer) -> str:
    """Run `trainer`'s (a DistillationTrainer) chunked divergence on fused_linear_distillation;
    returns "" or why not."""
    student = _unwrap(trainer, trainer.model)
    teacher = None if trainer.teacher_model is None else _unwrap(trainer, trainer.teacher_model)
    why = keep_reason(student, teacher)
    if why:
        return why
    module = sys.modules.get("trl.trainer.distillation_trainer")
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


def unroute_distillation(trainer) -> None:
    student = _unwrap(trainer, trainer.model)
    _ROUTED.pop(id(student.get_output_embeddings().weight), None)


def _dispatcher(original):
    @functools.wraps(original)
    def chunked_divergence_loss(
        student_hidden_states,
        teacher_hidden_states,
        student_lm_head_weight,
        teacher_lm_head_weight,
        completion_mask,
        beta,
        num_items_in_batch=None,
        student_lm_head_bias=None,
        teacher_lm_head_bias=None,
        student_logit_scale=1.0,
        teacher_logit_scale=1.0,
        student_final_logit_softcapping=None,
        teacher_final_logit_softcapping=None,
        temperature=1.0,
    ):
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

    chunked_divergence_loss._lmkernels_patch = True
    return chunked_divergence_loss


def _full(t):
    return t.full_tensor() if t is not None and type(t).__name__ == "DTensor" else t


def _chunked(
    hs, ht, ws, wt, completion_mask, beta, num_items, bs, bt, s_scale, t_scale, temperature, backend, flce
):
    """TRL's _chunked_divergence_loss (loss, student entropy sum, valid count) on lmkernels."""
    ws, bs, wt, bt = _full(ws), _full(bs), _full(wt), _full(bt)
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
