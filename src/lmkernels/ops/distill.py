"""Fused linear distillation: a divergence between the student's and the teacher's softmax over the
vocabulary, taken through both lm_heads, plus an optional hard cross entropy of the student.

Shapes: student_hidden (..., Hs), student_weight (V, Hs), teacher_hidden (..., Ht) with the same
leading dims, teacher_weight (V, Ht), target None or (...) int64/int32 with values in [0, V) or
ignore_index, student_bias / teacher_bias None or (V,). Student tensors share one dtype, teacher
tensors one dtype (the two may differ). The loss is fp32 whatever the inputs' dtype.

Per token i, with logits x_s = h_s @ W_s.T + b_s and x_t = h_t @ W_t.T + b_t, temperature T,
log_s = log_softmax(x_s / T), log_t = log_softmax(x_t / T) (p_s, p_t their softmaxes):

    forward_kl:  D_i = KL(p_t || p_s) = sum_c p_t (log_t - log_s)
    reverse_kl:  D_i = KL(p_s || p_t) = sum_c p_s (log_s - log_t)
    jsd (beta):  m = (1 - beta) p_s + beta p_t,
                 D_i = beta KL(p_t || m) + (1 - beta) KL(p_s || m)
                 beta = 0 is forward_kl and beta = 1 reverse_kl (not the limits of the formula,
                 which are 0)

    loss_i = soft_weight * D_i + hard_weight * (logsumexp(x_s) - x_s[target_i])

This is TRL's GKDTrainer.generalized_jsd_loss (trl.experimental.gkd, TRL 1.16) and Liger's
LigerFusedLinearJSD: the same mixture, the same beta (the teacher's share of m), the same
special cases at beta 0 and 1, both logits divided by the temperature and no T^2 factor on the
divergence. The hard loss is the student's cross entropy at temperature 1 (the label loss of
Hinton-style distillation, Liger's weight_hard_loss); hard_weight > 0 needs a target. The
divergence is TRL's default with beta = 0.5 (jsd), as are the other defaults (soft_weight 1,
hard_weight 0).

Tokens whose target is ignore_index have loss 0 and no gradient; without a target every token
counts. A target outside [0, V) (possible only when LMKERNELS_CHECK_VALUES=0 skipped the check)
makes that token's loss and gradients nan, whatever hard_weight is.

Reductions: "none" returns loss_i (shape of the leading dims; fp32, differentiable); "sum" the
sum; "mean" the sum over the tokens that count divided by their number: TRL's "batchmean" with
labels (and its num_items_in_batch when that is the local count). Without a target "mean"
divides by the number of tokens (TRL's batchmean without labels divides by the batch's first
dim, the sequences, not the tokens). When no token counts "mean" returns 0, as TRL's clamp does.

Gradients reach student_hidden, student_weight and student_bias. The teacher is normally frozen
(its tensors do not require grad); where a teacher tensor does require grad the eager and
compile backends differentiate it as plain PyTorch does, and the Triton backend refuses the
call (never a silently missing gradient).
"""

from __future__ import annotations

import dataclasses
import math
import sys

import torch
import torch.nn.functional as F

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
from lmkernels.utils import (
    check_choice,
    check_int,
    check_number,
    check_same_device,
    check_tensor,
    fail,
)

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")
REDUCTIONS = ("mean", "sum", "none")


@dataclasses.dataclass(frozen=True, eq=False)
class DistillOptions:
    """The op's options besides the four hidden/weight inputs and the target, defined once: every
    backend reads ``DistillOptions(**options)`` (an unknown option is a TypeError naming it).
    Their meaning is in the module docstring."""

    student_bias: torch.Tensor | None = None  # (V,)
    teacher_bias: torch.Tensor | None = None  # (V,)
    divergence: str = "jsd"  # one of DIVERGENCES
    beta: float = 0.5  # jsd only: the teacher's share of the mixture
    temperature: float = 1.0
    ignore_index: int = -100
    hard_weight: float = 0.0
    soft_weight: float = 1.0
    reduction: str = "mean"  # one of REDUCTIONS


