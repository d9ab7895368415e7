"""Axolotl plugin: train with lmkernels' norms, rotary embedding, gated MLP and fused loss.

In the Axolotl config:

    plugins:
      - lmkernels.integrations.axolotl.LmkernelsPlugin
    lmkernels: true                 # every op below, unless switched off one by one
    lmkernels_backend: triton       # optional: None lets lmkernels' dispatch choose per call
    lmkernels_flce: false           # optional per-op switches (see OP_KEYS)

The plugin patches the model instance right after Axolotl builds it (`post_model_build`:
before LoRA, quantization-aware training, FSDP and torch.compile wrap it) with
`lmkernels.integrations.transformers.apply(model, backend, ops, strict)`: modules are
recognized by structure and each replacement is checked against the module it replaces when
it is applied (see that module). With `lmkernels_flce` on, a training forward with labels
computes lm_head + cross entropy as one fused call and returns no logits. What was patched,
and what was kept and why, is logged once per model (logger axolotl.integrations.lmkernels).

Keys (all optional; `lmkernels: true` turns every op on, each `lmkernels_<op>` key then turns
one off or, without `lmkernels`, on):

- `lmkernels_rms_norm`, `lmkernels_layer_norm`, `lmkernels_rope`, `lmkernels_glu` (the gated
  MLP: SwiGLU / GeGLU), `lmkernels_flce` (lm_head + loss), `lmkernels_causal_mask` (no mask
  built for plain causal batches);
- `lmkernels_backend`: a backend name or per-op spec ("triton", "triton,flce=compile");
- `lmkernels_strict` (default true): refuse to train if something that looks patchable fails its
  check; false patches what passes and logs the rest.

Config validation refuses an op that another plugin or Axolotl option also replaces (Liger's
kernels, Cut Cross Entropy, chunked cross entropy), and a backend spec that does not parse.
With a LoRA adapter, Axolotl's own fused LoRA MLP kernel (`lora_mlp_kernel`, which Axolotl
turns on by default for LoRA) replaces each MLP's forward after the adapter is in: the plugin
then leaves the MLP to it (a warning says so); `lora_mlp_kernel: false` gives lmkernels' GLU
with LoRA running inside the projections.

This module is imported by Axolotl's plugin manager; it needs axolotl (and pydantic, which
axolotl brings) and raises LMKernelsError without them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from torch import nn

from lmkernels.registry import LMKernelsError, parse_backend_spec

try:
    from axolotl.integrations.base import BasePlugin
    from pydantic import BaseModel, Field, model_validator
except ImportError as exc:  # pragma: no cover - the message is tested where axolotl is absent
    raise LMKernelsError(
        "lmkernels.integrations.axolotl is an Axolotl plugin and needs axolotl installed "
        f"(pip install axolotl; {exc}). Outside Axolotl, use lmkernels.integrations.transformers."
    ) from exc

from lmkernels import _versions  # noqa: E402

_versions.check("axolotl")  # the range of pyproject.toml's axolotl extra

PLUGIN = "lmkernels.integrations.axolotl.LmkernelsPlugin"

# config key suffix -> the op of lmkernels.integrations.transformers.apply
OP_KEYS = {
    "rms_norm": "rms_norm",
    "layer_norm": "layer_norm",
    "rope": "rope",
    "glu": "mlp",
    "flce": "flce",
    "causal_mask": "causal_mask",
}

# Options of Axolotl (and of its bundled plugins) that replace the same thing as one of ours:
# both on would leave one silently unused, so validation refuses the pair.
_CONFLICTS = {
    "rms_norm": ("liger_rms_norm",),
    "layer_norm": ("liger_layer_norm",),
    "rope": ("liger_rope",),
    "glu": ("liger_glu_activation", "liger_swiglu"),
    "flce": (
        "liger_fused_linear_cross_entropy",
        "liger_cross_entropy",
        "cut_cross_entropy",
        "chunked_cross_entropy",
        "flash_attn_cross_entropy",
    ),
}
_CCE_PLUGIN = "axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"


def _op_switch(cfg: Mapping[str, Any], key: str) -> bool:
    value = cfg.get(f"lmkernels_{key}")
    return bool(cfg.get("lmkernels")) if value is None else bool(value)


def selected_ops(cfg: Mapping[str, Any]) -> tuple[str, ...]:
    """The ops of lmkernels.integrations.transformers.apply that `cfg` (a mapping) turns on."""
    return tuple(op for key, op in OP_KEYS.items() if _op_switch(cfg, key))


def _conflicts(data: dict[str, Any]) -> list[str]:
    found = []
    for key, others in _CONFLICTS.items():
        if not _op_switch(data, key):
            continue
        for other in others:
            on = data.get(other)
            if other == "cut_cross_entropy" and on is None:
                on = _CCE_PLUGIN in (data.get("plugins") or [])  # the CCE plugin defaults it on
            if on:
                found.append(f"lmkernels_{key} and {other} both replace the same computation")
    return found


class LmkernelsArgs(BaseModel):
    """Axolotl config keys of the lmkernels plugin (merged into Axolotl's config schema)."""

    lmkernels: bool | None = Field(
        default=None,
        json_schema_extra={
            "description": "Turn on every lmkernels op (each lmkernels_<op> key can turn one off)."
        },
    )
    lmkernels_backend: str | None = Field(
        default=None,
        json_schema_extra={
            "description": "lmkernels backend: a name ('triton') or per-op spec ('triton,flce=compile'); "
            "unset lets lmkernels' dispatch choose per call."
        },
    )
    lmkernels_rms_norm: bool | None = None
    lmkernels_layer_norm: bool | None = None
    lmkernels_rope: bool | None = None
    lmkernels_glu: bool | None = Field(
        default=None, json_schema_extra={"description": "The gated MLP (SwiGLU / GeGLU) as one lmkernels op."}
    )
    lmkernels_flce: bool | None = Field(
        default=None,
        json_schema_extra={
            "description": "lm_head + cross entropy as one fused call (no logits in training with labels)."
        },
    )
    lmkernels_causal_mask: bool | None = None
    lmkernels_strict: bool | None = Field(
        default=None,
        json_schema_extra={
            "description": "Default true: refuse to train if a module that looks patchable fails its check."
        },
    )

    @model_validator(mode="before")
    @classmethod
    def _check_lmkernels(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        backend = data.get("lmkernels_backend")
        if backend is not None:
            if not isinstance(backend, str):
                raise ValueError(f"lmkernels_backend: expected a string, got {type(backend).__name__}")
            try:
                parse_backend_spec(backend, where="lmkernels_backend")
            except LMKernelsError as exc:
                raise ValueError(str(exc)) from exc
        conflicts = _conflicts(data)
        if data.get("lmkernels_glu") and data.get("lora_mlp_kernel"):
            conflicts.append("lmkernels_glu and lora_mlp_kernel both replace the MLP's forward")
        if conflicts:
            raise ValueError("lmkernels: " + "; ".join(conflicts) + " (turn one of each pair off)")
        return data


def _is_peft(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - axolotl depends on peft
        return False
    return isinstance(model, PeftModel)


class LmkernelsPlugin(BasePlugin):
    """Patches the model Axolotl builds with lmkernels ops (see the module docstring)."""

    def get_input_args(self) -> str:
        return f"{__name__}.LmkernelsArgs"

    def post_model_build(self, cfg: Mapping[str, Any], model: nn.Module) -> None:
        """Patch the model Axolotl built (unless it is a PEFT checkpoint: pre_lora_load then)."""
        # A base checkpoint that is itself a PEFT model is merged by Axolotl after this hook:
        # that one is patched in pre_lora_load instead.
        if plugin_ops(cfg) and not _is_peft(model):
            _patch(cfg, model)

    def pre_lora_load(self, cfg: Mapping[str, Any], model: nn.Module) -> None:
        """Patch the model before Axolotl loads the LoRA adapter, if post_model_build did not."""
        from lmkernels.integrations import transformers as lk_hf

        if plugin_ops(cfg) and not lk_hf.is_patched(model):
            _patch(cfg, model)


def _log(message: str, warning: bool = False) -> None:
    # Axolotl shows INFO lines only of loggers under "axolotl" (others: warnings and errors).
    logger = logging.getLogger("axolotl.integrations.lmkernels")
    (logger.warning if warning else logger.info)(message)


def _axolotl_lora_mlp(cfg: Mapping[str, Any]) -> bool:
    return bool(cfg.get("lora_mlp_kernel")) and cfg.get("adapter") in ("lora", "qlora")


def plugin_ops(cfg: Mapping[str, Any]) -> tuple[str, ...]:
    """selected_ops(cfg) less what Axolotl itself replaces later: with a LoRA adapter Axolotl
    turns on its fused LoRA MLP kernel (`lora_mlp_kernel`, on by default for LoRA), which sets
    each MLP's forward after the adapter is in, over lmkernels' GLU."""
    ops = selected_ops(cfg)
    return tuple(op for op in ops if op != "mlp") if _axolotl_lora_mlp(cfg) else ops


def _patch(cfg: Mapping[str, Any], model: nn.Module) -> None:
    from lmkernels.integrations import transformers as lk_hf

    if "mlp" in selected_ops(cfg) and _axolotl_lora_mlp(cfg):
        _log(
            "lmkernels: the gated MLP is left to Axolotl's LoRA MLP kernel (lora_mlp_kernel); "
            "set lora_mlp_kernel: false for lmkernels' SwiGLU / GeGLU with LoRA inside it",
            warning=True,
        )
    strict = cfg.get("lmkernels_strict") is not False
    lk_hf.apply(model, backend=cfg.get("lmkernels_backend"), ops=plugin_ops(cfg), strict=strict)
    report = lk_hf.report(model)
    if report is not None:  # (apply() just patched it)
        _log("\n" + report.format())
