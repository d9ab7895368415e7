"""A gated MLP's (or MoE expert's) down projection that keeps no copy of its input for the backward.

down_proj(h) with h = act(gate) * up: autograd normally saves h (B*T x intermediate values per
layer, about a fifth of a Llama layer's saved activations) for down_proj's weight gradient,
while the GLU saves gate and up. h is a cheap elementwise function of gate and up, so here
autograd stores a recipe instead and recomputes h, with the same kernel and so the same bits,
when down_proj's backward asks for it. Cost: one elementwise pass (read gate and up, write h)
per layer in the backward; the step's peak drops by h's bytes per layer that is not
checkpointed.

Applied only where it is safe and pays:
- grad mode on, h a plain tensor that needs grad (not a DTensor: tensor parallel saves local
  shards under other identities);
- no other saved-tensor hooks active (activation checkpointing or offloading own the saved
  tensors there: a recipe would keep gate and up alive and undo their savings);
- not while torch.compile traces (its partitioner decides what to save).
gate and up are read again in the backward: if anything wrote them before down_proj's backward
(a second backward after a GLU that consumed its inputs), unpacking raises instead of computing
from the gradients that now live there.

LMKERNELS_MLP_RECOMPUTE=0 turns it off (h saved as usual).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

ENV = "LMKERNELS_MLP_RECOMPUTE"


class _Recipe:
    """A saved tensor that views h's memory (F.linear saves h.view(-1, K) for 3-D inputs), as
    what recomputes h and the view's geometry within it."""

    __slots__ = ("recompute", "sources", "versions", "size", "stride", "offset")

    def __init__(
        self,
        recompute: Callable[[], torch.Tensor],
        sources: tuple[torch.Tensor, ...],
        view: torch.Tensor,
        h_offset: int | torch.SymInt,
    ) -> None:
        self.recompute = recompute
        self.sources = sources
        self.versions = tuple(t._version for t in sources)
        self.size, self.stride = view.size(), view.stride()
        self.offset = view.storage_offset() - h_offset

    def run(self) -> torch.Tensor:
        if tuple(t._version for t in self.sources) != self.versions:
            raise RuntimeError(
                "lmkernels: the MLP's down_proj input cannot be recomputed for this backward: the GLU's "
                "inputs were modified after the forward (a second backward through a GLU called with "
                f"consume_inputs=True?). Set {ENV}=0 to save the input instead."
            )
        with torch.no_grad():
            h = self.recompute()
        return h.as_strided(self.size, self.stride, h.storage_offset() + self.offset)


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def _other_hooks_active() -> bool:
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None  # unknown torch: assume they are


def project_recomputed(
    down_proj: Callable[[torch.Tensor], torch.Tensor],
    h: torch.Tensor,
    recompute: Callable[[], torch.Tensor],
    sources: tuple[torch.Tensor, ...],
) -> torch.Tensor:
    """down_proj(h) (a module, or a function of h) where autograd saves `recompute` (which must
    return h's exact values from `sources`, tensors that stay saved until down_proj's backward
    anyway) instead of h."""
    if (
        not (torch.is_grad_enabled() and h.requires_grad)
        or type(h) is not torch.Tensor
        or not h.is_contiguous()  # the recomputation's layout
        or torch.compiler.is_compiling()
        or not enabled()
        or _other_hooks_active()
    ):
        return down_proj(h)
    # Identified by its memory, not by identity: what down_proj saves may be a view of h. The
    # hooks hold no reference to h (h's memory is alive while down_proj runs).
    memory, h_offset = h.untyped_storage().data_ptr(), h.storage_offset()

    def pack(t: torch.Tensor) -> torch.Tensor | _Recipe:
        if type(t) is torch.Tensor and t.untyped_storage().data_ptr() == memory:
            return _Recipe(recompute, sources, t, h_offset)
        return t

    def unpack(saved: torch.Tensor | _Recipe) -> torch.Tensor:
        return saved.run() if isinstance(saved, _Recipe) else saved

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return down_proj(h)


def glu_down(
    down_proj: Callable[[torch.Tensor], torch.Tensor],
    glu: Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor],
    gate: torch.Tensor,
    up: torch.Tensor,
) -> torch.Tensor:
    """down_proj(glu(gate, up, True)) with the GLU's output recomputed for down_proj's backward.
    glu(gate, up, consume_inputs) is the MLP's GLU call: True hands gate and up over (see
    lmkernels.swiglu) for the forward, False leaves them intact for the recomputation."""
    h = glu(gate, up, True)
    return project_recomputed(down_proj, h, lambda: glu(gate, up, False), (gate, up))
