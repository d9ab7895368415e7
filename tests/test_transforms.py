"""torch.func transforms and forward-mode AD through the backends: the reproducers of what once
went wrong (a zero tangent from torch.func.jvp on Triton, a None tangent from forward_ad, errors
that were not lmkernels' from torch.func.grad, a value check that broke vmap), and what must
still be refused by name. Every op and backend is covered by test_properties.py (check_forward_ad,
check_func_grad, check_vmap); these are the cases named one by one."""

import pytest
import torch
import torch.autograd.forward_ad as forward_ad

import lmkernels as lk
from conftest import DEVICE
from lmkernels.ops.flce import fused_linear_cross_entropy_reference
from lmkernels.ops.rms_norm import rms_norm_reference

TRITON = ("triton", "triton_lean")
# Inputs on DEVICE: on a GPU the Triton kernels run compiled (the interpreter only on the CPU).


def _rms_inputs():
    gen = torch.Generator().manual_seed(0)
    x, v = torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)
    return x.to(DEVICE), torch.randn(5, generator=gen).to(DEVICE), v.to(DEVICE)


def _rms_tangent_fp64(x, w, v):
    _, t = torch.func.jvp(lambda a: rms_norm_reference(a, w.double()), (x.double(),), (v.double(),))
    return t


def test_rms_norm_triton_jvp_is_the_tangent():
    x, w, v = _rms_inputs()
    out, tangent = torch.func.jvp(lambda a: lk.rms_norm(a, w, backend="triton"), (x,), (v,))
    expected = _rms_tangent_fp64(x, w, v)
    assert tangent.abs().max() > 0.1
    torch.testing.assert_close(tangent.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, lk.rms_norm(x, w, backend="eager"))


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "requires_grad"])
def test_rms_norm_triton_forward_ad_tangent(requires_grad):
    """make_dual / unpack_dual, on both eager paths of `call` (raw launcher, recording Function)."""
    x, w, v = _rms_inputs()
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(x.requires_grad_(requires_grad), v)
        tangent = forward_ad.unpack_dual(lk.rms_norm(dual, w, backend="triton")).tangent
    assert tangent is not None
    torch.testing.assert_close(tangent.double(), _rms_tangent_fp64(x.detach(), w, v), rtol=1e-5, atol=1e-5)


def _flce_inputs():
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(4, 3, generator=gen), torch.randn(5, 3, generator=gen)
    return hidden.to(DEVICE), weight.to(DEVICE), torch.randint(0, 5, (4,), generator=gen).to(DEVICE)


@pytest.mark.parametrize("backend", TRITON)
def test_flce_triton_forward_ad_is_refused_by_name(backend):
    hidden, weight, target = _flce_inputs()

    def loss(h):
        return lk.fused_linear_cross_entropy(h, weight, target, backend=backend)

    match = rf"fused_linear_cross_entropy: backend '{backend}' has no forward-mode AD.*\['compile', 'eager'\]"
    with pytest.raises(lk.ForwardADError, match=match):
        torch.func.jvp(loss, (hidden,), (torch.ones_like(hidden),))
    with pytest.raises(lk.ForwardADError, match=match), forward_ad.dual_level():
        loss(forward_ad.make_dual(hidden, torch.ones_like(hidden)))


