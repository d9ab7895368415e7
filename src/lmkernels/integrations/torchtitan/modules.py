"""torchtitan modules that run lmkernels ops: drop-in subclasses of torchtitan's own RMSNorm,
LayerNorm, RoPE and FeedForward (same parameters and buffers, so checkpoints, parameter
initialization and sharding configs carry over), each with a `backend` field in its Config.

`convert(config, ops, backend)` swaps them into a model config tree: exact types only (a
subclass of torchtitan's module may compute something else, and is left as it is).

DTensor inputs (tensor parallel): the norms and the GLU run on the local shards
(lmkernels.distributed.local); RoPE falls back to torchtitan's own code for DTensors, whose
positions would have to follow the sequence shards.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.config import derive
from torchtitan.models.common import ComplexRoPE, CosSinRoPE, FeedForward, LayerNorm, RMSNorm

import lmkernels
from lmkernels.nn.recompute import glu_down
from lmkernels.registry import LMKernelsError
from lmkernels.types import RopeLayout


def _is_dtensor(t: object) -> bool:
    return t is not None and type(t).__name__ == "DTensor"


class LmkernelsRMSNorm(RMSNorm):
    """torchtitan's RMSNorm (nn.RMSNorm: normalize in fp32, cast to x's dtype, then scale by the
    weight) as `lmkernels.rms_norm`."""

    @dataclass(kw_only=True, slots=True)
    class Config(RMSNorm.Config):
        backend: str | None = None

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.backend = config.backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.normalized_shape) != 1:
            return super().forward(x)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps

        def norm(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
            return lmkernels.rms_norm(x, weight, eps=eps, casting_mode="llama", backend=self.backend)

        if _is_dtensor(x) or _is_dtensor(self.weight):
            from lmkernels.distributed.local import local_call

            return local_call(norm, [x], [self.weight], op="rms_norm")
        return norm(x, self.weight)


class LmkernelsLayerNorm(LayerNorm):
    """torchtitan's LayerNorm (nn.LayerNorm over the last dim) as `lmkernels.layer_norm`."""

    @dataclass(kw_only=True, slots=True)
    class Config(LayerNorm.Config):
        backend: str | None = None

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.backend = config.backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.normalized_shape) != 1:
            return super().forward(x)

        def norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
            return lmkernels.layer_norm(x, weight, bias, eps=self.eps, backend=self.backend)

        if _is_dtensor(x) or _is_dtensor(self.weight):
            from lmkernels.distributed.local import local_call

            return local_call(norm, [x], [self.weight, self.bias], op="layer_norm")
        return norm(x, self.weight, self.bias)


def _rows(cache: torch.Tensor, seq_len: int, batch: int, positions: torch.Tensor | None) -> torch.Tensor:
    """The cache rows of the sequence: (L, W) for positions 0..L-1 or one position row shared by
    the batch, (B, L, W) for per-sample positions."""
    if positions is None:
        return cache[:seq_len]
    if positions.dim() != 2 or positions.shape[-1] != seq_len:
        raise LMKernelsError(f"positions: expected shape (batch, {seq_len}), got {tuple(positions.shape)}")
    if positions.shape[0] == 1:
        return cache[positions[0]]
    if positions.shape[0] != batch:
        raise LMKernelsError(f"positions: expected batch {batch} or 1, got {positions.shape[0]}")
    return cache[positions]


