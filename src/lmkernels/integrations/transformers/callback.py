"""One switch for the transformers Trainer and TRL's trainers:

    trainer = Trainer(..., callbacks=[lk_hf.LmkernelsCallback()])      # or SFTTrainer, GRPOTrainer, ...

- on_init_end (end of Trainer.__init__: the model is built and PEFT-wrapped, no optimizer yet):
  patches the model with apply() (PEFT seen through) unless it is patched already; a model
  patched before PEFT wrapped its lm_head is checked again (strict: raise naming the layer and
  the fix; non-strict: patched again without the head, which the report then lists as kept).
  Records what the trainer's config says about TRL's head (trl.py: does a loss differentiate
  the entropy).
- on_train_begin (TRL's fused head, if any, is on the model by then): routes TRL's head
  (trl.route); patches the trainer's reference model (DPO, KTO, GRPO, RLOO) and teacher (GKD,
  DistillationTrainer) like the policy and routes their heads; runs GKD's and
  DistillationTrainer's divergence on lmkernels.fused_linear_distillation (trl_distill.py), the
  log-probs of trl.experimental's CPOTrainer / ORPOTrainer on the fused head (trl_prefs.py); and
  logs, once, on the main process: what is patched and kept, and which loss runs. (The trainer
  is found at on_init_end as the caller whose callback handler holds this callback: the events
  carry the model, not the trainer.) Logger "lmkernels": INFO when lmkernels' fused loss runs, WARNING when it does not (a
  kept head, TRL's head kept, the Trainer's label smoothing computing its loss from the logits).
- A model the Trainer builds after its __init__ (model_init, hyperparameter search) cannot be
  patched by the callback (accelerate has wrapped its forward by on_train_begin): strict raises
  saying to call lk_hf.apply() inside model_init; non-strict logs a WARNING.

Refused: `use_liger_kernel=True` in the same run (Liger replaces the same forwards when
train() starts).
"""

from __future__ import annotations

import logging
import sys
import types
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal

from torch import nn
from transformers import TrainerCallback

from lmkernels.integrations import peft as lk_peft
from lmkernels.integrations import trl as lk_trl
from lmkernels.registry import LMKernelsError

if TYPE_CHECKING:
    from transformers import TrainerControl, TrainerState, TrainingArguments

logger = logging.getLogger("lmkernels")


