"""TRL's fused LM head, run on lmkernels' fused loss (or kept, saying why).

TRL 1.x trainers (SFT, DPO, GRPO, RLOO, KTO) never let the model compute its loss: after
building the trainer they wrap the policy's forward (and the reference model's) with
`trl.trainer.utils.add_fused_lm_head`, and call `model(..., fused_lm_head=True)`, which runs the
backbone and TRL's own chunked log-prob kernel on lm_head's weight, returning per-token
log-probs (and entropy, token accuracy, mean logit, log sum p^2, ... as the trainer asks) in a
`FusedCausalLMOutput`. A model patched by lmkernels would train through TRL's head, not
lmkernels', without a word.

`route(model)` finds TRL's head on a patched model (by its code object, also inside accelerate's
mixed-precision wrapper, reading what TRL bound into it: the outputs asked for, temperature,
fp32 cast, softcap, logit scale) and answers `fused_lm_head=True` with one
`lmkernels.fused_linear_cross_entropy(..., reduction="none", return_stats=True)` call: log-probs
and entropy with their gradients (GRPO's entropy bonus), top-1; the mean logit (DPO / KTO
metrics) from lmkernels.flce_mean_logits (no pass over the logits), log sum p^2 (DPO's WPO
weights) from one more FLCE forward without gradient. Every other call goes to the forward TRL
wrapped. The choice is made once per TRL head and logged once (logger "lmkernels": INFO when
lmkernels runs the loss, WARNING when TRL's head is kept, with the reason). TRL's head is kept
where lmkernels cannot give what the trainer needs:

- an output lmkernels does not compute (none in TRL 1.16);
- an entropy that needs a gradient (GRPO with entropy_coef != 0 or adaptive entropy) on an FLCE
  backend without it, or that may need one (a trainer whose config lmkernels was not shown:
  see LmkernelsCallback);
- a lm_head the fused loss cannot compute (peft.py), "flce" not patched on the model, or
  trl_head="trl" (LmkernelsCallback).

Under DeepSpeed ZeRO-3 the head runs as lm_head's forward (lm_head_loss._fsdp_call ->
distributed/zero.call_as_forward), so ZeRO-3's own hooks gather the partitioned weight for it and
for its backward, as TRL's maybe_gather_lm_head_ctx does for TRL's head; under FSDP2 as
lm_head's registered FSDP forward method (or the root's unshard), DTensor weights outside one
gathered with full_tensor() as TRL does.

When it runs: `LmkernelsCallback` routes at on_train_begin with the trainer's config (GRPO's
entropy_coef), the reference model's head too (patched like the policy; its calls run under
no_grad), and the distillation trainers' losses (trl_distill.py); a patched model also routes
itself at its first `fused_lm_head=True` call (a forward pre-hook patching.py installs), from
what the model alone shows: heads whose entropy may need a gradient are kept unless the backend
has it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lmkernels.integrations import peft as lk_peft
from lmkernels.integrations.lm_head_loss import lm_head_token_stats
from lmkernels.integrations.transformers.record import RECORD, Saved
from lmkernels.registry import LMKernelsError

logger = logging.getLogger("lmkernels")

# What lmkernels' fused head returns: every output of TRL 1.16's head (mean_logits: TRL's DPO /
# KTO metrics; log_sum_sq_probs: DPO's WPO weights, one more forward over the head).
OURS = frozenset({"log_probs", "entropy", "is_top1", "mean_logits", "log_sum_sq_probs"})
PREFER = ("auto", "lmkernels", "trl")
# "auto": lmkernels wherever it can give the trainer what it reads, the faster head of the two
# (docs/trainers.md times an SFT step with each, `lmkernels-bench trl-head`).
AUTO = "lmkernels"
# Set by a call the pre-hook redirected (see _pre_hook): the patched forward TRL wraps receives
# it and computes TRL's output with lmkernels (redirected()).
REDIRECT = "_lmkernels_trl_redirect"
_CHAIN = 8  # how many wrappers deep TRL's forward is looked for


@dataclasses.dataclass
class TrlHead:
    """What `add_fused_lm_head` bound into the forward it set on a model."""

    fn: types.FunctionType  # TRL's `_fused_forward` (the one this head was read from)
    forward: types.MethodType  # the same, bound to the model
    top: bool  # TRL's forward is the model's forward itself (else inside another wrapper)
    problem: str = ""  # why it cannot be read (a TRL whose head binds other names)
    wrapped: Callable[..., Any] | None = (
        None  # the forward TRL wraps (called for every call without fused_lm_head)
    )
    outputs: tuple[str, ...] = ()
    temperature: float = 1.0
    fp32: bool = False  # cast_lm_head_to_fp32
    softcap: float | None = None
    logit_scale: float = 1.0
    backbone_attr: str = "base_model"


@dataclasses.dataclass
class Decision:
    ours: bool
    why: str  # why TRL's head is kept ("" when lmkernels runs it)
    message: str  # the line logged
    head: types.FunctionType | None = None  # TRL's `_fused_forward` this decision is about
    trl: TrlHead | None = None  # what lmkernels computes, when it runs the head


_FIELDS = (
    "original_forward",
    "outputs",
    "temperature",
    "cast_lm_head_to_fp32",
    "final_logit_softcapping",
    "logit_scale",
    "backbone_attr",
)


def _fused_code() -> types.CodeType | None:
    """The code object of TRL's `_fused_forward` (None without TRL, or a TRL without it)."""
    utils = sys.modules.get("trl.trainer.utils")  # only a loaded TRL can have wrapped a model
    code = getattr(getattr(utils, "add_fused_lm_head", None), "__code__", None)
    return None if code is None else _inner_code(code)


