"""lmkernels.losses against plain PyTorch from full logits in fp64.

Each loss runs on fp32 inputs through lmkernels' fused ops (eager backend, and the Triton backend
under the interpreter for one loss per family); the reference computes the logits of the same
inputs in fp64 (log_softmax, gather) and transcribes TRL 1.16's formulas (DPOTrainer, KTOTrainer,
GRPOTrainer, RLOOTrainer, trl.experimental CPO / ORPO, GKD's generalized JSD), and where TRL is
installed its own CPO / ORPO / GKD functions are run on the same fp64 log-probs too. Compared:
the loss, its gradients w.r.t. hidden and weight (and bias), and every metric.

The Triton backend's temperature and entropy gradient are compared with eager's like the rest.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
import torch.nn.functional as F

import lmkernels
from conftest import DEVICE
from lmkernels import losses as L

B, T, H, V = 3, 7, 16, 29  # B pairs (2B rows for the preference losses)
VALUE_RTOL = 2e-6  # fp32 fused loss against fp64 (short sums of O(1) terms)
GRAD_RTOL = 2e-5
ATOL = 2e-6  # scalars: fp32 sums of ~20 log-probs of size ~3


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _rel(a, b) -> float:
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _close(got, want, rtol, what="", atol=ATOL):
    """Relative (norm) error within rtol, or, for scalars, |got - want| <= rtol |want| + atol: a
    metric such as a reward is a difference of sequence log-probs, whose fp32 rounding is absolute."""
    got, want = torch.as_tensor(got).double(), torch.as_tensor(want).double()
    if want.numel() == 1:
        err = abs(got.item() - want.item())
        assert err <= rtol * abs(want.item()) + atol, (what, got.item(), want.item(), err)
    else:
        assert _rel(got, want) <= rtol, (what, got, want, _rel(got, want))


# --- inputs ---------------------------------------------------------------------------------------


def _inputs(rows, seed=0, hidden_width=H, with_bias=False, prompt=2):
    """fp64 hidden (rows, T, H) and weight (V, H) (logits std ~1.5), targets with the first
    `prompt` positions ignored, and a completion mask that ends early on some rows (padding)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, T, hidden_width, generator=g, dtype=torch.float64)
    weight = torch.randn(V, hidden_width, generator=g, dtype=torch.float64) * 1.5 / hidden_width**0.5
    bias = torch.randn(V, generator=g, dtype=torch.float64) * 0.3 if with_bias else None
    target = torch.randint(0, V, (rows, T), generator=g)
    target[:, :prompt] = -100
    mask = torch.ones(rows, T, dtype=torch.long)
    for r in range(rows):
        mask[r, T - int(torch.randint(0, 3, (1,), generator=g)) :] = 0
    return hidden, weight, bias, target, mask


class Leaves:
    """fp32 leaves for lmkernels and fp64 leaves for the reference, of the same values."""

    def __init__(self, *tensors):
        self.f32 = [None if t is None else t.float().requires_grad_() for t in tensors]
        self.f64 = [None if t is None else t.clone().requires_grad_() for t in tensors]

    def grads(self, loss32, loss64):
        live = [i for i, t in enumerate(self.f32) if t is not None]
        g32 = torch.autograd.grad(loss32, [self.f32[i] for i in live])
        g64 = torch.autograd.grad(loss64, [self.f64[i] for i in live])
        for i, a, b in zip(live, g32, g64):
            _close(a, b, GRAD_RTOL, f"grad {i}")


# --- the reference: full logits in fp64 -------------------------------------------------------------


def ref_tokens(
    hidden, weight, target, mask=None, bias=None, temperature=1.0, softcap=None, all_positions=False
):
    """Per-token log-probs, entropy, top-1 and mean logit from the full logits; log-probs 0 where
    the token does not count unless all_positions (TRL's GRPO head scores every completion token)."""
    z = hidden @ weight.T
    if bias is not None:
        z = z + bias
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    logp = torch.log_softmax(z, -1)
    counted = target != -100
    if mask is not None:
        counted = counted & mask.bool()
    lp = logp.gather(-1, target.clamp(min=0)[..., None])[..., 0]
    entropy = -(logp.exp() * logp).sum(-1)
    top1 = z.gather(-1, target.clamp(min=0)[..., None])[..., 0] >= z.amax(-1)
    if not all_positions:
        lp = torch.where(counted, lp, 0.0)
    return types.SimpleNamespace(
        logps=lp,
        entropy=torch.where(counted, entropy, 0.0),
        top1=top1 & counted,
        mask=counted,
        mean=z.mean(-1),
    )


def masked_mean(x, m):
    m = m.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1)


# --- sequence log-probs -------------------------------------------------------------------------------


@pytest.mark.parametrize("average", [False, True])
@pytest.mark.parametrize("options", [{}, {"temperature": 0.7, "softcap": 3.0, "with_bias": True}])
def test_sequence_logps(average, options):
    options = dict(options)
    with_bias = options.pop("with_bias", False)
    hidden, weight, bias, target, mask = _inputs(4, with_bias=with_bias)
    x = Leaves(hidden, weight, bias)
    (h, w, b), (h64, w64, b64) = x.f32, x.f64
    got = L.sequence_logps(h, w, target, mask, bias=b, average=average, backend="eager", **options)
    r = ref_tokens(h64, w64, target, mask, bias=b64, **options)
    want = (r.logps * r.mask).sum(-1)
    if average:
        want = want / r.mask.sum(-1).clamp(min=1)
    assert got.dtype == torch.float32 and got.shape == (4,)
    _close(got, want, VALUE_RTOL)
    x.grads((got * torch.arange(1.0, 5.0)).sum(), (want * torch.arange(1.0, 5.0, dtype=torch.float64)).sum())
    t = L.token_logps(h, w, target, mask, bias=b, stats=True, backend="eager", **options)
    _close(t.logps, r.logps, VALUE_RTOL)
    _close(t.entropy, r.entropy, VALUE_RTOL)
    assert torch.equal(t.is_top1, r.top1) and torch.equal(t.mask, r.mask)
    _close(
        L.mean_logits(h, w, b, options.get("softcap"), options.get("temperature", 1.0)), r.mean, VALUE_RTOL
    )


