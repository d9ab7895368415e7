"""torchtitan: lmkernels' RMSNorm, RoPE and SwiGLU in the model, lm_head + loss fused.

Three ways in, from the most to the least hands-off:

    # 1. a config module: any torchtitan config function, with lmkernels
    torchrun ... -m torchtitan.train --module lmkernels.integrations.torchtitan --config llama3_8b
    #    ("--config llama3_8b" finds torchtitan.models.llama3.config_registry.llama3_8b;
    #     "--config my_pkg.configs.my_run" takes a config function of your own)
    #    --loss.backend triton picks the fused loss's backend on the command line.

    # 2. in your own config function
    from lmkernels.integrations import torchtitan as lk_tt
    config = lk_tt.apply(llama3_8b(), backend=None)          # the model's modules + the loss
    spec = model_registry("8B", converters=[lk_tt.LmkernelsConverter.Config()])  # modules only

    # 3. torchtitan's override mechanism, one target per kind
    --override.imports lmkernels.integrations.torchtitan.overrides.rms_norm,\
lmkernels.integrations.torchtitan.overrides.rope,lmkernels.integrations.torchtitan.overrides.swiglu,\
lmkernels.integrations.torchtitan.overrides.flce
    #    ('...overrides.rms_norm={"backend": "triton"}' passes a backend)

What changes (modules.py, loss.py): RMSNorm, LayerNorm, ComplexRoPE / CosSinRoPE and the SwiGLU
FeedForward configs (exact types) become subclasses that call lmkernels ops, with the same
parameters and buffers (checkpoints, initialization and sharding configs are unchanged); the
loss (torchtitan's cross entropy, chunked or not) becomes FusedLinearCrossEntropyLoss, a
ChunkedLossWrapper that gets the final hidden states and lm_head from torchtitan's trainer and
computes lm_head + cross entropy in one lmkernels call, FSDP2-sharded lm_head included.

`backend`: None lets lmkernels' dispatch choose per call (Triton on CUDA); LMKERNELS_BACKEND
works as everywhere. Tested with torchtitan 0.3.0.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from lmkernels.registry import LMKernelsError, parse_backend_spec

try:
    from torchtitan.protocols.model import ModelConfigConverter
except ImportError as exc:  # pragma: no cover - the message is tested where torchtitan is absent
    raise LMKernelsError(
        f"lmkernels.integrations.torchtitan needs torchtitan installed (pip install torchtitan; {exc})"
    ) from exc

from lmkernels import _versions  # noqa: E402

_versions.check("torchtitan")  # the range of pyproject.toml's torchtitan extra

from lmkernels.integrations.torchtitan.loss import FusedLinearCrossEntropyLoss, fused_loss_config  # noqa: E402
from lmkernels.integrations.torchtitan.modules import (  # noqa: E402
    MODEL_OPS,
    LmkernelsComplexRoPE,
    LmkernelsCosSinRoPE,
    LmkernelsFeedForward,
    LmkernelsLayerNorm,
    LmkernelsRMSNorm,
    convert,
)

OPS = (*MODEL_OPS, "flce")

__all__ = [
    "OPS",
    "FusedLinearCrossEntropyLoss",
    "LmkernelsComplexRoPE",
    "LmkernelsConverter",
    "LmkernelsCosSinRoPE",
    "LmkernelsFeedForward",
    "LmkernelsLayerNorm",
    "LmkernelsRMSNorm",
    "apply",
]


def _check(ops: Iterable[str], allowed: tuple[str, ...], backend: str | None) -> tuple[str, ...]:
    ops = (ops,) if isinstance(ops, str) else tuple(ops)
    unknown = [op for op in ops if op not in allowed]
    if unknown:
        raise LMKernelsError(f"ops: unknown {unknown}; expected a subset of {allowed}")
    if backend is not None:
        parse_backend_spec(backend, where="backend")
    return ops


class LmkernelsConverter(ModelConfigConverter):
    """A torchtitan model converter (like Float8LinearConverter): swaps the norms, rotary
    embedding and SwiGLU feed-forward configs of the model config tree for lmkernels'. The loss
    is not part of the model config: use apply() on the trainer config (or the flce override)
    for the fused lm_head + loss."""

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        ops: list[str] = field(default_factory=lambda: list(MODEL_OPS))
        """Subset of rms_norm, layer_norm, rope, mlp."""

        backend: str | None = None
        """lmkernels backend of the swapped modules (None: lmkernels' dispatch chooses)."""

    def __init__(self, config: Config):
        self.ops = _check(config.ops, MODEL_OPS, config.backend)
        self.backend = config.backend
        self.swapped: list[str] = []

    def convert(self, model_config: Any) -> Any:
        model_config, self.swapped = convert(model_config, self.ops, self.backend)
        _log(self.swapped, None)
        return model_config


def _log(swapped: list[str], loss: Any) -> None:
    from torchtitan.tools.logging import logger

    kinds = sorted({fqn.rpartition(".")[-1] for fqn in swapped})
    text = f"lmkernels: {len(swapped)} module configs swapped ({', '.join(kinds) or 'none'})"
    if loss is not None:
        text += f"; loss {type(loss).__qualname__.removesuffix('.Config')}"
    logger.info(text)


def apply(config: Any, *, ops: Iterable[str] = OPS, backend: str | None = None) -> Any:
    """A torchtitan Trainer.Config with lmkernels: the model's modules of `ops` (see
    LmkernelsConverter) and, with "flce", the fused lm_head + loss. Changes `config` in place
    and returns it."""
    ops = _check(ops, OPS, backend)
    spec = getattr(config, "model_spec", None)
    if spec is None:
        raise LMKernelsError("config: expected a torchtitan Trainer.Config with a model_spec")
    spec.model, swapped = convert(spec.model, [op for op in ops if op in MODEL_OPS], backend)
    if "flce" in ops:
        config.loss = fused_loss_config(config.loss, backend)
    _log(swapped, config.loss)
    return config