@functools.lru_cache(maxsize=4)
def _inner_code(code: types.CodeType) -> types.CodeType | None:
    return next(
        (c for c in code.co_consts if isinstance(c, types.CodeType) and c.co_name == "_fused_forward"), None
    )


def _chain(forward: Callable[..., Any]) -> list[Any]:
    """The functions `forward` wraps, outermost first, through functools.wraps' __wrapped__
    (accelerate's mixed-precision wrappers set it: convert_outputs_to_fp32, torch.autocast)."""
    fn: Any = forward
    found: list[Any] = []
    while fn is not None and len(found) < _CHAIN:
        fn = getattr(fn, "__func__", fn)
        found.append(fn)
        fn = getattr(fn, "__wrapped__", None)
    return found


def _ours(forward: object) -> bool:
    return bool(getattr(getattr(forward, "__func__", forward), "_lmkernels_patch", False))


def trl_head(model: nn.Module, forward: Callable[..., Any] | None = None) -> TrlHead | None:
    """TRL's fused head in `model`'s forward (set by add_fused_lm_head, possibly inside
    accelerate's mixed-precision wrappers; or in `forward`, a forward TRL set); None if there is
    none above lmkernels' own. `problem` says why a head could not be read."""
    forward = vars(model).get("forward") if forward is None else forward
    code = _fused_code()
    if forward is None or code is None:
        return None
    chain = _chain(forward)
    # (lmkernels' own wrapper before any TRL head: routed already)
    ours = next((i for i, f in enumerate(chain) if getattr(f, "_lmkernels_patch", False)), len(chain))
    depth = next((i for i, f in enumerate(chain[:ours]) if getattr(f, "__code__", None) is code), None)
    if depth is None:
        return None
    fn = chain[depth]
    found = dict(fn=fn, forward=types.MethodType(fn, model), top=depth == 0)
    cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
    missing = [f for f in _FIELDS if f not in cells]
    if missing:
        return TrlHead(
            **found, problem=f"TRL's fused head binds no {missing} (a TRL lmkernels does not know)"
        )
    return TrlHead(
        **found,
        wrapped=cells["original_forward"],
        outputs=tuple(cells["outputs"]),
        temperature=float(cells["temperature"]),
        fp32=bool(cells["cast_lm_head_to_fp32"]),
        softcap=cells["final_logit_softcapping"],
        logit_scale=float(cells["logit_scale"]),
        backbone_attr=cells["backbone_attr"],
    )


