"""Fused linear cross entropy: the loss of cross_entropy(softcap(hidden @ weight.T + bias) / T, target).

Shapes: hidden (..., H), weight (V, H), target (...) int64/int32 with values in [0, V) or
ignore_index, bias (V,), class_weight (V,). The loss is returned in fp32 whatever the inputs'
dtype (a training loss is reduced and logged in fp32 anyway).

Per token i with target t, logits z = softcap(h_i @ W.T + b) / T (softcap c: c * tanh(y / c);
temperature T, in fp32 after the matmul), lse = logsumexp(z), class weights w (all ones if
class_weight is None), smoothing e:

    loss_i = (1 - e) * w[t] * (lse - z[t]) + (e / V) * sum_c w[c] * (lse - z[c]) + s * lse**2

with s = z_loss_scale. Ignored tokens (target == ignore_index) have loss 0 and no gradient.
This is torch.nn.functional.cross_entropy's definition, label smoothing and class weights
included, plus the z-loss term.

Reductions: "none" returns loss_i (shape of target; differentiable); "sum" returns sum_i loss_i;
"mean" returns sum_i loss_i / sum_{i not ignored} w[t_i], the same denominator torch uses (the
number of non-ignored tokens without class weights). The z-loss is divided by that denominator
too, so without class weights it is the mean of s * lse**2 over non-ignored tokens. One
deliberate difference from torch: when every token is ignored, "mean" returns 0 (torch returns
nan), so a fully padded micro-batch does not poison a training run.

Temperature T (> 0): the logits are divided by T in fp32 after the matmul and after the softcap,
as TRL's fused head computes them; lse, the loss, the entropy and is_top1 are those of the
scaled logits, and every gradient carries the chain factor 1/T.

reduction "none": the per-token loss is fp32 and differentiable under any upstream gradient (per
token, of any sign, zero for some tokens: what per-sequence sums and RL advantages give it).

return_lse=True returns (loss, lse) with lse (shape of target, fp32, not differentiable).
return_stats=True returns (loss, lse, entropy, is_top1), per token (shape of target):
entropy H = sum_c p_c (lse - z_c) of the softmax p of the logits z (fp32), and is_top1 = no
logit is larger than the target's (False for ignored tokens): the entropy and token accuracy a
trainer logs, without a pass of its own over the logits. The entropy is differentiable in every
backend of ours (an entropy bonus, RL trainers' entropy term; ignored tokens have an entropy and
its gradient too): dH/dz_c = -p_c (z_c - lse + H), times the softcap's and the temperature's
chain factors, added to the loss's d loss/dz per token as g_loss * d loss/dz + g_H * dH/dz. lse
and is_top1 are not differentiable. (The Triton backends then keep the logsumexp and the
entropy and compute both terms in their recomputing backward, which return_stats=True selects
whenever a gradient is needed: the plain loss's path, without stats, is unchanged.)

grad_accum_dtype: the dtype backends may accumulate the weight gradient in across chunks of
tokens. torch.float32: rounded once; weight.dtype: the leanest (one rounding per chunk); None:
the backend's documented default, always within the correctness policy. The eager reference
ignores it (it has no chunks).
memory_budget: how much memory the loss may hold beyond its gradients, as a fraction of their
bytes (grad_hidden + grad_weight): None for the backend's default, 0 for the least it can do.
Not part of the math: the Triton backends choose their chunks, and whether to recompute the
logits in the backward, from it; eager (which holds the logits) and compile (its own chunks)
ignore it; the peers' adapters refuse it.

flce_mean_logits(hidden, weight, bias, softcap, temperature): the mean over the vocabulary of
each token's logits z (temperature and softcap included; fp32, no gradient), what DPO and KTO
log, without the logits: (h . mean_c(W_c) + mean(b)) / T without a softcap, chunks of tokens
with one.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Literal, overload

import torch

from lmkernels.ops._common import (
    ROW_COUNTS,
    VOCAB_TOLERANCES,
    check_class_indices,
    generator,
    op_function,
    randn,
    upcast,
)
from lmkernels.registry.core import ErrorInput, OpSpec, register_op
from lmkernels.types import Reduction
from lmkernels.utils import (
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_same_device,
    check_tensor,
    fail,
)

REDUCTIONS = ("mean", "sum", "none")


@dataclasses.dataclass(frozen=True, eq=False)
class FlceOptions:
    """The op's options besides hidden, weight and target, defined once: every backend reads
    ``FlceOptions(**options)`` (an unknown option is a TypeError naming it), and a test holds the
    public function's and the reference's keyword arguments to these names and defaults. Their
    meaning is in the module docstring."""

    bias: torch.Tensor | None = None  # (V,), added to the logits before the softcap
    ignore_index: int = -100
    reduction: str = "mean"  # one of REDUCTIONS
    label_smoothing: float = 0.0  # e
    softcap: float | None = None  # c; None: no softcap
    z_loss_scale: float = 0.0  # s
    class_weight: torch.Tensor | None = None  # (V,), w; None: all ones
    return_lse: bool = False
    grad_accum_dtype: torch.dtype | None = None
    return_stats: bool = False
    memory_budget: float | None = None
    temperature: float = 1.0  # T: the logits are divided by it (after the softcap)


def fused_linear_cross_entropy_reference(
    hidden,
    weight,
    target,
    bias=None,
    ignore_index=-100,
    reduction="mean",
    label_smoothing=0.0,
    softcap=None,
    z_loss_scale=0.0,
    class_weight=None,
    return_lse=False,
    grad_accum_dtype=None,
    return_stats=False,
    memory_budget=None,
    temperature=1.0,
):
    """The module docstring's semantics in eager PyTorch; the options are FlceOptions' fields."""
    V, H = weight.shape
    t = target.reshape(-1)
    # The lm_head matmul as a model computes it (in the inputs' dtype, fp32-accumulated, rounded
    # to that dtype), the loss in fp32: so the eager run in a low dtype is what plain PyTorch
    # gets, the baseline of the correctness policy (its backward rounds d loss / d logits to
    # that dtype before the two gradient matmuls, as every fused kernel must). In fp64: exact.
    logits = upcast(torch.nn.functional.linear(hidden.reshape(-1, H), weight, bias))
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    valid = t != ignore_index
    # A target outside [0, V) (only possible with value checks off) is never read: nan loss.
    in_range = (t >= 0) & (t < V)
    safe_t = torch.where(valid & in_range, t, 0).long()
    nll = lse - logits.gather(1, safe_t[:, None])[:, 0]
    if class_weight is None:
        w_t = torch.ones_like(nll)
        smooth = V * lse - logits.sum(-1)
    else:
        w = upcast(class_weight)
        w_t = w[safe_t]
        smooth = w.sum() * lse - logits @ w
    w_t = torch.where(in_range | ~valid, w_t, float("nan"))
    loss = (1.0 - label_smoothing) * w_t * nll
    if label_smoothing:
        loss = loss + (label_smoothing / V) * smooth
    if z_loss_scale:
        loss = loss + z_loss_scale * lse.square()
    loss = torch.where(valid, loss, 0.0)
    if reduction == "none":
        out = loss.view(target.shape)
    elif reduction == "sum":
        out = loss.sum()
    else:
        denom = torch.where(valid, w_t, 0.0).sum()
        out = loss.sum() / torch.where(denom == 0, 1.0, denom)
    if return_stats:
        gap = lse[:, None] - logits  # entropy = sum_c p_c (lse - z_c): no cancellation at large z
        entropy = (torch.exp(-gap) * gap).nan_to_num(nan=0.0).sum(-1)
        top = logits.gather(1, safe_t[:, None])[:, 0] >= logits.amax(-1)
        stats = (entropy, valid & in_range & top)
        return out, lse.detach().view(target.shape), *(x.view(target.shape) for x in stats)
    if return_lse:
        return out, lse.detach().view(target.shape)
    return out


def check_inputs(hidden, weight, target, **options):
    o = FlceOptions(**options)
    check_tensor("hidden", hidden)
    check_tensor("weight", weight, ndim=2)
    check_tensor("target", target, dtypes=(torch.int64, torch.int32))
    V, H = weight.shape
    if V == 0 or H == 0:
        fail(f"weight: expected at least one class and one hidden feature, got shape {(V, H)}")
    if hidden.dim() < 1 or hidden.shape[-1] != H:
        fail(f"hidden: expected shape (..., {H}) to match weight (V={V}, H={H}), got {tuple(hidden.shape)}")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        fail(
            f"target: expected shape {tuple(hidden.shape[:-1])} (hidden without its last dim), got {tuple(target.shape)}"
        )
    if weight.dtype != hidden.dtype:
        fail(f"weight: expected dtype {hidden.dtype} (same as hidden), got {weight.dtype}")
    for name, t in (("bias", o.bias), ("class_weight", o.class_weight)):
        if t is not None:
            check_tensor(name, t, ndim=1)
            if t.shape[0] != V:
                fail(f"{name}: expected shape ({V},) to match weight's V, got {tuple(t.shape)}")
    if o.bias is not None and o.bias.dtype != weight.dtype:
        fail(f"bias: expected dtype {weight.dtype} (same as weight), got {o.bias.dtype}")
    check_same_device(hidden=hidden, weight=weight, target=target, bias=o.bias, class_weight=o.class_weight)
    check_choice("reduction", o.reduction, REDUCTIONS)
    check_int("ignore_index", o.ignore_index)
    check_number("label_smoothing", o.label_smoothing, low=0.0, high=1.0, what="a number in [0, 1]")
    if o.softcap is not None:
        check_number("softcap", o.softcap, low=0.0, what="None or a positive number")
        if o.softcap == 0:
            fail("softcap: expected None or a positive number, got 0")
    check_number("z_loss_scale", o.z_loss_scale, low=0.0, what="a non-negative number")
    check_number(
        "temperature", o.temperature, low=0.0, high=sys.float_info.max, what="a positive finite number"
    )
    if o.temperature == 0:
        fail("temperature: expected a positive finite number, got 0")
    check_bool("return_lse", o.return_lse)
    check_bool("return_stats", o.return_stats)
    if o.memory_budget is not None:
        check_number(
            "memory_budget",
            o.memory_budget,
            low=0.0,
            high=sys.float_info.max,
            what="None or a finite number >= 0",
        )
    if o.grad_accum_dtype not in (None, torch.float32, weight.dtype):
        fail(
            f"grad_accum_dtype: expected None, torch.float32 or weight's dtype {weight.dtype}, got {o.grad_accum_dtype}"
        )


def check_values(hidden, weight, target, ignore_index=FlceOptions.ignore_index, **_):
    """Targets in range: reads values, so the dispatcher runs it on every call (check_inputs only
    once per input signature)."""
    check_class_indices(target, weight.shape[0], ignore_index)


# Logit regimes of make_inputs (DESIGN.md, "Inputs like real training"): FLCE's speed can depend
# on the softmax (CCE's gradient filter skips tiles where it is tiny), so benchmarks run all three.
REGIMES = ("uniform", "gaussian", "zipf")
UNIFORM_LOGIT_STD = 0.5  # random init: softmax entropy about ln(V) - std^2 / 2
GAUSSIAN_LOGIT_STD = 2.0
# zipf: logit = -ZIPF_EXPONENT * ln(rank of the class) + N(0, ZIPF_NOISE_STD^2). Chosen so the
# mean softmax entropy is 2.4-2.7 nats for V from 32k to 256k, softcap 30 adding ~0.1 (trained
# LMs: 2-3 nats).
ZIPF_EXPONENT = 1.5
ZIPF_NOISE_STD = 3.5


def _normal(shape, dtype, device, g, dg, scale):
    """N(0, scale^2) from the device generator `dg` where there is one (CUDA), else from the CPU
    generator `g` as ops._common.randn draws the other ops' inputs."""
    if dg is None:
        return randn(shape, dtype, device, g, scale=scale)
    return torch.randn(shape, generator=dg, device=device, dtype=dtype).mul_(scale)