@pytest.mark.parametrize("backend", ["compile", "eager"])
def test_flce_jvp_on_compile_and_eager(backend):
    hidden, weight, target = _flce_inputs()
    v = torch.randn_like(hidden)
    _, got = torch.func.jvp(
        lambda h: lk.fused_linear_cross_entropy(h, weight, target, backend=backend), (hidden,), (v,)
    )
    _, expected = torch.func.jvp(
        lambda h: fused_linear_cross_entropy_reference(h, weight.double(), target),
        (hidden.double(),),
        (v.double(),),
    )
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["triton", "compile"])
def test_func_grad_first_order(backend):
    """torch.func.grad once raised torch's "must override setup_context" (triton) and
    HigherOrderGradientError (compile)."""
    x, w, _ = _rms_inputs()
    got = torch.func.grad(lambda a: lk.rms_norm(a, w, backend=backend).pow(2).sum())(x)
    expected = torch.func.grad(lambda a: lk.rms_norm(a, w, backend="eager").pow(2).sum())(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_compile_still_refuses_an_eager_double_backward():
    x, w, _ = _rms_inputs()
    x.requires_grad_(True)
    with pytest.raises(lk.HigherOrderGradientError, match="rms_norm: backend 'compile'"):
        torch.autograd.grad(lk.rms_norm(x, w, backend="compile").pow(2).sum(), x, create_graph=True)


def _second_order(transform, f, x):
    if transform == "grad_of_grad":
        return torch.func.grad(lambda a: torch.func.grad(f)(a).pow(2).sum())(x)
    return torch.func.jvp(torch.func.grad(f), (x,), (torch.ones_like(x),))[1]


@pytest.mark.parametrize("transform", ["grad_of_grad", "jvp_of_grad"])
@pytest.mark.parametrize("op", ["rms_norm", "swiglu", "flce"])
def test_second_order_through_triton_is_refused_by_name(op, transform):
    """functorch builds the graph of every backward; the Triton backward kernels have no
    derivative, so differentiating through one raises, naming the op and the backend (FLCE's
    jvp of a grad meets its forward first: no forward-mode AD at all)."""
    x, w, _ = _rms_inputs()
    hidden, weight, target = _flce_inputs()
    f, arg, name = {
        "rms_norm": (lambda a: lk.rms_norm(a, w, backend="triton").pow(2).sum(), x, "rms_norm"),
        "swiglu": (lambda a: lk.swiglu(a, a * 0.5, backend="triton").pow(2).sum(), x, "swiglu"),
        "flce": (
            lambda h: lk.fused_linear_cross_entropy(h, weight, target, backend="triton"),
            hidden,
            "fused_linear_cross_entropy",
        ),
    }[op]
    error, what = lk.HigherOrderGradientError, "double backward"
    if op == "flce" and transform == "jvp_of_grad":
        error, what = lk.ForwardADError, "forward-mode AD"
    with pytest.raises(error, match=f"{name}: backend 'triton' has no {what}"):
        _second_order(transform, f, arg)


@pytest.mark.parametrize("op", ["rms_norm", "rope"])
def test_jvp_of_jvp_through_triton_is_refused_by_name(op):
    """torch runs an autograd.Function's jvp with forward AD off: an outer jvp would see a zero."""
    x, w, v = _rms_inputs()
    gen = torch.Generator().manual_seed(0)
    q, k, cos, sin = (
        torch.randn(s, generator=gen).to(DEVICE) for s in ((1, 2, 3, 4), (1, 1, 3, 4), (3, 4), (3, 4))
    )
    f, arg = {
        "rms_norm": (lambda a: lk.rms_norm(a, w, backend="triton"), x),
        "rope": (lambda a: lk.rope(a, k, cos, sin, backend="triton")[0], q),
    }[op]
    t = torch.ones_like(arg)
    with pytest.raises(lk.ForwardADError, match=f"{op}: backend 'triton' has no forward-mode AD nested"):
        torch.func.jvp(lambda a: torch.func.jvp(f, (a,), (t,))[1], (arg,), (t,))


@pytest.mark.parametrize("transform", ["grad_of_grad", "jvp_of_grad"])
def test_second_order_through_triton_rope(transform):
    """Triton's RoPE has a double backward (its backward is the inverse rotation)."""
    gen = torch.Generator().manual_seed(0)
    q, k = (
        torch.randn(1, 2, 3, 4, generator=gen).to(DEVICE),
        torch.randn(1, 1, 3, 4, generator=gen).to(DEVICE),
    )
    cos, sin = torch.randn(3, 4, generator=gen).to(DEVICE), torch.randn(3, 4, generator=gen).to(DEVICE)

    def f(backend):
        return lambda a: sum(o.pow(3).sum() for o in lk.rope(a, k, cos, sin, backend=backend))

    torch.testing.assert_close(
        _second_order(transform, f("triton"), q), _second_order(transform, f("eager"), q)
    )


@pytest.mark.parametrize("backend", [*TRITON, "compile", "eager"])
def test_flce_vmap_with_value_checks(backend):
    """vmap with the targets batched: the value check reads every batch element's targets (it
    once branched on a batched tensor), and per-element losses match a loop."""
    hidden, weight, target = _flce_inputs()
    hidden_b = torch.stack([hidden, 2 * hidden])
    target_b = torch.stack([target, target.flip(0)])

    def loss(h, t):
        return lk.fused_linear_cross_entropy(h, weight, t, backend=backend)

    expected = torch.stack([loss(h, t) for h, t in zip(hidden_b, target_b)])
    torch.testing.assert_close(torch.vmap(loss)(hidden_b, target_b), expected)
    target_b[1, 2] = 9
    with pytest.raises(lk.LMKernelsError, match=r"target: expected class indices in \[0, 5\).*found 9"):
        torch.vmap(loss)(hidden_b, target_b)


@pytest.mark.parametrize("backend", TRITON)
def test_flce_triton_grad_of_vmap(backend):
    """Inside grad, a tensor batched by vmap reports requires_grad=False: the gradients must
    still come (they are recomputed for what autograd asks)."""
    hidden, weight, target = _flce_inputs()
    hidden_b = torch.stack([hidden, 2 * hidden])

    def total(b):
        return lambda h: torch.vmap(lambda x: lk.fused_linear_cross_entropy(x, weight, target, backend=b))(
            h
        ).sum()

    torch.testing.assert_close(
        torch.func.grad(total(backend))(hidden_b), torch.func.grad(total("eager"))(hidden_b)
    )


def test_triton_declines_torch_func_inside_torch_compile():
    """Code torch.compile traces runs the custom ops, which have no tangent formula (functorch's
    jvp saw zeros there): the Triton backends decline torch.func transforms inside it."""
    x, w, v = _rms_inputs()

    def tangent(a):
        return torch.func.jvp(lambda c: lk.rms_norm(c, w, backend="triton"), (a,), (v,))[1]

    with pytest.raises(
        Exception, match=r"rms_norm: backend 'triton' .*no torch.func transform inside torch.compile"
    ):
        torch.compile(tangent, backend="aot_eager", fullgraph=True)(x)
    torch._dynamo.reset()
    # Without fullgraph the call runs eagerly at the graph break, by the transforms' Function.
    got = torch.compile(tangent, backend="aot_eager")(x)
    torch.testing.assert_close(got.double(), _rms_tangent_fp64(x, w, v), rtol=1e-5, atol=1e-5)