def _zero3() -> bool:
    if "deepspeed" not in sys.modules:
        return False
    try:
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    except ImportError:
        return False
    return bool(is_deepspeed_zero3_enabled())


def _keep_reason(model: nn.Module, head: TrlHead, patch: Any, plain: Callable[..., Any] | None) -> str:
    # patch: the model's patching.Patch (which imports this module)
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
        return f"the trainer reads {', '.join(extra)} from TRL's head, which lmkernels' fused head does not compute"
    causal_lm: Any = model  # a transformers causal LM
    problem = lk_peft.head_problem(causal_lm.get_output_embeddings())
    if problem:
        return problem
    if plain is None and not _ours(head.wrapped):  # a call is handed over through it (REDIRECT)
        return "TRL's head wraps a forward lmkernels did not set (something replaced the patched one)"
    return ""


def _describe(head: TrlHead) -> str:
    names = {
        "log_probs": "log-probs",
        "entropy": "entropy",
        "is_top1": "token accuracy",
        "mean_logits": "mean logits",
        "log_sum_sq_probs": "log sum p^2 (one more forward)",
    }
    parts = [names.get(o, o) for o in head.outputs]
    if head.temperature != 1.0:
        parts.append(f"temperature {head.temperature:g}")
    if head.fp32:
        parts.append("fp32 head")
    return ", ".join(parts)


def route(
    model: nn.Module,
    log: bool = True,
    trl_forward: Callable[..., Any] | None = None,
    plain: Callable[..., Any] | None = None,
) -> Decision | None:
    """Run TRL's fused head on `model` through lmkernels, or keep it (see the module docstring).

    `model`: the transformers model TRL wrapped (PEFT wrappers are seen through), patched by
    lk_hf.apply(). Returns None when it carries no TRL head lmkernels has not seen; otherwise
    the decision, logged once unless log=False (the callback logs its own). The decision is
    made once per TRL head; how lmkernels then takes the calls:

    - TRL's forward is the model's forward: replaced by lmkernels' wrapper of it (revert()
      restores TRL's), which answers `fused_lm_head=True` itself;
    - TRL's forward inside another wrapper (accelerate's mixed precision: its autocast must stay
      around the head): left in place; the patched model's forward pre-hook hands each
      `fused_lm_head=True` call to lmkernels through TRL's plain path (REDIRECT).

    `trl_forward` / `plain`: apply() on a model TRL had already wrapped passes TRL's forward (no
    longer on the model) and the patched forward that now stands for the one TRL wraps.
    """
    model = lk_peft.inner_model(model)
    patch = vars(model).get(RECORD)
    head = trl_head(model, trl_forward)
    if patch is None or head is None:
        return None
    decided = patch.trl_decision
    if decided is not None and decided.head is head.fn:
        return decided  # seen before (TRL's forward left inside another wrapper)
    why = head.problem or _keep_reason(model, head, patch, plain)
    decision = Decision(not why, why, "", head=head.fn, trl=None if why else head)
    if head.top:
        trl_forward = head.forward if trl_forward is None else trl_forward
        forward = _wrapper(model, decision.trl, trl_forward, plain, patch.flce_backend)
        patch.saved.append(Saved.replace(model, "forward", types.MethodType(forward, model)))
    label = type(model).__name__
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