@pytest.mark.parametrize("backend", ["eager", pytest.param("triton", marks=pytest.mark.slow)])
def test_sequence_logps_long_sequences_bf16(backend):
    """Sequences of 4096 tokens in bf16: the fused sequence log-probs (fp32 loss math; Triton
    keeps the logits in fp32 too) are no further from fp64 than plain PyTorch's bf16 logits +
    log_softmax, whose roundings add up over the sequence."""
    g = torch.Generator().manual_seed(0)
    n, length, width, vocab = (2 if backend == "eager" else 1), 4096, 32, 256  # (the interpreter is slow)
    hidden = torch.randn(n, length, width, generator=g).bfloat16()
    weight = (torch.randn(vocab, width, generator=g) * 2.0 / width**0.5).bfloat16()
    target = torch.randint(0, vocab, (n, length), generator=g)
    exact = ref_tokens(hidden.double(), weight.double(), target).logps.sum(-1)
    logits = hidden @ weight.T  # bf16, as a model's lm_head returns them
    plain = torch.log_softmax(logits, -1).gather(-1, target[..., None])[..., 0].float().sum(-1)
    # On a GPU the Triton backend runs compiled there (the interpreter only on the CPU).
    fused = L.sequence_logps(hidden.to(DEVICE), weight.to(DEVICE), target.to(DEVICE), backend=backend).cpu()
    err_plain = (plain.double() - exact).abs().max().item()
    err_fused = (fused.double() - exact).abs().max().item()
    print(f"{backend}: |fused - fp64| {err_fused:.3e}, |plain bf16 - fp64| {err_plain:.3e}")
    assert err_fused <= err_plain


# --- DPO ------------------------------------------------------------------------------------------------


def ref_dpo(h, w, target, mask, ref_logps, *, beta, loss_type, loss_weights, label_smoothing,
            f_divergence_type, f_alpha_divergence_coef, discopop_tau, ld_alpha):  # fmt: skip
    """TRL 1.16 DPOTrainer._compute_loss on fp64 full-logit log-probs (its code, transcribed)."""
    s = ref_tokens(h, w, target, mask)
    per_token_logps, shift_completion_mask = s.logps, s.mask.long()

    def aggregate(ptl):
        if ld_alpha is None:
            return ptl.sum(dim=1)
        comp_pos = shift_completion_mask.cumsum(dim=1)
        comp_lens = shift_completion_mask.sum(dim=1).long()
        chosen_lens, rejected_lens = comp_lens.chunk(2, dim=0)
        shared_lens = torch.minimum(chosen_lens, rejected_lens)
        shared_lens = torch.cat([shared_lens, shared_lens], dim=0)
        shared_mask = (comp_pos > 0) & (comp_pos <= shared_lens.unsqueeze(1))
        tail_mask = comp_pos > shared_lens.unsqueeze(1)
        return (ptl * shared_mask).sum(dim=1) + ld_alpha * (ptl * tail_mask).sum(dim=1)

    chosen_logps, rejected_logps = aggregate(per_token_logps).chunk(2, dim=0)
    ref_chosen_logps, ref_rejected_logps = ref_logps.chunk(2, dim=0)
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    if f_divergence_type == "reverse_kl":
        chosen_scores, rejected_scores = chosen_logratios, rejected_logratios
    elif f_divergence_type == "forward_kl":
        chosen_scores, rejected_scores = 1 - torch.exp(-chosen_logratios), 1 - torch.exp(-rejected_logratios)
    elif f_divergence_type == "js_divergence":
        chosen_scores = math.log(2) + F.logsigmoid(chosen_logratios)
        rejected_scores = math.log(2) + F.logsigmoid(rejected_logratios)
    else:
        coef = 1.0 / (f_alpha_divergence_coef - 1.0)
        chosen_scores = (torch.exp((f_alpha_divergence_coef - 1.0) * chosen_logratios) - 1.0) * coef
        rejected_scores = (torch.exp((f_alpha_divergence_coef - 1.0) * rejected_logratios) - 1.0) * coef
    delta_score = chosen_scores - rejected_scores
    completion_mask = shift_completion_mask
    loss = 0.0
    for lt, lw in zip(loss_type, loss_weights):
        if lt == "sigmoid":
            per = -F.logsigmoid(beta * delta_score)
        elif lt == "hinge":
            per = torch.relu(1 - beta * delta_score)
        elif lt in ("ipo", "sigmoid_norm"):
            cm, rm = completion_mask.chunk(2, dim=0)
            d = chosen_scores / cm.sum(dim=1).clamp(min=1.0) - rejected_scores / rm.sum(dim=1).clamp(min=1.0)
            per = (d - 1 / (2 * beta)) ** 2 if lt == "ipo" else -F.logsigmoid(beta * d)
        elif lt == "exo_pair":
            eps = torch.tensor(label_smoothing, dtype=torch.float64)
            qw, log_qw = torch.sigmoid(beta * delta_score), F.logsigmoid(beta * delta_score)
            ql, log_ql = torch.sigmoid(-beta * delta_score), F.logsigmoid(-beta * delta_score)
            per = qw * (log_qw - torch.log1p(-eps)) + ql * (log_ql - torch.log(eps))
        elif lt == "nca_pair":
            cr, rr = beta * chosen_logratios, beta * rejected_logratios
            per = -F.logsigmoid(cr) - 0.5 * F.logsigmoid(-cr) - 0.5 * F.logsigmoid(-rr)
        elif lt == "robust":
            clean = -(1 - label_smoothing) * F.logsigmoid(beta * delta_score)
            flipped = -label_smoothing * F.logsigmoid(-beta * delta_score)
            per = (clean - flipped) / (1 - 2 * label_smoothing)
        elif lt == "bco_pair":
            per = -F.logsigmoid(beta * chosen_logratios) - F.logsigmoid(-beta * rejected_logratios)
        elif lt == "sppo_hard":
            per = (chosen_logratios - 0.5 / beta) ** 2 + (rejected_logratios + 0.5 / beta) ** 2
        elif lt in ("aot", "aot_unpaired"):
            if lt == "aot":
                d = (
                    torch.sort(chosen_logps - rejected_logps, 0)[0]
                    - torch.sort(ref_chosen_logps - ref_rejected_logps, 0)[0]
                )
            else:
                d = torch.sort(chosen_logratios, 0)[0] - torch.sort(rejected_logratios, 0)[0]
            per = -F.logsigmoid(beta * d) * (1 - label_smoothing) - F.logsigmoid(-beta * d) * label_smoothing
        elif lt == "apo_zero":
            per = 1 - torch.sigmoid(beta * chosen_logratios) + torch.sigmoid(beta * rejected_logratios)
        elif lt == "apo_down":
            per = (
                torch.sigmoid(beta * chosen_logratios)
                + 1
                - torch.sigmoid(beta * (chosen_logratios - rejected_logratios))
            )
        elif lt == "discopop":
            logits = delta_score * beta
            mod = torch.sigmoid(logits / discopop_tau)
            per = -F.logsigmoid(logits) * (1 - mod) + torch.exp(-logits) * mod
        elif lt == "sft":
            cm, _ = shift_completion_mask.chunk(2, dim=0)
            cptl, _ = per_token_logps.chunk(2, dim=0)
            per = (-cptl[cm.bool()].mean()).expand(cptl.size(0))
        loss = loss + per.mean() * lw
    cm, rm = s.mask.chunk(2, dim=0)
    cr, rr = beta * chosen_logratios.detach(), beta * rejected_logratios.detach()
    metrics = {
        "rewards/chosen": cr.mean(),
        "rewards/rejected": rr.mean(),
        "rewards/accuracies": (cr > rr).double().mean(),
        "rewards/margins": (cr - rr).mean(),
        "logps/chosen": chosen_logps.detach().mean(),
        "logps/rejected": rejected_logps.detach().mean(),
        "entropy": masked_mean(s.entropy.detach(), s.mask),
        "mean_token_accuracy": masked_mean(s.top1.chunk(2)[0].double(), cm),
        "logits/chosen": masked_mean(s.mean.detach().chunk(2)[0], cm),
        "logits/rejected": masked_mean(s.mean.detach().chunk(2)[1], rm),
    }
    return loss, metrics


