"""torchtitan overrides (`--override.imports`): each swaps one kind of component for lmkernels'.

    --override.imports lmkernels.integrations.torchtitan.overrides.rms_norm,\
lmkernels.integrations.torchtitan.overrides.rope,lmkernels.integrations.torchtitan.overrides.swiglu,\
lmkernels.integrations.torchtitan.overrides.flce

Each takes an optional backend: 'lmkernels.integrations.torchtitan.overrides.flce={"backend": "triton"}'.
A config of a type lmkernels has no module for (a subclass of torchtitan's RoPE with its own
math, a custom loss) is kept (rope) or refused (flce: the run would not compute what it asks).
"""

from __future__ import annotations

from typing import Any

from torchtitan.components.loss import BaseLoss
from torchtitan.config import override
from torchtitan.models.common import FeedForward, LayerNorm, RMSNorm, RoPE

from lmkernels.integrations.torchtitan.loss import fused_loss_config
from lmkernels.integrations.torchtitan.modules import replacement


@override(target=RMSNorm.Config, exact=True, description="lmkernels RMSNorm")
def rms_norm(cfg: Any, backend: str | None = None) -> Any:
    return replacement(cfg, backend)


@override(target=LayerNorm.Config, exact=True, description="lmkernels LayerNorm")
def layer_norm(cfg: Any, backend: str | None = None) -> Any:
    return replacement(cfg, backend)


@override(target=RoPE.Config, description="lmkernels rotary embedding (ComplexRoPE, CosSinRoPE)")
def rope(cfg: Any, backend: str | None = None) -> Any:
    return replacement(cfg, backend) or cfg  # other RoPE subclasses compute something else: kept


@override(target=FeedForward.Config, exact=True, description="lmkernels SwiGLU feed-forward")
def swiglu(cfg: Any, backend: str | None = None) -> Any:
    return replacement(cfg, backend)


@override(target=BaseLoss.Config, fqns=["loss"], description="lmkernels fused lm_head + cross entropy")
def flce(cfg: Any, backend: str | None = None) -> Any:
    return fused_loss_config(cfg, backend)
