"""What every backend does at the edges where a fused kernel is most tempted to differ from plain
PyTorch: who owns the inputs (consume_inputs on leaves and views), several backward calls
through one graph, non-finite values. Each test runs every backend of ours that is available
here, against eager."""

import pytest
import torch

import lmkernels
from lmkernels import ConsumedInputsError
from lmkernels.ops.flce import fused_linear_cross_entropy_reference
from lmkernels.ops.rope import rope_tables
from lmkernels.registry.core import impls


def _backends(op):
    return [i.backend for i in impls(op) if not i.external and not i.unavailable_reason()]


def _device(backend, triton_device):
    return triton_device if backend.startswith("triton") else "cpu"


def _randn(*shape, seed=0, device="cpu"):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)


# --- consume_inputs: leaves, views of leaves and tensors without gradient are never written ------


@pytest.mark.parametrize("backend", _backends("swiglu"))
@pytest.mark.parametrize("kind", ["parameters", "views_of_a_leaf", "no_grad_up"])
def test_consume_inputs_never_writes_what_cannot_be_handed_over(backend, kind, triton_device):
    device = _device(backend, triton_device)
    if kind == "parameters":
        gate = torch.nn.Parameter(_randn(4, 8, seed=1, device=device))
        up = torch.nn.Parameter(_randn(4, 8, seed=2, device=device))
        leaves = (gate, up)
    elif kind == "views_of_a_leaf":
        base = _randn(4, 16, seed=3, device=device).requires_grad_()
        gate, up = base[:, :8], base[:, 8:]  # a fused gate_up projection's halves
        leaves = (base,)
    else:
        gate = _randn(4, 8, seed=1, device=device).requires_grad_()
        up = _randn(4, 8, seed=2, device=device)  # no gradient: must not be overwritten for nothing
        leaves = (gate,)
    before = [t.detach().clone() for t in (gate, up)]
    y = lmkernels.swiglu(gate, up, consume_inputs=True, backend=backend)
    y.backward(torch.ones_like(y))
    for t, b in zip((gate, up), before):
        assert torch.equal(t.detach(), b), "an input the caller owns was written"
    ref_leaves = [leaf.detach().clone().requires_grad_(leaf.requires_grad) for leaf in leaves]
    if kind == "views_of_a_leaf":
        rg, ru = ref_leaves[0][:, :8], ref_leaves[0][:, 8:]
    elif kind == "parameters":
        rg, ru = ref_leaves
    else:
        rg, ru = ref_leaves[0], up.detach()
    ref = lmkernels.swiglu(rg, ru, backend="eager")
    ref.backward(torch.ones_like(ref))
    for leaf, ref_leaf in zip(leaves, ref_leaves):
        torch.testing.assert_close(leaf.grad, ref_leaf.grad)
        assert leaf.grad.data_ptr() != leaf.data_ptr(), ".grad aliases the parameter"


def test_consume_inputs_still_reuses_the_memory_it_was_handed(triton_device):
    if "triton" not in _backends("swiglu"):
        pytest.skip("triton unavailable here")
    from lmkernels.backends.triton import glu as glu_mod

    a = _randn(5, 8, device=triton_device).requires_grad_()
    gate, up = a * 2, a * 3  # created by the caller's forward: handed over
    seen = []
    original = glu_mod._glu_backward_to

    def spy(grad, g, u, *args):
        d_gate, d_up = original(grad, g, u, *args)
        seen.append((d_gate.data_ptr() == g.data_ptr(), d_up.data_ptr() == u.data_ptr()))
        return d_gate, d_up

    glu_mod._glu_backward_to = spy
    try:
        lmkernels.swiglu(gate, up, consume_inputs=True, backend="triton").sum().backward()
    finally:
        glu_mod._glu_backward_to = original
    assert seen == [(True, True)]


@pytest.mark.parametrize("backend", _backends("swiglu"))
def test_a_consumed_input_another_node_saved_is_never_read_as_values(backend, triton_device):
    """`gate * v` saves gate for v's gradient. Whichever backward runs first, v.grad is right or
    autograd refuses (the consuming backward bumped gate's version): never a gradient read as
    the value of gate."""
    device = _device(backend, triton_device)
    a = _randn(4, 8, seed=1, device=device).requires_grad_()
    v = _randn(4, 8, seed=2, device=device).requires_grad_()
    gate, up = a * 2, a * 3
    loss = lmkernels.swiglu(gate, up, consume_inputs=True, backend=backend).sum() + (gate * v).sum()
    try:
        loss.backward()
    except RuntimeError as e:
        assert "modified by an inplace operation" in str(e)
        return
    torch.testing.assert_close(v.grad, (a * 2).detach())