DPO_CASES = [
    *[{"loss_type": t} for t in L.preference.DPO_LOSS_TYPES],
    {"loss_type": "sigmoid", "f_divergence_type": "forward_kl"},
    {"loss_type": "sigmoid", "f_divergence_type": "js_divergence"},
    {"loss_type": "hinge", "f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.5},
    {"loss_type": "sigmoid", "ld_alpha": 0.5},
    {"loss_type": ["sigmoid", "sft", "bco_pair"], "loss_weights": [0.8, 0.2, 1.0]},  # MPO-style mix
]


@pytest.mark.parametrize("case", DPO_CASES, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_dpo_family(case):
    case = dict(case)
    loss_type = case.pop("loss_type")
    types_ = [loss_type] if isinstance(loss_type, str) else loss_type
    kw = dict(
        beta=0.3,
        loss_type=loss_type,
        loss_weights=case.pop("loss_weights", None),
        label_smoothing=0.1 if set(types_) & {"robust", "exo_pair", "aot", "aot_unpaired"} else 0.0,
        f_divergence_type=case.pop("f_divergence_type", "reverse_kl"),
        f_alpha_divergence_coef=case.pop("f_alpha_divergence_coef", 0.5),
        discopop_tau=0.05,
        ld_alpha=case.pop("ld_alpha", None),
    )
    hidden, weight, _, target, mask = _inputs(2 * B)
    ref_hidden, ref_weight, *_ = _inputs(2 * B, seed=1, hidden_width=12)
    x = Leaves(hidden, weight)
    (h, w), (h64, w64) = x.f32, x.f64
    loss, metrics = L.dpo_loss(
        h,
        w,
        target,
        mask,
        ref_hidden=ref_hidden.float(),
        ref_weight=ref_weight.float(),
        backend="eager",
        **kw,
    )
    r = ref_tokens(ref_hidden, ref_weight, target, mask)
    ref_seq = r.logps.sum(-1)
    if kw["ld_alpha"] is not None:  # the reference's log-probs aggregated the same way
        m = r.mask.long()
        pos, lens = m.cumsum(1), m.sum(1)
        shared = torch.minimum(*lens.chunk(2)).repeat(2)[:, None]
        ref_seq = (r.logps * ((pos > 0) & (pos <= shared))).sum(1) + kw["ld_alpha"] * (
            r.logps * (pos > shared)
        ).sum(1)
    want, want_metrics = ref_dpo(
        h64,
        w64,
        target,
        mask,
        ref_seq,
        **{**kw, "loss_type": types_, "loss_weights": kw["loss_weights"] or [1.0] * len(types_)},
    )
    _close(loss, want, VALUE_RTOL)
    assert metrics.keys() == want_metrics.keys()
    for k, v in want_metrics.items():
        _close(metrics[k], v, VALUE_RTOL, k)
    x.grads(loss, want)


def test_dpo_precomputed_reference_equals_reference_model():
    hidden, weight, _, target, mask = _inputs(2 * B)
    ref_hidden, ref_weight, *_ = _inputs(2 * B, seed=1)
    with torch.no_grad():
        ref_logps = L.sequence_logps(ref_hidden.float(), ref_weight.float(), target, mask, backend="eager")
    a = L.dpo_loss(hidden.float(), weight.float(), target, mask, ref_logps=ref_logps, backend="eager")
    b = L.dpo_loss(
        hidden.float(),
        weight.float(),
        target,
        mask,
        ref_hidden=ref_hidden.float(),
        ref_weight=ref_weight.float(),
        backend="eager",
    )
    assert torch.equal(a[0], b[0])
    with pytest.raises(lmkernels.LMKernelsError, match="ref_logps"):
        L.dpo_loss(hidden.float(), weight.float(), target, mask, backend="eager")
    with pytest.raises(lmkernels.LMKernelsError, match="loss_type"):
        L.dpo_loss(
            hidden.float(), weight.float(), target, ref_logps=ref_logps, loss_type="dpo", backend="eager"
        )


# --- ORPO, CPO, SimPO --------------------------------------------------------------------------------


def _trl_self(**fields):
    """A stand-in `self` for TRL's CPO / ORPO loss methods (they read these fields only)."""
    return types.SimpleNamespace(accelerator=types.SimpleNamespace(device=torch.device("cpu")), **fields)


def ref_cpo(h, w, target, mask, *, beta, loss_type, label_smoothing, simpo_gamma, cpo_alpha, alpha):
    s = ref_tokens(h, w, target, mask)
    seq = (s.logps * s.mask).sum(-1)
    if loss_type in ("ipo", "simpo"):
        seq = seq / s.mask.sum(-1)
    c, r = seq.chunk(2)
    if alpha != 0:
        cr, rr = (1 - torch.exp(c).pow(-alpha)) / alpha, (1 - torch.exp(r).pow(-alpha)) / alpha
    else:
        cr, rr = c, r
    logits = cr - rr
    if loss_type == "simpo":
        logits = logits - simpo_gamma / beta
    if loss_type in ("sigmoid", "simpo"):
        per = (
            -F.logsigmoid(beta * logits) * (1 - label_smoothing)
            - F.logsigmoid(-beta * logits) * label_smoothing
        )
    elif loss_type == "hinge":
        per = torch.relu(1 - beta * logits)
    else:
        per = (logits - 1 / (2 * beta)) ** 2
    cm = s.mask.chunk(2)[0]
    nll = -(s.logps.chunk(2)[0] * cm).sum() / cm.sum()
    loss = per.mean() + (cpo_alpha * nll if cpo_alpha else 0.0)
    try:  # TRL's own cpo_loss on the same log-probs
        from trl.experimental.cpo import CPOTrainer
    except ImportError:
        pass
    else:
        fake = _trl_self(
            beta=beta,
            alpha=alpha,
            loss_type=loss_type,
            simpo_gamma=simpo_gamma,
            label_smoothing=label_smoothing,
        )
        trl_losses, *_ = CPOTrainer.cpo_loss(fake, c, r)
        _close(trl_losses.mean(), per.mean(), 1e-12, "TRL's cpo_loss")
    cr, rr = beta * cr.detach(), beta * rr.detach()
    metrics = {
        "rewards/chosen": cr.mean(),
        "rewards/rejected": rr.mean(),
        "rewards/accuracies": (cr > rr).double().mean(),
        "rewards/margins": (cr - rr).mean(),
        "logps/chosen": c.detach().mean(),
        "logps/rejected": r.detach().mean(),
        "nll_loss": nll.detach() if cpo_alpha else torch.zeros((), dtype=torch.float64),
        "logits/chosen": masked_mean(s.mean.detach().chunk(2)[0], cm),
        "logits/rejected": masked_mean(s.mean.detach().chunk(2)[1], s.mask.chunk(2)[1]),
    }
    return loss, metrics


@pytest.mark.parametrize(
    "kw",
    [
        {"loss_type": "sigmoid"},
        {"loss_type": "sigmoid", "label_smoothing": 0.1, "alpha": 0.3},  # conservative + AlphaPO
        {"loss_type": "hinge"},
        {"loss_type": "ipo"},
        {"loss_type": "simpo", "cpo_alpha": 0.0, "beta": 2.0, "simpo_gamma": 1.0},
    ],
    ids=lambda k: "-".join(map(str, k.values())),
)
def test_cpo_family(kw):
    kw = {"beta": 0.3, "label_smoothing": 0.0, "simpo_gamma": 0.5, "cpo_alpha": 1.0, "alpha": 0.0, **kw}
    hidden, weight, _, target, mask = _inputs(2 * B)
    x = Leaves(hidden, weight)
    (h, w), (h64, w64) = x.f32, x.f64
    loss, metrics = L.cpo_loss(h, w, target, mask, backend="eager", **kw)
    want, want_metrics = ref_cpo(h64, w64, target, mask, **kw)
    _close(loss, want, VALUE_RTOL)
    assert metrics.keys() == want_metrics.keys()
    for k, v in want_metrics.items():
        _close(metrics[k], v, VALUE_RTOL, k)
    x.grads(loss, want)
    if kw["loss_type"] == "simpo":
        again, _ = L.simpo_loss(h, w, target, mask, beta=2.0, gamma=1.0, backend="eager")
        torch.testing.assert_close(again, loss, rtol=0, atol=0)


@pytest.mark.parametrize("separate_nll", [False, True])
def test_orpo(separate_nll):
    hidden, weight, _, target, mask = _inputs(2 * B)
    nll_target = None
    if separate_nll:  # TRL: the NLL over prompt + completion
        g = torch.Generator().manual_seed(5)
        nll_target = torch.randint(0, V, (2 * B, T), generator=g)
        nll_target[:, -1] = -100
    x = Leaves(hidden, weight)
    (h, w), (h64, w64) = x.f32, x.f64
    beta = 0.2
    loss, metrics = L.orpo_loss(h, w, target, mask, nll_target=nll_target, beta=beta, backend="eager")
    s = ref_tokens(h64, w64, target, mask)
    seq = (s.logps * s.mask).sum(-1) / s.mask.sum(-1)
    c, r = seq.chunk(2)
    log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
    ratio = F.logsigmoid(log_odds)
    if nll_target is None:
        cm = s.mask.chunk(2)[0]
        nll = -(s.logps.chunk(2)[0] * cm).sum() / cm.sum()
    else:
        logits = (h64 @ w64.T)[:B]
        nll = F.cross_entropy(logits.reshape(-1, V), nll_target[:B].reshape(-1))
    want = nll - (beta * ratio).mean()
    try:
        from trl.experimental.orpo import ORPOTrainer
    except ImportError:
        pass
    else:
        losses, *_, trl_ratio, trl_log_odds = ORPOTrainer.odds_ratio_loss(_trl_self(beta=beta), c, r)
        _close(losses.mean(), (beta * ratio).mean(), 1e-12, "TRL's odds_ratio_loss")
    _close(loss, want, VALUE_RTOL)
    _close(metrics["nll_loss"], nll, VALUE_RTOL)
    _close(metrics["log_odds_ratio"], ratio.mean(), VALUE_RTOL)
    _close(metrics["log_odds_chosen"], log_odds.mean(), VALUE_RTOL)
    _close(metrics["rewards/margins"], beta * (c - r).mean(), VALUE_RTOL)
    x.grads(loss, want)


# --- KTO ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
@pytest.mark.parametrize("with_kl", [True, False])
def test_kto(loss_type, with_kl):
    n = 5
    hidden, weight, _, target, mask = _inputs(n)
    ref_hidden, ref_weight, *_ = _inputs(n, seed=1)
    desirable = torch.tensor([True, False, True, True, False])
    kl_hidden, _, _, kl_target, kl_mask = _inputs(n, seed=2)
    ref_kl_hidden, *_ = _inputs(n, seed=3)
    with torch.no_grad():
        policy_kl = L.sequence_logps(kl_hidden.float(), weight.float(), kl_target, kl_mask, backend="eager")
        ref_kl = L.sequence_logps(
            ref_kl_hidden.float(), ref_weight.float(), kl_target, kl_mask, backend="eager"
        )
    kl = L.kto_kl(policy_kl, ref_kl) if with_kl else None
    x = Leaves(hidden, weight)
    (h, w), (h64, w64) = x.f32, x.f64
    kw = dict(beta=0.4, desirable_weight=1.3, undesirable_weight=0.7, loss_type=loss_type)
    loss, metrics = L.kto_loss(
        h,
        w,
        target,
        desirable,
        mask,
        ref_hidden=ref_hidden.float(),
        ref_weight=ref_weight.float(),
        kl=kl,
        backend="eager",
        **kw,
    )
    # TRL's KTOTrainer._compute_loss, transcribed
    s = ref_tokens(h64, w64, target, mask)
    completion_logps = s.logps.sum(-1)
    ref_completion = ref_tokens(ref_hidden, ref_weight, target, mask).logps.sum(-1)
    if with_kl:
        p_kl = ref_tokens(kl_hidden, weight, kl_target, kl_mask).logps.sum(-1)
        r_kl = ref_tokens(ref_kl_hidden, ref_weight, kl_target, kl_mask).logps.sum(-1)
        z0 = (p_kl - r_kl).mean().detach().clamp(min=0)
    else:
        z0 = torch.zeros((), dtype=torch.float64)
    ci, ri = desirable.nonzero().view(-1), (~desirable).nonzero().view(-1)
    cl, rl = completion_logps[ci] - ref_completion[ci], completion_logps[ri] - ref_completion[ri]
    beta = kw["beta"]
    if loss_type == "kto":
        c_losses, r_losses = 1 - torch.sigmoid(beta * (cl - z0)), 1 - torch.sigmoid(beta * (z0 - rl))
    else:
        c_losses, r_losses = 1 - torch.sigmoid(beta * cl), torch.sigmoid(beta * rl)
    want = torch.cat([kw["desirable_weight"] * c_losses, kw["undesirable_weight"] * r_losses]).nanmean()
    _close(loss, want, VALUE_RTOL)
    z = s.mean
    want_metrics = {
        "kl": z0,
        "rewards/chosen": (beta * cl).sum() / len(ci),
        "logps/chosen": completion_logps[ci].sum() / len(ci),
        "rewards/rejected": (beta * rl).sum() / len(ri),
        "logps/rejected": completion_logps[ri].sum() / len(ri),
        "rewards/margins": (beta * cl).sum() / len(ci) - (beta * rl).sum() / len(ri),
        "entropy": masked_mean(s.entropy, s.mask),
        "logits/chosen": masked_mean(z, desirable[:, None] & s.mask),
        "logits/rejected": masked_mean(z, ~desirable[:, None] & s.mask),
    }
    assert metrics.keys() == want_metrics.keys()
    for k, v in want_metrics.items():
        _close(metrics[k], v.detach(), VALUE_RTOL, k)
    x.grads(loss, want)


def test_kto_one_sided_batch_has_one_sided_metrics():
    hidden, weight, _, target, mask = _inputs(3)
    _, metrics = L.kto_loss(
        hidden.float(),
        weight.float(),
        target,
        torch.ones(3, dtype=torch.bool),
        mask,
        ref_logps=torch.zeros(3),
        backend="eager",
    )
    assert (
        "rewards/chosen" in metrics and "rewards/rejected" not in metrics and "rewards/margins" not in metrics
    )


# --- GRPO, RLOO ---------------------------------------------------------------------------------------


def ref_grpo(h, w, target, mask, advantages, old, ref, *, temperature, beta, eps_low, eps_high, delta, loss_type,
             level, entropy_coef, bias_correction, is_ratio, max_len, num_items, tau_pos, tau_neg):  # fmt: skip
    """TRL 1.16 GRPOTrainer._compute_loss, transcribed; TRL's head scores every completion
    position (all_positions), the mask applies after."""
    s = ref_tokens(h, w, target, None, temperature=temperature, all_positions=True)
    per_token_logps, entropies = s.logps, s.entropy  # (every target counts: prompt=0)
    mask = mask.double()
    advantages = advantages.unsqueeze(1)
    old_per_token_logps = per_token_logps.detach() if old is None else old
    log_ratio = per_token_logps - old_per_token_logps
    if level == "token":
        liw = log_ratio
    else:
        liw = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(liw)
    if beta != 0.0:
        per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
        if bias_correction:
            per_token_kl = per_token_kl * coef_1
    if loss_type == "cispo":
        per_token_loss = -torch.clamp(coef_1, max=eps_high).detach() * advantages * per_token_logps
    elif loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    else:
        temps = torch.where(advantages > 0, tau_pos, tau_neg)
        per_token_loss = -torch.sigmoid(temps * (coef_1 - 1)) * 4 / temps * advantages
    if is_ratio is not None:
        per_token_loss = per_token_loss * is_ratio
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    if loss_type in ("grpo", "sapo"):
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_len)
    elif loss_type in ("dapo", "cispo"):
        loss = (per_token_loss * mask).sum() / num_items
    else:
        loss = (per_token_loss * mask).sum(-1).mean()
    metrics = {"policy_loss": loss.detach()}
    if entropy_coef:
        loss = loss - entropy_coef * (entropies * mask).sum() / mask.sum().clamp(min=1.0)

    def seq_mean(x):
        return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

    def global_mean(x):
        if x.shape[1] == 1:
            return x.sum() / x.shape[0]
        return (x * mask).sum() / mask.sum().clamp(min=1.0)

    if beta != 0.0:
        metrics["kl"] = global_mean(per_token_kl.detach())
    metrics["entropy"] = global_mean(entropies.detach())
    if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        low = ((coef_1 < 1 - eps_low) & (advantages < 0)).double()
        high = ((coef_1 > 1 + eps_high) & (advantages > 0)).double()
        metrics["clip_ratio/low_mean"] = global_mean(low)
        metrics["clip_ratio/high_mean"] = global_mean(high)
        metrics["clip_ratio/region_mean"] = global_mean((low.bool() | high.bool()).double())
        metrics["clip_ratio/low_min"] = seq_mean(low).nan_to_num(nan=float("inf")).min()
        metrics["clip_ratio/high_max"] = seq_mean(high).nan_to_num(nan=float("-inf")).max()
    elif loss_type == "cispo":
        metrics["cispo_clip_ratio"] = global_mean(((coef_1 > eps_high) & (advantages > 0)).double())
    return loss, metrics


GRPO_CASES = [{"loss_type": t} for t in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo")] + [
    {"loss_type": "dapo", "beta": 0.04, "entropy_coef": 0.01},  # the KL to the reference + entropy bonus
    {"loss_type": "grpo", "beta": 0.04, "bias_correction": False, "temperature": 1.0, "no_old": True},
    {"loss_type": "bnpo", "level": "sequence", "beta": 0.04},
    {"loss_type": "grpo", "delta": 1.1, "eps_high": 0.28, "is_ratio": True},
    {"loss_type": "dapo", "num_items": 40.0, "entropy_coef": -0.02},
]


@pytest.mark.parametrize("case", GRPO_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_grpo_family(case):
    kw = dict(temperature=0.7, beta=0.0, eps_low=0.2, eps_high=0.2, delta=None, level="token", entropy_coef=0.0,
              bias_correction=True, is_ratio=None, max_len=9, num_items=None, tau_pos=1.0, tau_neg=1.05)  # fmt: skip
    case = dict(case)
    no_old = case.pop("no_old", False)
    kw.update(case)
    hidden, weight, _, target, mask = _inputs(4, prompt=0)
    g = torch.Generator().manual_seed(7)
    advantages = torch.tensor([1.2, -0.7, 0.4, -1.5], dtype=torch.float64)
    base = ref_tokens(hidden, weight, target, None, temperature=kw["temperature"], all_positions=True).logps
    old = None if no_old else base + 0.3 * torch.randn(base.shape, generator=g, dtype=torch.float64)
    ref = base + 0.2 * torch.randn(base.shape, generator=g, dtype=torch.float64)
    is_ratio = None
    if kw["is_ratio"]:
        is_ratio = 0.8 + 0.4 * torch.rand(base.shape, generator=g, dtype=torch.float64)
    if kw["num_items"] is None and kw["loss_type"] in ("dapo", "cispo"):
        kw["num_items"] = mask.sum().double()
    x = Leaves(hidden, weight)
    (h, w), (h64, w64) = x.f32, x.f64
    loss, metrics = L.grpo_loss(
        h,
        w,
        target,
        advantages.float(),
        mask,
        old_logps=None if old is None else old.float(),
        ref_logps=ref.float(),
        temperature=kw["temperature"],
        beta=kw["beta"],
        epsilon_low=kw["eps_low"],
        epsilon_high=kw["eps_high"],
        delta=kw["delta"],
        loss_type=kw["loss_type"],
        importance_sampling_level=kw["level"],
        entropy_coef=kw["entropy_coef"],
        use_bias_correction_kl=kw["bias_correction"],
        importance_sampling_ratio=None if is_ratio is None else is_ratio.float(),
        max_completion_length=kw["max_len"],
        num_items_in_batch=kw["num_items"],
        backend="eager",
    )
    want, want_metrics = ref_grpo(
        h64, w64, target, mask, advantages, old, ref, **{**kw, "is_ratio": is_ratio}
    )
    _close(loss, want, VALUE_RTOL)
    assert metrics.keys() == want_metrics.keys()
    for k, v in want_metrics.items():
        _close(metrics[k], v, VALUE_RTOL, k)
    x.grads(loss, want)


@pytest.mark.parametrize("entropy_coef", [0.0, 0.05])
def test_rloo(entropy_coef):
    n = 4
    hidden, weight, bias, target, mask = _inputs(n, prompt=0, with_bias=True)
    g = torch.Generator().manual_seed(3)
    rewards = torch.tensor([1.0, 0.0, 2.0, 0.5], dtype=torch.float64)
    seq_kl = torch.randn(n, generator=g, dtype=torch.float64)
    advantages = L.rloo_advantages(rewards, 2, kl=seq_kl, beta=0.05, normalize=True)
    r = rewards - 0.05 * seq_kl  # TRL's RLOO advantages, transcribed
    grouped = r.view(-1, 2)
    want_adv = (grouped - (grouped.sum(1, keepdim=True) - grouped) / 1).view(-1)
    want_adv = (want_adv - want_adv.mean()) / (want_adv.std() + 1e-4)
    _close(advantages, want_adv, 1e-12)
    base = ref_tokens(hidden, weight, target, mask, bias=bias, temperature=0.9)
    old = (base.logps * base.mask).sum(-1).detach() + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)
    x = Leaves(hidden, weight, bias)
    (h, w, b), (h64, w64, b64) = x.f32, x.f64
    loss, metrics = L.rloo_loss(
        h,
        w,
        target,
        advantages.float(),
        mask,
        old_logps=old.float(),
        bias=b,
        temperature=0.9,
        entropy_coef=entropy_coef,
        backend="eager",
    )
    s = ref_tokens(h64, w64, target, mask, bias=b64, temperature=0.9)
    coef_1 = torch.exp((s.logps * s.mask).sum(1) - old)
    coef_2 = torch.clamp(coef_1, 0.8, 1.2)
    want = (-torch.min(coef_1 * advantages, coef_2 * advantages)).mean()
    want = want - entropy_coef * masked_mean(s.entropy, s.mask)
    _close(loss, want, VALUE_RTOL)
    low = ((coef_1 < 0.8) & (advantages < 0)).double()
    high = ((coef_1 > 1.2) & (advantages > 0)).double()
    for k, v in {
        "entropy": masked_mean(s.entropy, s.mask),
        "clip_ratio/low_mean": low.mean(),
        "clip_ratio/low_min": low.min(),
        "clip_ratio/high_mean": high.mean(),
        "clip_ratio/high_max": high.max(),
        "clip_ratio/region_mean": (low + high).clamp(max=1).mean(),
    }.items():
        _close(metrics[k], v.detach(), VALUE_RTOL, k)
    x.grads(loss, want)


def test_grpo_advantages():
    rewards = torch.tensor([1.0, 3.0, 0.0, 0.0, 2.0, 5.0])
    adv = L.grpo_advantages(rewards, 2)
    grouped = rewards.view(-1, 2)
    want = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)
    torch.testing.assert_close(adv, want)
    torch.testing.assert_close(
        L.grpo_advantages(rewards, 2, "none"), (grouped - grouped.mean(1, keepdim=True)).view(-1)
    )


