"""TRL's fused LM head, run on lmkernels' fused loss (or kept, saying why).

TRL 1.x trainers (SFT, DPO, GRPO, RLOO, KTO) never let the model compute its loss: after
building the trainer they wrap the policy's forward with `trl.trainer.utils.add_fused_lm_head`,
and call `model(..., fused_lm_head=True)`, which runs the backbone and TRL's own chunked
log-prob kernel on lm_head's weight, returning per-token log-probs (and entropy, token accuracy,
... as the trainer asks) in a `FusedCausalLMOutput`. A model patched by lmkernels would train
through TRL's head, not lmkernels', without a word.

`route(model)` finds TRL's head on a patched model (by its code object, reading what TRL bound
into it: the outputs asked for, temperature, fp32 cast, softcap, logit scale) and, where
lmkernels' fused loss can give the trainer everything it reads, sets the model's forward to one
that answers `fused_lm_head=True` with one `lmkernels.fused_linear_cross_entropy(...,
reduction="none", return_stats=True)` call (log-probs with their gradient, entropy and top-1
without: TRL's metrics). Every other call goes to the forward TRL wrapped. The choice is made
once per model and logged once (logger "lmkernels": INFO when lmkernels runs the loss, WARNING
when TRL's head is kept, with the reason). TRL's head is kept where lmkernels cannot give what
the trainer needs:

- outputs other than log-probs, entropy and top-1 (DPO and KTO read mean_logits, WPO
  log_sum_sq_probs);
- an entropy that needs a gradient (GRPO / RLOO with entropy_coef != 0 or adaptive entropy), or
  may (a trainer whose config lmkernels was not shown: see LmkernelsCallback);
- DeepSpeed ZeRO-3 (TRL gathers the partitioned head itself), a lm_head the fused loss cannot
  compute (peft.py), "flce" not patched on the model, or `prefer="trl"`.

The entropy lmkernels returns has no gradient; should a loss differentiate it anyway, the
backward raises (never a silently missing term).

When it runs: `LmkernelsCallback` routes at on_train_begin with the trainer's config (GRPO's
entropy_coef); a patched model also routes itself at its first `fused_lm_head=True` call (a
forward pre-hook patching.py installs), from what the model alone shows: the SFT head
(log-probs, entropy, top-1) routes; heads whose entropy may need a gradient are kept.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
import types

import torch
import torch.nn.functional as F
from torch import nn

from lmkernels.integrations import peft as lk_peft
from lmkernels.integrations.lm_head_loss import lm_head_token_stats
from lmkernels.registry import LMKernelsError

logger = logging.getLogger("lmkernels")

OURS = frozenset({"log_probs", "entropy", "is_top1"})  # what lmkernels' fused head returns
PREFER = ("auto", "lmkernels", "trl")
# "auto": lmkernels wherever it can give the trainer what it reads. benchmarks/trl_head.py
# measures one SFT step both ways on a GPU; if TRL's head wins somewhere, that goes here.
AUTO = "lmkernels"
# Set by a call the pre-hook redirected (see _pre_hook): the forward TRL wrapped receives it and
# hands the call to the model's new forward.
REDIRECT = "_lmkernels_trl_redirect"


@dataclasses.dataclass
class TrlHead:
    """What `add_fused_lm_head` bound into the forward it set on a model."""

    forward: types.MethodType  # TRL's forward, as set on the model
    wrapped: object  # the forward TRL wraps (called for every call without fused_lm_head)
    outputs: tuple[str, ...]
    temperature: float
    fp32: bool  # cast_lm_head_to_fp32
    softcap: float | None
    logit_scale: float
    backbone_attr: str


@dataclasses.dataclass
class Decision:
    ours: bool
    why: str  # why TRL's head is kept ("" when lmkernels runs it)
    message: str  # the line logged


_FIELDS = (
    "original_forward",
    "outputs",
    "temperature",
    "cast_lm_head_to_fp32",
    "final_logit_softcapping",
    "logit_scale",
    "backbone_attr",
)


def _fused_code():
    """The code object of TRL's `_fused_forward` (None without TRL, or a TRL without it)."""
    utils = sys.modules.get("trl.trainer.utils")  # only a loaded TRL can have wrapped a model
    add = getattr(utils, "add_fused_lm_head", None)
    code = getattr(add, "__code__", None)
    if code is None:
        return None
    return next(
        (c for c in code.co_consts if isinstance(c, types.CodeType) and c.co_name == "_fused_forward"), None
    )


def trl_head(model: nn.Module, forward=None) -> TrlHead | str | None:
    """TRL's fused head on `model` (an instance forward set by add_fused_lm_head; or `forward`,
    such a forward); a string saying why it cannot be read (another TRL's form); None if none."""
    forward = vars(model).get("forward") if forward is None else forward
    fn = getattr(forward, "__func__", None)
    code = _fused_code()
    if fn is None or code is None or fn.__code__ is not code:
        return None
    cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
    missing = [f for f in _FIELDS if f not in cells]
    if missing:
        return f"TRL's fused head binds no {missing} (a TRL version lmkernels does not know)"
    return TrlHead(
        forward=forward,
        wrapped=cells["original_forward"],
        outputs=tuple(cells["outputs"]),
        temperature=float(cells["temperature"]),
        fp32=bool(cells["cast_lm_head_to_fp32"]),
        softcap=cells["final_logit_softcapping"],
        logit_scale=float(cells["logit_scale"]),
        backbone_attr=cells["backbone_attr"],
    )


