"""Seeing through PEFT's wrappers: the model a PeftModel wraps, and what a wrapped linear computes.

lmkernels patches the transformers model itself, so PEFT may wrap it before or after apply():

- `inner_model(m)`: the transformers model inside a PeftModel (or a tuner such as LoraModel);
  apply(), report(), revert() and the Trainer callback patch and read that model.
- `base_linear(module)`: the nn.Linear a PEFT tuner layer (LoRA, ...) wraps. A patched gated MLP
  calls its projections as modules, so a wrapped projection runs as PEFT defines it.
- `head_parts(head, hidden)`: lm_head as (hidden', weight', bias') with
  `head(hidden) == hidden' @ weight'.T + bias'`, so the fused loss can run on a wrapped head:
  an nn.Linear as it is; `modules_to_save=["lm_head"]` (ModulesToSaveWrapper) as its active copy
  (the original under `disable_adapter()`); LoRA on lm_head as
  `[x, s * A(dropout(x))] @ [W, B].T` (one column block per active adapter), exact with dropout
  on, since it calls the adapter's own dropout modules in PEFT's order. That costs a
  (V, H + r) copy of the weight per call and, with the adapter training, its gradient.
  Anything else (DoRA and the other LoRA variants, merged-and-disabled LoRA, other tuners on
  lm_head) raises LMKernelsError naming the layer and the fix.

Nothing here imports peft: modules are recognized by their class's module and attributes, so a
model without PEFT costs nothing (and PEFT's layers are typed Any: duck-typed).
"""

from __future__ import annotations

import copy
from typing import Any, TypeGuard

import torch
from torch import nn

from lmkernels.registry import LMKernelsError

FIX = "remove 'lm_head' from the PEFT config's target_modules, or apply lmkernels with ops excluding 'flce'"


def from_peft(module: object) -> bool:
    """Whether `module` is an instance of a class defined by peft."""
    return type(module).__module__.split(".")[0] == "peft"


def inner_model(model: nn.Module) -> nn.Module:
    """The transformers model inside PEFT's wrappers (the argument itself if it is not one)."""
    seen = set()
    while from_peft(model) and id(model) not in seen:
        seen.add(id(model))
        get_base_model = getattr(model, "get_base_model", None)
        if get_base_model is not None:  # PeftModel*
            inner = get_base_model()
        else:  # a tuner (LoraModel, ...): the model it injected its layers into
            inner = getattr(model, "model", None)
        if not isinstance(inner, nn.Module) or inner is model:
            break
        model = inner
    return model


def wrapper_name(model: object) -> str | None:
    """`PeftModelForCausalLM` for a wrapped model, None for a plain one (or a class, a name)."""
    if not isinstance(model, nn.Module) or not from_peft(model):
        return None
    return type(model).__name__ if inner_model(model) is not model else None


def plain_linear(module: object) -> TypeGuard[nn.Linear]:
    """An nn.Linear that computes nn.Linear's forward (not a subclass with its own)."""
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


def base_linear(module: Any) -> nn.Linear | None:
    """The plain nn.Linear under a PEFT tuner layer; None if `module` is not one."""
    if not from_peft(module) or not callable(getattr(type(module), "get_base_layer", None)):
        return None
    base = module.get_base_layer()
    return base if plain_linear(base) else None


def linear_like(module: object) -> bool:
    """A projection a patched MLP may call as a module: a plain nn.Linear or a PEFT layer over one."""
    return plain_linear(module) or base_linear(module) is not None


def describe(module: Any) -> str:
    """`peft.Linear (LoRA: default r=8)`-style name of a wrapped layer, for reports and errors."""
    kind = f"{type(module).__module__.split('.')[0]}.{type(module).__name__}"
    if _is_lora_linear(module):
        ranks = ", ".join(f"{a} r={module.r[a]}" for a in _lora_active(module))
        return f"{kind} (LoRA: {ranks or 'no active adapter'})"
    if _is_modules_to_save(module):
        return f"{kind} (modules_to_save)"
    return kind


# --- the linear map a (possibly wrapped) lm_head computes --------------------------------------------


def _is_lora_linear(module: object) -> bool:
    return (
        from_peft(module)
        and type(module).__name__ == "Linear"
        and all(hasattr(module, a) for a in ("lora_A", "lora_B", "lora_dropout", "scaling", "base_layer"))
    )


def _is_modules_to_save(module: object) -> bool:
    return from_peft(module) and all(hasattr(module, a) for a in ("modules_to_save", "original_module"))


def _lora_active(module: Any) -> list[str]:
    return [a for a in module.active_adapters if a in module.lora_A]


def _modules_to_save_active(module: Any) -> nn.Module:
    """The module a ModulesToSaveWrapper's forward calls (as PEFT's forward decides)."""
    active = list(module.active_adapters)
    adapters = getattr(module, "_adapters", set(module.modules_to_save.keys()))
    if module.disable_adapters or not active or any(a not in adapters for a in active):
        return module.original_module
    return module.modules_to_save[active[0]]