# --- distillation -------------------------------------------------------------------------------------


def ref_gkd(xs, xt, labels, beta, temperature, num_items=None):
    """TRL GKDTrainer.generalized_jsd_loss, transcribed (and checked against TRL's own where it
    is installed)."""
    s = F.log_softmax(xs / temperature, dim=-1)
    t = F.log_softmax(xt / temperature, dim=-1)
    if beta == 0:
        jsd = F.kl_div(s, t, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(t, s, reduction="none", log_target=True)
    else:
        b = torch.tensor(beta, dtype=s.dtype)
        m = torch.logsumexp(torch.stack([s + torch.log1p(-b), t + torch.log(b)]), dim=0)
        jsd = beta * F.kl_div(m, t, reduction="none", log_target=True) + (1 - beta) * F.kl_div(
            m, s, reduction="none", log_target=True
        )
    mask = labels != -100
    jsd = jsd[mask]
    loss = jsd.sum() / num_items if num_items is not None else jsd.sum() / mask.sum().clamp_min(1)
    try:
        from trl.experimental.gkd import GKDTrainer
    except ImportError:
        return loss
    trl = GKDTrainer.generalized_jsd_loss(
        xs, xt, labels, beta=beta, temperature=temperature, num_items_in_batch=num_items
    )
    _close(trl, loss, 1e-12, "TRL's generalized_jsd_loss")
    return loss


@pytest.mark.parametrize(
    "kw",
    [
        {"beta": 0.5},
        {"beta": 0.0, "temperature": 0.9},
        {"beta": 1.0, "num_items": 17.0},
        {"beta": 0.3, "temperature": 2.0, "student_entropy": True},
    ],
    ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()),
)
def test_distillation(kw):
    kw = {"temperature": 1.0, "num_items": None, "student_entropy": False, **kw}
    hidden, weight, bias, target, mask = _inputs(3, with_bias=True)
    t_hidden, t_weight, t_bias, *_ = _inputs(3, seed=4, hidden_width=24, with_bias=True)
    x = Leaves(hidden, weight, bias)
    (h, w, b), (h64, w64, b64) = x.f32, x.f64
    loss, metrics = L.distillation_loss(
        h, w, t_hidden.float(), t_weight.float(), target, mask,
        divergence="jsd", beta=kw["beta"], temperature=kw["temperature"], student_bias=b, teacher_bias=t_bias.float(),
        num_items_in_batch=kw["num_items"], student_entropy=kw["student_entropy"], backend="eager",
    )  # fmt: skip
    labels = torch.where(mask.bool(), target, -100)
    want = ref_gkd(
        h64 @ w64.T + b64,
        t_hidden @ t_weight.T + t_bias,
        labels,
        kw["beta"],
        kw["temperature"],
        kw["num_items"],
    )
    _close(loss, want, VALUE_RTOL)
    x.grads(loss, want)
    if kw["student_entropy"]:
        s = ref_tokens(h64, w64, target, mask, bias=b64, temperature=kw["temperature"])
        _close(metrics["entropy"], masked_mean(s.entropy, s.mask).detach(), VALUE_RTOL)
    else:
        assert metrics == {}


