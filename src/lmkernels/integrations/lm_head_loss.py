"""The loss path of a patched causal LM: lm_head + transformers' ForCausalLMLoss, fused.

`lm_head_loss(lm_head, hidden, labels, ...)` is the one place a patched model computes its loss
(`lm_head_token_stats`: per-token log-prob, entropy and top-1, for TRL's fused head, trl.py);
both take the lm_head module (not its weight) so that the code owning the weight is honoured:

- PEFT: lm_head wrapped by LoRA or modules_to_save is computed as PEFT does (peft.head_parts).

- FSDP2 (`fully_shard(model.lm_head)`): the patched forward never calls lm_head, so FSDP2's
  pre-forward unshard would not run and the kernel would meet the sharded DTensor weight. The loss
  runs as a registered FSDP forward method of lm_head (`register_fsdp_forward_method`, public
  API): FSDP2 unshards before it, reshards after it, unshards again for its backward and
  reduce-scatters the weight gradient, as it does for lm_head's own forward. Mixed-precision
  policies apply as they would to lm_head (hidden cast to param_dtype).
- lm_head inside a bigger FSDP2 unit (per layer + root): the root's forward already unsharded it.
- a DTensor weight that FSDP2 does not manage (tensor parallel): lmkernels.distributed computes
  the loss on the local shard (vocab-parallel for a vocabulary-sharded weight).
- DeepSpeed ZeRO-3 (partitioned lm_head parameters): the loss runs as lm_head's forward, so that
  ZeRO-3's module hooks gather the weight for it (lmkernels/distributed/zero.py).
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import nn

import lmkernels
from lmkernels.integrations.peft import head_parts
from lmkernels.losses import logps as losses_logps
from lmkernels.registry import LMKernelsError
from lmkernels.types import Reduction

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

_R = TypeVar("_R")


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


def _flce_dtype(weight: torch.Tensor, device_type: str) -> torch.dtype:
    # Under autocast transformers' lm_head would run in the autocast dtype; do the same (the caller
    # then turns autocast off so the backends' own fp32 upcasts inside FLCE are not cast back down).
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


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
    if _any_dtensor(hidden):
        # The DTensor loss gathers hidden anyway; gathered first, the flatten below is local
        # (DTensor in torch 2.11 refuses to flatten a sequence-sharded (Shard(1)) tensor).
        from torch.distributed.tensor import Replicate

        mesh = cast("DTensor", hidden).device_mesh
        hidden = cast("DTensor", hidden).redistribute(mesh, [Replicate()] * mesh.ndim)
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
    dtype = _flce_dtype(weight, device_type)
    with torch.autocast(device_type, enabled=False):
        reduction: Reduction = "mean" if num_items_in_batch is None else "sum"
        flce: Callable[..., torch.Tensor] = lmkernels.fused_linear_cross_entropy
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


class HeadStats(typing.NamedTuple):
    """Per token (the targets' shape): nll = -log p_target (differentiable), entropy
    (differentiable where the FLCE backend has its gradient), is_top1 (bool), and when asked for
    mean_logits and log_sum_sq_probs (fp32, no gradient; None otherwise). Ignored tokens: 0 /
    False everywhere."""

    nll: torch.Tensor
    entropy: torch.Tensor
    is_top1: torch.Tensor
    mean_logits: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None


def token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    scale: float = 1.0,
    softcap: float | None = None,
    fp32: bool = False,
    ignore_index: int = -100,
    mean_logits: bool = False,
    log_sum_sq_probs: bool = False,
    backend: str | None = None,
) -> HeadStats:
    """Per token of `targets` (any shape, hidden is (*targets.shape, H)): the loss -log p_target
    (differentiable), the entropy of the next-token distribution (differentiable) and whether
    the target is its most likely token, of the logits

        z = softcap(scale * (hidden @ weight.T + bias))      (softcap c: c * tanh(y / c))

    from one `lmkernels.fused_linear_cross_entropy(..., reduction="none", return_stats=True)`
    call: no logits are built. `scale` multiplies hidden and bias, so a temperature T after the
    softcap is `scale=1/T, softcap=c/T`. Ignored tokens: loss 0, entropy 0, is_top1 False.
    fp32: hidden and weight in fp32 (TRL's cast_lm_head_to_fp32), else as causal_lm_loss (the
    autocast dtype under autocast, as TRL's head computes too).

    mean_logits: also (1/V) sum_c z_c (TRL's DPO / KTO metric; lmkernels.losses.mean_logits, no
    pass over the logits without a softcap). log_sum_sq_probs: also log sum_c p_c^2 =
    logsumexp(2 z) - 2 logsumexp(z) (TRL's WPO weights): the logsumexp of 2 z is one more FLCE
    forward (no gradient) with hidden and bias scaled by 2 and the softcap doubled.
    """
    H = weight.shape[-1]
    h = hidden.reshape(-1, H)
    if scale != 1.0:
        h = h * scale
        bias = None if bias is None else bias * scale
    target = targets.reshape(-1).to(h.device)
    if _any_dtensor(hidden):
        raise LMKernelsError(
            "hidden: a DTensor (sequence parallel?); the per-token fused head takes a plain tensor"
        )
    if _any_dtensor(weight, bias):  # FSDP2 / TP parameters outside an unshard: gathered, as TRL does
        weight = cast("DTensor", weight).full_tensor()
        bias = None if bias is None else cast("DTensor", bias).full_tensor()
    device_type = h.device.type
    dtype = torch.float32 if fp32 else _flce_dtype(weight, device_type)
    h, weight = h.to(dtype), weight.to(dtype)
    bias = None if bias is None else bias.to(dtype)
    with torch.autocast(device_type, enabled=False):
        loss, lse, entropy, is_top1 = lmkernels.fused_linear_cross_entropy(
            h,
            weight,
            target,
            bias=bias,
            ignore_index=ignore_index,
            reduction="none",
            softcap=softcap,
            return_stats=True,
            backend=backend,
        )
        means = squares = None
        with torch.no_grad():
            if mean_logits:
                means = losses_logps.mean_logits(h, weight, bias, softcap)
            if log_sum_sq_probs:
                _, lse2 = lmkernels.fused_linear_cross_entropy(
                    h * 2,
                    weight,
                    target,
                    bias=None if bias is None else bias * 2,
                    ignore_index=ignore_index,
                    reduction="none",
                    softcap=None if softcap is None else 2 * softcap,
                    return_lse=True,
                    backend=backend,
                )
                squares = lse2 - 2 * lse
    valid = target != ignore_index
    shape = targets.shape

    def zeroed(x: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, x, 0.0).view(shape)

    return HeadStats(
        loss.view(shape),
        zeroed(entropy),
        (is_top1 & valid).view(shape),
        None if means is None else zeroed(means),
        None if squares is None else zeroed(squares),
    )


def _any_dtensor(*tensors: torch.Tensor | None) -> bool:
    # DTensor subclasses torch.Tensor; checking the type name avoids importing torch.distributed
    # for every single-device loss.
    return any(t is not None and type(t).__name__ == "DTensor" for t in tensors)


def _params_loss(
    lm_head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor | None, **kwargs: Any
) -> torch.Tensor:
    hidden, weight, bias = head_parts(lm_head, hidden)
    return causal_lm_loss(hidden, weight, labels, bias=bias, **kwargs)


def _params_stats(
    lm_head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, **kwargs: Any
) -> HeadStats:
    hidden, weight, bias = head_parts(lm_head, hidden)
    return token_stats(hidden, weight, targets, bias=bias, **kwargs)


_FSDP_METHOD = "_lmkernels_fsdp_call"


def _fsdp_call(lm_head: nn.Module, fn: Callable[..., _R], *args: Any, **kwargs: Any) -> _R:
    """fn(lm_head, *args, **kwargs), inside FSDP2's pre/post-forward of lm_head when lm_head is an
    FSDP2 module itself (registered once per module), else a plain call."""
    if "FSDP" in type(lm_head).__name__:  # fully_shard swaps the class to FSDP<cls>
        from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

        if isinstance(lm_head, FSDPModule):
            if _FSDP_METHOD not in vars(lm_head):
                setattr(lm_head, _FSDP_METHOD, types.MethodType(_call_on, lm_head))
                register_fsdp_forward_method(lm_head, _FSDP_METHOD)
            result: _R = getattr(lm_head, _FSDP_METHOD)(fn, *args, **kwargs)
            return result
    if any(hasattr(p, "ds_id") for p in lm_head.parameters()):  # DeepSpeed ZeRO-3
        from lmkernels.distributed.zero import call_as_forward

        return call_as_forward(lm_head, fn, *args, **kwargs)
    return fn(lm_head, *args, **kwargs)


def _call_on(lm_head: nn.Module, fn: Callable[..., _R], *args: Any, **kwargs: Any) -> _R:
    return fn(lm_head, *args, **kwargs)


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
    """causal_lm_loss of `lm_head` (an nn.Linear, or PEFT's wrapper of one: see
    integrations/peft.py) applied to `hidden`, through lm_head's FSDP2 forward hooks when lm_head
    is sharded on its own (see the module docstring)."""
    kwargs: dict[str, Any] = dict(
        softcap=softcap,
        logit_scale=logit_scale,
        num_items_in_batch=num_items_in_batch,
        ignore_index=ignore_index,
        shift_labels=shift_labels,
        backend=backend,
    )
    return _fsdp_call(lm_head, _params_loss, hidden, labels, **kwargs)


def lm_head_token_stats(
    lm_head: nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    *,
    scale: float = 1.0,
    softcap: float | None = None,
    fp32: bool = False,
    ignore_index: int = -100,
    mean_logits: bool = False,
    log_sum_sq_probs: bool = False,
    backend: str | None = None,
) -> HeadStats:
    """token_stats of `lm_head` (as lm_head_loss takes it) applied to `hidden`."""
    kwargs: dict[str, Any] = dict(
        scale=scale,
        softcap=softcap,
        fp32=fp32,
        ignore_index=ignore_index,
        mean_logits=mean_logits,
        log_sum_sq_probs=log_sum_sq_probs,
        backend=backend,
    )
    return _fsdp_call(lm_head, _params_stats, hidden, targets, **kwargs)
