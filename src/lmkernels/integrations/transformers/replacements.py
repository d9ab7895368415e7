"""The functions a patched model runs instead of transformers' code, one per kind of module.

Each factory takes what the structural check found out about the module (epsilon attribute,
offset, casting mode, activation, rope layout, head scaling) and returns a `forward(self, ...)`
that is set on the module (an instance patch) or its class. Nothing here decides whether a
replacement is right for a module: verify.py checks each one against the original first.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

import lmkernels
from lmkernels.integrations import trl as lk_trl
from lmkernels.integrations.lm_head_loss import keep_hidden, lm_head_loss
from lmkernels.nn.recompute import glu_down
from lmkernels.registry import LMKernelsError
from lmkernels.types import CastingMode, GluKind, RopeLayout

_F = TypeVar("_F", bound=Callable[..., Any])

# transformers activation classes (by name: they were renamed across versions) -> GLU op.
GLU_BY_ACTIVATION: dict[str, GluKind] = {
    "SiLUActivation": ("swiglu", None),
    "SiLU": ("swiglu", None),
    "GELUTanh": ("geglu", "tanh"),
    "PytorchGELUTanh": ("geglu", "tanh"),
    "NewGELUActivation": ("geglu", "tanh"),  # the same tanh formula, written out in Python
    "GELUActivation": ("geglu", "none"),
    "GELU": ("geglu", "none"),  # torch.nn.GELU; its `approximate` attribute is read below
}
ACTIVATION_ATTRS = ("act_fn", "activation_fn", "act")


def glu_kind(act_fn: nn.Module) -> GluKind | None:
    """("swiglu", None) or ("geglu", approximate) for a transformers activation, else None."""
    kind = GLU_BY_ACTIVATION.get(type(act_fn).__name__)
    if kind is None:
        return None
    # (GELUTanh(use_gelu_tanh_python=True) and GELUActivation(use_gelu_python=True) compute the
    # same functions in Python, so the class name decides.) torch.nn.GELU carries its approximation.
    approximate = getattr(act_fn, "approximate", None)
    if kind[0] == "geglu" and approximate == "tanh":
        return ("geglu", "tanh")
    if kind[0] == "geglu" and approximate == "none":
        return ("geglu", "none")
    return kind


def mark(fn: _F) -> _F:
    """fn, marked as a replacement lmkernels installed (unwrapped() and revert find it by that)."""
    fn._lmkernels_patch = True  # type: ignore[attr-defined]  # a function's own attribute
    return fn


# --- norms -------------------------------------------------------------------------------------------


def rms_norm_forward(
    eps_attr: str | None, eps: float, offset: float, casting: CastingMode, backend: str | None
) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    """eps is read from `eps_attr` at each call when the module has one (else the fixed `eps`)."""

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        e = getattr(self, eps_attr) if eps_attr else eps

        def norm(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
            return lmkernels.rms_norm(x, weight, eps=e, offset=offset, casting_mode=casting, backend=backend)

        weight = getattr(self, "weight", None)
        if type(x).__name__ == "DTensor" and weight is not None:  # sequence parallel: local rows
            from lmkernels.distributed.local import local_call

            return local_call(norm, [x], [weight], op="rms_norm")
        return norm(x, weight)

    return mark(forward)


def layer_norm_forward(
    eps_attr: str | None, eps: float, backend: str | None
) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        e = getattr(self, eps_attr) if eps_attr else eps
        weight, bias = getattr(self, "weight", None), getattr(self, "bias", None)
        return lmkernels.layer_norm(x, weight, bias, eps=e, backend=backend)

    return mark(forward)


# --- gated MLPs ----------------------------------------------------------------------------------------


def glu(
    kind: GluKind,
    gate: torch.Tensor,
    up: torch.Tensor,
    consume: bool = True,
    *,
    backends: dict[str, str | None],
) -> torch.Tensor:
    """The one GLU call of every patched MLP and MoE expert. gate and up are created by the
    caller's projections and used by nothing else, so the GLU may consume them (its backward
    writes the gradients over them; it leaves chunk() halves of a fused projection alone).
    consume=False: the recomputation of the output for down_proj's backward (glu_down)."""
    if type(gate).__name__ == "DTensor":  # tensor parallel: the local shard
        from lmkernels.distributed.local import local_call

        return local_call(
            lambda g, u: glu(kind, g, u, backends=backends), [gate, up], op=kind[0], reduced_dims=()
        )
    if kind[0] == "swiglu":
        return lmkernels.swiglu(gate, up, consume_inputs=consume, backend=backends["swiglu"])
    return lmkernels.geglu(gate, up, approximate=kind[1], consume_inputs=consume, backend=backends["geglu"])


