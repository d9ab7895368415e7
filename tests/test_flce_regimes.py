"""FLCE make_inputs logit regimes (ops/flce.py): entropy ranges, sampled targets, determinism."""

import math

import pytest
import torch

from lmkernels.ops import flce
from lmkernels.registry.core import LMKernelsError

SHAPE = {"BT": 256, "H": 64, "V": 4096}


def _make(regime, seed=0, **kw):
    stats = {}
    inputs = flce.make_inputs(SHAPE, torch.float32, "cpu", seed, regime=regime, stats=stats, **kw)
    return inputs, stats["mean_entropy"]


def test_entropy_per_regime():
    _, uniform = _make("uniform")
    _, gaussian = _make("gaussian")
    _, zipf = _make("zipf")
    # near-uniform: within std^2 / 2 (+ sampling noise) of ln V
    assert math.log(SHAPE["V"]) - 0.3 < uniform < math.log(SHAPE["V"])
    assert 2.0 <= zipf <= 3.0
    assert zipf < gaussian < uniform


def test_zipf_targets_follow_the_softmax():
    # Targets drawn from the softmax make the loss about the entropy; uniform targets under the
    # same logits would cost about ln V + the prior's spread (over 10 nats here).
    inputs, entropy = _make("zipf", ignore_fraction=0.0)
    loss = flce.fused_linear_cross_entropy_reference(inputs["hidden"], inputs["weight"], inputs["target"])
    assert abs(loss.item() - entropy) < 0.3
    uniform_targets = torch.randint(0, SHAPE["V"], (SHAPE["BT"],), generator=torch.Generator().manual_seed(1))
    wrong = flce.fused_linear_cross_entropy_reference(inputs["hidden"], inputs["weight"], uniform_targets)
    assert wrong.item() > entropy + 5


def test_zipf_with_softcap_bias_and_ignored_tokens():
    inputs, entropy = _make("zipf", softcap=15.0, with_bias=True, ignore_fraction=0.5)
    assert inputs["softcap"] == 15.0 and "regime" not in inputs and "stats" not in inputs
    ignored = inputs["target"] == -100
    assert 0.3 < ignored.float().mean() < 0.7
    assert ((inputs["target"][~ignored] >= 0) & (inputs["target"][~ignored] < SHAPE["V"])).all()
    assert 1.5 < entropy < 3.5


@pytest.mark.parametrize("regime", flce.REGIMES)
def test_deterministic_from_the_seed(regime):
    a, ea = _make(regime, seed=5)
    b, eb = _make(regime, seed=5)
    c, _ = _make(regime, seed=6)
    for k in ("hidden", "weight", "target"):
        assert torch.equal(a[k], b[k])
    assert ea == eb
    assert not torch.equal(a["weight"], c["weight"])


def test_default_regime_is_gaussian():
    a = flce.make_inputs(SHAPE, torch.float32, "cpu", 0)
    b, _ = _make("gaussian")
    assert torch.equal(a["weight"], b["weight"]) and torch.equal(a["target"], b["target"])


def test_bad_regime_named():
    with pytest.raises(LMKernelsError, match="regime"):
        _make("trained")
    with pytest.raises(LMKernelsError, match="H >= 2"):
        flce.make_inputs({"BT": 4, "H": 1, "V": 8}, torch.float32, "cpu", 0, regime="zipf")