# --- the Triton backend (interpreter on the CPU): one loss per family --------------------------------


def _same(a, b, rtol=1e-5):
    _close(a, b, rtol)


@pytest.mark.parametrize("family", ["dpo", "kto", "simpo", "grpo", "rloo", "distill"])
def test_triton_backend_matches_eager(family):
    """The plain options of each family (temperature 1, entropy not differentiated): Triton
    under the interpreter equals eager (values, gradients, metrics)."""
    pytest.importorskip("triton")
    rows = 2 * B if family in ("dpo", "simpo") else 4
    hidden, weight, _, target, mask = _inputs(rows)
    ref_hidden, ref_weight, *_ = _inputs(rows, seed=1)
    t_hidden, t_weight, *_ = _inputs(rows, seed=4, hidden_width=24)
    advantages = torch.tensor([1.0, -0.5, 0.3, -1.2], device=DEVICE)
    # Both backends on DEVICE: Triton compiled on a GPU, interpreted on the CPU.
    hidden, weight, target, mask = (x.to(DEVICE) for x in (hidden, weight, target, mask))
    ref_hidden, ref_weight, t_hidden, t_weight = (
        x.to(DEVICE) for x in (ref_hidden, ref_weight, t_hidden, t_weight)
    )

    def run(backend):
        h, w = hidden.float().requires_grad_(), weight.float().requires_grad_()
        ref = dict(ref_hidden=ref_hidden.float(), ref_weight=ref_weight.float())
        if family == "dpo":
            out = L.dpo_loss(h, w, target, mask, backend=backend, **ref)
        elif family == "kto":
            out = L.kto_loss(
                h,
                w,
                target,
                torch.tensor([True, False, True, False], device=DEVICE),
                mask,
                backend=backend,
                kl=0.1,
                **ref,
            )
        elif family == "simpo":
            out = L.simpo_loss(h, w, target, mask, backend=backend)
        elif family == "grpo":
            out = L.grpo_loss(h, w, target, advantages, mask, beta=0.04, backend=backend, **ref)
        elif family == "rloo":
            out = L.rloo_loss(h, w, target, advantages, mask, backend=backend)
        else:
            out = L.distillation_loss(
                h,
                w,
                t_hidden.float(),
                t_weight.float(),
                target,
                mask,
                temperature=0.8,
                hard_weight=0.5,
                backend=backend,
            )
        loss, metrics = out
        return loss, metrics, torch.autograd.grad(loss, (h, w))

    loss, metrics, grads = run("triton")
    want, want_metrics, want_grads = run("eager")
    _same(loss, want)
    for k, v in want_metrics.items():
        _same(metrics[k], v)
    for a, b in zip(grads, want_grads):
        _same(a, b, 1e-4)