def _pre_hook(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """A patched model's forward pre-hook. A `fused_lm_head=True` call of a TRL head lmkernels
    runs (route decides at the first one) and that the forward has not replaced (the first call
    goes to the forward it was bound to; TRL's forward inside accelerate's wrapper, every call)
    is sent through TRL's plain path to the patched forward TRL wraps, which computes the head
    (REDIRECT, see redirected())."""
    if not kwargs.get("fused_lm_head") or _fused_code() is None:
        return None
    decision = route(module)
    if decision is None or not decision.ours:
        return None
    return args, {**kwargs, "fused_lm_head": False, REDIRECT: True}


def redirected(self: nn.Module, kwargs: dict[str, Any]) -> tuple[bool, Any]:
    """(True, TRL's output computed by lmkernels) if the pre-hook redirected this call; (True,
    fn(self, kwargs)) if the caller passed REDIRECT=fn (a loss computed inside the model's wrapped
    forward: trl_distill.py)."""
    flag = kwargs.pop(REDIRECT, False)
    if not flag:
        return False, None
    if callable(flag):
        return True, flag(self, kwargs)
    patch = vars(self)[RECORD]
    labels, shift = kwargs.pop("labels", None), kwargs.pop("shift_labels", None)
    num_items = kwargs.pop("num_items_in_batch", None)
    head = patch.trl_decision.trl
    return True, fused_output(self, head, patch.flce_backend, (), kwargs, labels, shift, num_items)


def _wrapper(
    model: nn.Module,
    head: TrlHead | None,
    trl_forward: Callable[..., Any],
    plain: Callable[..., Any] | None,
    backend: str | None,
) -> Callable[..., Any]:
    """The forward set on a model with TRL's head: `fused_lm_head=True` runs lmkernels' fused
    head (`head` given) or TRL's; every other call goes to `plain` (default: TRL's forward,
    which calls the forward it wraps)."""

    @functools.wraps(type(model).forward)  # keeps the signature: generate() and the Trainer inspect it
    def forward(self: nn.Module, *args: Any, fused_lm_head: bool = False, **kwargs: Any) -> Any:
        if fused_lm_head and head is not None:
            labels, shift = kwargs.pop("labels", None), kwargs.pop("shift_labels", None)
            num_items = kwargs.pop("num_items_in_batch", None)
            return fused_output(self, head, backend, args, kwargs, labels, shift, num_items)
        if fused_lm_head or plain is None:
            return trl_forward(*args, fused_lm_head=fused_lm_head, **kwargs)
        return plain(*args, **kwargs)

    forward._lmkernels_patch = True  # type: ignore[attr-defined]  # (a function's own attribute)
    return forward


def fused_output(
    self: Any,
    head: TrlHead,
    backend: str | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    labels: torch.Tensor | None,
    shift_labels: torch.Tensor | None,
    num_items_in_batch: torch.Tensor | int | None,
) -> Any:
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
    stats = lm_head_token_stats(
        lm_head,
        hidden,
        targets,
        scale=scale,
        softcap=softcap,
        fp32=head.fp32,
        mean_logits="mean_logits" in head.outputs,
        log_sum_sq_probs="log_sum_sq_probs" in head.outputs,
        backend=backend,
    )
    nll, entropy, is_top1, mean_logits, log_sum_sq = stats
    if shift_labels is None:
        # copies, not views: FSDP2 warns that an in-place op on a view output would drop its
        # pre-backward hook (TRL's own head returns new tensors too)
        nll, entropy, is_top1, targets = (x[:, :-1].clone() for x in (nll, entropy, is_top1, targets))
        mean_logits, log_sum_sq = (
            None if x is None else x[:, :-1].clone() for x in (mean_logits, log_sum_sq)
        )
    mask = targets != -100
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    loss = nll.sum() / count
    aux_loss: torch.Tensor | None = None
    if kwargs.get("output_router_logits"):
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

        experts = getattr(text_config, "num_experts", None) or getattr(text_config, "num_local_experts", None)
        # (typed Tensor | int: 0 without router logits, which output_router_logits gives)
        balance: torch.Tensor = load_balancing_loss_func(  # type: ignore[assignment]
            backbone.router_logits, experts, text_config.num_experts_per_tok, kwargs.get("attention_mask")
        )
        aux_loss = balance
        loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * balance
    return FusedCausalLMOutput(
        loss=loss,
        log_probs=-nll,
        entropy=entropy if "entropy" in head.outputs else None,
        is_top1=is_top1 if "is_top1" in head.outputs else None,
        mean_logits=mean_logits,
        log_sum_sq_probs=log_sum_sq,
        label_mask=mask,
        aux_loss=aux_loss,
    )