def _softmax_pass(hidden, weight, bias=None, softcap=None, uniforms=None, temperature=1.0):
    """(mean softmax entropy in nats, targets drawn from the softmax by inverse CDF at `uniforms`
    or None) of the logits the op sees, chunk by chunk over tokens: no (tokens x V) tensor."""
    V = weight.shape[0]
    chunk = max(1, 2**26 // V)
    entropy = torch.zeros((), dtype=torch.float64, device=hidden.device)
    samples = []
    for i in range(0, hidden.shape[0], chunk):
        z = (hidden[i : i + chunk] @ weight.T).float()
        if bias is not None:
            z += bias.float()
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        if temperature != 1.0:
            z = z / temperature
        lse = torch.logsumexp(z, dim=-1, keepdim=True)
        p = torch.exp(z - lse)
        entropy += (lse[:, 0] - (p * z).sum(-1)).double().sum()
        if uniforms is not None:
            cdf = p.cumsum_(-1)
            u = uniforms[i : i + chunk].to(cdf)[:, None] * cdf[:, -1:]
            samples.append(torch.searchsorted(cdf, u)[:, 0].clamp_(max=V - 1))
    mean = entropy.item() / max(1, hidden.shape[0])
    if uniforms is None:
        return mean, None
    return mean, torch.cat(samples) if samples else torch.zeros(0, dtype=torch.long, device=hidden.device)


def make_inputs(
    shape,
    dtype,
    device,
    seed=0,
    with_bias=False,
    with_class_weight=False,
    ignore_fraction=0.1,
    lean=False,
    regime="gaussian",
    stats=None,
    entropy_grad=True,
    **options,
):
    """hidden (BT, H), weight (V, H), target (BT,) whose logits follow `regime`:

    - "gaussian" (default): logit std ~2, targets uniform over the vocabulary;
    - "uniform": logit std 0.5, near-uniform softmax (a randomly initialized model), uniform targets;
    - "zipf": trained-LM-like. hidden's column 0 is the constant 1 and weight's column 0 a
      per-class log-prior -ZIPF_EXPONENT * ln(rank) (ranks a random permutation), so each logit
      is that prior plus contextual noise of std ZIPF_NOISE_STD from the other columns; targets
      are drawn from the softmax of those logits (bias and softcap included), so the loss is
      about the entropy. Needs H >= 2.

    lean: grad_accum_dtype = the weight's dtype (what Liger does by default and all CCE can do).
    stats: a dict that receives "mean_entropy" (nats, of the softmax of the logits the op sees).
    entropy_grad: for the harness (no_upstream below), not an input: False gives the
    return_stats entropy no upstream gradient (a loss that only logs it).
    """
    check_choice("regime", regime, REGIMES)
    g = generator(seed)
    device = torch.device(device)
    # On CUDA hidden and weight come from a generator on the device: a 256k x 8k weight takes
    # ~25 s on a CPU generator. Deterministic from the seed either way.
    dg = torch.Generator(device).manual_seed(seed) if device.type == "cuda" else None
    BT, H, V = shape["BT"], shape["H"], shape["V"]
    hidden = _normal((BT, H), dtype, device, g, dg, 1.0)
    if regime == "zipf":
        if H < 2:
            fail(f"shape: regime='zipf' needs H >= 2 (one column carries the prior), got H={H}")
        weight = _normal((V, H), dtype, device, g, dg, ZIPF_NOISE_STD / (H - 1) ** 0.5)
        hidden[:, 0] = 1.0
        rank = torch.randperm(V, generator=g).double() + 1.0
        weight[:, 0] = (-ZIPF_EXPONENT * rank.log()).to(device, dtype)
    else:
        std = GAUSSIAN_LOGIT_STD if regime == "gaussian" else UNIFORM_LOGIT_STD
        weight = _normal((V, H), dtype, device, g, dg, std / H**0.5)
    target = torch.randint(0, V, (BT,), generator=g)
    ignored = torch.rand(BT, generator=g) < ignore_fraction
    out = {"hidden": hidden, "weight": weight, **options}
    if with_bias:
        out["bias"] = randn((V,), dtype, device, g, scale=0.5)
    if with_class_weight:
        out["class_weight"] = (torch.rand(V, generator=g) + 0.5).to(device, dtype)
    if regime == "zipf" or stats is not None:
        uniforms = torch.rand(BT, generator=g, dtype=torch.float64) if regime == "zipf" else None
        entropy, sampled = _softmax_pass(
            hidden, weight, out.get("bias"), options.get("softcap"), uniforms, options.get("temperature", 1.0)
        )
        if sampled is not None:
            target = sampled.cpu()
        if stats is not None:
            stats["mean_entropy"] = entropy
    target[ignored] = options.get("ignore_index", FlceOptions.ignore_index)
    out["target"] = target.to(device)
    if lean:
        out["grad_accum_dtype"] = dtype
    return out


def sample(draw):
    wide = draw.booleans()  # a vocabulary past 2^16, with few tokens
    V = draw.sampled_from((65537, 70001) if wide else (1, 2, 3, 7, 11, 64, 97, 128, 257, 1000))
    BT = draw.integers(0, 3) if wide else draw.sampled_from(ROW_COUNTS)
    # A wide vocabulary with H = 1 makes grad_hidden one fp32 dot product over 65k terms: its
    # error is the CPU BLAS's summation order (4e-5 relative, the dlogits themselves exact to
    # 2e-6), not the kernel's, so wide cases take H >= 2.
    H = draw.sampled_from((2, 3, 8, 16, 17, 64, 96) if wide else (1, 2, 3, 8, 16, 17, 64, 96))
    options = {
        "reduction": draw.sampled_from(REDUCTIONS),
        # Full smoothing over a few classes makes each gradient a difference of nearly equal
        # probabilities: relative errors of such sums measure rounding noise, not the kernel.
        "label_smoothing": draw.sampled_from((0.0, 0.0, 0.1, 1.0) if V >= 64 else (0.0, 0.0, 0.1)),
        "softcap": draw.sampled_from((None, None, 30.0, 1.5)),
        # (With one class only the z-loss term has a gradient, 2 s z: z = h . w cancels over H
        # terms, so its fp32 error can be eager's own near the dtype's bound; the policy holds
        # the backends to factor x eager's there, harness/checks.allowed_error.)
        "z_loss_scale": draw.sampled_from((0.0, 0.0, 1e-4)),
        "ignore_index": draw.sampled_from((-100, 0, 3)),
        "ignore_fraction": draw.sampled_from((0.0, 0.1, 0.5, 1.0)),
        "with_bias": draw.booleans(),
        "with_class_weight": draw.booleans(),
        "return_lse": draw.booleans(),
        "return_stats": draw.booleans(),
        # (only read with return_stats: whether a loss differentiates the entropy, see no_upstream)
        "entropy_grad": draw.booleans(),
        "temperature": draw.sampled_from((1.0, 1.0, 0.7, 2.0)),
        "memory_budget": draw.sampled_from((None, None, 0.0, 0.01, 0.08, 0.5, 4.0)),
        "lean": draw.booleans(),
        "regime": draw.sampled_from(("gaussian", "uniform", "zipf") if H >= 2 else ("gaussian", "uniform")),
    }
    return {"BT": BT, "H": H, "V": V}, options


def _no_upstream(options) -> tuple[int, ...]:
    """The harness's cases with return_stats and entropy_grad=False give the entropy (output 2)
    no upstream gradient: a loss that only logs it."""
    return (2,) if options.get("return_stats") and not options.get("entropy_grad", True) else ()


def error_inputs(device):
    def args(**over):
        base = {
            "hidden": torch.randn(5, 8, device=device),
            "weight": torch.randn(11, 8, device=device),
            "target": torch.randint(0, 11, (5,), device=device),
        }
        return {**base, **over}

    return [
        ErrorInput(args(hidden=torch.randn(5, 9, device=device)), r"hidden: expected shape \(..., 8\)"),
        ErrorInput(args(weight=torch.randn(11, 8, 1, device=device)), "weight: expected 2 dims"),
        ErrorInput(
            args(hidden=torch.randn(5, 0, device=device), weight=torch.randn(11, 0, device=device)),
            "weight: expected at least one class and one hidden feature",
        ),
        ErrorInput(
            args(weight=torch.randn(0, 8, device=device), target=torch.full((5,), -100, device=device)),
            "weight: expected at least one class and one hidden feature",
        ),
        ErrorInput(args(target=torch.randint(0, 11, (6,), device=device)), r"target: expected shape \(5,\)"),
        ErrorInput(args(target=torch.randn(5, device=device)), "target: expected dtype in"),
        ErrorInput(
            args(weight=torch.randn(11, 8, device=device).bfloat16()), "weight: expected dtype torch.float32"
        ),
        ErrorInput(
            args(target=torch.tensor([0, 1, 11, 2, -100], device=device)),
            r"target: expected class indices in \[0, 11\) or ignore_index=-100, found 11",
        ),
        ErrorInput(args(target=torch.tensor([0, 1, -3, 2, 3], device=device)), "target: .* found -3"),
        ErrorInput(args(reduction="avg"), "reduction: expected one of"),
        ErrorInput(args(label_smoothing=1.5), r"label_smoothing: expected a number in \[0, 1\]"),
        ErrorInput(args(softcap=0.0), "softcap: expected None or a positive number"),
        ErrorInput(args(softcap=-2.0), "softcap: expected None or a positive number"),
        ErrorInput(args(z_loss_scale=-1.0), "z_loss_scale: expected a non-negative number"),
        ErrorInput(args(temperature=0.0), "temperature: expected a positive finite number"),
        ErrorInput(args(temperature=float("inf")), "temperature: expected a positive finite number"),
        ErrorInput(args(ignore_index=-1.5), "ignore_index: expected an int"),
        ErrorInput(args(return_lse="yes"), "return_lse: expected a bool"),
        ErrorInput(args(return_stats=1), "return_stats: expected a bool"),
        ErrorInput(args(memory_budget=-0.1), "memory_budget: expected None or a finite number >= 0"),
        ErrorInput(args(memory_budget=float("inf")), "memory_budget: expected None or a finite number >= 0"),
        ErrorInput(args(bias=torch.randn(10, device=device)), r"bias: expected shape \(11,\)"),
        ErrorInput(
            args(bias=torch.randn(11, device=device).bfloat16()), r"bias: expected dtype torch.float32"
        ),
        ErrorInput(args(class_weight=torch.randn(3, device=device)), r"class_weight: expected shape \(11,\)"),
        ErrorInput(args(grad_accum_dtype=torch.float16), "grad_accum_dtype: expected None, torch.float32"),
        ErrorInput(
            args(target=torch.randint(0, 11, (5,), device="meta")), f"target: expected device {device}"
        ),
    ]


SPEC = register_op(
    OpSpec(
        name="fused_linear_cross_entropy",
        reference=fused_linear_cross_entropy_reference,
        make_inputs=make_inputs,
        check_inputs=check_inputs,
        check_values=check_values,
        grad_inputs=("hidden", "weight", "bias"),
        shapes={
            "tiny": [{"BT": 4, "H": 3, "V": 5}],
            "quick": [{"BT": 37, "H": 64, "V": 131}, {"BT": 10, "H": 40, "V": 500}],
            "full": [
                {"BT": 37, "H": 64, "V": 131},
                {"BT": 10, "H": 40, "V": 500},
                {"BT": 1023, "H": 2048, "V": 32000},
                {"BT": 4096, "H": 4096, "V": 128256},
                {"BT": 8192, "H": 4096, "V": 128256},
            ],
        },
        cases=[
            {},
            {"reduction": "sum", "with_bias": True},
            {"reduction": "none"},
            {"label_smoothing": 0.1, "with_class_weight": True},
            {"softcap": 30.0, "z_loss_scale": 1e-4, "ignore_index": 3},
            {"return_lse": True, "ignore_fraction": 1.0},
            {"return_stats": True, "softcap": 30.0, "with_bias": True},
            # The entropy differentiated (the harness gives it an upstream gradient, as every
            # differentiable output) or, with entropy_grad=False, only logged.
            {"return_stats": True, "reduction": "none", "temperature": 0.7},
            {"return_stats": True, "label_smoothing": 0.1, "z_loss_scale": 1e-4, "with_class_weight": True},
            {"return_stats": True, "entropy_grad": False, "reduction": "sum"},
            {"temperature": 0.7, "softcap": 30.0, "with_bias": True, "reduction": "sum"},
            {"memory_budget": 0.0, "reduction": "sum", "with_class_weight": True},
            {"memory_budget": 0.25, "label_smoothing": 0.1},
            {"memory_budget": 2.0, "softcap": 30.0, "with_bias": True},
            {"lean": True},
        ],
        tolerances=VOCAB_TOLERANCES,
        flops=lambda s: 6 * s["BT"] * s["H"] * s["V"],
        error_inputs=error_inputs,
        sample=sample,
        no_upstream=_no_upstream,
        # A weight expanded over V makes every class the same: the gradients are 0 in fp64 and
        # rounding noise in any other dtype.
        sample_layouts={"weight": ("contiguous", "fresh", "transposed", "sliced")},
        description="lm_head matmul + cross entropy without materializing the logits",
        short_name="flce",
    )
)


@overload
def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    z_loss_scale: float = 0.0,
    class_weight: torch.Tensor | None = None,
    return_lse: Literal[False] = False,
    grad_accum_dtype: torch.dtype | None = None,
    return_stats: Literal[False] = False,
    memory_budget: float | None = None,
    temperature: float = 1.0,
    *,
    backend: str | None = None,
) -> torch.Tensor: ...