def head_problem(head: nn.Module, name: str = "lm_head") -> str | None:
    """Why the fused loss cannot compute `head` (None: it can). Checked again at every call."""
    layer: Any = head  # PEFT's layers, duck-typed
    if plain_linear(head):
        return None
    if _is_modules_to_save(head):
        inner = _modules_to_save_active(head)
        if plain_linear(inner):
            return None
        return f"{name} is a PEFT modules_to_save copy of a {type(inner).__name__}, not nn.Linear"
    if _is_lora_linear(layer):
        if not plain_linear(layer.base_layer):
            return (
                f"{name} is LoRA over a {type(layer.base_layer).__name__} (quantized?), not nn.Linear; {FIX}"
            )
        variants = [a for a in _lora_active(layer) if a in getattr(layer, "lora_variant", {})]
        if variants and not layer.disable_adapters and not layer.merged:
            kind = type(layer.lora_variant[variants[0]]).__name__
            return f"{name} has a LoRA variant ({kind}, adapter {variants[0]!r}: DoRA?) the fused loss does not compute; {FIX}"
        if getattr(layer, "fan_in_fan_out", False):
            return f"{name} is LoRA with fan_in_fan_out=True; {FIX}"
        if layer.disable_adapters and layer.merged:
            return f"{name} is LoRA merged while adapters are disabled (PEFT unmerges it in its forward); unmerge first"
        return None
    if from_peft(head):
        return f"{name} is a {describe(head)}, which the fused loss does not compute; {FIX}"
    if isinstance(head, nn.Linear):
        return f"{name} is a {type(head).__name__}, whose forward is not nn.Linear's"
    return f"{name} is a {type(head).__name__}, not nn.Linear"


def head_parts(
    head: nn.Module, hidden: torch.Tensor, name: str = "lm_head"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(hidden', weight', bias') with head(hidden) == hidden' @ weight'.T + bias' (see the module
    docstring); raises LMKernelsError naming the layer and the fix if the fused loss cannot."""
    problem = head_problem(head, name)
    if problem:
        raise LMKernelsError(problem)
    if plain_linear(head):
        return hidden, head.weight, head.bias
    layer: Any = head  # PEFT's layers, duck-typed
    if _is_modules_to_save(layer):
        inner: Any = _modules_to_save_active(layer)
        return hidden, inner.weight, inner.bias
    base: nn.Linear = layer.base_layer
    active = _lora_active(layer)
    if layer.disable_adapters or layer.merged or not active:
        return hidden, base.weight, base.bias
    pieces, weights, bias = [hidden], [base.weight], base.bias
    for a in active:
        lora_b, scale = layer.lora_B[a], layer.scaling[a]
        x = layer._cast_input_dtype(hidden, layer.lora_A[a].weight.dtype)
        pieces.append(layer.lora_A[a](layer.lora_dropout[a](x)) * scale)
        weights.append(lora_b.weight)
        if getattr(lora_b, "bias", None) is not None:  # lora_bias=True
            bias = lora_b.bias * scale if bias is None else bias + lora_b.bias * scale
    dtype = hidden.dtype if torch.is_floating_point(hidden) else base.weight.dtype
    hidden = torch.cat([p.to(dtype) for p in pieces], dim=-1)
    weight = torch.cat([w.to(base.weight.dtype) for w in weights], dim=1)
    return hidden, weight, bias


def head_describe(head: nn.Module) -> str:
    """How the fused loss computes `head`, for the patch report ("" for a plain nn.Linear)."""
    if plain_linear(head):
        return ""
    if _is_modules_to_save(head):
        return "PEFT modules_to_save copy"
    layer: Any = head  # PEFT's layers, duck-typed
    ranks = ", ".join(f"{a!r} r={layer.r[a]}" for a in _lora_active(layer))
    return f"PEFT LoRA ({ranks}) as [x, s*A(x)] @ [W, B].T"


def _small(linear: nn.Module, g: torch.Generator, n_in: int, n_out: int) -> nn.Linear:
    small = nn.Linear(n_in, n_out, bias=getattr(linear, "bias", None) is not None)
    with torch.no_grad():
        small.weight.copy_(torch.randn(n_out, n_in, generator=g) * n_in**-0.5)
        if small.bias is not None:
            small.bias.copy_(torch.randn(n_out, generator=g) * 0.1)
    return small


def _small_clone(head: nn.Module, g: torch.Generator, H: int, V: int) -> nn.Module:
    """A shallow copy of a wrapped head whose linears are small random fp32 ones (different per
    copy and adapter, so picking the wrong one, or a wrong scale, shows)."""
    layer: Any = head  # PEFT's layers, duck-typed
    clone = copy.copy(head)
    clone._modules = dict(head._modules)
    if _is_modules_to_save(layer):
        clone._modules["original_module"] = _small(layer.original_module, g, H, V)
        copies = {a: _small(m, g, H, V) for a, m in layer.modules_to_save.items()}
        clone._modules["modules_to_save"] = nn.ModuleDict(copies)
    else:
        clone._modules["base_layer"] = _small(layer.base_layer, g, H, V)
        clone._modules["lora_A"] = nn.ModuleDict(
            {a: _small(m, g, H, m.out_features) for a, m in layer.lora_A.items()}
        )
        clone._modules["lora_B"] = nn.ModuleDict(
            {a: _small(m, g, m.in_features, V) for a, m in layer.lora_B.items()}
        )
    return clone


def check_head_parts(head: nn.Module) -> float:
    """head_parts against the head's own forward, on a small random copy (verify.py's way: the
    real weights, which may be huge or a LoRA B still zero, are not used), in eval mode (no
    dropout) and fp32; raises LMKernelsError past 1e-5 relative."""
    if plain_linear(head):
        return 0.0
    problem = head_problem(head)
    if problem:
        raise LMKernelsError(problem)
    g = torch.Generator().manual_seed(0)
    H, V = 16, 24
    clone = _small_clone(head, g, H, V)
    modes = {m: m.training for m in head.modules()}  # children the clone shares (dropout) are set too
    x = torch.randn(5, H, generator=g)
    try:
        clone.train(False)
        with torch.no_grad():
            ref = clone(x)
            h, w, b = head_parts(clone, x)
            out = h @ w.T + (0 if b is None else b)
    finally:
        for m, training in modes.items():
            m.training = training
    err = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    if not err <= 1e-5:
        raise LMKernelsError(f"lm_head: {describe(head)} differs from its fused form by {err:.1e}; {FIX}")
    return err