def _rope_blnh(
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    layout: RopeLayout,
    backend: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """lmkernels.rope on torchtitan's (batch, seq, heads, head_dim) layout."""
    q, k = lmkernels.rope(
        query.transpose(1, 2), key.transpose(1, 2), cos, sin, layout=layout, backend=backend
    )
    return q.transpose(1, 2), k.transpose(1, 2)


class LmkernelsComplexRoPE(ComplexRoPE):
    """torchtitan's ComplexRoPE (adjacent dims (2i, 2i+1) rotated by the complex cache
    cos + i sin) as `lmkernels.rope` with the interleaved layout, from the same cache."""

    @dataclass(kw_only=True, slots=True)
    class Config(ComplexRoPE.Config):
        backend: str | None = None

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.backend = config.backend

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if any(_is_dtensor(t) for t in (query, key, positions, self.cache)):
            return super().forward(query, key, positions)
        rows = _rows(self.cache, query.shape[1], query.shape[0], positions)
        cos = rows.real.repeat_interleave(2, dim=-1)
        sin = rows.imag.repeat_interleave(2, dim=-1)
        return _rope_blnh(query, key, cos, sin, "interleaved", self.backend)


class LmkernelsCosSinRoPE(CosSinRoPE):
    """torchtitan's CosSinRoPE (rotate-half, cache [cos | sin]) as `lmkernels.rope` with the
    neox layout, from the same cache."""

    @dataclass(kw_only=True, slots=True)
    class Config(CosSinRoPE.Config):
        backend: str | None = None

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.backend = config.backend

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if any(_is_dtensor(t) for t in (query, key, positions, self.cache)):
            return super().forward(query, key, positions)
        head_dim = query.shape[-1]
        rows = _rows(self.cache, query.shape[1], query.shape[0], positions)
        return _rope_blnh(query, key, rows[..., :head_dim], rows[..., head_dim:], "neox", self.backend)


class LmkernelsFeedForward(FeedForward):
    """torchtitan's SwiGLU FeedForward, w2(silu(w1(x)) * w3(x)), with `lmkernels.swiglu`, and
    w2's input recomputed for its backward instead of saved (lmkernels.nn.recompute)."""

    @dataclass(kw_only=True, slots=True)
    class Config(FeedForward.Config):
        backend: str | None = None

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.backend = config.backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # gate and up are created here and read by nothing else: handed over to the GLU.
        gate, up = self.w1(x), self.w3(x)
        if _is_dtensor(gate) or _is_dtensor(up):
            from lmkernels.distributed.local import local_call

            h = local_call(lambda g, u: self._glu(g, u, True), [gate, up], op="swiglu", reduced_dims=())
            return self.w2(h)
        return glu_down(self.w2, self._glu, gate, up)

    def _glu(self, gate: torch.Tensor, up: torch.Tensor, consume_inputs: bool) -> torch.Tensor:
        return lmkernels.swiglu(gate, up, consume_inputs=consume_inputs, backend=self.backend)


# torchtitan Config class (exact type) -> (ops name, the lmkernels Config class)
REPLACEMENTS = {
    RMSNorm.Config: ("rms_norm", LmkernelsRMSNorm.Config),
    LayerNorm.Config: ("layer_norm", LmkernelsLayerNorm.Config),
    ComplexRoPE.Config: ("rope", LmkernelsComplexRoPE.Config),
    CosSinRoPE.Config: ("rope", LmkernelsCosSinRoPE.Config),
    FeedForward.Config: ("mlp", LmkernelsFeedForward.Config),
}
MODEL_OPS = ("rms_norm", "layer_norm", "rope", "mlp")


def replacement(config: Any, backend: str | None = None) -> Any:
    """The lmkernels Config for a torchtitan module Config (fields copied), or None when its
    exact type has no lmkernels module."""
    entry = REPLACEMENTS.get(type(config))
    if entry is None:
        return None
    return derive(config, entry[1], backend=backend)


def convert(
    model_config: Any, ops: Iterable[str] = MODEL_OPS, backend: str | None = None
) -> tuple[Any, list[str]]:
    """Swap every module config of the `ops` kinds in a torchtitan model config tree for its
    lmkernels subclass, in place; returns the (possibly replaced) root and the FQNs swapped."""
    swapped: list[str] = []
    for config_cls, (op, _) in REPLACEMENTS.items():
        if op not in ops:
            continue
        for fqn, cfg, parent, attr in list(model_config.traverse(config_cls)):
            if type(cfg) is not config_cls:
                continue
            new = replacement(cfg, backend)
            if parent is None:
                model_config = new
            elif isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
            swapped.append(fqn)
    return model_config, swapped
