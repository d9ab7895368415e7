"""Installing verified replacements and undoing them exactly (the bookkeeping behind apply/revert).

Patching a model instance sets `forward` on its own submodules only; patching a class (or a
model type) replaces `forward` on the classes a tiny model of that family is built from, for
every model of the family. Rotary embedding is a module-level function in transformers that
the attention's forward calls: "rope" gives the patched attentions a copy of their forward that
finds lmkernels' rope under that name (replacements.with_global); the modeling module is not
touched. The mask functions, called by the base model, are replaced in the modeling module
("causal_mask"), held until the last apply() that asked for them is reverted (or its model
garbage collected), with functions that behave exactly as the originals for every model but
the patched ones: they route to lmkernels only for the plain-causal marker a patched base model
passes (masks.py).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import sys
import types
import weakref
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from torch import nn
from torch.utils.hooks import RemovableHandle

from lmkernels.integrations import trl as lk_trl
from lmkernels.integrations.transformers import masks
from lmkernels.integrations.transformers import replacements as rp
from lmkernels.integrations.transformers.record import RECORD as RECORD  # (re-exported)
from lmkernels.integrations.transformers.record import Saved, SavedCell
from lmkernels.integrations.transformers.report import PatchReport
from lmkernels.integrations.transformers.structure import PATCHED, Finding, unwrapped
from lmkernels.registry import LMKernelsError

_S = TypeVar("_S")
# op -> the backend its replacement runs with (None: dispatch decides)
TableBackend = Callable[[str], str | None]


@dataclasses.dataclass
class Patch:
    model_type: str
    saved: list[Saved | SavedCell]
    holds: tuple[tuple[str, str], ...]  # (kind, modeling module) of the module-level functions held
    report: PatchReport
    finalizer: weakref.finalize | None = None
    flce_backend: str | None = None  # the backend the fused loss runs with (None: dispatch decides)
    hooks: list[RemovableHandle] = dataclasses.field(default_factory=list)  # of forward hooks
    # What a trainer told the patch (LmkernelsCallback): trl_head preference, whether the
    # entropy needs a gradient; and TRL's fused head's routing, once decided (trl.py).
    hints: dict[str, Any] = dataclasses.field(default_factory=dict)
    trl_decision: lk_trl.Decision | None = None

    def __deepcopy__(self, memo: dict[int, Any]) -> Patch:
        # copy.deepcopy(patched_model): the copy's bound forwards follow the copy, but the mask
        # functions' hold and its finalizer stay with the original (the copy's hooks are in its
        # own dicts).
        return Patch(
            self.model_type,
            copy.deepcopy(self.saved, memo),
            (),
            self.report,
            flce_backend=self.flce_backend,
            hints=dict(self.hints),
        )


CLASS_PATCHES: dict[str, Patch] = {}
PATCHED_MODELS: weakref.WeakSet[nn.Module] = weakref.WeakSet()
# Module-level replacements, per (kind, modeling module): kind "causal_mask" (the mask
# functions). Who holds them ("class:<type>" strings and/or models) and what was saved.
_HOLDERS: dict[tuple[str, str], tuple[set[str], weakref.WeakSet[nn.Module]]] = {}
MODULE_SAVED: dict[tuple[str, str], list[Saved]] = {}


def _spec(finding: Finding, kind: type[_S]) -> _S:
    """The RopeStyle / HeadSpec that structure.py found for a patched rope / flce finding."""
    if not isinstance(finding.spec, kind):
        raise TypeError(f"{finding.what}: a patched {finding.op} finding without its {kind.__name__}")
    return finding.spec


def _forward(finding: Finding) -> Callable[..., Any]:
    """The replacement forward structure.py verified for a patched norm or MLP finding."""
    if finding.forward is None:
        raise TypeError(f"{finding.what}: a patched {finding.op} finding without its forward")
    return finding.forward


def _rope_forward(finding: Finding, backend: str | None, forward: Callable[..., Any]) -> Callable[..., Any]:
    """`forward` (an attention's of `finding`) calling lmkernels' rope with `backend` where it
    calls its modeling module's apply_rotary_pos_emb."""
    original = unwrapped(sys.modules[finding.module_name].apply_rotary_pos_emb)
    rope = rp.rope_function(original, _spec(finding, rp.RopeStyle), lambda: backend)
    copied = rp.with_global(forward, "apply_rotary_pos_emb", rope)
    if copied is None:  # structure.py verified that it can be made
        raise TypeError(f"{finding.what}: the attention's forward cannot be copied")
    return rp.mark(copied)


def _masks_install(finding: Finding) -> list[Saved]:
    module = importlib.import_module(finding.module_name)
    found = masks.mask_functions(vars(module))
    return [Saved.replace(module, name, masks.mask_function_wrapper(name, fn)) for name, fn in found.items()]


def _hold(finding: Finding, holder: Any) -> tuple[str, str]:
    """Replace the module-level functions of `finding` unless already replaced; `holder` holds them."""
    key = (finding.op, finding.module_name)
    classes, models = _HOLDERS.setdefault(key, (set(), weakref.WeakSet()))
    if key not in MODULE_SAVED:
        MODULE_SAVED[key] = _masks_install(finding)
    if isinstance(holder, str):
        classes.add(holder)
    else:
        models.add(holder)
    return key


def release(keys: Iterable[tuple[str, str]], holder: Any) -> None:
    """Drop `holder` (None: only models already collected) and restore what nobody holds."""
    for key in keys:
        classes, models = _HOLDERS.get(key, (set(), weakref.WeakSet()))
        if isinstance(holder, str):
            classes.discard(holder)
        elif holder is not None:
            models.discard(holder)
        alive = sum(1 for _ in models)  # iterating skips models already collected
        if not classes and not alive and key in MODULE_SAVED:
            for saved in reversed(MODULE_SAVED.pop(key)):
                if not saved.replaced_since():  # another library's replacement made after ours stays
                    saved.restore()


def _class_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return type(self).forward(self, *args, **kwargs)


def install_instance(
    model: nn.Module, model_type: str, report: PatchReport, table_backend: TableBackend
) -> None:
    """Install the verified replacements of `report` on `model`'s own modules (apply() on a model)."""
    saved: list[Saved | SavedCell] = []
    holds: list[tuple[str, str]] = []
    hooks: list[RemovableHandle] = []
    trl_forward, head = vars(model).get("forward"), lk_trl.trl_head(model)
    nested: lk_trl.TrlHead | None = None  # TRL's head inside another wrapper, over the loss we patch
    if head is not None and not head.top and any(f.op == "flce" for f in report.patched):
        nested = head
    if head is None or nested is not None:  # else TRL wrapped the model before apply(): re-wrapped below
        trl_forward = None
    if nested is not None and "original_forward" not in nested.fn.__code__.co_freevars:
        raise LMKernelsError(
            f"{type(model).__name__}: its forward wraps TRL's fused head in another wrapper (accelerate's "
            f"mixed precision?), and this TRL's head binds no original_forward; apply lmkernels before the "
            f"trainer prepares the model (LmkernelsCallback does), or with ops excluding 'flce'"
        )
    for f in report.patched:
        if f.op == "rope":
            # The class's own forward (not a class-level patch's copy) with this model's rope.
            copies = {
                cls: _rope_forward(f, table_backend("rope"), unwrapped(cls.forward))
                for cls in dict.fromkeys(type(m) for m in f.modules)
            }
            for module in f.modules:
                forward = copies[type(module)]
                saved.append(Saved.replace(module, "forward", types.MethodType(forward, module)))
        elif f.op == "causal_mask":
            holds.append(_hold(f, model))
            base = f.modules[0]
            forward = masks.plain_causal_forward(unwrapped(type(base).forward), _class_forward)
            saved.append(Saved.replace(base, "forward", types.MethodType(forward, base)))
        elif f.op == "flce":
            # The unpatched path goes through the class's forward at call time, so a class-level
            # patch applied or reverted later is honoured.
            forward = rp.causal_lm_forward(
                unwrapped(type(model).forward), _spec(f, rp.HeadSpec), table_backend("flce"), _class_forward
            )
            if nested is not None:
                # TRL's head inside accelerate's mixed-precision wrapper (a trainer's reference
                # model, prepared before lmkernels saw it): the wrapper stays (its autocast around
                # the head), the forward TRL's head wraps becomes the patched one (a closure cell
                # of TRL's function, this model's own), the pre-hook hands it the head's calls.
                cells = dict(zip(nested.fn.__code__.co_freevars, nested.fn.__closure__ or ()))
                saved.append(SavedCell.replace(cells["original_forward"], types.MethodType(forward, model)))
            else:
                saved.append(Saved.replace(model, "forward", types.MethodType(forward, model)))
            # TRL's fused head, added after apply(), is routed at its first call (trl.py).
            hooks.append(model.register_forward_pre_hook(lk_trl._pre_hook, with_kwargs=True))
        else:
            for module in f.modules:
                saved.append(Saved.replace(module, "forward", types.MethodType(_forward(f), module)))
    finalizer = None
    if holds:
        finalizer = weakref.finalize(model, release, tuple(holds), None)
    patch = Patch(model_type, saved, tuple(holds), report, finalizer, table_backend("flce"), hooks)
    object.__setattr__(model, RECORD, patch)
    PATCHED_MODELS.add(model)
    if trl_forward is not None:
        plain = vars(model).get("forward")  # the patched forward, or TRL's if flce is not patched
        lk_trl.route(model, trl_forward=trl_forward, plain=plain)
    elif nested is not None:
        lk_trl.route(model)


def install_class(model_type: str, report: PatchReport, table_backend: TableBackend) -> None:
    """Install the verified replacements of `report` on the classes of `model_type` (apply() on a
    class or a model type)."""
    saved: list[Saved | SavedCell] = []
    holds: list[tuple[str, str]] = []
    holder = f"class:{model_type}"
    for f in report.patched:
        if f.op == "rope":
            for cls in dict.fromkeys(type(m) for m in f.modules):
                original = unwrapped(cls.forward)
                saved.append(Saved.replace(cls, "forward", _rope_forward(f, table_backend("rope"), original)))
        elif f.op == "causal_mask":
            holds.append(_hold(f, holder))
            original = unwrapped(f.cls.forward)
            saved.append(Saved.replace(f.cls, "forward", masks.plain_causal_forward(original, original)))
        elif f.op == "flce":
            original = unwrapped(f.cls.forward)
            forward = rp.causal_lm_forward(original, _spec(f, rp.HeadSpec), table_backend("flce"), original)
            saved.append(Saved.replace(f.cls, "forward", forward))
        elif f.status == PATCHED:
            saved.append(Saved.replace(f.cls, "forward", _forward(f)))
    CLASS_PATCHES[model_type] = Patch(model_type, saved, tuple(holds), report)


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
    for handle in patch.hooks:
        handle.remove()
    for saved in reversed(patch.saved):
        saved.restore()
    if patch.finalizer is not None:
        patch.finalizer.detach()
    release(patch.holds, holder)
    return True
