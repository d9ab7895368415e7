"""Run Hugging Face transformers models on lmkernels ops.

    from lmkernels.integrations import transformers as lk_hf
    lk_hf.apply(model, backend="triton")          # an already-built model: patches its modules
    lk_hf.apply(LlamaForCausalLM)                 # a class (or "llama"): every model of the family
    ...
    lk_hf.revert(model)                           # restores the original functions exactly

What is replaced (`ops` chooses a subset):

- "rms_norm": the family's RMSNorm forward -> `lmkernels.rms_norm` (Llama/Mistral/Qwen2:
  casting "llama", offset 0; Gemma/Gemma2: casting "gemma", offset 1.0, i.e. x * (1 + w)).
  Gemma2's extra pre/post-feedforward norms are the same class and are patched with it.
- "rope": the modeling module's `apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)` ->
  `lmkernels.rope` (layout "neox", the rotate_half convention transformers uses).
- "mlp": the MLP forward `down(act(gate(x)) * up(x))` -> `down(swiglu(gate(x), up(x)))`, or geglu
  with approximate "tanh" (gelu_pytorch_tanh, gelu_new) / "none" (gelu), from the MLP's act_fn.
- "flce": the causal-LM forward. In training mode with `labels`, lm_head + loss become one
  `lmkernels.fused_linear_cross_entropy` call on the final hidden states: the (tokens x vocab)
  logits are never built and the output's `logits` is None. The loss is transformers'
  ForCausalLMLoss: labels shifted left by padding with ignore_index (or `shift_labels` as given),
  mean over non-ignored tokens, or sum / `num_items_in_batch` when the Trainer passes it;
  `logits_to_keep` slices the hidden states as the original forward does; Gemma2's
  `final_logit_softcapping` is FLCE's softcap. Without labels, or in eval mode, the original
  forward runs unchanged and returns logits (generation, evaluation metrics).

Patching a class (or a family name) replaces functions on the family's classes and modeling
module, so it affects every model of the family, built before or after. Patching a model
instance sets `forward` on its own submodules only, with one exception: rotary embedding is a
module-level function in transformers, so "rope" is always patched on the modeling module and
holds for every model of that family until the last apply() that asked for it is reverted (or
its model garbage collected); it uses the backend of the most recent apply(). A deep copy of a
patched model is patched too, without a rope hold of its own.

`backend`: None lets lmkernels' dispatch choose at each call (use_backend(), LMKERNELS_BACKEND,
auto); a name ("triton") or a spec like "triton,flce=compile" fixes it per op.

Known differences from the unpatched model, all in low precision only: lmkernels' RMSNorm output
has x's dtype even when the weight has another dtype (transformers' Llama norm promotes to the
weight's dtype); rope and GLU compute in fp32 and round once where transformers rounds after each
elementwise op; a batch whose labels are all ignore_index gives loss 0 instead of nan.

Supported: transformers >= 5.0 and < 6 (tested with 5.17 and 5.23). 4.x model forwards take
return_dict/output_* arguments and other rope signatures, which this module does not handle.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import inspect
import types
import weakref
from collections.abc import Iterable
from typing import Any

from torch import nn

import lmkernels
from lmkernels.integrations.lm_head_loss import causal_lm_loss, keep_hidden, lm_head_loss  # noqa: F401
from lmkernels.registry import LMKernelsError, canonical_op, parse_backend_spec

SUPPORTED_OPS = ("rms_norm", "rope", "mlp", "flce")
MIN_VERSION = (5, 0)
MAX_VERSION = (6, 0)  # exclusive: a new major version may rename the internals patched here


@dataclasses.dataclass(frozen=True)
class Family:
    """What differs between the supported model families."""

    model_type: str
    prefix: str  # class name prefix: f"{prefix}RMSNorm", f"{prefix}MLP", f"{prefix}ForCausalLM"
    rms_offset: float
    rms_casting: str
    rms_eps_attr: str  # the RMSNorm attribute that holds eps

    @property
    def module_name(self) -> str:
        return f"transformers.models.{self.model_type}.modeling_{self.model_type}"

    def module(self) -> types.ModuleType:
        return importlib.import_module(self.module_name)

    def cls(self, suffix: str) -> type:
        return getattr(self.module(), f"{self.prefix}{suffix}")


FAMILIES = {
    "llama": Family("llama", "Llama", 0.0, "llama", "variance_epsilon"),
    "mistral": Family("mistral", "Mistral", 0.0, "llama", "variance_epsilon"),
    "qwen2": Family("qwen2", "Qwen2", 0.0, "llama", "variance_epsilon"),
    "gemma": Family("gemma", "Gemma", 1.0, "gemma", "eps"),
    "gemma2": Family("gemma2", "Gemma2", 1.0, "gemma", "eps"),
}

# transformers activation classes (by name: they were renamed across versions) -> GLU op.
_GLU_BY_ACTIVATION = {
    "SiLUActivation": ("swiglu", None),
    "SiLU": ("swiglu", None),
    "GELUTanh": ("geglu", "tanh"),
    "PytorchGELUTanh": ("geglu", "tanh"),
    "NewGELUActivation": ("geglu", "tanh"),  # the same tanh formula, written out in Python
    "GELUActivation": ("geglu", "none"),
    "GELU": ("geglu", "none"),  # torch.nn.GELU; its `approximate` attribute is read below
}


# --- version and argument checks -----------------------------------------------------------------


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def check_transformers_version(version: str | None = None) -> None:
    """Raise LMKernelsError unless `version` (default: the installed one) is supported."""
    if version is None:
        import transformers

        version = transformers.__version__
    v = _version_tuple(version)
    if not MIN_VERSION <= v < MAX_VERSION:
        lo = ".".join(map(str, MIN_VERSION))
        hi = ".".join(map(str, MAX_VERSION))
        raise LMKernelsError(
            f"lmkernels.integrations.transformers: transformers {version} is not supported "
            f"(supported: >= {lo}, < {hi}); the model internals it patches differ in other versions"
        )


def _check_ops(ops: Iterable[str]) -> tuple[str, ...]:
    if isinstance(ops, str):
        ops = (ops,)
    ops = tuple(ops)
    bad = [op for op in ops if op not in SUPPORTED_OPS]
    if bad:
        raise LMKernelsError(f"ops: unknown {bad}; expected a subset of {SUPPORTED_OPS}")
    return ops


def _backend_table(backend: str | None) -> dict[str, str]:
    """None -> {} (dispatch decides); "triton" or "triton,flce=compile" -> per-op table."""
    if backend is None:
        return {}
    if not isinstance(backend, str):
        raise LMKernelsError(f"backend: expected None or a string, got {type(backend).__name__}")
    return parse_backend_spec(backend, where="backend")


def _op_backend(table: dict[str, str], op: str) -> str | None:
    op = canonical_op(op)
    return table.get(op, table.get("*"))


def _family_of(target: Any) -> Family:
    """The Family of a model instance, a model class, or a model_type string."""
    supported = sorted(FAMILIES)
    if isinstance(target, str):
        model_type, what = target, repr(target)
    elif isinstance(target, nn.Module):
        config = getattr(target, "config", None)
        model_type = getattr(config, "model_type", None)
        what = type(target).__name__
    elif isinstance(target, type):
        model_type, what = None, target.__name__
        for klass in target.__mro__:  # a user subclass of LlamaForCausalLM is a Llama
            for family in FAMILIES.values():
                if klass.__module__ == family.module_name:
                    model_type = family.model_type
                    break
            if model_type:
                break
        if model_type is None:
            config_class = getattr(target, "config_class", None)
            model_type = getattr(config_class, "model_type", None)
    else:
        raise LMKernelsError(
            f"model_or_class: expected a transformers model, model class or model type string, "
            f"got {type(target).__name__}"
        )
    if model_type not in FAMILIES:
        raise LMKernelsError(
            f"model_or_class: model type {model_type!r} ({what}) is not supported by "
            f"lmkernels.integrations.transformers; supported model types: {supported}"
        )
    return FAMILIES[model_type]


# --- the replacement functions ---------------------------------------------------------------------


def _mark(fn):
    fn._lmkernels_patch = True
    return fn


def _rms_norm_forward(family: Family, backend: str | None):
    eps_attr, offset, casting = family.rms_eps_attr, family.rms_offset, family.rms_casting

    def forward(self, x):
        def norm(x, weight):
            eps = getattr(self, eps_attr)
            return lmkernels.rms_norm(
                x, weight, eps=eps, offset=offset, casting_mode=casting, backend=backend
            )

        if type(x).__name__ == "DTensor":  # sequence parallel: the local rows (lmkernels.distributed)
            from lmkernels.distributed.local import local_call

            return local_call(norm, [x], [self.weight], op="rms_norm")
        return norm(x, self.weight)

    return _mark(forward)


def glu_kind(act_fn: nn.Module) -> tuple[str, str | None] | None:
    """("swiglu", None) or ("geglu", approximate) for a transformers activation, else None."""
    kind = _GLU_BY_ACTIVATION.get(type(act_fn).__name__)
    if kind is None:
        return None
    # (GELUTanh(use_gelu_tanh_python=True) and GELUActivation(use_gelu_python=True) compute the
    # same functions in Python, so the class name decides.) torch.nn.GELU carries its approximation.
    approximate = getattr(act_fn, "approximate", None)
    if kind[0] == "geglu" and approximate in ("tanh", "none"):
        return ("geglu", approximate)
    return kind


def _unsupported_activation(mlp: nn.Module) -> LMKernelsError:
    return LMKernelsError(
        f"{type(mlp).__name__}: activation {type(mlp.act_fn).__name__} has no lmkernels GLU op "
        f"(supported: {sorted(_GLU_BY_ACTIVATION)}); apply with ops excluding 'mlp'"
    )


def _mlp_forward(table: dict[str, str]):
    backends = {"swiglu": _op_backend(table, "swiglu"), "geglu": _op_backend(table, "geglu")}

    def forward(self, x):
        kind = glu_kind(self.act_fn)
        if kind is None:
            raise _unsupported_activation(self)
        gate, up = self.gate_proj(x), self.up_proj(x)

        # gate and up are created right here and used by nothing else: the GLU may consume them.
        def glu(gate, up):
            if kind[0] == "swiglu":
                return lmkernels.swiglu(gate, up, consume_inputs=True, backend=backends["swiglu"])
            return lmkernels.geglu(
                gate, up, approximate=kind[1], consume_inputs=True, backend=backends["geglu"]
            )

        if type(gate).__name__ == "DTensor":  # tensor parallel, DTensor outputs: the local shard
            from lmkernels.distributed.local import local_call

            return self.down_proj(local_call(glu, [gate, up], op=kind[0], reduced_dims=()))
        return self.down_proj(glu(gate, up))

    return _mark(forward)


# Backend of the patched rope per family (see the module docstring: rope is module-level).
_ROPE_BACKEND: dict[str, str | None] = {}


def _rope_function(family: Family, original):
    model_type = family.model_type

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        # transformers passes q, k as (B, H, T, D) with cos/sin (B or 1, T, D) and unsqueeze_dim=1;
        # (B, T, H, D) layouts use unsqueeze_dim=2. Anything else is not what these models call,
        # so it goes to the original function rather than guessing.
        if cos.dim() != 3 or cos.shape[-1] != q.shape[-1] or unsqueeze_dim not in (1, 2):
            return original(q, k, cos, sin, unsqueeze_dim)
        if unsqueeze_dim == 2:
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        if cos.shape[0] == 1 and q.shape[0] != 1:  # one table for the whole batch
            cos, sin = cos[0], sin[0]

        def rope(q, k):
            return lmkernels.rope(q, k, cos, sin, layout="neox", backend=_ROPE_BACKEND.get(model_type))

        if type(q).__name__ == "DTensor":  # tensor parallel, DTensor q/k: the local heads
            from lmkernels.distributed.local import local_call

            q_out, k_out = local_call(rope, [q, k], op="rope", reduced_dims=(-1, -2))
        else:
            q_out, k_out = rope(q, k)
        if unsqueeze_dim == 2:
            q_out, k_out = q_out.transpose(1, 2), k_out.transpose(1, 2)
        return q_out, k_out

    return _mark(apply_rotary_pos_emb)


def _check_loss_is_causal_lm(model: nn.Module) -> None:
    """FLCE computes ForCausalLMLoss; a model set up with another loss must not be patched."""
    custom = "_loss_function" in vars(model)
    loss_type = getattr(model, "loss_type", None)
    if custom or loss_type not in (None, "ForCausalLM"):
        what = "a custom loss_function" if custom else f"loss_type {loss_type!r}"
        raise LMKernelsError(
            f"{type(model).__name__} has {what}; the 'flce' patch computes the standard causal-LM "
            f"cross entropy, so apply with ops excluding 'flce'"
        )


def _positional_names(fn) -> list[str]:
    params = list(inspect.signature(fn).parameters.values())[1:]  # without self
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in params if p.kind in kinds]


def _causal_lm_forward(original, backend: str | None, call_original):
    """The patched causal-LM forward. `call_original(self, **kwargs)` runs the unpatched path."""
    names = _positional_names(original)

    @functools.wraps(original)  # keeps the signature: the Trainer and generate() inspect it
    def forward(self, *args, **kwargs):
        if args:
            if len(args) > len(names):
                raise TypeError(f"forward() takes {len(names)} positional arguments, got {len(args)}")
            for name, value in zip(names, args):
                if name in kwargs:
                    raise TypeError(f"forward() got multiple values for argument {name!r}")
                kwargs[name] = value
        if kwargs.get("labels") is None or not self.training:
            return call_original(self, **kwargs)
        return _flce_forward(self, backend, **kwargs)

    return _mark(forward)


def _flce_forward(self, backend, labels, logits_to_keep=0, return_dict=None, **kwargs):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    _check_loss_is_causal_lm(self)
    if not isinstance(self.lm_head, nn.Linear):
        raise LMKernelsError(
            f"{type(self).__name__}.lm_head is a {type(self.lm_head).__name__}, not nn.Linear; "
            f"apply with ops excluding 'flce'"
        )
    if return_dict is None:  # what transformers' can_return_tuple decides
        return_dict = getattr(self.config, "return_dict", True)
    # The original forward passes every extra kwarg (loss kwargs included) to the base model.
    outputs = self.model(**kwargs)
    hidden = keep_hidden(outputs.last_hidden_state, logits_to_keep)
    loss = lm_head_loss(
        self.lm_head,
        hidden,
        labels,
        softcap=getattr(self.config, "final_logit_softcapping", None),
        num_items_in_batch=kwargs.get("num_items_in_batch"),
        ignore_index=kwargs.get("ignore_index", -100),
        shift_labels=kwargs.get("shift_labels"),
        backend=backend,
    )
    out = CausalLMOutputWithPast(
        loss=loss,
        logits=None,
        past_key_values=getattr(outputs, "past_key_values", None),
        hidden_states=getattr(outputs, "hidden_states", None),
        attentions=getattr(outputs, "attentions", None),
    )
    return out if return_dict else out.to_tuple()


# --- bookkeeping: what was replaced, so revert() restores it exactly -------------------------------


@dataclasses.dataclass
class _Saved:
    obj: Any
    attr: str
    had_own: bool  # whether obj had attr in its own __dict__ (else it was inherited / absent)
    value: Any

    @classmethod
    def replace(cls, obj: Any, attr: str, new: Any) -> _Saved:
        own = vars(obj)
        saved = cls(obj, attr, attr in own, own.get(attr))
        setattr(obj, attr, new)
        return saved

    def restore(self) -> None:
        if self.had_own:
            setattr(self.obj, self.attr, self.value)
        else:
            delattr(self.obj, self.attr)


@dataclasses.dataclass
class _Patch:
    family: Family
    saved: list[_Saved]
    rope: bool
    finalizer: weakref.finalize | None = None

    def __deepcopy__(self, memo):
        # copy.deepcopy(patched_model): the copy's bound forwards follow the copy, but the rope
        # hold and its finalizer stay with the original.
        return _Patch(self.family, copy.deepcopy(self.saved, memo), rope=False)


_CLASS_PATCHES: dict[str, _Patch] = {}
# A model's own patch record lives on the model (_RECORD attribute): the record holds the model's
# modules, so keeping it anywhere else would keep every patched model alive forever.
_RECORD = "_lmkernels_patch_record"
_PATCHED_MODELS: weakref.WeakSet = weakref.WeakSet()
# Who holds the module-level rope patch of each family: "class" and/or patched model instances.
_ROPE_HOLDERS: dict[str, tuple[set[str], weakref.WeakSet]] = {}
_ROPE_SAVED: dict[str, _Saved] = {}


def _hold_rope(family: Family, holder: Any, backend: str | None) -> weakref.finalize | None:
    """Install the family's rope patch (once) for `holder`. For a model, returns a finalizer that
    releases it if the model is garbage collected without revert()."""
    classes, models = _ROPE_HOLDERS.setdefault(family.model_type, (set(), weakref.WeakSet()))
    _ROPE_BACKEND[family.model_type] = backend
    if family.model_type not in _ROPE_SAVED:
        module = family.module()
        patched = _rope_function(family, module.apply_rotary_pos_emb)
        _ROPE_SAVED[family.model_type] = _Saved.replace(module, "apply_rotary_pos_emb", patched)
    if isinstance(holder, str):
        classes.add(holder)
        return None
    models.add(holder)
    return weakref.finalize(holder, _release_rope, family, None)


def _release_rope(family: Family, holder: Any) -> None:
    """Drop `holder` (None: only a collected model) and restore rope when nobody holds it."""
    classes, models = _ROPE_HOLDERS.get(family.model_type, (set(), weakref.WeakSet()))
    if isinstance(holder, str):
        classes.discard(holder)
    elif holder is not None:
        models.discard(holder)
    alive = sum(1 for _ in models)  # iterating skips models already collected
    if not classes and not alive and family.model_type in _ROPE_SAVED:
        _ROPE_SAVED.pop(family.model_type).restore()
        _ROPE_BACKEND.pop(family.model_type, None)


# --- public API --------------------------------------------------------------------------------------


def apply(model_or_class: Any, backend: str | None = None, ops: Iterable[str] = SUPPORTED_OPS) -> Any:
    """Patch a model instance, a model class or a model type ("llama") to run lmkernels ops.

    Returns its argument. Applying again first reverts the previous patch of the same target.
    See the module docstring for what each op replaces and the semantics kept.
    """
    check_transformers_version()
    ops = _check_ops(ops)
    table = _backend_table(backend)
    family = _family_of(model_or_class)
    if isinstance(model_or_class, nn.Module):
        _apply_instance(model_or_class, family, table, ops)
    else:
        _apply_class(family, table, ops)
    return model_or_class


def revert(model_or_class: Any) -> Any:
    """Undo apply() on the same target; a target that is not patched is left as it is."""
    family = _family_of(model_or_class)
    if isinstance(model_or_class, nn.Module):
        patch = vars(model_or_class).pop(_RECORD, None)
        _PATCHED_MODELS.discard(model_or_class)
        holder: Any = model_or_class
    else:
        patch = _CLASS_PATCHES.pop(family.model_type, None)
        holder = "class"
    if patch is None:
        return model_or_class
    for saved in reversed(patch.saved):
        saved.restore()
    if patch.finalizer is not None:
        patch.finalizer.detach()
    if patch.rope:
        _release_rope(family, holder)
    return model_or_class


def is_patched(model_or_class: Any) -> bool:
    family = _family_of(model_or_class)
    if isinstance(model_or_class, nn.Module):
        return _RECORD in vars(model_or_class)
    return family.model_type in _CLASS_PATCHES


def family_patches(model_or_class: Any) -> list[str]:
    """What is patched for the whole family of `model_or_class` (not per instance): its classes,
    and rope, which is module-level. Empty: a new model of the family runs plain transformers."""
    family = _family_of(model_or_class)
    found = []
    if family.model_type in _CLASS_PATCHES:
        found.append(f"the {family.model_type} classes (apply on a class or model type)")
    if family.model_type in _ROPE_SAVED:
        found.append(f"{family.module_name}.apply_rotary_pos_emb (held by a patched model)")
    return found


def patched_models() -> list[nn.Module]:
    """The live models patched per instance (not through their class)."""
    return list(_PATCHED_MODELS)


def _apply_class(family: Family, table: dict[str, str], ops: tuple[str, ...]) -> None:
    revert(family.model_type)
    saved = []
    if "rms_norm" in ops:
        forward = _rms_norm_forward(family, _op_backend(table, "rms_norm"))
        saved.append(_Saved.replace(family.cls("RMSNorm"), "forward", forward))
    if "mlp" in ops:
        saved.append(_Saved.replace(family.cls("MLP"), "forward", _mlp_forward(table)))
    if "flce" in ops:
        lm_cls = family.cls("ForCausalLM")
        original = lm_cls.forward
        forward = _causal_lm_forward(original, _op_backend(table, "flce"), original)
        saved.append(_Saved.replace(lm_cls, "forward", forward))
    if "rope" in ops:
        _hold_rope(family, "class", _op_backend(table, "rope"))
    _CLASS_PATCHES[family.model_type] = _Patch(family, saved, "rope" in ops)


def _apply_instance(model: nn.Module, family: Family, table: dict[str, str], ops: tuple[str, ...]) -> None:
    revert(model)
    rms_cls, mlp_cls, lm_cls = family.cls("RMSNorm"), family.cls("MLP"), family.cls("ForCausalLM")
    # Check everything before changing anything, so a failed apply leaves the model untouched.
    if "mlp" in ops:
        for module in model.modules():
            if isinstance(module, mlp_cls) and glu_kind(module.act_fn) is None:
                raise _unsupported_activation(module)
    if "flce" in ops and isinstance(model, lm_cls):
        _check_loss_is_causal_lm(model)
    saved = []
    rms_forward = _rms_norm_forward(family, _op_backend(table, "rms_norm"))
    mlp_forward = _mlp_forward(table)
    for module in model.modules():
        if "rms_norm" in ops and isinstance(module, rms_cls):
            saved.append(_Saved.replace(module, "forward", types.MethodType(rms_forward, module)))
        elif "mlp" in ops and isinstance(module, mlp_cls):
            saved.append(_Saved.replace(module, "forward", types.MethodType(mlp_forward, module)))
    # Only causal LMs have an lm_head + loss to fuse; other heads (LlamaModel, ...) keep theirs.
    if "flce" in ops and isinstance(model, lm_cls):
        # The unpatched path goes through the class's forward at call time, so a class-level patch
        # applied or reverted later is honoured.
        forward = _causal_lm_forward(lm_cls.forward, _op_backend(table, "flce"), _class_forward)
        saved.append(_Saved.replace(model, "forward", types.MethodType(forward, model)))
    finalizer = _hold_rope(family, model, _op_backend(table, "rope")) if "rope" in ops else None
    object.__setattr__(model, _RECORD, _Patch(family, saved, "rope" in ops, finalizer))
    _PATCHED_MODELS.add(model)


def _class_forward(self, **kwargs):
    return type(self).forward(self, **kwargs)