def test_triton_backend_temperature_and_entropy_gradient():
    """GRPO at temperature 0.7 and with an entropy bonus on the Triton backend (the temperature
    inside the kernel, the entropy's gradient through its recompute path) equals eager."""
    pytest.importorskip("triton")
    hidden, weight, _, target, mask = (x.to(DEVICE) if x is not None else x for x in _inputs(4))
    advantages = torch.tensor([1.0, -0.5, 0.3, -1.2], device=DEVICE)

    def run(backend, **kw):
        h, w = hidden.float().requires_grad_(), weight.float().requires_grad_()
        loss, _ = L.grpo_loss(h, w, target, advantages, mask, backend=backend, **kw)
        return loss, torch.autograd.grad(loss, (h, w))

    for options in ({"temperature": 0.7}, {"entropy_coef": 0.01}):
        got, want = run("triton", **options), run("eager", **options)
        _same(got[0], want[0])
        for a, b in zip(got[1], want[1]):
            _same(a, b, 1e-4)


def test_losses_build_no_logits():
    """The losses call the fused ops only: patched out, no (tokens x V) product is ever formed
    by the loss code itself (the eager reference backend builds them; the fused backends don't)."""
    calls = []
    real = lmkernels.fused_linear_cross_entropy

    def counting(*args, **kwargs):
        calls.append(kwargs.get("reduction"))
        return real(*args, **kwargs)

    hidden, weight, _, target, mask = _inputs(2 * B)
    lmkernels.fused_linear_cross_entropy = counting
    try:
        L.dpo_loss(
            hidden.float(),
            weight.float(),
            target,
            mask,
            ref_hidden=hidden.float(),
            ref_weight=weight.float(),
            backend="eager",
        )
    finally:
        lmkernels.fused_linear_cross_entropy = real
    assert calls == ["none", "none"]  # the policy (with stats) and the reference


