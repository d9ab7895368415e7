"""lmkernels.nn: the modules compute what their PyTorch / transformers counterparts compute.

fp32 on the CPU. Tolerance: torch.testing.assert_close's fp32 default (rtol 1.3e-6, atol 1e-5):
the same math, at most a different summation order in a reduction over <= 176 elements.
The modules only forward to the public ops, whose backends tests/test_correctness.py checks;
here the eager backend keeps the tests fast, and a spy backend proves the `backend` argument
reaches the dispatcher.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lmkernels
from lmkernels import nn as lknn
from lmkernels.registry import LMKernelsError, UnknownBackendError, unregister

BACKENDS = ["eager"]


def randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("backend", BACKENDS)
def test_rms_norm_matches_transformers_llama_and_gemma(backend):
    pytest.importorskip("transformers", reason="compares with transformers' norms")
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = randn(4, 7, 96)
    llama = LlamaRMSNorm(96, eps=1e-6)
    gemma = GemmaRMSNorm(96, eps=1e-6)
    ours_llama = lknn.RMSNorm(96, eps=1e-6, backend=backend)
    ours_gemma = lknn.RMSNorm(96, eps=1e-6, offset=1.0, casting_mode="gemma", backend=backend)
    # Initial scale 1: ones for Llama, zeros (1 + w) for Gemma, as transformers initializes them.
    assert torch.equal(ours_llama.weight, llama.weight) and torch.equal(ours_gemma.weight, gemma.weight)
    with torch.no_grad():
        for m in (llama, gemma, ours_llama, ours_gemma):
            m.weight.add_(randn(96, seed=1, scale=0.3))
    torch.testing.assert_close(ours_llama(x), llama(x))
    torch.testing.assert_close(ours_gemma(x), gemma(x))


@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_norm_matches_torch(backend):
    x = randn(5, 100)
    ours = lknn.LayerNorm(100, eps=1e-5, backend=backend)
    ref = torch.nn.LayerNorm(100, eps=1e-5)
    with torch.no_grad():
        for m in (ours, ref):
            m.weight.copy_(randn(100, seed=2) + 1)
            m.bias.copy_(randn(100, seed=3))
    torch.testing.assert_close(ours(x), ref(x))
    no_affine = lknn.LayerNorm(100, elementwise_affine=False, backend=backend)
    assert no_affine.weight is None and no_affine.bias is None
    torch.testing.assert_close(no_affine(x), F.layer_norm(x, (100,)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_glu_mlps_match_transformers_mlps(backend):
    pytest.importorskip("transformers", reason="loads transformers' MLP state dicts")
    from transformers import GemmaConfig, LlamaConfig
    from transformers.models.gemma.modeling_gemma import GemmaMLP
    from transformers.models.llama.modeling_llama import LlamaMLP

    x = randn(3, 5, 64)
    for hf_mlp, ours in (
        (
            LlamaMLP(LlamaConfig(hidden_size=64, intermediate_size=176)),
            lknn.SwiGLUMLP(64, 176, backend=backend),
        ),
        (
            GemmaMLP(GemmaConfig(hidden_size=64, intermediate_size=176)),
            lknn.GeGLUMLP(64, 176, backend=backend),
        ),
    ):
        ours.load_state_dict(hf_mlp.state_dict())  # same parameter names and shapes
        y, y_ref = ours(x), hf_mlp(x)
        torch.testing.assert_close(y, y_ref)
        g, g_ref = (
            torch.autograd.grad(v.sum(), ours_or_hf.gate_proj.weight)[0]
            for v, ours_or_hf in ((y, ours), (y_ref, hf_mlp))
        )
        torch.testing.assert_close(g, g_ref)


def test_geglu_exact_gelu():
    mlp = lknn.GeGLUMLP(16, 24, approximate="none", backend="eager")
    x = randn(2, 16)
    expected = mlp.down_proj(F.gelu(mlp.gate_proj(x)) * mlp.up_proj(x))
    torch.testing.assert_close(mlp(x), expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_cross_entropy_loss_matches_torch(backend):
    hidden = randn(37, 64).requires_grad_()
    weight = randn(131, 64, seed=1, scale=0.125).requires_grad_()
    target = torch.randint(0, 131, (37,), generator=torch.Generator().manual_seed(2))
    target[::5] = -100
    class_weight = torch.rand(131, generator=torch.Generator().manual_seed(3)) + 0.5
    loss_fn = lknn.LinearCrossEntropyLoss(label_smoothing=0.1, class_weight=class_weight, backend=backend)
    loss = loss_fn(hidden, weight, target)
    ref = F.cross_entropy(hidden @ weight.T, target, weight=class_weight, label_smoothing=0.1)
    torch.testing.assert_close(loss, ref)
    grads = torch.autograd.grad(loss, (hidden, weight))
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)
    assert "class_weight" in dict(loss_fn.named_buffers())  # moves with .to()


def test_modules_dispatch_through_their_backend():
    """The backend argument reaches the op: a spy backend sees the call; an unknown name fails."""
    calls = []
    reference = lmkernels.get_op("rms_norm").reference

    def spy(**inputs):
        calls.append(inputs["casting_mode"])
        return reference(**inputs)

    lmkernels.register("rms_norm", "spy_nn", spy, priority=-1000)
    try:
        lknn.RMSNorm(8, casting_mode="gemma", offset=1.0, backend="spy_nn")(randn(2, 8))
    finally:
        unregister("rms_norm", "spy_nn")
    assert calls == ["gemma"]
    with pytest.raises(UnknownBackendError, match="no_such_backend"):
        lknn.SwiGLUMLP(8, 16, backend="no_such_backend")(randn(2, 8))
    with lmkernels.use_backend("eager"):  # backend=None: the dispatch rules choose
        lknn.LayerNorm(8)(randn(2, 8))


@pytest.mark.parametrize(
    "build, argument",
    [
        (lambda: lknn.RMSNorm(0), "hidden_size"),
        (lambda: lknn.RMSNorm(8, eps=-1.0), "eps"),
        (lambda: lknn.RMSNorm(8, casting_mode="fp16"), "casting_mode"),
        (lambda: lknn.LayerNorm(8.0), "hidden_size"),
        (lambda: lknn.SwiGLUMLP(8, -4), "intermediate_size"),
        (lambda: lknn.GeGLUMLP(8, 16, approximate="erf"), "approximate"),
        (lambda: lknn.LinearCrossEntropyLoss(reduction="avg"), "reduction"),
        (lambda: lknn.LinearCrossEntropyLoss(label_smoothing=1.5), "label_smoothing"),
        (lambda: lknn.LinearCrossEntropyLoss(softcap=0), "softcap"),
        (lambda: lknn.LinearCrossEntropyLoss(class_weight=[1.0, 2.0]), "class_weight"),
    ],
)
def test_bad_arguments_name_the_argument(build, argument):
    with pytest.raises(LMKernelsError, match=f"^{argument}:"):
        build()
