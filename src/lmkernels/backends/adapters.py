"""External libraries as ordinary backends, for comparison on the GPU, each run as its users run
it (DESIGN.md: "Peers run as their own users run them"):

- `liger`: Liger Kernel's functions with their defaults. FLCE: `liger_fused_linear_cross_entropy`
  with its default accum_dtype=None (weight gradient accumulated in the weight's dtype) when
  grad_accum_dtype is the weight's dtype; accum_dtype=fp32 for our default (None = fp32).
- `cce`: Cut Cross-Entropy's default call, `linear_cross_entropy(e, c, targets)`: its default
  filter_eps ("high" in 25.1.1: gradient blocks whose |softmax - onehot| stays below the
  dtype's eps / 32 are skipped, an approximation whose speed depends on the logits).
- `cce_exact`: the same with filter_eps=None (exact gradients).
- `torch_native`: torch.nn.functional.linear_cross_entropy with
  `options=LinearCrossEntropyOptions()` (its chunked path, "auto" policy: "compact" on CUDA
  bf16/fp16, dW accumulated into the weight-dtype gradient) when grad_accum_dtype is the
  weight's dtype; acc_policy="balanced" (an fp32 dW scratch) for our default.

With grad_accum_dtype = the weight's dtype (`lean`) every peer runs its default call; CCE has no
other mode and refuses our fp32 default.

Every adapter registers whether or not its package is installed, so `lmkernels list` shows it;
`available()` says why it cannot run here (package missing, no CUDA: they are CUDA-only). Their
priority is below eager's, so `auto` never picks them: they run only when asked for by name
(`lmkernels validate/bench --backend liger`, `backend="liger"`).

Each adapter maps our semantics (ops/*.py) onto the library's arguments exactly, and its
`supports()` lists every option of our signature the library cannot do. Known differences that
are not options, left as they are so that the benchmarks measure the libraries as people use
them (the harness reports them):

- Liger's SwiGLU/GeGLU backward writes the gradients into the saved `gate` and `up` tensors (it
  saves memory in an MLP, where those are temporaries): the caller's inputs are overwritten.
- Liger's FLCE rounds the logits and their gradient to the input dtype (bf16) before the
  matmuls; CCE accumulates the hidden-state gradient in the input dtype.
- torch's linear_cross_entropy returns the loss in the input dtype (ours is fp32).
- Liger's RMSNorm is called with in_place=False: its default writes dX into the upstream
  gradient, which autograd may share with another branch (why Liger turns it off for Gemma 2).
- Liger's RoPE rotates q and k in place when their memory layout is (B, T, H, D) (transformers'
  layout); the adapter clones them then, so the caller's q and k stay intact.
- Liger's FLCE and torch's chunked path compute the gradients in the forward; torch's refuses a
  second backward over the same graph.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from lmkernels.ops.flce import FlceOptions
from lmkernels.registry.core import register
from lmkernels.types import CastingMode, GeluApproximation, RopeLayout

PRIORITY = -10  # below eager (0): `auto` never picks an adapter
LIGER_MAX_COLS = 65536  # Liger's row kernels hold a whole row in one block (calculate_settings)


# --- availability --------------------------------------------------------------------------------


def _unavailable(module: str, pip_name: str) -> str | None:
    """Why `module`'s kernels cannot run here: not installed, no CUDA (the adapters are GPU
    comparisons, and Liger's norm/GLU kernels do not run on the Triton CPU interpreter that the
    test suite turns on), or a broken install (e.g. a triton mismatch)."""
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return f"{pip_name} is not installed (pip install {pip_name})"
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        importlib.import_module(module)
    except Exception as e:  # a broken install must not take lmkernels down
        return f"{pip_name} failed to import ({type(e).__name__}: {e})"
    return None


def liger_unavailable() -> str | None:
    return _unavailable("liger_kernel.transformers.functional", "liger-kernel")


def cce_unavailable() -> str | None:
    return _unavailable("cut_cross_entropy", "cut-cross-entropy")


def torch_native_unavailable() -> str | None:
    import torch.nn.functional as F

    if not hasattr(F, "linear_cross_entropy") or not hasattr(torch.nn, "LinearCrossEntropyOptions"):
        return (
            f"torch {torch.__version__} has no torch.nn.functional.linear_cross_entropy with chunking options"
        )
    return None


# --- shared helpers ------------------------------------------------------------------------------


def _wide_rows(x: torch.Tensor) -> list[str]:
    if x.shape[-1] > LIGER_MAX_COLS:
        return [f"last dim {x.shape[-1]} > {LIGER_MAX_COLS} (Liger keeps a whole row in one Triton block)"]
    return []


def _grad_needed(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _mean_denominator(
    target: torch.Tensor, ignore_index: int, class_weight: torch.Tensor | None
) -> torch.Tensor:
    """Our "mean" denominator: sum of the class weights of the non-ignored targets (their count
    without class weights), 1 when every token is ignored (so the loss is 0, not nan)."""
    valid = target != ignore_index
    if class_weight is None:
        denom = valid.sum().float()
    else:
        denom = torch.where(valid, class_weight.float()[torch.where(valid, target, 0).long()], 0.0).sum()
    return torch.where(denom == 0, 1.0, denom)


# --- Liger Kernel --------------------------------------------------------------------------------


def liger_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting_mode: CastingMode = "llama",
) -> torch.Tensor:
    from liger_kernel.transformers.functional import liger_rms_norm as rms_norm

    # Liger's casting modes are ours ("llama", "gemma", "none"). in_place=False: see the docstring.
    return rms_norm(x, weight, eps, offset=offset, casting_mode=casting_mode, in_place=False)


def _liger_rms_norm_supports(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting_mode: CastingMode = "llama",
) -> list[str]:
    return _wide_rows(x)


def liger_layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, eps: float = 1e-5
) -> torch.Tensor:
    from liger_kernel.transformers.functional import liger_layer_norm as layer_norm

    return layer_norm(x, weight, bias, eps)


def _liger_layer_norm_supports(
    x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, eps: float = 1e-5
) -> list[str]:
    reasons = _wide_rows(x)
    if weight is None or bias is None:
        reasons.append("weight=None or bias=None: Liger's LayerNorm always takes both")
    return reasons


def liger_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    layout: RopeLayout = "neox",
    rotary_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    from liger_kernel.transformers.functional import liger_rope as rope

    if position_ids is not None:
        # Liger takes position_ids but does not use them: look the rows up here, as
        # transformers does before apply_rotary_pos_emb; (B, T, R) tables are Liger's batched form.
        cos, sin = cos[position_ids], sin[position_ids]
    # Our RoPE computes in fp32 and rounds once; Liger computes in cos's dtype, so give it fp32
    # tables (they are small: T x R).
    cos, sin = cos.float(), sin.float()
    # Liger rotates in place when q/k are (B, T, H, D) in memory; keep the caller's tensors intact.
    if q.transpose(1, 2).is_contiguous():
        q = q.clone()
    if k.transpose(1, 2).is_contiguous():
        k = k.clone()
    return rope(q, k, cos, sin, None, 1, cos.shape[-1])


def _liger_rope_supports(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    layout: RopeLayout = "neox",
    rotary_dim: int | None = None,
) -> list[str]:
    if layout != "neox":
        return [f"layout={layout!r}: Liger's RoPE implements only the neox (rotate_half) layout"]
    return []


# consume_inputs is accepted and ignored: Liger's GLU backward always writes its gradients over
# gate and up (its own behaviour, which validation reports on the cases that keep the inputs).
def liger_swiglu(gate: torch.Tensor, up: torch.Tensor, consume_inputs: bool = False) -> torch.Tensor:
    from liger_kernel.transformers.functional import liger_swiglu as swiglu

    return swiglu(gate, up)


def _liger_swiglu_supports(gate: torch.Tensor, up: torch.Tensor, consume_inputs: bool = False) -> list[str]:
    return _wide_rows(gate)


def liger_geglu(
    gate: torch.Tensor,
    up: torch.Tensor,
    approximate: GeluApproximation = "tanh",
    consume_inputs: bool = False,
) -> torch.Tensor:
    from liger_kernel.transformers.functional import liger_geglu as geglu

    return geglu(gate, up)


def _liger_geglu_supports(
    gate: torch.Tensor,
    up: torch.Tensor,
    approximate: GeluApproximation = "tanh",
    consume_inputs: bool = False,
) -> list[str]:
    reasons = _wide_rows(gate)
    if approximate != "tanh":
        reasons.append(f"approximate={approximate!r}: Liger's GeGLU implements only the tanh approximation")
    return reasons


def liger_flce(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, **options: Any
) -> torch.Tensor:
    o = FlceOptions(**options)
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy as flce

    H = weight.shape[1]
    # Liger's accum_dtype=None accumulates the weight gradient in the weight's dtype, one rounding
    # per chunk (our grad_accum_dtype=weight.dtype); our default None means fp32.
    accum = torch.float32 if o.grad_accum_dtype in (None, torch.float32) else None
    loss = flce(
        hidden.reshape(-1, H),
        weight,
        target.reshape(-1).long(),  # Liger gathers class weights with the targets: int64 needed
        bias=o.bias,
        # Our reference reads class weights in fp32; Liger sums them in their own dtype.
        ce_weight=None if o.class_weight is None else o.class_weight.float(),
        ignore_index=o.ignore_index,
        lse_square_scale=o.z_loss_scale,
        label_smoothing=o.label_smoothing,
        reduction=o.reduction,
        softcap=o.softcap,
        accum_dtype=accum,
    )
    # Liger's loss is fp32 and its "mean" divides by the non-ignored class-weight sum, as ours.
    return loss.view(target.shape) if o.reduction == "none" else loss


def _liger_flce_supports(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, **options: Any
) -> list[str]:
    o = FlceOptions(**options)
    # Only the options this library lacks are named; supports() is called with every input.
    reasons = []
    if o.temperature != 1.0:
        reasons.append("temperature: Liger's FLCE has no temperature")
    if o.return_lse or o.return_stats:
        reasons.append("return_lse/return_stats=True: Liger's FLCE does not return the logsumexp")
    if o.memory_budget is not None:
        reasons.append("memory_budget: Liger sizes its chunks itself")
    if o.reduction == "mean" and o.class_weight is not None and o.z_loss_scale:
        reasons.append(
            "z_loss_scale with class_weight and reduction='mean': Liger divides the z-loss by the "
            "number of tokens, ours by the class-weight sum"
        )
    if _grad_needed(weight, o.bias) and not _grad_needed(hidden):
        reasons.append("weight/bias need gradients but hidden does not: Liger then returns none")
    return reasons


# --- Cut Cross-Entropy ---------------------------------------------------------------------------


def _make_cce(exact: bool) -> Callable[..., torch.Tensor]:
    def cce_flce(
        hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, **options: Any
    ) -> torch.Tensor:
        o = FlceOptions(**options)
        from cut_cross_entropy import linear_cross_entropy

        # `cce` leaves filter_eps and impl at CCE's defaults: its users' call.
        extra = {"filter_eps": None} if exact else {}
        # CCE's "mean" of a batch whose tokens are all ignored is nan (ours is 0): take its sum
        # and divide by our denominator, which is the same computation otherwise (CCE filters
        # on the softmax gradient before the reduction's scale, so the sum skips the same tiles).
        loss = linear_cross_entropy(
            hidden,
            weight,
            target,
            ignore_index=o.ignore_index,
            softcap=o.softcap,
            reduction="sum" if o.reduction == "mean" else o.reduction,
            **extra,
        ).float()
        if o.reduction == "mean":
            loss = loss / _mean_denominator(target, o.ignore_index, None)
        return loss

    cce_flce.__name__ = "cce_exact_flce" if exact else "cce_flce"
    return cce_flce


def _cce_supports(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, **options: Any
) -> list[str]:
    o = FlceOptions(**options)
    # Only the options this library lacks are named; supports() is called with every input.
    reasons = []
    if o.temperature != 1.0:
        reasons.append("temperature: CCE has no temperature")
    if o.memory_budget is not None:
        reasons.append("memory_budget: CCE sizes its blocks itself")
    if o.bias is not None:
        reasons.append("bias: CCE has no bias")
    if o.label_smoothing:
        reasons.append("label_smoothing: CCE has no label smoothing")
    if o.z_loss_scale:
        reasons.append("z_loss_scale: CCE has no z-loss")
    if o.class_weight is not None:
        reasons.append("class_weight: CCE has no class weights")
    if o.return_lse or o.return_stats:
        reasons.append("return_lse/return_stats=True: CCE does not return the logsumexp")
    if _grad_needed(weight) and o.grad_accum_dtype != weight.dtype:
        reasons.append(
            f"grad_accum_dtype={o.grad_accum_dtype} (fp32): CCE accumulates the weight gradient in the "
            f"weight's dtype (pass grad_accum_dtype={weight.dtype})"
        )
    return reasons


# --- torch.nn.functional.linear_cross_entropy ----------------------------------------------------


def torch_native_flce(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, **options: Any
) -> torch.Tensor:
    o = FlceOptions(**options)
    import torch.nn.functional as F

    H = weight.shape[1]
    low_precision = weight.dtype != torch.float32
    if o.grad_accum_dtype in (None, torch.float32) and low_precision:
        # Our default: an fp32 weight-gradient accumulator across chunks.
        chunking = torch.nn.LinearCrossEntropyOptions(acc_policy="balanced", acc_dtype=torch.float32)
    else:
        # grad_accum_dtype = the weight's dtype: torch's default chunked call ("auto": "compact"
        # on CUDA bf16/fp16, each chunk's dW added into the weight-dtype gradient).
        chunking = torch.nn.LinearCrossEntropyOptions()
    t = target.reshape(-1).long()  # the chunked path needs int64 targets
    loss = F.linear_cross_entropy(
        hidden.reshape(-1, H),
        weight,
        t,
        linear_bias=o.bias,
        weight=o.class_weight,
        # torch's "mean" of an all-ignored batch is nan (ours is 0): sum, then our denominator.
        reduction="sum" if o.reduction == "mean" else o.reduction,
        ignore_index=o.ignore_index,
        options=chunking,
    ).float()
    if o.reduction == "none":
        return loss.view(target.shape)
    if o.reduction == "mean":
        loss = loss / _mean_denominator(t, o.ignore_index, o.class_weight)
    return loss


def _torch_native_supports(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, **options: Any
) -> list[str]:
    o = FlceOptions(**options)
    # Only the options this library lacks are named; supports() is called with every input.
    reasons = []
    if o.temperature != 1.0:
        reasons.append("temperature: torch's linear_cross_entropy has no temperature")
    if o.memory_budget is not None:
        reasons.append("memory_budget: torch's linear_cross_entropy chunks by its own options")
    if o.softcap is not None:
        reasons.append("softcap: torch's linear_cross_entropy has no logit softcapping")
    if o.z_loss_scale:
        reasons.append("z_loss_scale: torch's linear_cross_entropy has no z-loss")
    if o.return_lse or o.return_stats:
        reasons.append(
            "return_lse/return_stats=True: torch's linear_cross_entropy does not return the logsumexp"
        )
    if o.label_smoothing:
        reasons.append("label_smoothing: torch's chunked path falls back to materializing the logits")
    return reasons


# --- registration --------------------------------------------------------------------------------

_LIGER: dict[str, tuple[Callable[..., Any], Callable[..., list[str]]]] = {
    "rms_norm": (liger_rms_norm, _liger_rms_norm_supports),
    "layer_norm": (liger_layer_norm, _liger_layer_norm_supports),
    "rope": (liger_rope, _liger_rope_supports),
    "swiglu": (liger_swiglu, _liger_swiglu_supports),
    "geglu": (liger_geglu, _liger_geglu_supports),
    "fused_linear_cross_entropy": (liger_flce, _liger_flce_supports),
}

for _op, (_fn, _supports) in _LIGER.items():
    register(
        _op,
        "liger",
        _fn,
        priority=PRIORITY,
        external=True,
        devices=("cuda",),
        available=liger_unavailable,
        supports=_supports,
        # Liger's FLCE reads a value back to the host in its forward: no fullgraph compile.
        compile_safe=_op != "fused_linear_cross_entropy",
        description=(
            "Liger Kernel's liger_fused_linear_cross_entropy, its defaults (accum_dtype=None: dW "
            "in the weight's dtype) under grad_accum_dtype=weight dtype, accum_dtype=fp32 otherwise"
            if _op == "fused_linear_cross_entropy"
            else f"Liger Kernel's liger_{_op} with its defaults"
            + (" (in_place=False: see backends/adapters.py)" if _op == "rms_norm" else "")
        ),
    )

for _name, _exact in (("cce", False), ("cce_exact", True)):
    register(
        "fused_linear_cross_entropy",
        _name,
        _make_cce(_exact),
        priority=PRIORITY,
        external=True,
        dtypes=(torch.bfloat16, torch.float16),  # CCE's backward asserts bf16/fp16 embeddings
        devices=("cuda",),
        min_capability=(8, 0),  # bf16 tensor-core dots
        available=cce_unavailable,
        supports=_cce_supports,
        # CCE builds index lists with nonzero() (data-dependent shapes): no fullgraph compile.
        compile_safe=False,
        description=(
            "Cut Cross-Entropy with filter_eps=None: exact gradients, dW in the weight's dtype"
            if _exact
            else "Cut Cross-Entropy's default call (default filter_eps, 'high': skips gradient "
            "blocks below the dtype's eps/32, an approximation), dW in the weight's dtype"
        ),
    )

register(
    "fused_linear_cross_entropy",
    "torch_native",
    torch_native_flce,
    priority=PRIORITY,
    external=True,
    available=torch_native_unavailable,
    supports=_torch_native_supports,
    # A GPU comparison like the other adapters; its bf16 loss (see the module docstring) fails
    # our fp32-loss policy, which `lmkernels validate --device cuda` reports.
    devices=("cuda",),
    # torch marks the chunked op as skipped by dynamo (it falls back to eager): no fullgraph compile.
    compile_safe=False,
    description=(
        "torch.nn.functional.linear_cross_entropy, chunked: LinearCrossEntropyOptions() (auto) "
        "under grad_accum_dtype=weight dtype, acc_policy='balanced' (fp32 dW) otherwise"
    ),
)
