"""lmkernels.integrations.verl: verl's fused actor head (log-probs and entropy with gradients,
temperature) on lmkernels, against verl 0.9.1's own code.

verl installs without its dependencies here (`pip install --no-deps verl==0.9.1`): `import verl`
needs Ray, so the tests load the modules of verl's fused-head path, which need torch and
transformers only, under stub parent packages (verl's own files, not copies):
`verl.utils.experimental.torch_functional` (FusedLinearForPPO, verl's torch implementation: the
reference), `verl.utils.kernel.linear_cross_entropy` (verl's Triton kernel: CUDA only, so on the
CPU its math is checked against a full-logit fp64 re-implementation of what it returns) and
`verl.models.transformers.dense_common` (the actor forwards verl's monkey patch installs).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch

from lmkernels.integrations import verl as lk_verl

VERL_VERSION = "0.9.1"
PACKAGES = (
    "verl",
    "verl.utils",
    "verl.utils.kernel",
    "verl.utils.experimental",
    "verl.models",
    "verl.models.transformers",
)


@pytest.fixture
def verl_modules(monkeypatch):
    """verl's fused-head modules, loaded from the installed verl without its package __init__s."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"verl is not installed (pip install --no-deps verl=={VERL_VERSION})")
    from importlib import metadata

    version = metadata.version("verl")
    if version != VERL_VERSION:
        pytest.skip(f"the tests pin verl {VERL_VERSION}, found {version}")
    root = Path(next(iter(spec.submodule_search_locations)))
    for name in [n for n in sys.modules if n == "verl" or n.startswith("verl.")]:
        monkeypatch.delitem(sys.modules, name)
    for name in PACKAGES:
        stub = types.ModuleType(name)
        stub.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
        monkeypatch.setitem(sys.modules, name, stub)
    yield {
        "lce": importlib.import_module(lk_verl.LCE_MODULE),
        "ppo": importlib.import_module(lk_verl.PPO_MODULE),
        "dense": importlib.import_module("verl.models.transformers.dense_common"),
    }
    lk_verl.disable()


def _inputs(shape=(2, 9), H=16, V=37, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, H, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, V, shape, generator=g)
    return hidden, weight, labels


def _run(fn, hidden, weight, labels, temperature):
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    logprobs, entropy = fn(h, w, labels, temperature)
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(logprobs.shape, generator=g), torch.randn(entropy.shape, generator=g)
    ((logprobs.float() * a).sum() + (entropy.float() * b).sum()).backward()
    return logprobs, entropy, h.grad, w.grad


def _close(got, want, rtol=2e-5):
    got, want = got.double(), want.double()
    assert got.shape == want.shape
    err = ((got - want).norm() / want.norm().clamp_min(1e-12)).item()
    assert err <= rtol, err


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_linear_for_ppo_equals_verls(verl_modules, temperature):
    """FusedLinearForPPO (verl's torch path, also its "liger" fallback): after enable(), verl's
    name is lmkernels' class, whose values and gradients equal verl's own implementation."""
    verl_class = verl_modules["ppo"].FusedLinearForPPO
    hidden, weight, labels = _inputs()
    want = _run(
        lambda h, w, y, t: verl_class(chunk_size=4).forward(h, w, y, t), hidden, weight, labels, temperature
    )
    lk_verl.enable(backend="eager")
    assert verl_modules["ppo"].FusedLinearForPPO is lk_verl.FusedLinearForPPO
    ours = verl_modules["ppo"].FusedLinearForPPO(impl_backend="torch")
    got = _run(lambda h, w, y, t: ours.forward(h, w, y, t), hidden, weight, labels, temperature)
    for g, w in zip(got, want):
        _close(g, w)
    assert got[0].dtype == want[0].dtype == torch.float32 and got[1].dtype == want[1].dtype
    lk_verl.disable()
    assert verl_modules["ppo"].FusedLinearForPPO is verl_class


def _reference(hidden, weight, labels, temperature, reduction):
    """What verl's Triton linear_cross_entropy returns (its kernels' math, full logits in fp64):
    log p(label) and entropy per flattened token, the log-probs summed or averaged on request."""
    z = (hidden.double().reshape(-1, hidden.shape[-1]) @ weight.double().T) / temperature
    logp = torch.log_softmax(z, -1)
    logprobs = logp.gather(-1, labels.reshape(-1, 1))[:, 0]
    entropy = -(logp.exp() * logp).sum(-1)
    if reduction == "sum":
        logprobs = logprobs.sum()
    elif reduction == "mean":
        logprobs = logprobs.mean()
    return logprobs, entropy


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_linear_cross_entropy_matches_verls_math(verl_modules, reduction):
    lk_verl.enable(backend="eager")
    fn = verl_modules["lce"].linear_cross_entropy
    assert fn is lk_verl.linear_cross_entropy
    hidden, weight, labels = _inputs()
    got = _run(lambda h, w, y, t: fn(h, w, y, t, reduction), hidden, weight, labels, 0.7)
    want = _run(
        lambda h, w, y, t: _reference(h, w, y, t, reduction), hidden.double(), weight.double(), labels, 0.7
    )
    assert got[0].shape == want[0].shape and got[1].shape == (18,)  # flat, as verl's kernel returns
    for g, w in zip(got, want):
        _close(g, w)
    with pytest.raises(lk_verl.LMKernelsError, match="dist_process_group"):
        fn(hidden, weight, labels, 1.0, "none", object())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="verl's Triton kernel needs CUDA")
def test_linear_cross_entropy_equals_verls_kernel_on_gpu(verl_modules):
    hidden, weight, labels = _inputs(shape=(2, 256), H=128, V=4096, dtype=torch.bfloat16)
    hidden, weight, labels = (t.detach().cuda() for t in (hidden, weight, labels))
    verl_fn = verl_modules["lce"].linear_cross_entropy
    want = _run(lambda h, w, y, t: verl_fn(h, w, y, t, "none"), hidden, weight, labels, 0.7)
    lk_verl.enable()
    got = _run(
        lambda h, w, y, t: verl_modules["lce"].linear_cross_entropy(h, w, y, t, "none"),
        hidden,
        weight,
        labels,
        0.7,
    )
    for g, w in zip(got, want):
        _close(g, w, rtol=2e-2)


def test_verls_actor_forward_runs_on_lmkernels(verl_modules):
    """verl's actor forwards (what patch_forward_with_backends installs) on a tiny Qwen2: the
    Triton-backend forward, enabled, equals the torch-backend forward with verl's own
    FusedLinearForPPO (log-probs, entropy and the model's gradients)."""
    pytest.importorskip("transformers")
    from lmkernels.integrations.transformers import tiny_model

    dense = verl_modules["dense"]
    model = tiny_model("qwen2", seed=0)
    ids = torch.randint(0, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))

    def step(forward):
        model.zero_grad()
        out = forward(model, input_ids=ids, return_dict=True, temperature=0.8)
        (out.log_probs.sum() - 0.1 * out.entropy.float().sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return out.log_probs.detach().reshape(ids.shape), out.entropy.detach().reshape(ids.shape), grads

    want = step(dense.forward_with_torch_backend)  # verl's FusedLinearForPPO
    lk_verl.enable(backend="eager")
    got = step(dense.forward_with_triton_backend)  # verl's linear_cross_entropy name: lmkernels'
    _close(got[0], want[0])
    _close(got[1], want[1])
    assert got[2].keys() == want[2].keys()
    for name, g in want[2].items():
        _close(got[2][name], g, rtol=1e-4)