@overload
def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    z_loss_scale: float = 0.0,
    class_weight: torch.Tensor | None = None,
    *,
    return_lse: Literal[True],
    grad_accum_dtype: torch.dtype | None = None,
    return_stats: Literal[False] = False,
    memory_budget: float | None = None,
    temperature: float = 1.0,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    z_loss_scale: float = 0.0,
    class_weight: torch.Tensor | None = None,
    *,
    return_lse: bool = False,
    grad_accum_dtype: torch.dtype | None = None,
    return_stats: Literal[True],
    memory_budget: float | None = None,
    temperature: float = 1.0,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]: ...


@overload
def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    z_loss_scale: float = 0.0,
    class_weight: torch.Tensor | None = None,
    return_lse: bool = False,
    grad_accum_dtype: torch.dtype | None = None,
    return_stats: bool = False,
    memory_budget: float | None = None,
    temperature: float = 1.0,
    *,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]: ...


@op_function("fused_linear_cross_entropy")  # writes the body: check the inputs, pick the backend, call it
def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    z_loss_scale: float = 0.0,
    class_weight: torch.Tensor | None = None,
    return_lse: bool = False,
    grad_accum_dtype: torch.dtype | None = None,
    return_stats: bool = False,
    memory_budget: float | None = None,
    temperature: float = 1.0,
    *,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Cross entropy of the logits ``softcap(hidden @ weight.T + bias) / temperature`` against target, without
    materializing the (tokens x V) logits in the fused backends: the lm_head matmul and the loss
    of a causal LM in one op.

    Per token i with target t, logits z, ``lse = logsumexp(z)``, class weights w (ones if
    class_weight is None), label smoothing e and z-loss scale s::

        loss_i = (1 - e) * w[t] * (lse - z[t]) + (e / V) * sum_c w[c] * (lse - z[c]) + s * lse**2

    torch.nn.functional.cross_entropy's definition plus the z-loss term. Tokens whose target is
    ignore_index have loss 0 and no gradient. The loss is fp32 whatever the inputs' dtype.

    Args:
        hidden: Final hidden states, shape (..., H); float32, bfloat16 or float16.
        weight: The lm_head weight, shape (V, H), hidden's dtype and device.
        target: Class indices, shape hidden.shape[:-1], int64 or int32, each in [0, V) or
            equal to ignore_index (checked unless LMKERNELS_CHECK_VALUES=0; an unchecked
            target out of range gives a nan loss, never an out-of-bounds read).
        bias: Optional (V,) added to the logits before the softcap, weight's dtype.
        ignore_index: The target value of tokens that count for nothing.
        reduction: "mean": sum_i loss_i / sum of w[t_i] over the tokens not ignored (torch's
            denominator; 0 when every token is ignored, where torch gives nan). "sum":
            sum_i loss_i. "none": loss_i per token, target's shape.
        label_smoothing: e, in [0, 1].
        softcap: c > 0: the logits become ``c * tanh(z / c)`` (Gemma 2); None for none.
        z_loss_scale: s >= 0, the weight of the ``lse**2`` term (0: no z-loss).
        class_weight: Optional (V,) per-class weights w (torch's ``weight`` argument).
        return_lse: True also returns lse per token.
        grad_accum_dtype: The dtype backends may accumulate the weight gradient in across
            chunks of tokens: torch.float32 (rounded once), weight.dtype (leanest) or None (the
            backend's default, within the correctness policy). Not part of the math.
        return_stats: True also returns lse, the softmax entropy and whether the target is a
            top-1 class, per token (what a trainer logs, without a pass of its own).
        temperature: T > 0: the logits are divided by it, in fp32, after the softcap (the
            sampling temperature RL trainers score their samples at); 1 for none.
        memory_budget: How much memory the op may hold beyond its gradients, as a fraction of
            their bytes (grad_hidden + grad_weight): None for the backend's default, 0 for the
            least it can do; a number >= 0. Not part of the math: the Triton backends choose
            their chunks and whether to recompute the logits from it; eager and compile ignore
            it; the peers' adapters refuse it.
        backend: The backend that runs the op ("triton", "compile", "eager", ...). None: the
            choice of ``use_backend()`` / ``set_backend()``, else of LMKERNELS_BACKEND, else the
            highest-priority backend that can take the inputs. A backend asked for that cannot
            take them raises BackendNotSupportedError (never a silent fallback).

    Returns:
        The loss (a scalar, or target's shape for reduction="none"; differentiable with respect
        to hidden, weight and bias). With return_lse=True: (loss, lse). With return_stats=True:
        (loss, lse, entropy, is_top1), where entropy is ``sum_c p_c (lse - z_c)`` of the softmax p
        (fp32, differentiable: an entropy bonus's gradient flows to hidden, weight and bias) and
        is_top1 is bool, True where no logit exceeds the target's (False for ignored tokens). All
        have target's shape; lse and is_top1 have no gradient.

    Raises:
        LMKernelsError: An input of the wrong type, shape, dtype or device, or an option out of
            range; the message names the argument.
    """


# --- mean logits ---------------------------------------------------------------------------------

MEAN_LOGITS_CHUNK_BYTES = 1 << 28  # fp32 logits per chunk of tokens (with a softcap)


def _check_mean_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    softcap: float | None,
    temperature: float,
) -> None:
    check_tensor("hidden", hidden)
    check_tensor("weight", weight, ndim=2)
    V, H = weight.shape
    if hidden.dim() < 1 or hidden.shape[-1] != H:
        fail(f"hidden: expected shape (..., {H}) to match weight (V={V}, H={H}), got {tuple(hidden.shape)}")
    if weight.dtype != hidden.dtype:
        fail(f"weight: expected dtype {hidden.dtype} (same as hidden), got {weight.dtype}")
    if bias is not None:
        check_tensor("bias", bias, ndim=1)
        if bias.shape[0] != V:
            fail(f"bias: expected shape ({V},) to match weight's V, got {tuple(bias.shape)}")
        if bias.dtype != weight.dtype:
            fail(f"bias: expected dtype {weight.dtype} (same as weight), got {bias.dtype}")
    check_same_device(hidden=hidden, weight=weight, bias=bias)
    if softcap is not None:
        check_number("softcap", softcap, low=0.0, what="None or a positive number")
        if softcap == 0:
            fail("softcap: expected None or a positive number, got 0")
    check_number(
        "temperature", temperature, low=0.0, high=sys.float_info.max, what="a positive finite number"
    )
    if temperature == 0:
        fail("temperature: expected a positive finite number, got 0")


def flce_mean_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Per token, the mean over the vocabulary of the logits fused_linear_cross_entropy sees,
    z = softcap(hidden @ weight.T + bias) / temperature, without the (tokens x V) logits: a metric
    (TRL's DPO and KTO log it as mean_logits).

    Args:
        hidden: Final hidden states, shape (..., H).
        weight: The lm_head weight, shape (V, H), hidden's dtype and device.
        bias: Optional (V,) added before the softcap, weight's dtype.
        softcap: c > 0: the logits become ``c * tanh(z / c)``; None for none.
        temperature: T > 0, the logits divided by it after the softcap.

    Returns:
        fp32, shape hidden.shape[:-1], no gradient.

    Without a softcap the mean is linear in the logits: (h . mean_c(W_c) + mean(b)) / T, with
    mean_c(W_c) summed in fp32 from the weight's own dtype (no copy of it) and one fp32
    matrix-vector product per chunk of tokens: exact to fp32 rounding, and more exact than the
    mean of logits rounded to a 16-bit dtype. With a softcap every logit is needed: fp32
    logits (fp32 accumulation) of chunks of tokens of at most MEAN_LOGITS_CHUNK_BYTES.
    """
    _check_mean_logits(hidden, weight, bias, softcap, temperature)
    V, H = weight.shape
    with torch.no_grad():
        h = hidden.detach().reshape(-1, H)
        w = weight.detach()
        n = h.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=h.device)
        if softcap is None:
            w_mean = w.sum(0, dtype=torch.float32).div_(V)
            shift = 0.0 if bias is None else bias.detach().sum(dtype=torch.float32) / V
            rows = max(1, MEAN_LOGITS_CHUNK_BYTES // (4 * max(H, 1)))
            for s in range(0, n, rows):
                out[s : s + rows] = h[s : s + rows].float() @ w_mean + shift
        else:
            # fp32 output of the 16-bit GEMM on CUDA; elsewhere the weight upcast once
            fp32_out = h.is_cuda and h.dtype != torch.float32 and hasattr(torch.ops.aten.mm, "dtype_out")
            w_mm = w if fp32_out or w.dtype == torch.float32 else w.float()
            b = None if bias is None else bias.detach().float()
            rows = max(1, MEAN_LOGITS_CHUNK_BYTES // (4 * max(V, 1)))
            for s in range(0, n, rows):
                hc = h[s : s + rows]
                if fp32_out:
                    z = torch.mm(hc, w_mm.T, out_dtype=torch.float32)
                else:
                    z = hc.to(w_mm.dtype) @ w_mm.T
                if b is not None:
                    z += b
                z = torch.tanh_(z.div_(softcap)).mul_(softcap)
                out[s : s + rows] = z.mean(-1)
        if temperature != 1.0:
            out.div_(temperature)
    return out.view(hidden.shape[:-1])
