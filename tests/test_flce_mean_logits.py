"""lmkernels.flce_mean_logits: the per-token mean over the vocabulary of the logits the FLCE sees
(softcap, then temperature), without the logits, against the plain computation in fp64."""

import pytest
import torch

import lmkernels
from lmkernels import LMKernelsError
from lmkernels.ops import flce as flce_op


def _plain(hidden, weight, bias, softcap, temperature):
    z = hidden.double() @ weight.double().T
    if bias is not None:
        z = z + bias.double()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return (z / temperature).mean(-1)


def _inputs(dtype, seed=0, V=301, H=24):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 7, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 2 / H**0.5 + 0.1).to(dtype)  # a nonzero mean
    bias = (torch.randn(V, generator=g) * 0.5).to(dtype)
    return hidden, weight, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("softcap", [None, 1.5, 30.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [False, True])
def test_mean_logits_match_fp64(dtype, softcap, temperature, with_bias, monkeypatch):
    monkeypatch.setattr(flce_op, "MEAN_LOGITS_CHUNK_BYTES", 4 * 301 * 4)  # chunks of 4 tokens
    hidden, weight, bias = _inputs(dtype)
    bias = bias if with_bias else None
    got = lmkernels.flce_mean_logits(hidden, weight, bias, softcap=softcap, temperature=temperature)
    want = _plain(hidden, weight, bias, softcap, temperature)
    assert got.dtype == torch.float32 and got.shape == hidden.shape[:-1]
    # fp32 sums of the logits' size: the error is relative to the logits, not to their mean
    scale = (hidden.double().norm(dim=-1).max() * weight.double().norm(dim=-1).max()).item()
    assert (got.double() - want).abs().max() <= 2e-6 * scale / temperature


def test_mean_logits_have_no_gradient_and_leave_inputs_alone():
    hidden, weight, bias = (t.requires_grad_() for t in _inputs(torch.float32))
    before = [t.detach().clone() for t in (hidden, weight, bias)]
    for softcap in (None, 30.0):
        out = lmkernels.flce_mean_logits(hidden, weight, bias, softcap=softcap)
        assert not out.requires_grad
    assert all(torch.equal(t.detach(), b) for t, b in zip((hidden, weight, bias), before))


def test_mean_logits_of_no_tokens():
    _, weight, _ = _inputs(torch.float32)
    out = lmkernels.flce_mean_logits(torch.zeros(0, 24), weight, softcap=30.0)
    assert out.shape == (0,)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(temperature=0.0), "temperature: expected a positive finite number"),
        (dict(temperature=float("inf")), "temperature: expected a positive finite number"),
        (dict(softcap=0.0), "softcap: expected None or a positive number"),
        (dict(hidden=torch.randn(4, 5)), r"hidden: expected shape \(..., 24\)"),
        (dict(weight=torch.randn(301, 24).bfloat16()), "weight: expected dtype torch.float32"),
        (dict(bias=torch.randn(7)), r"bias: expected shape \(301,\)"),
    ],
)
def test_mean_logits_refuse_bad_inputs(change, match):
    hidden, weight, _ = _inputs(torch.float32)
    args = dict(hidden=hidden, weight=weight, bias=None, softcap=None, temperature=1.0)
    args.update(change)
    with pytest.raises(LMKernelsError, match=match):
        lmkernels.flce_mean_logits(**args)