# --- several backward calls through one graph ----------------------------------------------------


@pytest.mark.parametrize("backend", _backends("rope"))
def test_rope_outputs_backpropagate_separately(backend, triton_device):
    device = _device(backend, triton_device)
    cos, sin = (t.to(device) for t in rope_tables(torch.arange(5), 8, "neox"))
    grads = {}
    for b in ("eager", backend):
        q = _randn(1, 2, 5, 8, seed=1, device=device).requires_grad_()
        k = _randn(1, 1, 5, 8, seed=2, device=device).requires_grad_()
        q_out, k_out = lmkernels.rope(q, k, cos, sin, backend=b)
        (q_out * 2).sum().backward()  # two separate backward calls, no retain_graph
        (k_out * 3).sum().backward()
        grads[b] = (q.grad, k.grad)
    torch.testing.assert_close(grads[backend], grads["eager"])


@pytest.mark.parametrize("backend", _backends("fused_linear_cross_entropy"))
def test_flce_second_backward_is_right_or_a_clear_error(backend, triton_device):
    device = _device(backend, triton_device)
    h = _randn(6, 8, seed=1, device=device).requires_grad_()
    w = _randn(11, 8, seed=2, device=device).requires_grad_()
    t = torch.tensor([0, 1, 2, 3, 4, -100], device=device)
    loss = lmkernels.fused_linear_cross_entropy(h, w, t, backend=backend)
    loss.backward(retain_graph=True)
    once = h.grad.clone()
    try:
        loss.backward()
    except ConsumedInputsError as e:
        assert backend == "triton" and "triton_lean" in str(e)  # names the backends that can
        return
    torch.testing.assert_close(h.grad, 2 * once)


# --- non-finite values: the same pattern as eager -------------------------------------------------