def effective_divergence(divergence: str, beta: float) -> str:
    """The divergence a call computes: jsd with beta 0 or 1 is forward or reverse KL (TRL's and
    Liger's special cases)."""
    if divergence == "jsd" and beta == 0.0:
        return "forward_kl"
    if divergence == "jsd" and beta == 1.0:
        return "reverse_kl"
    return divergence


def divergence_per_token(log_s, log_t, divergence="jsd", beta=0.5):
    """D_i of the module docstring from the student's and the teacher's log-probabilities (the
    last dim is the vocabulary)."""
    divergence = effective_divergence(divergence, beta)
    if divergence == "forward_kl":
        return (log_t.exp() * (log_t - log_s)).sum(-1)
    if divergence == "reverse_kl":
        return (log_s.exp() * (log_s - log_t)).sum(-1)
    log_m = torch.logaddexp(log_s + math.log1p(-beta), log_t + math.log(beta))
    kl_t = (log_t.exp() * (log_t - log_m)).sum(-1)
    kl_s = (log_s.exp() * (log_s - log_m)).sum(-1)
    return beta * kl_t + (1.0 - beta) * kl_s


def fused_linear_distillation_reference(
    student_hidden,
    student_weight,
    teacher_hidden,
    teacher_weight,
    target=None,
    student_bias=None,
    teacher_bias=None,
    divergence="jsd",
    beta=0.5,
    temperature=1.0,
    ignore_index=-100,
    hard_weight=0.0,
    soft_weight=1.0,
    reduction="mean",
):
    """The module docstring's semantics in eager PyTorch; the options are DistillOptions' fields."""
    V, Hs = student_weight.shape
    Ht = teacher_weight.shape[1]
    # Both lm_heads as a model computes them (in the inputs' dtype, rounded to it), the rest in
    # fp32 (fp64 for fp64 inputs): what plain PyTorch gets, the correctness policy's baseline.
    xs = upcast(F.linear(student_hidden.reshape(-1, Hs), student_weight, student_bias))
    xt = upcast(F.linear(teacher_hidden.reshape(-1, Ht), teacher_weight, teacher_bias)).to(xs.dtype)
    log_s = torch.log_softmax(xs / temperature, dim=-1)
    log_t = torch.log_softmax(xt / temperature, dim=-1)
    loss = soft_weight * divergence_per_token(log_s, log_t, divergence, beta)
    BT = xs.shape[0]
    if target is None:
        count = torch.tensor(float(max(BT, 1)), dtype=xs.dtype, device=xs.device)
        shape = student_hidden.shape[:-1]
    else:
        t = target.reshape(-1)
        valid = t != ignore_index
        in_range = (t >= 0) & (t < V)
        if hard_weight:
            # A target outside [0, V) is never read (index 0 instead): the token's loss is nan below.
            safe_t = torch.where(valid & in_range, t, 0).long()
            nll = torch.logsumexp(xs, dim=-1) - xs.gather(1, safe_t[:, None])[:, 0]
            loss = loss + hard_weight * nll
        loss = loss * torch.where(valid & ~in_range, float("nan"), 1.0).to(loss.dtype)
        loss = torch.where(valid, loss, 0.0)
        count = valid.sum().to(xs.dtype)
        shape = target.shape
    if reduction == "none":
        return loss.view(shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / torch.where(count == 0, 1.0, count)


def check_inputs(student_hidden, student_weight, teacher_hidden, teacher_weight, target=None, **options):
    o = DistillOptions(**options)
    check_tensor("student_hidden", student_hidden)
    check_tensor("student_weight", student_weight, ndim=2)
    check_tensor("teacher_hidden", teacher_hidden)
    check_tensor("teacher_weight", teacher_weight, ndim=2)
    V, Hs = student_weight.shape
    Ht = teacher_weight.shape[1]
    if V == 0:
        fail("student_weight: expected at least one row (a vocabulary of V >= 1), got shape (0, ...)")
    for name, width in (("student_weight", Hs), ("teacher_weight", Ht)):
        if width == 0:
            fail(f"{name}: expected at least one hidden feature, got shape (..., 0)")
    if teacher_weight.shape[0] != V:
        fail(
            f"teacher_weight: expected {V} rows (the vocabulary of student_weight), got shape {tuple(teacher_weight.shape)}"
        )
    if student_hidden.dim() < 1 or student_hidden.shape[-1] != Hs:
        fail(
            f"student_hidden: expected shape (..., {Hs}) to match student_weight (V={V}, H={Hs}), got {tuple(student_hidden.shape)}"
        )
    lead = tuple(student_hidden.shape[:-1])
    if teacher_hidden.dim() < 1 or tuple(teacher_hidden.shape) != (*lead, Ht):
        fail(
            f"teacher_hidden: expected shape {(*lead, Ht)} (student_hidden's leading dims, teacher_weight's H), got {tuple(teacher_hidden.shape)}"
        )
    if student_weight.dtype != student_hidden.dtype:
        fail(
            f"student_weight: expected dtype {student_hidden.dtype} (same as student_hidden), got {student_weight.dtype}"
        )
    if teacher_weight.dtype != teacher_hidden.dtype:
        fail(
            f"teacher_weight: expected dtype {teacher_hidden.dtype} (same as teacher_hidden), got {teacher_weight.dtype}"
        )
    if target is not None:
        check_tensor("target", target, dtypes=(torch.int64, torch.int32))
        if tuple(target.shape) != lead:
            fail(
                f"target: expected shape {lead} (student_hidden without its last dim), got {tuple(target.shape)}"
            )
    for name, bias, owner in (
        ("student_bias", o.student_bias, student_weight),
        ("teacher_bias", o.teacher_bias, teacher_weight),
    ):
        if bias is not None:
            check_tensor(name, bias, ndim=1)
            if bias.shape[0] != V:
                fail(f"{name}: expected shape ({V},) to match the vocabulary, got {tuple(bias.shape)}")
            if bias.dtype != owner.dtype:
                fail(f"{name}: expected dtype {owner.dtype} (same as its weight), got {bias.dtype}")
    check_same_device(
        student_hidden=student_hidden,
        student_weight=student_weight,
        teacher_hidden=teacher_hidden,
        teacher_weight=teacher_weight,
        target=target,
        student_bias=o.student_bias,
        teacher_bias=o.teacher_bias,
    )
    check_choice("divergence", o.divergence, DIVERGENCES)
    check_number("beta", o.beta, low=0.0, high=1.0, what="a number in [0, 1]")
    finite = sys.float_info.max
    check_number("temperature", o.temperature, low=0.0, high=finite, what="a finite number > 0")
    if o.temperature == 0:
        fail("temperature: expected a finite number > 0, got 0")
    check_int("ignore_index", o.ignore_index)
    check_number("hard_weight", o.hard_weight, low=0.0, high=finite, what="a finite number >= 0")
    check_number("soft_weight", o.soft_weight, low=0.0, high=finite, what="a finite number >= 0")
    if o.hard_weight and target is None:
        fail(f"hard_weight: {o.hard_weight} needs a target (the hard loss is a cross entropy against it)")
    check_choice("reduction", o.reduction, REDUCTIONS)


def check_values(student_weight, target=None, ignore_index=DistillOptions.ignore_index, **_):
    """Targets in range: reads values, so the dispatcher runs it on every call (check_inputs only
    once per input signature)."""
    if target is not None:
        check_class_indices(target, student_weight.shape[0], ignore_index)


# make_inputs: logits of std LOGIT_STD from a latent the two models share, the student's class
# embeddings off the teacher's by STUDENT_OFFSET of that std, so the student is a teacher's
# imperfect copy (a divergence of a fraction of a nat), not an unrelated model (several nats).
LOGIT_STD = 2.0
STUDENT_OFFSET = 0.5
PRIVATE_STD = 0.3  # each model's own hidden dims beyond the shared latent, as a share of LOGIT_STD


def make_inputs(
    shape,
    dtype,
    device,
    seed=0,
    with_target=True,
    with_bias=False,
    ignore_fraction=0.1,
    **options,
):
    """student_hidden (BT, Hs), student_weight (V, Hs), teacher_hidden (BT, Ht), teacher_weight
    (V, Ht), target (BT,) (with_target; a share ignore_fraction of it ignore_index), both biases
    (with_bias). The first r = min(Hs, Ht) hidden dims of both models are one latent u ~ N(0, 1);
    the teacher's class embeddings E ~ N(0, LOGIT_STD^2 / r) there, the student's E plus
    N(0, (STUDENT_OFFSET * LOGIT_STD)^2 / r); the remaining dims add noise of PRIVATE_STD x
    LOGIT_STD to each model's logits."""
    g = generator(seed)
    BT, Hs, Ht, V = shape["BT"], shape["Hs"], shape["Ht"], shape["V"]
    r = max(1, min(Hs, Ht))

    def model(H, offset):
        hidden = torch.randn(BT, H, generator=g)
        weight = torch.randn(V, H, generator=g) * (PRIVATE_STD * LOGIT_STD / max(H - r, 1) ** 0.5)
        k = min(r, H)
        hidden[:, :k] = latent[:, :k]
        weight[:, :k] = embed[:, :k] + offset * torch.randn(V, k, generator=g) * (LOGIT_STD / r**0.5)
        return hidden.to(device, dtype), weight.to(device, dtype)

    latent = torch.randn(BT, r, generator=g)
    embed = torch.randn(V, r, generator=g) * (LOGIT_STD / r**0.5)
    teacher_hidden, teacher_weight = model(Ht, 0.0)
    student_hidden, student_weight = model(Hs, STUDENT_OFFSET)
    out = {
        "student_hidden": student_hidden,
        "student_weight": student_weight,
        "teacher_hidden": teacher_hidden,
        "teacher_weight": teacher_weight,
        **options,
    }
    if with_target:
        target = torch.randint(0, V, (BT,), generator=g)
        target[torch.rand(BT, generator=g) < ignore_fraction] = options.get(
            "ignore_index", DistillOptions.ignore_index
        )
        out["target"] = target.to(device)
    if with_bias:
        out["student_bias"] = randn((V,), dtype, device, g, scale=0.5)
        out["teacher_bias"] = randn((V,), dtype, device, g, scale=0.5)
    return out


def sample(draw):
    wide = draw.booleans()  # a vocabulary past 2^16, with few tokens
    V = draw.sampled_from((65537, 70001) if wide else (1, 2, 3, 7, 11, 64, 97, 128, 257, 1000))
    BT = draw.integers(0, 3) if wide else draw.sampled_from(ROW_COUNTS)
    widths = (2, 3, 8, 16, 17, 64) if wide else (1, 2, 3, 8, 16, 17, 64, 96)
    with_target = draw.booleans()
    options = {
        "divergence": draw.sampled_from(DIVERGENCES),
        "beta": draw.sampled_from((0.0, 0.1, 0.5, 0.5, 0.9, 1.0)),
        "temperature": draw.sampled_from((1.0, 1.0, 0.5, 2.0)),
        "reduction": draw.sampled_from(REDUCTIONS),
        "soft_weight": draw.sampled_from((1.0, 1.0, 0.5)),
        "hard_weight": draw.sampled_from((0.0, 0.0, 0.5)) if with_target else 0.0,
        "ignore_index": draw.sampled_from((-100, 0, 3)),
        "ignore_fraction": draw.sampled_from((0.0, 0.1, 0.5, 1.0)),
        "with_target": with_target,
        "with_bias": draw.booleans(),
    }
    return {"BT": BT, "Hs": draw.sampled_from(widths), "Ht": draw.sampled_from(widths), "V": V}, options


def error_inputs(device):
    def args(**over):
        base = {
            "student_hidden": torch.randn(5, 8, device=device),
            "student_weight": torch.randn(11, 8, device=device),
            "teacher_hidden": torch.randn(5, 6, device=device),
            "teacher_weight": torch.randn(11, 6, device=device),
            "target": torch.randint(0, 11, (5,), device=device),
        }
        return {**base, **over}

    return [
        ErrorInput(
            args(
                teacher_hidden=torch.randn(5, 0, device=device),
                teacher_weight=torch.randn(11, 0, device=device),
            ),
            "teacher_weight: expected at least one hidden feature",
        ),
        ErrorInput(
            args(student_hidden=torch.randn(5, 9, device=device)),
            r"student_hidden: expected shape \(..., 8\)",
        ),
        ErrorInput(
            args(student_weight=torch.randn(11, 8, 1, device=device)), "student_weight: expected 2 dims"
        ),
        ErrorInput(
            args(teacher_weight=torch.randn(12, 6, device=device)), "teacher_weight: expected 11 rows"
        ),
        ErrorInput(
            args(teacher_hidden=torch.randn(4, 6, device=device)), r"teacher_hidden: expected shape \(5, 6\)"
        ),
        ErrorInput(
            args(teacher_hidden=torch.randn(5, 7, device=device)), r"teacher_hidden: expected shape \(5, 6\)"
        ),
        ErrorInput(
            args(student_weight=torch.randn(11, 8, device=device).bfloat16()),
            "student_weight: expected dtype torch.float32",
        ),
        ErrorInput(
            args(teacher_weight=torch.randn(11, 6, device=device).half()),
            "teacher_weight: expected dtype torch.float32",
        ),
        ErrorInput(
            args(student_weight=torch.randn(0, 8, device=device)), "student_weight: expected at least one row"
        ),
        ErrorInput(args(target=torch.randint(0, 11, (6,), device=device)), r"target: expected shape \(5,\)"),
        ErrorInput(args(target=torch.randn(5, device=device)), "target: expected dtype in"),
        ErrorInput(
            args(target=torch.tensor([0, 1, 11, 2, -100], device=device)),
            r"target: expected class indices in \[0, 11\) or ignore_index=-100, found 11",
        ),
        ErrorInput(args(target=torch.tensor([0, 1, -3, 2, 3], device=device)), "target: .* found -3"),
        ErrorInput(
            args(student_bias=torch.randn(10, device=device)), r"student_bias: expected shape \(11,\)"
        ),
        ErrorInput(
            args(teacher_bias=torch.randn(11, device=device).bfloat16()),
            "teacher_bias: expected dtype torch.float32",
        ),
        ErrorInput(args(divergence="kl"), "divergence: expected one of"),
        ErrorInput(args(beta=1.5), r"beta: expected a number in \[0, 1\]"),
        ErrorInput(args(beta=float("nan")), r"beta: expected a number in \[0, 1\]"),
        ErrorInput(args(temperature=0.0), "temperature: expected a finite number > 0"),
        ErrorInput(args(temperature=-1.0), "temperature: expected a finite number > 0"),
        ErrorInput(args(temperature=float("inf")), "temperature: expected a finite number > 0"),
        ErrorInput(args(hard_weight=-0.5), "hard_weight: expected a finite number >= 0"),
        ErrorInput(args(soft_weight=float("inf")), "soft_weight: expected a finite number >= 0"),
        ErrorInput(args(target=None, hard_weight=0.5), "hard_weight: 0.5 needs a target"),
        ErrorInput(args(ignore_index=-1.5), "ignore_index: expected an int"),
        ErrorInput(args(reduction="batchmean"), "reduction: expected one of"),
        ErrorInput(
            args(teacher_weight=torch.randn(11, 6, device="meta")),
            f"teacher_weight: expected device {device}",
        ),
    ]


SPEC = register_op(
    OpSpec(
        name="fused_linear_distillation",
        reference=fused_linear_distillation_reference,
        make_inputs=make_inputs,
        check_inputs=check_inputs,
        check_values=check_values,
        grad_inputs=("student_hidden", "student_weight", "student_bias"),
        tolerances=VOCAB_TOLERANCES,
        shapes={
            "tiny": [{"BT": 4, "Hs": 3, "Ht": 5, "V": 7}],
            "quick": [{"BT": 37, "Hs": 64, "Ht": 96, "V": 131}, {"BT": 10, "Hs": 40, "Ht": 24, "V": 500}],
            "full": [
                {"BT": 37, "Hs": 64, "Ht": 96, "V": 131},
                {"BT": 10, "Hs": 40, "Ht": 24, "V": 500},
                {"BT": 1023, "Hs": 1024, "Ht": 2048, "V": 32000},
                {"BT": 4096, "Hs": 2048, "Ht": 4096, "V": 128256},
                {"BT": 8192, "Hs": 2048, "Ht": 4096, "V": 151936},
            ],
        },
        cases=[
            {},
            {"divergence": "forward_kl", "temperature": 2.0},
            {"divergence": "reverse_kl", "reduction": "sum", "with_bias": True},
            {"beta": 0.1, "temperature": 0.7, "hard_weight": 0.5, "soft_weight": 0.5},
            {"reduction": "none", "ignore_index": 3, "with_bias": True},
            {"with_target": False, "divergence": "forward_kl", "reduction": "sum"},
            {"beta": 0.0, "hard_weight": 1.0},
            {"beta": 1.0, "temperature": 2.0, "reduction": "none"},
            {"divergence": "reverse_kl", "hard_weight": 0.3, "ignore_fraction": 1.0},
        ],
        # Both logits matmuls forward, the student's two gradient matmuls backward.
        flops=lambda s: 2 * s["BT"] * s["V"] * (3 * s["Hs"] + s["Ht"]),
        error_inputs=error_inputs,
        sample=sample,
        # A weight expanded over V makes every class the same: the gradients' sums over the
        # vocabulary cancel exactly in fp64 and leave rounding noise in any other dtype.
        sample_layouts={
            "student_weight": ("contiguous", "fresh", "transposed", "sliced"),
            "teacher_weight": ("contiguous", "fresh", "transposed", "sliced"),
        },
        description="distillation loss through the student's and the teacher's lm_heads, logits never materialized",
        short_name="distill",
    )
)


@op_function("fused_linear_distillation")  # writes the body: check the inputs, pick the backend, call it
def fused_linear_distillation(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    target: torch.Tensor | None = None,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    divergence: str = "jsd",
    beta: float = 0.5,
    temperature: float = 1.0,
    ignore_index: int = -100,
    hard_weight: float = 0.0,
    soft_weight: float = 1.0,
    reduction: str = "mean",
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Knowledge-distillation loss of a student against a teacher, computed from both models'
    last hidden states and lm_head weights without materializing the (tokens x V) logits in
    the fused backends.

    Args:
        student_hidden: (..., Hs) the student's last hidden states; gets a gradient.
        student_weight: (V, Hs) the student's lm_head weight; gets a gradient.
        teacher_hidden: (..., Ht) the teacher's, same leading dims.
        teacher_weight: (V, Ht) the teacher's lm_head weight.
        target: (...) int labels, or None. Tokens labelled ignore_index count for nothing; the
            hard loss is the cross entropy against the labels.
        student_bias, teacher_bias: (V,) lm_head biases, or None.
        divergence: "forward_kl" (KL(teacher || student)), "reverse_kl" (KL(student ||
            teacher)) or "jsd" (TRL's generalized JSD; beta 0 and 1 are the two KLs).
        beta: jsd's teacher share of the mixture, in [0, 1].
        temperature: both logits are divided by it before their softmaxes (> 0).
        ignore_index: the label of tokens to skip.
        hard_weight, soft_weight: loss = soft_weight * divergence + hard_weight * the student's
            cross entropy at temperature 1 (hard_weight > 0 needs a target).
        reduction: "mean" (over the tokens that count), "sum" or "none" (per token).
        backend: an explicit backend (see lmkernels.explain), else the dispatch order.

    Returns:
        The loss in fp32: a scalar, or per token (the leading dims) for reduction "none".

    See the module docstring for the exact definitions and how they match TRL's GKD and Liger's
    fused linear JSD.
    """