# --- docs/losses.md: every example runs ----------------------------------------------------------------


@pytest.mark.triton  # an example asks for it by name
def test_docs_examples_run(triton_device):
    """Each Python block of docs/losses.md, on tiny Llama models (a wider teacher), with the
    tensors the examples name, where the Triton kernels run (an example asks for them)."""
    import re
    from pathlib import Path

    pytest.importorskip("transformers")
    from lmkernels.integrations import transformers as lk_hf

    text = (Path(__file__).resolve().parents[1] / "docs" / "losses.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
    assert len(blocks) == 5
    model, ref_model = lk_hf.tiny_model("llama", seed=0), lk_hf.tiny_model("llama", seed=1)
    teacher = lk_hf.tiny_model("llama", seed=2, hidden_size=48)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    rows, length, n = 4, 10, 4
    input_ids = torch.randint(3, vocab, (rows, length), generator=g)
    attention_mask = torch.ones(rows, length, dtype=torch.long)
    attention_mask[1, -2:] = 0
    completion_mask = attention_mask.clone()
    completion_mask[:, :4] = 0
    sequences = input_ids
    completion_ids = sequences[:, -n:]
    scope = dict(
        torch=torch,
        model=model,
        ref_model=ref_model,
        teacher=teacher,
        input_ids=input_ids,
        attention_mask=attention_mask,
        completion_mask=completion_mask,
        kl_input_ids=input_ids.roll(1, 0),
        kl_mask=completion_mask.roll(1, 0),
        desirable=torch.tensor([True, False, True, False]),
        rewards=torch.tensor([1.0, 0.0, 2.0, 1.0]),
        sequences=sequences,
        completion_ids=completion_ids,
        old_logps=torch.zeros(rows, n) - 4.0,
    )
    scope = {
        k: v.to(triton_device) if isinstance(v, torch.Tensor | torch.nn.Module) else v
        for k, v in scope.items()
    }
    model = scope["model"]
    for block in blocks:
        model.zero_grad()
        with lmkernels.use_backend("eager"):  # (auto on the CPU would compile each new shape)
            exec(compile(block, "docs/losses.md", "exec"), dict(scope))
        assert model.lm_head.weight.grad is not None and torch.isfinite(model.lm_head.weight.grad).all()