@pytest.mark.parametrize("backend", _backends("fused_linear_cross_entropy"))
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_flce_non_finite_weights_give_eagers_pattern(backend, value, triton_device):
    device = _device(backend, triton_device)
    for seed in range(4):
        h = _randn(6, 8, seed=seed, device=device)
        w = _randn(11, 8, seed=seed + 10, device=device)
        w[3, 2] = value
        t = torch.tensor([0, 1, 2, 3, 4, 5], device=device)
        got, lse = lmkernels.fused_linear_cross_entropy(
            h, w, t, reduction="none", return_lse=True, backend=backend
        )
        want, want_lse = lmkernels.fused_linear_cross_entropy(
            h, w, t, reduction="none", return_lse=True, backend="eager"
        )
        for a, b in ((got, want), (lse, want_lse)):
            assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.isinf(), b.isinf()), (a, b)
            finite = b.isfinite()
            torch.testing.assert_close(a[finite], b[finite], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", _backends("fused_linear_cross_entropy"))
@pytest.mark.parametrize("scale", [100.0, 1000.0])
def test_flce_entropy_at_large_logits_matches_fp64(backend, scale, triton_device):
    """Logits of a few hundred: the entropy (near 0) must not come out of lse - sum p z, a
    difference of two numbers of the logits' size."""
    device = _device(backend, triton_device)
    hidden = _randn(16, 32, seed=1, device=device) * scale
    weight = _randn(50, 32, seed=2, device=device) * 0.1
    target = torch.randint(0, 50, (16,), generator=torch.Generator().manual_seed(3)).to(device)
    ref = fused_linear_cross_entropy_reference(hidden.double(), weight.double(), target, return_stats=True)[2]
    entropy = lmkernels.fused_linear_cross_entropy(
        hidden, weight, target, return_stats=True, backend=backend
    )[2]
    # fp32 logits of size ~scale carry an absolute error of ~scale * 1e-7 per logit
    assert (entropy.double() - ref).abs().max() <= 1e-6 * scale


def _flce_grads(fn, hidden, weight, bias, target, upstream, **options):
    """(outputs, grads of hidden, weight, bias) of sum over the outputs of upstream(outputs)."""
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
    out = fn(leaves[0], leaves[1], target, bias=leaves[2], **options)
    outs = out if isinstance(out, tuple) else (out,)
    upstream(outs).backward()
    return [o.detach() for o in outs], [t.grad for t in leaves]


@pytest.mark.parametrize("backend", _backends("fused_linear_cross_entropy"))
@pytest.mark.parametrize("stats", [False, True], ids=["loss", "loss_and_entropy"])
@pytest.mark.parametrize("upstream", ["random", "some_tokens"])
def test_flce_per_token_outputs_under_any_upstream_gradient(backend, stats, upstream, triton_device):
    """reduction="none": the per-token loss (and entropy) are fp32 whatever the inputs' dtype,
    and their gradients match fp64 under any per-token upstream gradient: random of both signs
    with exact zeros, or a loss over some tokens only (a per-sequence sum, RL advantages), the
    entropy differentiated over others; temperature and softcap on."""
    device = _device(backend, triton_device)
    BT, H, V = 23, 16, 41
    hidden, weight, bias = _randn(BT, H, seed=1), _randn(V, H, seed=2) * 0.5, _randn(V, seed=3) * 0.1
    target = torch.randint(0, V, (BT,), generator=torch.Generator().manual_seed(4))
    target[[2, 9]] = -100
    g = _randn(2, BT, seed=5)
    g[:, ::4] = 0.0
    pick = torch.rand(2, BT, generator=torch.Generator().manual_seed(6)) < 0.4

    def up(outs):
        if upstream == "random":
            terms = [(outs[0] * g[0].to(outs[0].device)).sum()]
            if stats:
                terms.append((outs[2] * g[1].to(outs[2].device)).sum())
        else:
            terms = [outs[0][pick[0].to(outs[0].device)].sum()]
            if stats:
                terms.append(-0.3 * outs[2][pick[1].to(outs[2].device)].sum())
        return sum(terms)

    options = dict(reduction="none", return_stats=stats, temperature=0.7, softcap=5.0)
    ref_outs, ref_grads = _flce_grads(
        fused_linear_cross_entropy_reference,
        *(t.double() for t in (hidden, weight, bias)),
        target,
        up,
        **options,
    )
    for dtype in (torch.float32, torch.bfloat16):
        args = [t.to(device, dtype) for t in (hidden, weight, bias)]
        outs, grads = _flce_grads(
            lambda *a, **k: lmkernels.fused_linear_cross_entropy(*a, backend=backend, **k),
            *args,
            target.to(device),
            up,
            **options,
        )
        assert outs[0].dtype == torch.float32 and outs[0].shape == (BT,)
        if stats:
            assert outs[2].dtype == torch.float32 and outs[2].shape == (BT,)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        for got, want in [*zip(outs[:1] + outs[2:3], ref_outs[:1] + ref_outs[2:3]), *zip(grads, ref_grads)]:
            err = (got.cpu().double() - want).norm() / want.norm()
            assert err <= tol, (dtype, err)


@pytest.mark.parametrize("backend", _backends("fused_linear_cross_entropy"))
def test_flce_entropy_masked_in_place(backend, triton_device):
    """The returned entropy may be written over (masked in place, as a trainer zeroes padding):
    the backward keeps its own copy, and the masked tokens' entropy gets no gradient."""
    device = _device(backend, triton_device)
    hidden, weight = _randn(2, 7, 16, seed=1), _randn(29, 16, seed=2) * 0.5
    target = torch.randint(0, 29, (2, 7), generator=torch.Generator().manual_seed(3))
    target[0, :2] = -100
    grads = {}
    for name, dev, fn in (
        ("ref", "cpu", fused_linear_cross_entropy_reference),
        ("impl", device, lambda *a, **k: lmkernels.fused_linear_cross_entropy(*a, backend=backend, **k)),
    ):
        h, w = (t.to(dev).requires_grad_() for t in (hidden.clone(), weight.clone()))
        loss, _, entropy, _ = fn(h, w, target.to(dev), reduction="none", return_stats=True)
        entropy.masked_fill_(target.to(dev) == -100, 0.0)
        (loss.sum() - 0.5 * entropy.sum()).backward()
        grads[name] = (h.grad.cpu(), w.grad.cpu())
    for got, want in zip(grads["impl"], grads["ref"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
