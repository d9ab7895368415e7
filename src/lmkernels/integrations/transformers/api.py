"""The integration's functions (apply, revert, report, from_pretrained, ...); the package
re-exports them (see its docstring)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from lmkernels.integrations import peft as lk_peft
from lmkernels.integrations.lm_head_loss import causal_lm_loss, keep_hidden, lm_head_loss
from lmkernels.integrations.transformers import patching
from lmkernels.integrations.transformers.families import (
    FAMILIES,
    TESTED,
    Family,
    causal_lm_class,
    check_transformers_version,
    model_type_of,
    tiny_config,
    tiny_model,
)
from lmkernels.integrations.transformers.replacements import glu_kind
from lmkernels.integrations.transformers.report import PatchReport
from lmkernels.integrations.transformers.structure import analyze
from lmkernels.registry import LMKernelsError, canonical_op, parse_backend_spec

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = [
    "FAMILIES",
    "Family",
    "PatchReport",
    "SUPPORTED_OPS",
    "TESTED",
    "apply",
    "causal_lm_class",
    "causal_lm_loss",
    "check_transformers_version",
    "family_patches",
    "from_config",
    "from_pretrained",
    "glu_kind",
    "is_patched",
    "keep_hidden",
    "lm_head_loss",
    "model_type_of",
    "patch_report",
    "patched_models",
    "report",
    "revert",
    "tiny_config",
    "tiny_model",
]

# A model instance, a model class or a model type ("llama"): apply() and revert() return it.
_Target = TypeVar("_Target")

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


def _analyze(
    model: nn.Module,
    table: dict[str, str],
    ops: tuple[str, ...],
    backend: str | None,
    wrapper: str | None = None,
) -> PatchReport:
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
    target: Any, backend: str | None = None, ops: Iterable[str] = SUPPORTED_OPS, **config_overrides: Any
) -> PatchReport:
    """What apply() would patch on `target`, and why the rest is kept; changes nothing.

    Args:
        target: A model instance (PEFT wrappers are seen through), a model class or a model type
            ("llama"); for a class or type, a tiny model of that type is built and checked.
        backend: As apply(): the backend the checks run with.
        ops: As apply(): the subset of SUPPORTED_OPS to look for.
        **config_overrides: For a class or type: fields of the tiny model's config.

    Returns:
        The PatchReport (print it, or its format()): every finding, patched, kept or failed.
    """
    check_transformers_version()
    ops, table = _check_ops(ops), _backend_table(backend)
    if isinstance(target, nn.Module):
        model = _target(target)
    else:
        model = tiny_model(model_type_of(target), **config_overrides)
    return _analyze(model, table, ops, backend, lk_peft.wrapper_name(target))


def apply(
    model_or_class: _Target,
    backend: str | None = None,
    ops: Iterable[str] = SUPPORTED_OPS,
    strict: bool = True,
) -> _Target:
    """Patch a model instance, a model class or a model type ("llama") to run lmkernels ops.

    Applying again first reverts the previous patch of the same target. A PEFT model is seen
    through: the transformers model it wraps is patched (peft.py). See the module docstring for
    what each op replaces and the semantics kept.

    Args:
        model_or_class: A transformers causal LM (patched per instance: its own modules), a
            causal-LM class or a model type string (patched per class: every model of the
            family, built before or after).
        backend: None lets lmkernels' dispatch choose at each call; a name ("triton") or a spec
            ("triton,flce=compile") fixes it per op.
        ops: The subset of SUPPORTED_OPS to patch.
        strict: True raises LMKernelsError, before changing anything, if a module that looks
            like one of these kinds cannot be patched correctly; False patches what passed its
            check and reports the rest (report()).

    Returns:
        Its argument, patched.
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

    def table_backend(op: str) -> str | None:
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


def revert(model_or_class: _Target) -> _Target:
    """Undo apply() on the same target (restoring the original functions exactly); a target that
    is not patched is left as it is. Returns its argument."""
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
    """Whether apply() patched this model instance, or this class / model type (per class)."""
    target = _target(model_or_class)
    if isinstance(target, nn.Module):
        model_type_of(target)
        return patching.RECORD in vars(target)
    return model_type_of(target) in patching.CLASS_PATCHES


def family_patches(model_or_class: Any) -> list[str]:
    """What is patched for the whole family of `model_or_class` (not per instance): its classes,
    and the mask functions, which are module-level. Empty: a new model of the family runs plain
    transformers."""
    model_type = model_type_of(model_or_class)
    found = []
    if model_type in patching.CLASS_PATCHES:
        found.append(f"the {model_type} classes (apply on a class or model type)")
    module_name = FAMILIES[model_type].module_name
    for _kind, name in patching.MODULE_SAVED:
        if name == module_name:
            found.append(f"{name} mask functions (held by a patched model)")
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
) -> PreTrainedModel:
    """`AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)`, patched by apply().

    Patch before wrapping the model in FSDP or torch.compile (PEFT may wrap before or after).

    Args:
        name_or_path: A hub model id or a local checkpoint directory.
        backend, strict: As apply(). `strict=False` patches what passes its checks and keeps the
            rest (see `report(model)`).
        ops: As apply() (None: SUPPORTED_OPS).
        **kwargs: Passed to from_pretrained (torch_dtype, device_map, ...).

    Returns:
        The loaded model, patched.
    """
    from transformers import AutoModelForCausalLM

    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    return apply(model, backend=backend, strict=strict, ops=ops or SUPPORTED_OPS)


def from_config(
    config: PretrainedConfig,
    backend: str | None = None,
    strict: bool = True,
    ops: Iterable[str] | None = None,
    **kwargs: Any,
) -> PreTrainedModel:
    """`AutoModelForCausalLM.from_config(config, **kwargs)` (random weights), patched by apply().

    Args:
        config: A transformers config of a causal LM (tiny_config() makes small ones).
        backend, strict: As apply().
        ops: As apply() (None: SUPPORTED_OPS).
        **kwargs: Passed to from_config (torch_dtype, ...).

    Returns:
        The new model, patched.
    """
    from transformers import AutoModelForCausalLM

    model: PreTrainedModel = AutoModelForCausalLM.from_config(config, **kwargs)
    return apply(model, backend=backend, strict=strict, ops=ops or SUPPORTED_OPS)
