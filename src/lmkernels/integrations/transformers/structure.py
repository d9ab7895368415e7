"""Recognize the patchable parts of a model by what they are, and verify each replacement.

analyze(model, ...) walks the model once and returns Findings, one per group of identical
modules (same class, same epsilon and shapes: one check covers them all), per rotary function
(per modeling module) and for the causal-LM head:

- norms: torch's nn.LayerNorm / nn.RMSNorm, and classes named *RMSNorm / *LayerNorm with at
  most a 1-D weight and bias. Which RMSNorm (epsilon attribute, (1 + w) offset, casting mode)
  is found by probing the module (verify.probe_rms_norm), not from its family.
- gated MLPs: gate_proj + up_proj + down_proj, or a fused gate_up_proj + down_proj (Phi3, GLM),
  with an activation lmkernels has a GLU for. MoE experts with 3-D gate_up_proj / down_proj
  (Mixtral, Qwen2-MoE, Qwen3-MoE) get the same GLU inside their routing loop.
- rotary: the `apply_rotary_pos_emb` an attention module's forward calls, in that module's own
  namespace; its layout (neox / interleaved, partial rotary, table form) is probed.
- the causal-LM head + loss: an nn.Linear output embedding (nn.Linear's own forward), the
  standard causal-LM loss, logit scaling (Cohere, Granite), final softcapping (Gemma2/3) and
  router aux loss (MoE).
- the base model's mask building (masks.py): its forward's source is read, not run.

A Finding is "patched" (verified), "kept" (not a kind lmkernels has an op for: the reason says
why; no error) or "failed" (looks like a kind we patch but cannot be patched correctly: strict
apply raises on these).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, TypedDict

import torch
from torch import nn

from lmkernels.integrations import peft as lk_peft
from lmkernels.integrations.transformers import masks
from lmkernels.integrations.transformers import replacements as rp
from lmkernels.integrations.transformers import verify as vf
from lmkernels.registry import LMKernelsError, canonical_op

PATCHED, KEPT, FAILED = "patched", "kept", "failed"


@dataclasses.dataclass
class Finding:
    op: str  # the `ops` name that controls it: rms_norm, layer_norm, mlp, rope, flce, causal_mask
    what: str  # class name, or module.function for rotary
    paths: list[str]  # module paths (instances), or the function's qualified name
    status: str
    detail: str
    cls: type[nn.Module]  # the class whose forward a class-level patch replaces
    modules: list[nn.Module] = dataclasses.field(default_factory=list)
    forward: Callable[..., Any] | None = None  # the replacement (unbound: takes self) / rope function
    spec: rp.RopeStyle | rp.HeadSpec | None = None  # rope: the RopeStyle; flce: the HeadSpec
    module_name: str = ""  # rope, causal_mask: the modeling module whose functions are replaced

    @property
    def count(self) -> int:
        return len(self.modules) or 1


class _Where(TypedDict):
    """The Finding fields that say what was found where (the rest say what became of it)."""

    what: str
    paths: list[str]
    cls: type[nn.Module]
    modules: list[nn.Module]
    module_name: str


def _backend(table: dict[str, str], op: str) -> str | None:
    return table.get(canonical_op(op), table.get("*"))


def _norm_kind(module: nn.Module) -> str | None:
    if isinstance(module, nn.LayerNorm):
        return "layer_norm"
    if hasattr(nn, "RMSNorm") and isinstance(module, nn.RMSNorm):
        return "rms_norm"
    name = type(module).__name__
    if name.endswith("RMSNorm"):
        return "rms_norm"
    if name.endswith("LayerNorm"):
        return "layer_norm"
    return None


def _norm_problem(module: nn.Module) -> str | None:
    extra = [n for n, p in module.named_parameters(recurse=False) if n not in ("weight", "bias")]
    if extra or any(True for _ in module.children()):
        return f"has parameters or submodules besides weight/bias ({extra or 'children'})"
    for name in ("weight", "bias"):
        t = getattr(module, name, None)
        if t is not None and getattr(t, "dim", lambda: 1)() != 1:
            return f"{name} is {t.dim()}-D (per-head norm); lmkernels norms take a 1-D {name}"
    if isinstance(module, nn.LayerNorm) and len(module.normalized_shape) != 1:
        return f"normalizes over {len(module.normalized_shape)} dims; lmkernels normalizes the last one"
    return None


def _act_attr(module: nn.Module) -> str | None:
    for name in rp.ACTIVATION_ATTRS:
        if isinstance(getattr(module, name, None), nn.Module):
            return name
    return None


def _mlp_layout(module: nn.Module) -> str | None:
    def lin(
        name: str,
    ) -> bool:  # (a PEFT layer over an nn.Linear too: the patched forward calls it as a module)
        return lk_peft.linear_like(getattr(module, name, None))

    if lin("gate_proj") and lin("up_proj") and lin("down_proj"):
        return "separate"
    if lin("gate_up_proj") and lin("down_proj"):
        return "fused"
    params = module._parameters
    gu, down = params.get("gate_up_proj"), params.get("down_proj")
    if gu is not None and down is not None and gu.dim() == 3 and down.dim() == 3:
        return "experts"
    return None


def _peft_layer(module: nn.Module, name: str) -> bool:
    return lk_peft.base_linear(getattr(module, name, None)) is not None


def _is_mlp_like(module: nn.Module) -> bool:
    name = type(module).__name__
    return name.endswith(("MLP", "Experts")) or name.endswith("FeedForward")


def _device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


def _group_key(module: nn.Module) -> tuple[object, ...]:
    shapes = tuple((n, tuple(p.shape)) for n, p in module.named_parameters(recurse=False))
    eps = tuple(getattr(module, a, None) for a in vf.EPS_ATTRS)
    act = _act_attr(module)
    act_key = (
        (type(getattr(module, act)).__name__, getattr(getattr(module, act), "approximate", None))
        if act
        else None
    )
    return (type(module), shapes, eps, act_key)


def _attempt(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, str | None]:
    """(result, None) or (None, reason) for a probe/check: Mismatch and backend errors alike."""
    try:
        return fn(*args, **kwargs), None
    except vf.Mismatch as e:
        return None, str(e)
    except Exception as e:  # the original or the replacement cannot run this: not verified
        return None, f"check raised {type(e).__name__}: {e}"


def _module_findings(
    model: nn.Module, table: dict[str, str], ops: tuple[str, ...], device: torch.device
) -> list[Finding]:
    groups: dict[tuple[object, ...], list[tuple[str, nn.Module]]] = {}
    for path, module in model.named_modules():
        if path == "" and _norm_kind(module) is None:
            continue
        groups.setdefault(_group_key(module), []).append((path, module))
    findings = []
    glu_backends = rp.glu_backends(table)
    for members in groups.values():
        paths = [p for p, _ in members]
        modules = [m for _, m in members]
        first = modules[0]
        base = _Where(
            what=type(first).__name__, paths=paths, cls=type(first), modules=modules, module_name=""
        )
        kind = _norm_kind(first)
        if kind is not None:
            if kind not in ops:
                continue
            problem = _norm_problem(first)
            if problem:
                findings.append(Finding(kind, status=KEPT, detail=problem, **base))
                continue
            probe = vf.probe_rms_norm if kind == "rms_norm" else vf.probe_layer_norm
            result, why = _attempt(probe, first, _backend(table, kind), device=device)
            if why:
                findings.append(Finding(kind, status=FAILED, detail=why, **base))
            else:
                findings.append(Finding(kind, status=PATCHED, detail=result[1], forward=result[0], **base))
            continue
        layout = _mlp_layout(first)
        if layout is None:
            if _is_mlp_like(first) and "mlp" in ops:
                projections = [n for n in ("gate_proj", "up_proj", "gate_up_proj") if hasattr(first, n)]
                if projections:  # gated, but its projections are something else (quantized, ...)
                    kind = lk_peft.describe(getattr(first, projections[0]))
                    why = (
                        f"{projections[0]} is a {kind}, neither nn.Linear nor a PEFT layer over one; "
                        f"apply with ops excluding 'mlp'"
                    )
                    findings.append(Finding("mlp", status=FAILED, detail=why, **base))
                else:
                    findings.append(
                        Finding("mlp", status=KEPT, detail="not a gated MLP (no lmkernels op)", **base)
                    )
            continue
        if "mlp" not in ops:
            continue
        act = _act_attr(first)
        glu = rp.glu_kind(getattr(first, act)) if act else None
        if glu is None or act is None:
            act_name = type(getattr(first, act)).__name__ if act else "none found"
            detail = (
                f"activation {act_name} has no lmkernels GLU op (supported: {sorted(rp.GLU_BY_ACTIVATION)}); "
                f"apply with ops excluding 'mlp'"
            )
            findings.append(Finding("mlp", status=FAILED, detail=detail, **base))
            continue
        forward: Callable[..., torch.Tensor]
        if layout == "experts":
            forward = rp.experts_forward(act, glu_backends)
            _, why = _attempt(vf.check_experts, first, forward, device=device)
        else:
            forward = rp.mlp_forward(layout, act, glu_backends)
            _, why = _attempt(vf.check_mlp, first, layout, forward, device=device)
        glu_name = glu[0] + (f" ({glu[1]})" if glu[1] else "")
        if why:
            findings.append(Finding("mlp", status=FAILED, detail=why, **base))
        else:
            desc = {"separate": "gate/up", "fused": "fused gate_up", "experts": "MoE experts"}[layout]
            wrapped = [
                n for n in ("gate_proj", "up_proj", "gate_up_proj", "down_proj") if _peft_layer(first, n)
            ]
            if wrapped:
                desc += f" (PEFT layers: {', '.join(wrapped)})"
            findings.append(
                Finding("mlp", status=PATCHED, detail=f"{desc}, {glu_name}", forward=forward, **base)
            )
    return findings


def unwrapped(fn: Any) -> Any:
    """The function an lmkernels replacement wraps (the original), else `fn` itself."""
    return getattr(fn, "__wrapped__", fn) if getattr(fn, "_lmkernels_patch", False) else fn


def _rotary_dim(model: nn.Module) -> int | None:
    for name, buf in model.named_buffers():
        if name.endswith("inv_freq"):
            return 2 * buf.numel()
    return None


def _rope_callers(model: nn.Module) -> dict[str, list[nn.Module]]:
    """The modules whose forward calls their modeling module's apply_rotary_pos_emb (the
    attentions), per modeling module name."""
    callers: dict[str, list[nn.Module]] = {}
    for module in model.modules():
        fwd = inspect.unwrap(unwrapped(type(module).forward))
        code = getattr(fwd, "__code__", None)
        if code is not None and "apply_rotary_pos_emb" in code.co_names:
            callers.setdefault(fwd.__globals__.get("__name__", "?"), []).append(module)
    return callers


def _rope_findings(
    model: nn.Module,
    table: dict[str, str],
    device: torch.device,
    backend_of: Callable[[str], Callable[[], str | None]],
) -> list[Finding]:
    findings = []
    rdim = _rotary_dim(model)
    for module_name, modules in _rope_callers(model).items():
        module = modules[0]
        namespace = inspect.unwrap(unwrapped(type(module).forward)).__globals__
        original = unwrapped(namespace.get("apply_rotary_pos_emb"))
        what = f"{module_name.rsplit('.', 1)[-1]}.apply_rotary_pos_emb"
        base = _Where(
            what=what,
            paths=[f"{module_name}.apply_rotary_pos_emb"],
            module_name=module_name,
            modules=modules,
            cls=type(module),
        )
        head_dim = getattr(module, "head_dim", None) or getattr(module, "head_size", None)
        why = None
        if original is None:
            why = "function not found"
        elif not rp.rope_signature_ok(original):
            why = "not the (q, k, cos, sin, unsqueeze_dim) convention"
        elif not isinstance(head_dim, int):  # e.g. DeepSeek's MLA: rope on a slice of each head
            why = f"{type(module).__name__} has no integer head_dim or head_size"
        elif any(
            rp.with_global(unwrapped(cls.forward), "apply_rotary_pos_emb", original) is None
            for cls in dict.fromkeys(type(m) for m in modules)
        ):
            why = "the attention's forward is wrapped in a way its copy cannot follow"
        if why or not isinstance(head_dim, int):
            findings.append(Finding("rope", status=FAILED, detail=why or "", **base))
            continue
        rotary = rdim or head_dim
        result, why = _attempt(
            vf.probe_rope, original, head_dim, rotary, backend_of(module_name), device=device
        )
        if why and rotary < head_dim:  # partial rotary split off by the attention itself (Phi, StableLM)
            result, narrow = _attempt(
                vf.probe_rope, original, rotary, rotary, backend_of(module_name), device=device
            )
            why = narrow and why
        if why:
            findings.append(Finding("rope", status=FAILED, detail=why, **base))
        else:
            findings.append(Finding("rope", status=PATCHED, detail=result[1], spec=result[0], **base))
    return findings


def _loss_problem(model: nn.Module) -> str | None:
    custom = "_loss_function" in vars(model)
    loss_type = getattr(model, "loss_type", None)
    if custom or loss_type not in (None, "ForCausalLM"):
        what = "a custom loss_function" if custom else f"loss_type {loss_type!r}"
        return f"has {what}; the fused loss is the standard causal-LM cross entropy"
    return None


def head_spec(model: nn.Module) -> tuple[rp.HeadSpec | None, str | None]:
    """The HeadSpec of a causal LM, or (None, why not)."""
    base_attr = getattr(model, "base_model_prefix", None)
    if not base_attr or not isinstance(getattr(model, base_attr, None), nn.Module):
        return None, "no base model attribute (base_model_prefix)"
    get_output_embeddings = getattr(model, "get_output_embeddings", None)
    head = get_output_embeddings() if get_output_embeddings is not None else None
    head_attr = next((n for n, m in model.named_children() if m is head), None)
    if head is None or head_attr is None:
        return None, "no output embedding (lm_head)"
    # The fused loss reads the weight and bias, so a subclass's own forward would be skipped:
    # e.g. transformers' DoryLMHead scales each vocabulary entry's logit by a learned parameter
    # that is exactly 1 at initialization (the apply-time value check cannot see it). PEFT's
    # wrappers of an nn.Linear (LoRA, modules_to_save) are computed as PEFT does (peft.py).
    problem = lk_peft.head_problem(head, head_attr)
    if problem:
        return None, problem
    # Likewise a parameter of the causal LM outside those two would get no gradient.
    outside = [
        n
        for n, _ in model.named_parameters(remove_duplicate=False)
        if n.split(".")[0] not in (base_attr, head_attr)
    ]
    if outside:
        return (
            None,
            f"{outside[0]} is outside {base_attr} and {head_attr}, the only modules the fused loss runs",
        )
    problem = _loss_problem(model)
    if problem:
        return None, problem
    config = model.config
    scale_from = None
    if isinstance(getattr(model, "logit_scale", None), (int, float)):
        scale_from = "logit_scale"
    elif isinstance(getattr(config, "logits_scaling", None), (int, float)):
        scale_from = "logits_scaling"
    softcap = getattr(config, "final_logit_softcapping", None) is not None
    params = inspect.signature(unwrapped(type(model).forward)).parameters
    moe = "output_router_logits" in params
    if moe and not all(
        hasattr(model, a) for a in ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")
    ):
        return None, "router aux loss of an unrecognized form (no num_experts / router_aux_loss_coef)"
    return rp.HeadSpec(base_attr, head_attr, scale_from, softcap, moe), None


def _head_findings(model: nn.Module, table: dict[str, str], device: torch.device) -> list[Finding]:
    if not type(model).__name__.endswith(("ForCausalLM", "LMHeadModel")):
        return []
    base = _Where(
        what=type(model).__name__, paths=["(model)"], cls=type(model), modules=[model], module_name=""
    )
    spec, why = head_spec(model)
    if spec is None:
        return [Finding("flce", status=FAILED, detail=why or "", **base)]
    backend = _backend(table, "flce")
    _, why = _attempt(vf.check_head, model, spec, backend, device=device)
    if why is None:
        try:
            lk_peft.check_head_parts(getattr(model, spec.head_attr))
        except LMKernelsError as e:
            why = str(e)
    if why:
        return [Finding("flce", status=FAILED, detail=why, **base)]
    detail = ", ".join(filter(None, [spec.describe(), lk_peft.head_describe(getattr(model, spec.head_attr))]))
    return [Finding("flce", status=PATCHED, detail=detail, spec=spec, **base)]


def _mask_findings(model: nn.Module) -> list[Finding]:
    base = masks.base_model(model)
    if base is None:
        return []
    cls = type(base)
    path = next(p for p, m in model.named_modules() if m is base) or "(model)"
    module_name = inspect.unwrap(cls.forward).__globals__.get("__name__", "?")
    found = _Where(what=cls.__name__, paths=[path], cls=cls, modules=[base], module_name=module_name)
    why = masks.forward_problem(base)
    not_causal = [p for p, m in model.named_modules() if getattr(m, "is_causal", True) is False]
    if why is None and not_causal:
        why = f"{not_causal[0]} has is_causal=False"
    if why is None and masks.own_sdpa_call(model):
        why = f"{masks.own_sdpa_call(model)} calls scaled_dot_product_attention itself"
    if why:
        return [
            Finding("causal_mask", status=KEPT, detail=f"mask built as transformers does: {why}", **found)
        ]
    detail = "plain causal calls build no mask: SDPA is_causal, also compiled"
    return [Finding("causal_mask", status=PATCHED, detail=detail, **found)]


def analyze(
    model: nn.Module,
    table: dict[str, str],
    ops: tuple[str, ...],
    backend_of: Callable[[str], Callable[[], str | None]],
) -> list[Finding]:
    """Every patchable part of `model` (for the requested ops), each verified.

    `backend_of(module_name)` returns a callable giving the rope backend to verify with."""
    device = _device(model)
    findings = _module_findings(model, table, ops, device)
    if "rope" in ops:
        findings += _rope_findings(model, table, device, backend_of)
    if "flce" in ops:
        findings += _head_findings(model, table, device)
    if "causal_mask" in ops:
        findings += _mask_findings(model)
    return findings