class LmkernelsCallback(TrainerCallback):
    """Patch the Trainer's model with lmkernels before the optimizer exists and run its loss
    through lmkernels' fused loss, TRL's trainers included. See the module docstring.

    backend, ops, strict: as lk_hf.apply() (used when the model is not patched yet).
    trl_head: "auto" (lmkernels' fused head wherever it gives the trainer what it reads, else
    TRL's), "lmkernels" (the same: TRL's head is still kept where lmkernels cannot serve the
    trainer, with the reason logged), or "trl" (always TRL's head).
    `summary`: the message logged at on_train_begin (None before).

    Args:
        backend: As apply(): None lets dispatch choose at each call; a name ("triton") or a
            spec ("triton,flce=compile") fixes it per op.
        ops: As apply(): the subset of SUPPORTED_OPS to patch (None: all).
        strict: As apply(): raise if a module that looks patchable cannot be patched correctly.
        trl_head: Which runs TRL's fused LM head (above).
    """

    def __init__(
        self,
        backend: str | None = None,
        ops: Iterable[str] | None = None,
        strict: bool = True,
        trl_head: Literal["auto", "lmkernels", "trl"] = "auto",
    ) -> None:
        from lmkernels.integrations.transformers import api as lk_hf

        if trl_head not in lk_trl.PREFER:
            raise LMKernelsError(f"trl_head: expected one of {lk_trl.PREFER}, got {trl_head!r}")
        if not isinstance(strict, bool):
            raise LMKernelsError(f"strict: expected a bool, got {type(strict).__name__}")
        self.ops = lk_hf._check_ops(lk_hf.SUPPORTED_OPS if ops is None else ops)
        lk_hf._backend_table(backend)  # checked now, not at the first step
        self.backend, self.strict, self.trl_head = backend, strict, trl_head
        self.summary: str | None = None
        self._trainer: weakref.ref[Any] | None = None  # the Trainer whose __init__ ran on_init_end

    # --- events ----------------------------------------------------------------------------------

    def on_init_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        """Patch the model (unless patched already) and record what the trainer's config says."""
        if getattr(args, "use_liger_kernel", False):
            raise LMKernelsError(
                "use_liger_kernel: Liger patches the same modules when train() starts; with "
                "LmkernelsCallback set use_liger_kernel=False"
            )
        trainer = _find_trainer(self)
        self._trainer = None if trainer is None else weakref.ref(trainer)
        self._patch(model, args)

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        """Route TRL's fused head (if any) and log, once, what is patched and which loss runs."""
        from lmkernels.integrations.transformers import patching

        if model is None:
            raise LMKernelsError("model: the Trainer passed no model to LmkernelsCallback")
        inner = lk_peft.inner_model(model)
        if patching.RECORD not in vars(inner):
            # A model built after on_init_end (model_init): the Trainer has prepared it already
            # (accelerate's mixed-precision wrapper is on its forward), too late to patch here.
            why = (
                f"model: {type(inner).__name__} was built after the Trainer's __init__ (model_init?) "
                f"and is not patched; call lk_hf.apply(model) inside model_init"
            )
            if self.strict:
                raise LMKernelsError(why)
            logger.warning(f"lmkernels: {why}")
            return
        decision = lk_trl.route(inner, log=False)
        trainer = None if self._trainer is None else self._trainer()
        companions: list[tuple[str, bool]] = [] if trainer is None else self._companions(trainer)
        if self.summary is None:
            self.summary, level = self._summary(inner, args, decision)
            for line, warn in companions:
                self.summary += f"\nlmkernels: {line}"
                level = logging.WARNING if warn and self.trl_head != "trl" else level
            if state is None or state.is_world_process_zero:
                logger.log(level, self.summary)

    # --- helpers ---------------------------------------------------------------------------------

    def _patch(self, model: nn.Module | None, args: TrainingArguments) -> nn.Module:
        from lmkernels.integrations.transformers import api as lk_hf
        from lmkernels.integrations.transformers import patching

        if model is None:
            raise LMKernelsError("model: the Trainer passed no model to LmkernelsCallback")
        inner: Any = lk_peft.inner_model(model)  # a transformers causal LM
        patch = vars(inner).get(patching.RECORD)
        if patch is None:
            lk_hf.apply(model, backend=self.backend, ops=self.ops, strict=self.strict)
        elif "flce" in patch.report.patched_ops():  # patched before PEFT wrapped lm_head?
            head = inner.get_output_embeddings()
            problem = lk_peft.head_problem(head)
            if problem is None:
                try:
                    lk_peft.check_head_parts(head)
                except LMKernelsError as e:
                    problem = str(e)
            if problem and self.strict:
                raise LMKernelsError(f"{type(inner).__name__}: the fused loss cannot run: {problem}")
            if problem:
                applied = patch.hints.get("apply", {})
                lk_hf.apply(
                    model,
                    backend=applied.get("backend", patch.report.backend),
                    ops=applied.get("ops", lk_hf.SUPPORTED_OPS),
                    strict=False,
                )
        patch = vars(inner)[patching.RECORD]
        patch.hints["prefer"] = self.trl_head
        return inner

    def _companions(self, trainer: Any) -> list[tuple[str, bool]]:
        """The trainer's other models and losses: its reference model (DPO, KTO, GRPO, RLOO) and
        teacher (GKD, DistillationTrainer) patched like the policy, their TRL heads routed;
        GKD's and DistillationTrainer's divergence on fused_linear_distillation. Returns the
        summary lines, each with whether it is a warning."""
        from lmkernels.integrations import trl_distill, trl_prefs

        lines = []
        for attr, role in (("ref_model", "reference model"), ("teacher_model", "teacher")):
            other = getattr(trainer, attr, None)
            if isinstance(other, nn.Module):
                lines.append(self._patch_companion(trainer, other, role))
        kind = type(trainer).__mro__
        names = {c.__module__ + "." + c.__qualname__ for c in kind}
        route = None
        if "trl.experimental.gkd.gkd_trainer.GKDTrainer" in names:
            route, what = trl_distill.route_gkd, "GKD's generalized JSD"
        elif "trl.trainer.distillation_trainer.DistillationTrainer" in names:
            route, what = trl_distill.route_distillation, "DistillationTrainer's chunked divergence"
        if trl_prefs.kind(trainer) is not None:
            what = f"{type(trainer).__name__}'s log-probs from the logits"
            if self.trl_head == "trl":
                lines.append((f"{what}: kept (trl_head='trl')", False))
            else:
                why = trl_prefs.route(trainer)
                verdict = f"kept ({why})" if why else "run on lmkernels.fused_linear_cross_entropy"
                lines.append((f"{what}: {verdict}", bool(why)))
        if route is not None:
            if self.trl_head == "trl":
                lines.append((f"distillation: {what} kept (trl_head='trl')", False))
            else:
                why = route(trainer)
                if why:
                    lines.append((f"distillation: {what} kept ({why})", True))
                else:
                    lines.append((f"distillation: {what} runs on lmkernels.fused_linear_distillation", False))
        return lines

    def _patch_companion(self, trainer: Any, other: nn.Module, role: str) -> tuple[str, bool]:
        from lmkernels.integrations.transformers import api as lk_hf
        from lmkernels.integrations.transformers import patching

        unwrap = getattr(getattr(trainer, "accelerator", None), "unwrap_model", None)
        inner = lk_peft.inner_model(unwrap(other) if unwrap is not None else other)
        if patching.RECORD not in vars(inner):
            # trl_head="trl": its TRL head stays (apply() routes a head already on the model)
            ops = [op for op in self.ops if op != "flce"] if self.trl_head == "trl" else self.ops
            try:
                lk_hf.apply(inner, backend=self.backend, ops=ops, strict=False)
            except LMKernelsError as e:
                return f"{role}: not patched ({e})", True
        patch = vars(inner)[patching.RECORD]
        patch.hints["prefer"] = self.trl_head
        decision = lk_trl.route(inner, log=False) or patch.trl_decision
        if decision is None:
            return f"{role}: {patch.report.brief()}", False
        head = decision.message.split(": ", 2)[-1]
        return f"{role}: {patch.report.brief()}; {head}", not decision.ours

    def _summary(
        self, inner: nn.Module, args: TrainingArguments, decision: lk_trl.Decision | None
    ) -> tuple[str, int]:
        from lmkernels.integrations.transformers import patching

        patch = vars(inner)[patching.RECORD]
        report = patch.report
        level = logging.INFO
        if decision is None:
            decision = patch.trl_decision  # routed at apply() or by the pre-hook already
        smoothing = getattr(args, "label_smoothing_factor", 0)
        if smoothing and (decision is not None or "flce" in report.patched_ops()):
            # Trainer and SFTTrainer both hand the logits to their label smoother
            loss = (
                f"label_smoothing_factor={smoothing}: the trainer computes its loss from the logits, "
                f"not through lmkernels' fused loss"
            )
            if decision is not None and decision.ours:
                loss += " (TRL's fused head runs on lmkernels for its metrics only)"
            level = logging.WARNING
        elif decision is not None:
            loss = decision.message.split(": ", 2)[-1]
            if not decision.ours and self.trl_head != "trl":
                level = logging.WARNING
        elif "flce" in report.patched_ops():
            head = next(f.detail for f in report.patched if f.op == "flce")
            loss = (
                f"the model's forward runs lmkernels.fused_linear_cross_entropy "
                f"(backend {patch.flce_backend or 'auto'}; {head}) in training mode with labels"
            )
        else:
            why = [f.detail for f in report.findings if f.op == "flce"]
            loss = "the model's own (lm_head logits + cross entropy)" + (f": {why[0]}" if why else "")
            level = logging.WARNING if why else logging.INFO
        if report.failed:
            level = logging.WARNING
        return f"lmkernels: {report.brief()}\nlmkernels: loss: {loss}", level


def _find_trainer(callback: TrainerCallback) -> Any:
    """The Trainer whose __init__ runs `callback`'s on_init_end: the caller whose `self` holds it
    in its callback handler (the event carries the model, not the trainer; LmkernelsCallback
    needs the trainer's reference model, teacher and loss)."""
    frame: types.FrameType | None = sys._getframe(1)
    for _ in range(64):
        if frame is None:
            return None
        obj = frame.f_locals.get("self")
        handler = getattr(obj, "callback_handler", None)
        if handler is not None and any(cb is callback for cb in getattr(handler, "callbacks", ())):
            return obj
        frame = frame.f_back
    return None