def entropy_grad(args) -> bool | None:
    """Whether a trainer with these training arguments differentiates the entropy TRL's head
    returns: GRPO / RLOO's entropy bonus (entropy_coef != 0, or adaptive). None: cannot tell."""
    if args is None:
        return None
    if hasattr(args, "entropy_coef") or hasattr(args, "use_adaptive_entropy"):
        return bool(getattr(args, "entropy_coef", 0.0)) or bool(getattr(args, "use_adaptive_entropy", False))
    return False  # a config without an entropy term (SFT, DPO, ...): the entropy is a metric


def _zero3() -> bool:
    if "deepspeed" not in sys.modules:
        return False
    try:
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    except ImportError:
        return False
    return bool(is_deepspeed_zero3_enabled())


def _keep_reason(model: nn.Module, head: TrlHead, patch) -> str:
    """Why TRL's head must stay on `model` ("" if lmkernels can run it)."""
    hints = patch.hints
    prefer = hints.get("prefer", "auto")
    if (AUTO if prefer == "auto" else prefer) == "trl":
        return f"trl_head={prefer!r}" if prefer != "auto" else "trl_head='auto' picks TRL's head (AUTO)"
    if "flce" not in patch.report.patched_ops():
        failed = [f.detail for f in patch.report.findings if f.op == "flce"]
        return "flce is not patched on this model" + (f" ({failed[0]})" if failed else " (ops excluded it)")
    extra = sorted(set(head.outputs) - OURS)
    if extra:
        return (
            f"the trainer reads {', '.join(extra)} from TRL's head (DPO / KTO metrics, WPO weights); "
            f"lmkernels' fused loss gives log-probs, entropy and top-1 only"
        )
    if "entropy" in head.outputs:
        grad = hints.get("entropy_grad")
        if grad is None and "is_top1" not in head.outputs:  # not the SFT head: GRPO, RLOO, ...
            return (
                "the trainer may differentiate the entropy (GRPO / RLOO entropy_coef) and its config was "
                "not shown to lmkernels: pass callbacks=[lk_hf.LmkernelsCallback()] to the trainer"
            )
        if grad:
            return "the entropy bonus (entropy_coef / use_adaptive_entropy) needs the entropy's gradient"
    if _zero3():
        return "DeepSpeed ZeRO-3: TRL's head gathers the partitioned lm_head itself"
    problem = lk_peft.head_problem(model.get_output_embeddings())
    if problem:
        return problem
    return ""


def _describe(head: TrlHead) -> str:
    names = {"log_probs": "log-probs", "entropy": "entropy", "is_top1": "token accuracy"}
    parts = [names.get(o, o) for o in head.outputs]
    if head.temperature != 1.0:
        parts.append(f"temperature {head.temperature:g}")
    if head.fp32:
        parts.append("fp32 head")
    return ", ".join(parts)


def route(model: nn.Module, log: bool = True, trl_forward=None, plain=None) -> Decision | None:
    """Run TRL's fused head on `model` through lmkernels, or keep it (see the module docstring).

    `model`: the transformers model TRL wrapped (PEFT wrappers are seen through), patched by
    lk_hf.apply(). Returns None when the model carries no TRL head (none added, or already
    routed); otherwise the decision, logged once unless log=False (the callback logs its own).
    Either way the model's forward becomes lmkernels' wrapper of TRL's (patch.saved: revert()
    restores TRL's), so the decision is made once. `trl_forward` / `plain`: apply() on a model
    TRL had already wrapped passes TRL's forward (no longer on the model) and the patched forward
    that now stands for the one TRL wraps.
    """
    from lmkernels.integrations.transformers import patching

    model = lk_peft.inner_model(model)
    patch = vars(model).get(patching.RECORD)
    trl_forward = vars(model).get("forward") if trl_forward is None else trl_forward
    head = trl_head(model, trl_forward)
    if patch is None or head is None:
        return None
    label = type(model).__name__
    if isinstance(head, str):
        decision = Decision(False, head, "")
    else:
        why = _keep_reason(model, head, patch)
        decision = Decision(not why, why, "")
    forward = _wrapper(model, head if decision.ours else None, trl_forward, plain, patch.flce_backend)
    patch.saved.append(patching.Saved.replace(model, "forward", types.MethodType(forward, model)))
    if decision.ours:
        backend = patch.flce_backend or "auto"
        decision.message = (
            f"lmkernels: {label}: TRL's fused LM head runs on lmkernels.fused_linear_cross_entropy "
            f"(backend {backend}): {_describe(head)}"
        )
    else:
        decision.message = f"lmkernels: {label}: TRL's fused LM head kept ({decision.why})"
    patch.trl_decision = decision
    if log:
        quiet = not decision.ours and patch.hints.get("prefer") == "trl"
        logger.log(logging.INFO if decision.ours or quiet else logging.WARNING, decision.message)
    return decision


