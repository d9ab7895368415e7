"""The integration's functions (apply, revert, report, from_pretrained, ...); the package
re-exports them (see its docstring)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lmkernels.integrations import peft as lk_peft
from lmkernels.integrations.lm_head_loss import causal_lm_loss, keep_hidden, lm_head_loss  # noqa: F401
from lmkernels.integrations.transformers import patching
from lmkernels.integrations.transformers.families import (  # noqa: F401
    FAMILIES,
    TESTED,
    Family,
    causal_lm_class,
    check_transformers_version,
    model_type_of,
    tiny_config,
    tiny_model,
)
from lmkernels.integrations.transformers.replacements import glu_kind  # noqa: F401
from lmkernels.integrations.transformers.report import PatchReport
from lmkernels.integrations.transformers.structure import analyze
from lmkernels.registry import LMKernelsError, canonical_op, parse_backend_spec

SUPPORTED_OPS = ("rms_norm", "layer_norm", "rope", "mlp", "flce", "causal_mask")


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
    op = {"flce": "fused_linear_cross_entropy"}.get(op, op)
    return table.get(canonical_op(op), table.get("*"))


def _analyze(model: nn.Module, table, ops, backend, wrapper: str | None = None) -> PatchReport:
    rope = _op_backend(table, "rope")
    findings = analyze(model, table, ops, lambda name: lambda: rope)
    label = f"{type(model).__name__} ({getattr(model.config, 'model_type', '?')})"
    if wrapper:
        label += f" in {wrapper}"
    return PatchReport(label, backend, findings)


def _target(model_or_class: Any) -> Any:
    """The transformers model itself: PEFT's wrappers are seen through (peft.py)."""
    return lk_peft.inner_model(model_or_class) if isinstance(model_or_class, nn.Module) else model_or_class


def _raise_if_failed(report: PatchReport, ops: tuple[str, ...]) -> None:
    if report.failed:
        lines = [f"  {f.op} {f.what}: {f.detail}" for f in report.failed]
        raise LMKernelsError(
            f"{report.model}: cannot patch (strict=True; strict=False patches the rest):\n" + "\n".join(lines)
        )
    if ops and not report.patched:  # (ops=() patches nothing on purpose: the convergence ablation)
        raise LMKernelsError(f"{report.model}: nothing lmkernels can patch was found\n{report.format()}")


def patch_report(
    target: Any, backend: str | None = None, ops: Iterable[str] = SUPPORTED_OPS, **config_overrides
) -> PatchReport:
    """What apply() would patch on `target` (a model, class or model type: a tiny model of that
    type is built) and why the rest is kept; changes nothing."""
    check_transformers_version()
    ops, table = _check_ops(ops), _backend_table(backend)
    if isinstance(target, nn.Module):
        model = _target(target)
    else:
        model = tiny_model(model_type_of(target), **config_overrides)
    return _analyze(model, table, ops, backend, lk_peft.wrapper_name(target))


def apply(
    model_or_class: Any, backend: str | None = None, ops: Iterable[str] = SUPPORTED_OPS, strict: bool = True
) -> Any:
    """Patch a model instance, a model class or a model type ("llama") to run lmkernels ops.

    Returns its argument. Applying again first reverts the previous patch of the same target.
    A PEFT model is seen through: the transformers model it wraps is patched (peft.py).
    See the module docstring for what each op replaces, `strict`, and the semantics kept.
    """
    check_transformers_version()
    ops, table = _check_ops(ops), _backend_table(backend)
    target = _target(model_or_class)
    model_type = model_type_of(target)
    if isinstance(target, nn.Module):
        _check_dtypes(target)
    revert(target)
    model = target if isinstance(target, nn.Module) else tiny_model(model_type)
    report = _analyze(model, table, ops, backend, lk_peft.wrapper_name(model_or_class))
    if strict:
        _raise_if_failed(report, ops)

    def table_backend(op):
        return _op_backend(table, op)

    if isinstance(target, nn.Module):
        patching.install_instance(model, model_type, report, table_backend)
        # (what LmkernelsCallback re-applies with, should PEFT wrap the head after this)
        vars(model)[patching.RECORD].hints["apply"] = {"backend": backend, "ops": ops}
    else:
        patching.install_class(model_type, report, table_backend)
    return model_or_class


def _check_dtypes(model: nn.Module) -> None:
    """lmkernels' ops take fp32, bf16 and fp16: a model holding another floating dtype is refused
    here rather than failing in its first forward."""
    taken = (torch.float32, torch.bfloat16, torch.float16)
    for name, p in model.named_parameters():
        if p.is_floating_point() and p.dtype not in taken:
            raise LMKernelsError(
                f"{type(model).__name__}: parameter {name} is {p.dtype}; lmkernels' ops take float32, "
                f"bfloat16 or float16 models (convert the model first, or leave it unpatched)"
            )


def revert(model_or_class: Any) -> Any:
    """Undo apply() on the same target; a target that is not patched is left as it is."""
    target = _target(model_or_class)
    patching.uninstall(target, model_type_of(target))
    return model_or_class


def report(model_or_class: Any) -> PatchReport | None:
    """The report of the patch apply() installed on this target (None if not patched)."""
    target = _target(model_or_class)
    if isinstance(target, nn.Module):
        patch = vars(target).get(patching.RECORD)
    else:
        patch = patching.CLASS_PATCHES.get(model_type_of(target))
    return None if patch is None else patch.report


def is_patched(model_or_class: Any) -> bool:
    target = _target(model_or_class)
    if isinstance(target, nn.Module):
        model_type_of(target)
        return patching.RECORD in vars(target)
    return model_type_of(target) in patching.CLASS_PATCHES


def family_patches(model_or_class: Any) -> list[str]:
    """What is patched for the whole family of `model_or_class` (not per instance): its classes,
    and rope, which is module-level. Empty: a new model of the family runs plain transformers."""
    model_type = model_type_of(model_or_class)
    found = []
    if model_type in patching.CLASS_PATCHES:
        found.append(f"the {model_type} classes (apply on a class or model type)")
    module_name = FAMILIES[model_type].module_name
    for kind, name in patching.MODULE_SAVED:
        if name == module_name:
            what = "apply_rotary_pos_emb" if kind == "rope" else "mask functions"
            found.append(f"{name} {what} (held by a patched model)")
    return found


def patched_models() -> list[nn.Module]:
    """The live models patched per instance (not through their class)."""
    return list(patching.PATCHED_MODELS)


# --- one line for users: load (or build) a causal LM and return it patched ----------------------


def from_pretrained(
    name_or_path: str,
    backend: str | None = None,
    strict: bool = True,
    ops: Iterable[str] | None = None,
    **kwargs: Any,
):
    """`AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)`, patched by apply().

    Patch before wrapping the model in FSDP or torch.compile (PEFT may wrap before or after).
    `strict=False` patches what passes its checks and keeps the rest
    (see `report(model)`)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    return apply(model, backend=backend, strict=strict, ops=ops or SUPPORTED_OPS)


def from_config(
    config,
    backend: str | None = None,
    strict: bool = True,
    ops: Iterable[str] | None = None,
    **kwargs: Any,
):
    """`AutoModelForCausalLM.from_config(config, **kwargs)` (random weights), patched by apply()."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, **kwargs)
    return apply(model, backend=backend, strict=strict, ops=ops or SUPPORTED_OPS)
