"""verl's fused actor head on lmkernels: per-token log-probs and entropy, both with gradients.

verl (tested against 0.9.1) computes the actor's log-probs and entropy without the logits when
`actor_rollout_ref.model.use_fused_kernels=True`: `verl.models.transformers.monkey_patch.
patch_forward_with_backends` sets the model class's forward to one that runs the backbone and
then, at every call, imports and calls

- `fused_kernels_backend="triton"`: `verl.utils.kernel.linear_cross_entropy.linear_cross_entropy(
  hidden, weight, labels, temperature, reduction)` -> (log_probs, entropy), fp32, flat (N,)
  (hidden flattened to (N, H)); reduction "none", or "sum" / "mean" of the log-probs (the entropy
  stays per token);
- `fused_kernels_backend="torch"` / `"liger"`: `verl.utils.experimental.torch_functional.
  FusedLinearForPPO(impl_backend=...).forward(hidden_states, vocab_weights, input_ids,
  temperature)` -> (log_probs fp32, entropy in hidden's dtype), input_ids' shape.

Both: log p(label) and the entropy of softmax(hidden @ weight.T / temperature), every label
counts (verl rolls the input ids: no ignore index), gradients of both reach hidden and weight.

    from lmkernels.integrations import verl as lk_verl
    lk_verl.enable()            # before verl's workers build the actor; backend="triton" etc. optional
    ...                         # verl's PPO / GRPO with use_fused_kernels=True
    lk_verl.disable()

`enable()` replaces those two module attributes (verl imports them at each call, so every model
verl patched picks lmkernels' up) with lmkernels.fused_linear_cross_entropy(reduction="none",
return_stats=True, temperature=T): no logits built, the entropy's gradient through the FLCE
backend (every lmkernels backend has it; the peers refuse return_stats). With Ray, enable() must run
in the worker processes: call it where the actor is built (e.g. a worker extension or
`VERL_USE_LMKERNELS=1` read by your entry point). verl's tensor-parallel `dist_process_group`
(vocabulary-sharded head) is refused by name.
"""

from __future__ import annotations

import importlib
import typing

import torch

import lmkernels
from lmkernels.registry import LMKernelsError

if typing.TYPE_CHECKING:
    from torch.distributed import ProcessGroup

LCE_MODULE = "verl.utils.kernel.linear_cross_entropy"
PPO_MODULE = "verl.utils.experimental.torch_functional"

_SAVED: dict[str, tuple[typing.Any, str, typing.Any]] = {}
_STATE: dict[str, str | None] = {"backend": None}


def _stats(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float, backend: str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(label), entropy) per row of hidden (..., H), fp32, both differentiable."""
    labels = labels.to(torch.int64)
    loss, _, entropy, _ = lmkernels.fused_linear_cross_entropy(
        hidden,
        weight,
        labels,
        ignore_index=-100,  # every label counts (token ids are never negative)
        reduction="none",
        return_stats=True,
        temperature=float(temperature),
        backend=backend,
    )
    return -loss, entropy


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    reduction: str = "none",
    dist_process_group: ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl.utils.kernel.linear_cross_entropy.linear_cross_entropy on lmkernels' fused loss."""
    if dist_process_group is not None:
        raise LMKernelsError(
            "dist_process_group: verl's vocabulary-parallel head is not run by lmkernels.integrations.verl; "
            "call lk_verl.disable() for tensor-parallel actors"
        )
    if reduction not in ("none", "sum", "mean"):
        raise LMKernelsError(f"reduction: expected 'none', 'sum' or 'mean', got {reduction!r}")
    h = hidden.reshape(-1, hidden.shape[-1])
    logprobs, entropy = _stats(h, weight, labels.reshape(-1), temperature, _STATE["backend"])
    if reduction == "sum":
        logprobs = logprobs.sum()
    elif reduction == "mean":
        logprobs = logprobs.mean()
    return logprobs, entropy


class FusedLinearForPPO(torch.nn.Module):
    """verl.utils.experimental.torch_functional.FusedLinearForPPO on lmkernels' fused loss (the
    chunk_size and impl_backend arguments are accepted and not needed)."""

    def __init__(self, chunk_size: int = 512, impl_backend: str = "torch"):
        super().__init__()
        if impl_backend not in ("torch", "liger"):
            raise ValueError(
                f"Unsupported FusedLinearForPPO backend: {impl_backend}. Choose 'torch' or 'liger'."
            )
        self.chunk_size, self.impl_backend = chunk_size, impl_backend

    def forward(
        self,
        hidden_states: torch.Tensor,
        vocab_weights: torch.Tensor,
        input_ids: torch.Tensor,
        temperature: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logprobs, entropy = _stats(hidden_states, vocab_weights, input_ids, temperature, _STATE["backend"])
        return logprobs, entropy.to(hidden_states.dtype)


def enable(backend: str | None = None) -> None:
    """Run verl's fused actor head (both backends) on lmkernels; `backend`: the FLCE backend
    (None: lmkernels' dispatch). Idempotent; disable() restores verl's."""
    _STATE["backend"] = backend
    targets = (
        (LCE_MODULE, "linear_cross_entropy", linear_cross_entropy),
        (PPO_MODULE, "FusedLinearForPPO", FusedLinearForPPO),
    )
    for module_name, attr, ours in targets:
        module = importlib.import_module(module_name)
        if getattr(module, attr) is not ours:
            _SAVED.setdefault(f"{module_name}.{attr}", (module, attr, getattr(module, attr)))
            setattr(module, attr, ours)


def disable() -> None:
    """verl's own fused head again."""
    for module, attr, original in _SAVED.values():
        setattr(module, attr, original)
    _SAVED.clear()
    _STATE["backend"] = None


def enabled() -> bool:
    return bool(_SAVED)