def _pre_hook(module: nn.Module, args, kwargs):
    """A patched model's forward pre-hook: its first `fused_lm_head=True` call decides (route).
    When lmkernels takes over, this call (already bound to TRL's forward) is sent through TRL's
    plain path to the forward TRL wraps, the patched one, which hands it to the new forward
    (REDIRECT, see redirected())."""
    if not kwargs.get("fused_lm_head") or _fused_code() is None:
        return None
    decision = route(module)
    if decision is None or not decision.ours:
        return None
    return args, {**kwargs, "fused_lm_head": False, REDIRECT: True}


def redirected(self: nn.Module, kwargs: dict):
    """(True, output) if the pre-hook redirected this call to `self.forward(fused_lm_head=True)`."""
    if kwargs.pop(REDIRECT, False):
        return True, self.forward(fused_lm_head=True, **kwargs)
    return False, None


def _wrapper(model: nn.Module, head: TrlHead | None, trl_forward, plain, backend: str | None):
    """The forward set on a model with TRL's head: `fused_lm_head=True` runs lmkernels' fused
    head (`head` given) or TRL's; every other call goes to `plain` (default: TRL's forward,
    which calls the forward it wraps)."""

    @functools.wraps(type(model).forward)  # keeps the signature: generate() and the Trainer inspect it
    def forward(self, *args, fused_lm_head=False, **kwargs):
        if fused_lm_head and head is not None:
            labels, shift = kwargs.pop("labels", None), kwargs.pop("shift_labels", None)
            num_items = kwargs.pop("num_items_in_batch", None)
            return fused_output(self, head, backend, args, kwargs, labels, shift, num_items)
        if fused_lm_head or plain is None:
            return trl_forward(*args, fused_lm_head=fused_lm_head, **kwargs)
        return plain(*args, **kwargs)

    forward._lmkernels_patch = True
    return forward


class _EntropyWithoutGradient(torch.autograd.Function):
    """The entropy as a value whose gradient is refused: a loss that differentiates it raises."""

    @staticmethod
    def forward(ctx, entropy, anchor):
        return entropy.clone()

    @staticmethod
    def backward(ctx, grad):
        raise LMKernelsError(
            "entropy: a loss differentiates the per-token entropy of lmkernels' fused LM head, which has "
            "no gradient (GRPO / RLOO entropy_coef?); pass callbacks=[lk_hf.LmkernelsCallback()] so that "
            "TRL's head is kept for that trainer, or LmkernelsCallback(trl_head='trl')"
        )


def _guard(entropy: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and anchor.requires_grad:
        return _EntropyWithoutGradient.apply(entropy, anchor)
    return entropy


def fused_output(self, head: TrlHead, backend, args, kwargs, labels, shift_labels, num_items_in_batch):
    """TRL's FusedCausalLMOutput for `model(..., fused_lm_head=True)`, from lmkernels' fused loss:
    the same fields, shapes and zeros on ignored positions as TRL's head."""
    from trl.trainer.utils import FusedCausalLMOutput

    kwargs["use_cache"] = False
    text_config = self.config.get_text_config()
    if getattr(text_config, "output_router_logits", False):  # MoE: as the model's own forward
        kwargs.setdefault("output_router_logits", True)
    backbone = getattr(self, head.backbone_attr)(*args, **kwargs)
    if shift_labels is None:
        if labels is None:
            raise LMKernelsError("labels: model(..., fused_lm_head=True) needs labels or shift_labels")
        targets = F.pad(labels, (0, 1), value=-100)[..., 1:]  # last position: ignored, cut below
    else:
        targets = shift_labels
    lm_head = self.get_output_embeddings()
    device = next(lm_head.parameters()).device  # (device_map: the backbone may end elsewhere)
    hidden, targets = backbone.last_hidden_state.to(device), targets.to(device)
    # TRL's logits: softcap(logit_scale * z) / T == softcap_{c/T}((logit_scale / T) * z)
    scale = head.logit_scale / head.temperature
    softcap = None if head.softcap is None else head.softcap / head.temperature
    nll, entropy, is_top1 = lm_head_token_stats(
        lm_head, hidden, targets, scale=scale, softcap=softcap, fp32=head.fp32, backend=backend
    )
    if shift_labels is None:
        nll, entropy, is_top1, targets = (x[:, :-1] for x in (nll, entropy, is_top1, targets))
    mask = targets != -100
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    loss = nll.sum() / count
    aux_loss = None
    if kwargs.get("output_router_logits"):
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

        experts = getattr(text_config, "num_experts", None) or getattr(text_config, "num_local_experts", None)
        aux_loss = load_balancing_loss_func(
            backbone.router_logits, experts, text_config.num_experts_per_tok, kwargs.get("attention_mask")
        )
        loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss
    return FusedCausalLMOutput(
        loss=loss,
        log_probs=-nll,
        entropy=_guard(entropy, hidden) if "entropy" in head.outputs else None,
        is_top1=is_top1 if "is_top1" in head.outputs else None,
        label_mask=mask,
        aux_loss=aux_loss,
    )