def glu_backends(table: dict[str, str]) -> dict[str, str | None]:
    from lmkernels.registry import canonical_op

    def pick(op: str) -> str | None:
        return table.get(canonical_op(op), table.get("*"))

    return {"swiglu": pick("swiglu"), "geglu": pick("geglu")}


def mlp_forward(
    layout: str, act_attr: str, backends: dict[str, str | None]
) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """layout "separate": down(act(gate(x)) * up(x)); "fused": gate_up_proj(x) = [gate | up]."""

    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        kind = glu_kind(getattr(self, act_attr))
        if kind is None:  # the activation was swapped after apply()
            raise LMKernelsError(
                f"{type(self).__name__}: activation {type(getattr(self, act_attr)).__name__} has no lmkernels "
                f"GLU op; revert() and apply with ops excluding 'mlp'"
            )
        if layout == "fused":
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return glu_down(self.down_proj, functools.partial(glu, kind, backends=backends), gate, up)

    return mark(forward)


def experts_forward(
    act_attr: str, backends: dict[str, str | None]
) -> Callable[[Any, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """MoE experts stored as 3-D tensors (gate_up_proj (E, 2I, H), down_proj (E, H, I)): each
    token's top-k experts, weighted and summed. Routing index E means "no expert" (transformers
    uses it to mask experts another rank owns)."""

    def forward(
        self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        kind = glu_kind(getattr(self, act_attr))
        if kind is None:  # the activation was swapped after apply()
            raise LMKernelsError(
                f"{type(self).__name__}: activation {type(getattr(self, act_attr)).__name__} has no lmkernels "
                f"GLU op; revert() and apply with ops excluding 'mlp'"
            )
        n_experts = self.gate_up_proj.shape[0]
        out = torch.zeros_like(hidden_states)
        k = top_k_index.shape[-1]
        expert = top_k_index.reshape(-1)
        token = torch.arange(hidden_states.shape[0], device=expert.device).repeat_interleave(k)
        weight = top_k_weights.reshape(-1)
        order = torch.argsort(expert, stable=True)
        # Tokens per expert decide the loop: one host sync per MoE layer, as transformers' own loop.
        counts = torch.bincount(expert, minlength=n_experts + 1).tolist()
        start = 0
        for e, count in enumerate(counts):
            rows = order[start : start + count]
            start += count
            if count == 0 or e == n_experts:
                continue
            tok = token[rows]
            gate, up = F.linear(hidden_states[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            down = functools.partial(F.linear, weight=self.down_proj[e])
            y = glu_down(down, functools.partial(glu, kind, backends=backends), gate, up) * weight[rows, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out

    return mark(forward)


# --- rotary embedding --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RopeStyle:
    layout: RopeLayout  # "neox" (rotate_half over halves) or "interleaved" (pairs)
    half_table: bool  # the function builds its table from cos[..., :R/2] repeated per pair (GLM)
    half_width: bool = False  # it is passed R/2 columns, one per pair, for both halves (GPT-OSS)

    def describe(self) -> str:
        return (
            self.layout
            + (", half table repeated per pair" if self.half_table else "")
            + (", half-width table" if self.half_width else "")
        )


ROPE_STYLES = (
    RopeStyle("neox", False),
    RopeStyle("interleaved", False),
    RopeStyle("interleaved", True),
    RopeStyle("neox", False, half_width=True),
)


# transformers' apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1) -> (q_out, k_out)
RopeFunction = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def rope_function(
    original: RopeFunction, style: RopeStyle, backend_of: Callable[[], str | None]
) -> RopeFunction:
    """A drop-in `apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`. Partial rotary (cos
    narrower than the head: Phi3, GLM, GPT-NeoX) rotates the first cos.shape[-1] dims."""

    @functools.wraps(original)
    def apply_rotary_pos_emb(
        q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # transformers passes q, k as (B, H, T, D) with cos/sin (B or 1, T, R) and unsqueeze_dim=1;
        # (B, T, H, D) layouts use unsqueeze_dim=2. Anything else is not what these models call,
        # so it goes to the original function rather than guessing.
        width = cos.shape[-1] * (2 if style.half_width else 1)
        if cos.dim() != 3 or width > q.shape[-1] or width % 2 or unsqueeze_dim not in (1, 2):
            return original(q, k, cos, sin, unsqueeze_dim)
        if style.half_width:
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        if style.half_table:
            half = cos.shape[-1] // 2
            cos = cos[..., :half].repeat_interleave(2, dim=-1)
            sin = sin[..., :half].repeat_interleave(2, dim=-1)
        if unsqueeze_dim == 2:
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        if cos.shape[0] == 1 and q.shape[0] != 1:  # one table for the whole batch
            cos, sin = cos[0], sin[0]
        rdim = cos.shape[-1] if cos.shape[-1] < q.shape[-1] else None

        def rope(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return lmkernels.rope(q, k, cos, sin, layout=style.layout, rotary_dim=rdim, backend=backend_of())

        if type(q).__name__ == "DTensor":  # tensor parallel: the local heads
            from lmkernels.distributed.local import local_call

            q_out, k_out = local_call(rope, [q, k], op="rope", reduced_dims=(-1, -2))
        else:
            q_out, k_out = rope(q, k)
        if unsqueeze_dim == 2:
            q_out, k_out = q_out.transpose(1, 2), k_out.transpose(1, 2)
        return q_out, k_out

    return mark(apply_rotary_pos_emb)


def with_global(fn: Callable[..., Any], name: str, value: Any) -> Callable[..., Any] | None:
    """A copy of `fn` that finds `value` under the global `name`; None where it cannot be made.

    `fn` is an attention's forward that calls its modeling module's apply_rotary_pos_emb: the copy
    runs with a copy of the module's globals (as they are at patch time) in which that name is
    the patched model's rope, so the module itself, and every model that was not patched, keeps
    the original. No state
    changes at call time: torch.compile traces the copy as it traces the original, inside an
    activation checkpoint too (where dynamo refuses stores to outside state). Wrappers made with
    functools.wraps that hold the wrapped function in a closure cell (transformers'
    deprecate_kwarg) are copied around the copy; any other wrapper gives None.
    """
    inner = getattr(fn, "__wrapped__", None)
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    if inner is None:
        if name not in code.co_names:
            return None
        namespace = dict(fn.__globals__)
        namespace[name] = value
        # Not the module's own namespace: without the module's name in it, dynamo reads its
        # globals from this dict instead of importing the module by name.
        namespace.pop("__name__", None)
        copied = types.FunctionType(code, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    else:
        inner_copy = with_global(inner, name, value)
        cells = fn.__closure__ or ()
        held = [i for i, cell in enumerate(cells) if _cell_holds(cell, inner)]
        if inner_copy is None or len(held) != 1:
            return None
        closure = tuple(types.CellType(inner_copy) if i == held[0] else c for i, c in enumerate(cells))
        copied = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, closure)
    copied.__kwdefaults__ = fn.__kwdefaults__
    return functools.update_wrapper(copied, fn)  # __wrapped__: the original, as unwrapped() expects


def _cell_holds(cell: types.CellType, value: Any) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False


def rope_signature_ok(fn: Callable[..., Any] | nn.Module) -> bool:
    """The call convention the wrapper implements: (q, k, cos, sin, unsqueeze_dim=1). With the
    `kernels` package installed, transformers' hub-kernel decorator turns apply_rotary_pos_emb
    into an nn.Module whose forward calls the function with the function's signature."""
    if isinstance(fn, nn.Module):
        fn = fn.forward
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    return names == ["q", "k", "cos", "sin", "unsqueeze_dim"]


# --- causal-LM head + loss -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HeadSpec:
    """What a family's causal-LM forward does between the base model and the loss."""

    base_attr: str  # the base model's attribute ("model", "gpt_neox")
    head_attr: str  # the output embedding's attribute ("lm_head", "embed_out")
    scale_from: str | None  # "logit_scale" (logits * model.logit_scale), "logits_scaling" (/ config.x)
    softcap: bool  # config.final_logit_softcapping
    moe: bool  # router aux loss (output_router_logits, load_balancing_loss_func)

    def describe(self) -> str:
        parts = [f"{self.head_attr}"]
        if self.scale_from:
            parts.append(f"scaled by {self.scale_from}")
        if self.softcap:
            parts.append("final softcap")
        if self.moe:
            parts.append("+ router aux loss")
        return ", ".join(parts)


def logit_scale(model: Any, spec: HeadSpec) -> float | None:
    if spec.scale_from == "logit_scale":
        return float(model.logit_scale)
    if spec.scale_from == "logits_scaling":
        return 1.0 / float(model.config.logits_scaling)
    return None


def positional_names(fn: Callable[..., Any]) -> list[str]:
    params = list(inspect.signature(fn).parameters.values())[1:]  # without self
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in params if p.kind in kinds]


def causal_lm_forward(
    original: Callable[..., Any], spec: HeadSpec, backend: str | None, call_original: Callable[..., Any]
) -> Callable[..., Any]:
    """The patched causal-LM forward. `call_original(self, **kwargs)` runs the unpatched path."""
    names = positional_names(original)

    @functools.wraps(original)  # keeps the signature: the Trainer and generate() inspect it
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if args:
            if len(args) > len(names):
                raise TypeError(f"forward() takes {len(names)} positional arguments, got {len(args)}")
            for name, value in zip(names, args):
                if name in kwargs:
                    raise TypeError(f"forward() got multiple values for argument {name!r}")
                kwargs[name] = value
        done, out = lk_trl.redirected(self, kwargs)  # TRL's head, routed at this call (trl.py)
        if done:
            return out
        if kwargs.get("labels") is None or not self.training:
            return call_original(self, **kwargs)
        return fused_forward(self, spec, backend, **kwargs)

    return mark(forward)


def fused_forward(
    self: Any,
    spec: HeadSpec,
    backend: str | None,
    labels: torch.Tensor,
    logits_to_keep: int | torch.Tensor = 0,
    return_dict: bool | None = None,
    **kwargs: Any,
) -> Any:
    """transformers' causal-LM forward with lm_head + loss as one fused call (no logits)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    if return_dict is None:  # what transformers' can_return_tuple decides
        return_dict = getattr(self.config, "return_dict", True)
    if spec.moe:
        router = kwargs.get("output_router_logits")
        kwargs["output_router_logits"] = self.config.output_router_logits if router is None else router
    # The original forward passes every extra kwarg (loss kwargs included) to the base model.
    outputs = getattr(self, spec.base_attr)(**kwargs)
    hidden = keep_hidden(outputs.last_hidden_state, logits_to_keep)
    loss = lm_head_loss(
        getattr(self, spec.head_attr),
        hidden,
        labels,
        softcap=getattr(self.config, "final_logit_softcapping", None) if spec.softcap else None,
        logit_scale=logit_scale(self, spec),
        num_items_in_batch=kwargs.get("num_items_in_batch"),
        ignore_index=kwargs.get("ignore_index", -100),
        shift_labels=kwargs.get("shift_labels"),
        backend=backend,
    )
    # The cache field: past_key_values up to transformers 5.23, cache from 5.24.
    cache = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
    common = {
        cache: getattr(outputs, cache, None),
        "hidden_states": getattr(outputs, "hidden_states", None),
        "attentions": getattr(outputs, "attentions", None),
    }
    if spec.moe:
        aux_loss = None
        if kwargs["output_router_logits"]:
            balance = inspect.unwrap(type(self).forward).__globals__["load_balancing_loss_func"]
            aux_loss = balance(
                outputs.router_logits,
                self.num_experts,
                self.num_experts_per_tok,
                kwargs.get("attention_mask"),
            )
            loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
        out: CausalLMOutputWithPast | MoeCausalLMOutputWithPast = MoeCausalLMOutputWithPast(
            loss=loss, aux_loss=aux_loss, logits=None, router_logits=outputs.router_logits, **common
        )
    else:
        out = CausalLMOutputWithPast(loss=loss, logits=None, **common)
    return out if return_dict else out.to_tuple()
