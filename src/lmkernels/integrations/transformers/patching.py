"""Installing verified replacements and undoing them exactly (the bookkeeping behind apply/revert).

Patching a model instance sets `forward` on its own submodules only; patching a class (or a
model type) replaces `forward` on the classes a tiny model of that family is built from, for
every model of the family. Rotary embedding is a module-level function in transformers, so
"rope" is always patched in the modeling module and held until the last apply() that asked for
it is reverted (or its model garbage collected); it uses the backend of the most recent apply().
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import types
import weakref
from typing import Any

from torch import nn

from lmkernels.integrations.transformers import replacements as rp
from lmkernels.integrations.transformers.report import PatchReport
from lmkernels.integrations.transformers.structure import PATCHED, Finding, unwrapped


@dataclasses.dataclass
class Saved:
    obj: Any
    attr: str
    had_own: bool  # whether obj had attr in its own __dict__ (else it was inherited / absent)
    value: Any

    @classmethod
    def replace(cls, obj: Any, attr: str, new: Any) -> Saved:
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
class Patch:
    model_type: str
    saved: list[Saved]
    rope_modules: tuple[str, ...]  # modeling modules whose rope this patch holds
    report: PatchReport | None = None
    finalizer: weakref.finalize | None = None

    def __deepcopy__(self, memo):
        # copy.deepcopy(patched_model): the copy's bound forwards follow the copy, but the rope
        # hold and its finalizer stay with the original.
        return Patch(self.model_type, copy.deepcopy(self.saved, memo), (), self.report)


CLASS_PATCHES: dict[str, Patch] = {}
# A model's own patch record lives on the model (RECORD attribute): the record holds the model's
# modules, so keeping it anywhere else would keep every patched model alive forever.
RECORD = "_lmkernels_patch_record"
PATCHED_MODELS: weakref.WeakSet = weakref.WeakSet()
# Rope per modeling module: who holds it ("class:<type>" strings and/or models), what was saved,
# and the backend the patched function uses (the most recent apply's).
_ROPE_HOLDERS: dict[str, tuple[set[str], weakref.WeakSet]] = {}
ROPE_SAVED: dict[str, Saved] = {}
_ROPE_BACKEND: dict[str, str | None] = {}


def rope_backend_getter(module_name: str):
    return lambda: _ROPE_BACKEND.get(module_name)


def _hold_rope(finding: Finding, holder: Any, backend: str | None) -> None:
    name = finding.module_name
    classes, models = _ROPE_HOLDERS.setdefault(name, (set(), weakref.WeakSet()))
    _ROPE_BACKEND[name] = backend
    if name not in ROPE_SAVED:
        module = importlib.import_module(name)
        original = unwrapped(module.apply_rotary_pos_emb)
        patched = rp.rope_function(original, finding.spec, rope_backend_getter(name))
        ROPE_SAVED[name] = Saved.replace(module, "apply_rotary_pos_emb", patched)
    if isinstance(holder, str):
        classes.add(holder)
    else:
        models.add(holder)


def release_rope(module_names, holder: Any) -> None:
    """Drop `holder` (None: only models already collected) and restore rope nobody holds."""
    for name in module_names:
        classes, models = _ROPE_HOLDERS.get(name, (set(), weakref.WeakSet()))
        if isinstance(holder, str):
            classes.discard(holder)
        elif holder is not None:
            models.discard(holder)
        alive = sum(1 for _ in models)  # iterating skips models already collected
        if not classes and not alive and name in ROPE_SAVED:
            ROPE_SAVED.pop(name).restore()
            _ROPE_BACKEND.pop(name, None)


def _class_forward(self, **kwargs):
    return type(self).forward(self, **kwargs)


def install_instance(model: nn.Module, model_type: str, report: PatchReport, table_backend) -> None:
    saved, rope_modules = [], []
    for f in report.patched:
        if f.op == "rope":
            _hold_rope(f, model, table_backend("rope"))
            rope_modules.append(f.module_name)
        elif f.op == "flce":
            # The unpatched path goes through the class's forward at call time, so a class-level
            # patch applied or reverted later is honoured.
            forward = rp.causal_lm_forward(
                unwrapped(type(model).forward), f.spec, table_backend("flce"), _class_forward
            )
            saved.append(Saved.replace(model, "forward", types.MethodType(forward, model)))
        else:
            for module in f.modules:
                saved.append(Saved.replace(module, "forward", types.MethodType(f.forward, module)))
    finalizer = None
    if rope_modules:
        finalizer = weakref.finalize(model, release_rope, tuple(rope_modules), None)
    patch = Patch(model_type, saved, tuple(rope_modules), report, finalizer)
    object.__setattr__(model, RECORD, patch)
    PATCHED_MODELS.add(model)


def install_class(model_type: str, report: PatchReport, table_backend) -> None:
    saved, rope_modules = [], []
    holder = f"class:{model_type}"
    for f in report.patched:
        if f.op == "rope":
            _hold_rope(f, holder, table_backend("rope"))
            rope_modules.append(f.module_name)
        elif f.op == "flce":
            original = unwrapped(f.cls.forward)
            forward = rp.causal_lm_forward(original, f.spec, table_backend("flce"), original)
            saved.append(Saved.replace(f.cls, "forward", forward))
        elif f.cls is not None and f.status == PATCHED:
            saved.append(Saved.replace(f.cls, "forward", f.forward))
    CLASS_PATCHES[model_type] = Patch(model_type, saved, tuple(rope_modules), report)


def uninstall(target: Any, model_type: str) -> bool:
    """Undo the patch of a model (instance) or of a family's classes; False if none."""
    if isinstance(target, nn.Module):
        patch = vars(target).pop(RECORD, None)
        PATCHED_MODELS.discard(target)
        holder: Any = target
    else:
        patch = CLASS_PATCHES.pop(model_type, None)
        holder = f"class:{model_type}"
    if patch is None:
        return False
    for saved in reversed(patch.saved):
        saved.restore()
    if patch.finalizer is not None:
        patch.finalizer.detach()
    release_rope(patch.rope_modules, holder)
    return True
