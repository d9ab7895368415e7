"""The loss path of a patched causal LM: lm_head + transformers' ForCausalLMLoss, fused.

`lm_head_loss(lm_head, hidden, labels, ...)` is the one place a patched model computes its loss;
it takes the lm_head module (not its weight) so that the code owning the weight is honoured:

- FSDP2 (`fully_shard(model.lm_head)`): the patched forward never calls lm_head, so FSDP2's
  pre-forward unshard would not run and the kernel would meet the sharded DTensor weight. The loss
  runs as a registered FSDP forward method of lm_head (`register_fsdp_forward_method`, public
  API): FSDP2 unshards before it, reshards after it, unshards again for its backward and
  reduce-scatters the weight gradient, as it does for lm_head's own forward. Mixed-precision
  policies apply as they would to lm_head (hidden cast to param_dtype).
- lm_head inside a bigger FSDP2 unit (per layer + root): the root's forward already unsharded it.
- a DTensor weight that FSDP2 does not manage (tensor parallel): lmkernels.distributed computes
  the loss on the local shard (vocab-parallel for a vocabulary-sharded weight).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

import lmkernels
from lmkernels.registry import LMKernelsError


def keep_hidden(hidden: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The hidden states the original forward would feed lm_head, for this transformers version."""
    if isinstance(logits_to_keep, int) and logits_to_keep == 0:
        return hidden
    try:  # newer transformers: also boolean masks and per-sample positions
        from transformers.modeling_utils import slice_logits_to_keep
    except ImportError:
        index = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return hidden[:, index, :]
    return slice_logits_to_keep(hidden, logits_to_keep)


def causal_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    logit_scale: float | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """transformers' ForCausalLMLoss of the logits hidden @ weight.T (+ bias, softcap), fused.

    `logit_scale` multiplies the logits before the softcap and the loss (Cohere's logit_scale,
    1 / Granite's logits_scaling); it is applied to hidden (and bias), so no logits are built.
    Labels are shifted left by padding one ignore_index at the end (so hidden needs no slicing or
    copy), unless `shift_labels` is given. Mean over non-ignored tokens, or sum / num_items_in_batch.
    """
    if shift_labels is None:
        if labels is None:
            raise LMKernelsError("labels: expected a tensor of token ids (or shift_labels), got None")
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    H = weight.shape[-1]
    h = hidden.reshape(-1, H)
    if logit_scale is not None:
        h = h * logit_scale
        bias = None if bias is None else bias * logit_scale
    target = shift_labels.reshape(-1).to(h.device)
    if target.shape[0] != h.shape[0]:
        raise LMKernelsError(
            f"labels: {target.shape[0]} labels for {h.shape[0]} hidden states (shape "
            f"{tuple(hidden.shape)}); with logits_to_keep the labels must match the kept positions"
        )
    device_type = h.device.type
    # Under autocast transformers' lm_head would run in the autocast dtype; do the same, then turn
    # autocast off so the backends' own fp32 upcasts inside FLCE are not cast back down.
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = weight.dtype
    with torch.autocast(device_type, enabled=False):
        reduction = "mean" if num_items_in_batch is None else "sum"
        flce = lmkernels.fused_linear_cross_entropy
        if _any_dtensor(hidden, weight, bias):
            from lmkernels.distributed.dtensor_loss import dtensor_linear_cross_entropy as flce
        loss = flce(
            h.to(dtype),
            weight.to(dtype),
            target,
            bias=None if bias is None else bias.to(dtype),
            ignore_index=ignore_index,
            reduction=reduction,
            softcap=softcap,
            backend=backend,
        )
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def _any_dtensor(*tensors) -> bool:
    # DTensor subclasses torch.Tensor; checking the type name avoids importing torch.distributed
    # for every single-device loss.
    return any(t is not None and type(t).__name__ == "DTensor" for t in tensors)


def _params_loss(lm_head: nn.Module, hidden, labels, **kwargs) -> torch.Tensor:
    if not isinstance(lm_head, nn.Linear):
        raise LMKernelsError(
            f"lm_head: expected an nn.Linear (its weight is the loss's), got {type(lm_head).__name__}"
        )
    return causal_lm_loss(hidden, lm_head.weight, labels, bias=lm_head.bias, **kwargs)


_FSDP_METHOD = "_lmkernels_fsdp_loss"


def _fsdp_loss_method(lm_head: nn.Module):
    """lm_head's loss method wrapped in FSDP2's pre/post-forward, or None if lm_head is not an
    FSDP2 module itself. Registered once per module."""
    if "FSDP" not in type(lm_head).__name__:  # fully_shard swaps the class to FSDP<cls>
        return None
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    if not isinstance(lm_head, FSDPModule):
        return None
    if _FSDP_METHOD not in vars(lm_head):
        setattr(lm_head, _FSDP_METHOD, types.MethodType(_params_loss, lm_head))
        register_fsdp_forward_method(lm_head, _FSDP_METHOD)
    return getattr(lm_head, _FSDP_METHOD)


def lm_head_loss(
    lm_head: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    softcap: float | None = None,
    logit_scale: float | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """causal_lm_loss of `lm_head` (an nn.Linear) applied to `hidden`, through lm_head's FSDP2
    forward hooks when lm_head is sharded on its own (see the module docstring)."""
    kwargs = dict(
        softcap=softcap,
        logit_scale=logit_scale,
        num_items_in_batch=num_items_in_batch,
        ignore_index=ignore_index,
        shift_labels=shift_labels,
        backend=backend,
    )
    fsdp_method = _fsdp_loss_method(lm_head)
    if fsdp_method is not None:
        return fsdp_method(hidden, labels, **kwargs)
    return _params_loss(lm_head, hidden, labels, **kwargs)
