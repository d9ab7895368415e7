"""Who owns gate and up in the Triton SwiGLU/GeGLU backward (backends/triton/glu.py).

consume_inputs=True: the caller hands gate and up over, the backward writes d_gate and d_up over
their memory and allocates nothing. consume_inputs=False (the default): they are never written.
The gradients are bitwise the same either way.
"""

import functools
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

pytest.importorskip("triton", reason="the Triton backend needs triton")
from lmkernels.backends.triton import triton_unavailable_reason  # noqa: E402

if triton_unavailable_reason() is not None:  # e.g. the CPU interpreter of triton 3.6
    pytest.skip(triton_unavailable_reason(), allow_module_level=True)

import lmkernels  # noqa: E402
import lmkernels.nn  # noqa: E402
from lmkernels.backends.triton import glu as glu_mod  # noqa: E402
from lmkernels.harness.bench import peak_memory_bytes  # noqa: E402
from lmkernels.harness.checks import check_case  # noqa: E402
from lmkernels.registry import LMKernelsError, get_op, register, unregister  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

D, H = 16, 40  # model and MLP widths: tiny, the interpreter is slow
ACTS = {
    "swiglu": lambda g, u, consume: lmkernels.swiglu(g, u, consume_inputs=consume, backend="triton"),
    "geglu": lambda g, u, consume: lmkernels.geglu(
        g, u, approximate="none", consume_inputs=consume, backend="triton"
    ),
}


def _randn(*shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)


def _gate_up(dtype=torch.float32, seed=0):
    """gate and up as a forward creates them: non-leaf products of a leaf."""
    a = _randn(5, H, seed=seed, dtype=dtype).requires_grad_()
    return a * 2, a * 3


def _large_allocations(fn, nbytes: int) -> list[int]:
    """Sizes of the allocations of at least nbytes that fn makes (profiler memory events)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = prof.profiler.kineto_results.events()
    return [e.nbytes() for e in events if e.name() == "[memory]" and e.nbytes() >= nbytes]


@pytest.fixture
def writes(monkeypatch):
    """Records, per backward, whether d_gate went over the saved gate and d_up over the saved up."""
    seen = []
    backward_to = glu_mod._glu_backward_to

    def spy(grad, gate, up, *args):
        d_gate, d_up = backward_to(grad, gate, up, *args)
        seen.append((d_gate.data_ptr() == gate.data_ptr(), d_up.data_ptr() == up.data_ptr()))
        return d_gate, d_up

    monkeypatch.setattr(glu_mod, "_glu_backward_to", spy)
    return seen


def _assert_bitwise(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and torch.equal(a, b)


# --- the op: consumed when declared, untouched when not --------------------------------------------


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_consumed_when_declared_untouched_when_not(act, dtype):
    """The same backward, both ways: with consume_inputs the gradients are gate's and up's own
    memory and no gate/up-sized buffer is allocated; without, gate and up keep their values and
    the backward allocates the two gradients. Bitwise equal results."""
    grad = _randn(5, H, seed=9, dtype=dtype)
    results = {}
    for consume in (False, True):
        gate, up = _gate_up(dtype)
        before = gate.detach().clone(), up.detach().clone()
        out = ACTS[act](gate, up, consume)
        grads = []
        big = _large_allocations(
            lambda: grads.extend(torch.autograd.grad(out, (gate, up), grad)),  # noqa: B023
            gate.numel() * gate.element_size(),
        )
        d_gate, d_up = grads
        if consume:
            assert big == []
            assert d_gate.data_ptr() == gate.data_ptr() and d_up.data_ptr() == up.data_ptr()
            assert torch.equal(gate.detach(), d_gate) and torch.equal(up.detach(), d_up)
        else:
            assert len(big) == 2  # the counter sees the two gradients allocated
            _assert_bitwise([gate.detach(), up.detach()], list(before))
        results[consume] = (out.detach(), d_gate.clone(), d_up.clone())
    _assert_bitwise(results[True], results[False])


def test_default_never_writes_the_callers_leaves():
    gate, up = _randn(5, H, seed=1), _randn(5, H, seed=2)
    before = gate.clone(), up.clone()
    gate.requires_grad_(), up.requires_grad_()
    lmkernels.swiglu(gate, up, backend="triton").backward(_randn(5, H, seed=3))
    _assert_bitwise([gate.detach(), up.detach()], list(before))
    assert gate.grad.data_ptr() != gate.data_ptr()


def test_chunks_of_a_fused_projection_are_never_written(writes):
    """gate and up as chunk(2, dim=-1) of one gate_up buffer are strided: the backward copies them
    for the kernel and writes the gradients into those copies, consume_inputs or not. The fused
    buffer keeps its values; only the two copies are allocated."""
    grad = _randn(5, H, seed=4)
    results = []
    for consume in (False, True):
        gate_up = _randn(5, 2 * H, seed=5).requires_grad_() * 1.0
        gate, up = gate_up.chunk(2, dim=-1)
        before = gate_up.detach().clone()
        out = lmkernels.swiglu(gate, up, consume_inputs=consume, backend="triton")
        grads = []
        big = _large_allocations(
            lambda: grads.extend(torch.autograd.grad(out, (gate, up), grad)),  # noqa: B023
            gate.numel() * gate.element_size(),
        )
        assert len(big) == 2
        assert torch.equal(gate_up.detach(), before)
        results.append(grads)
    assert writes == [(False, False), (False, False)]
    _assert_bitwise(results[1], results[0])


def test_same_tensor_as_gate_and_up(writes):
    """gate is up: only one of the two results may go over it."""
    grads = []
    for consume in (False, True):
        a = _randn(5, H, seed=6).requires_grad_()
        gate = a * 2
        lmkernels.swiglu(gate, gate, consume_inputs=consume, backend="triton").backward(_randn(5, H, seed=7))
        grads.append(a.grad)
    assert writes == [(False, False), (True, False)]
    _assert_bitwise([grads[1]], [grads[0]])


def test_gradient_sharing_memory_with_gate_is_not_written_over(writes):
    """The caller's gradient is gate itself: gate may not be written while it is still read as
    the gradient of other elements, and the gradient is not the caller's to hand over."""
    gate, up = _gate_up()
    out = lmkernels.swiglu(gate, up, consume_inputs=True, backend="triton")
    grad = gate.detach()
    before = grad.clone()
    (d_gate,) = torch.autograd.grad(out, gate, grad)
    assert writes == [(False, True)] and torch.equal(grad, before)
    gate2, up2 = _gate_up()
    (expected,) = torch.autograd.grad(lmkernels.swiglu(gate2, up2, backend="triton"), gate2, before)
    assert torch.equal(d_gate, expected)


def test_create_graph_writes_nothing_and_refuses_the_second_order(writes):
    """create_graph=True (torch.func.vjp asks for it by default): the functional backward, exact
    first-order gradients, nothing written over; differentiating them is refused by name."""
    gate, up = _gate_up()
    before = gate.detach().clone()
    out = lmkernels.swiglu(gate, up, consume_inputs=True, backend="triton")
    (d_gate,) = torch.autograd.grad(out.sum(), gate, create_graph=True)
    assert not any(any(w) for w in writes) and torch.equal(gate.detach(), before)
    gate2, up2 = _gate_up()
    (expected,) = torch.autograd.grad(lmkernels.swiglu(gate2, up2, backend="triton").sum(), gate2)
    assert torch.equal(d_gate.detach(), expected)
    with pytest.raises(lmkernels.HigherOrderGradientError, match="swiglu: backend 'triton'"):
        torch.autograd.grad(d_gate.sum(), gate)


@pytest.mark.filterwarnings("ignore:Your compiler for AOTAutograd:UserWarning")
def test_compiled_graphs_accept_the_flag_and_stay_functional(writes):
    """Under torch.compile(fullgraph=True) the flag is a constant that changes nothing: the
    graph calls the functional custom ops, whose gradients equal the eager consuming ones."""
    torch._dynamo.reset()

    def fn(a):
        return lmkernels.swiglu(a * 2, a * 3, consume_inputs=True, backend="triton") * 2

    grads = []
    for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        a = _randn(5, H, seed=13).requires_grad_()
        f(a).backward(_randn(5, H, seed=14))
        grads.append(a.grad)
    assert writes == [(True, True), (False, False)]
    _assert_bitwise([grads[1]], [grads[0]])


def test_consume_inputs_must_be_a_bool():
    gate, up = _randn(2, 3, seed=0), _randn(2, 3, seed=1)
    with pytest.raises(LMKernelsError, match="consume_inputs: expected a bool"):
        lmkernels.swiglu(gate, up, consume_inputs="yes", backend="triton")
    with pytest.raises(LMKernelsError, match="consume_inputs: expected a bool"):
        lmkernels.geglu(gate, up, consume_inputs=None)


# --- after a consuming backward, nothing reads gate and up again -----------------------------------


def _consumed_loss():
    gate, up = _gate_up()
    return (lmkernels.swiglu(gate, up, consume_inputs=True, backend="triton") * _randn(5, H, seed=8)).sum()


def test_retain_graph_second_backward_raises_autograds_error(writes):
    loss = _consumed_loss()
    loss.backward(retain_graph=True)
    assert writes == [(True, True)]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_second_backward_under_saved_tensor_hooks_raises():
    """Saved-tensor hooks skip autograd's version check: the Function refuses by itself."""
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        loss = _consumed_loss()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="already wrote its gradients over gate and up"):
        loss.backward()


def test_retain_graph_under_non_reentrant_checkpointing_recomputes():
    """Non-reentrant checkpointing recomputes gate and up for each backward: a second one runs
    on fresh tensors and is right."""
    torch.manual_seed(0)
    mlp = lmkernels.nn.SwiGLUMLP(D, H, backend="triton").to(DEVICE)
    x = _randn(2, 5, D, seed=12)
    expected = _module_grads(mlp, "plain", x)
    x = x.detach().clone().requires_grad_()
    loss = checkpoint(mlp, x, use_reentrant=False).float().square().sum() / 2
    loss.backward(retain_graph=True)
    loss.backward()
    _assert_bitwise([x.grad] + [p.grad for p in mlp.parameters()], [2 * g for g in expected])


def test_another_node_that_saved_gate_raises_instead_of_reading_gradients():
    """gate = exp(z): exp's backward reads gate, which a (wrong) consume_inputs=True handed over.
    The bumped version counter turns that into autograd's error, not a wrong gradient."""
    z = _randn(5, H, seed=10).requires_grad_()
    gate, up = z.exp(), _randn(5, H, seed=11)
    loss = lmkernels.swiglu(gate, up, consume_inputs=True, backend="triton").sum()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


# --- the owners: nn modules and the transformers integration ---------------------------------------


@pytest.fixture
def never_consume(monkeypatch):
    """Runs a function with every lmkernels.swiglu / geglu call forced to consume_inputs=False."""

    def forced(op, *args, **kwargs):
        return op(*args, **{**kwargs, "consume_inputs": False})

    def run(fn, *args):
        with monkeypatch.context() as m:
            for name in ("swiglu", "geglu"):
                m.setattr(lmkernels, name, functools.partial(forced, getattr(lmkernels, name)))
            return fn(*args)

    return run


def _module_grads(module, mode, x):
    x = x.detach().clone().requires_grad_()
    if mode == "plain":
        y = module(x)
    else:
        y = checkpoint(module, x, use_reentrant=mode == "reentrant")
    (y.float().square().sum() / 2).backward()
    grads = [x.grad] + [p.grad for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    return grads


MODES = ["plain", "non_reentrant", "reentrant"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cls", [lmkernels.nn.SwiGLUMLP, lmkernels.nn.GeGLUMLP], ids=["swiglu", "geglu"])
def test_nn_modules_consume_their_gate_and_up(cls, mode, writes, never_consume):
    torch.manual_seed(0)
    mlp = cls(D, H, backend="triton").to(DEVICE)
    x = _randn(2, 5, D, seed=12)
    got = _module_grads(mlp, mode, x)
    assert writes == [(True, True)]
    _assert_bitwise(got, never_consume(_module_grads, mlp, mode, x))
    assert writes[1:] == [(False, False)]


@pytest.fixture(scope="module")
def tiny_llama():
    pytest.importorskip("transformers", reason="the transformers integration needs the hf extra")
    from lmkernels.convergence.models import build_model
    from lmkernels.integrations import transformers as lk_hf

    model = lk_hf.apply(build_model("llama", 128, 16).to(DEVICE), backend="triton", ops=("mlp",))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    return model, ids.to(DEVICE)


def _llama_grads(model, ids, mode):
    if mode == "plain":
        model.gradient_checkpointing_disable()
    else:
        kwargs = {"use_reentrant": mode == "reentrant"}
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_.* is deprecated:FutureWarning")
@pytest.mark.parametrize("mode", MODES)
def test_patched_llama_mlp_consumes_gate_and_up(tiny_llama, mode, writes, never_consume):
    model, ids = tiny_llama
    got = _llama_grads(model, ids, mode)
    layers = model.config.num_hidden_layers
    assert writes == [(True, True)] * layers
    _assert_bitwise(got, never_consume(_llama_grads, model, ids, mode))
    assert writes[layers:] == [(False, False)] * layers


# --- the harness still flags a backend that writes the caller's tensors ----------------------------


def test_harness_flags_writing_inputs_unless_they_are_handed_over():
    """A backend that always consumes (as Liger's GLU does) fails the default case, where the
    inputs are the caller's, and passes the consume_inputs=True case; ours passes both."""

    class WritesGradientsOverInputs(torch.autograd.Function):
        """Liger-style: the backward writes d_gate and d_up over gate and up, whoever owns them."""

        @staticmethod
        def forward(ctx, gate, up):
            ctx.save_for_backward(gate, up)
            return glu_mod.swiglu_triton(gate, up)

        @staticmethod
        def backward(ctx, grad):
            gate, up = ctx.saved_tensors
            d_gate, d_up = glu_mod._glu_backward(grad, gate, up, "silu")
            gate.data.copy_(d_gate)
            up.data.copy_(d_up)
            return gate.data, up.data

    def always_consumes(gate, up, consume_inputs=False):
        return WritesGradientsOverInputs.apply(gate, up)

    spec, shape = get_op("swiglu"), {"M": 37, "N": 96}
    impl = register("swiglu", "toy_always_consumes", always_consumes, priority=-100)
    try:
        kept = check_case(spec, impl, shape, torch.float32, {}, device=DEVICE)
        handed_over = check_case(spec, impl, shape, torch.float32, {"consume_inputs": True}, device=DEVICE)
    finally:
        unregister("swiglu", "toy_always_consumes")
    assert kept.status == "fail" and "input gate was modified" in kept.reason
    assert "input up was modified" in kept.reason
    assert handed_over.status == "pass", handed_over.reason

    triton = lmkernels.get_impl("swiglu", "triton")
    for case in ({}, {"consume_inputs": True}):
        result = check_case(spec, triton, shape, torch.float32, case, device=DEVICE)
        assert result.status == "pass", result.reason


# --- GPU: memory ---------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs a CUDA GPU (peak memory)")
def test_consuming_backward_lowers_peak_memory():
    M, N = 8192, 8192

    def peak_of_backward(consume):
        a = torch.randn(M, 1, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        gate, up = a.expand(M, N) * 2, a.expand(M, N) * 3
        loss = (lmkernels.swiglu(gate, up, consume_inputs=consume, backend="triton") * w).sum()
        del gate, up
        return peak_memory_bytes(loss.backward, [], "cuda")

    saved = peak_of_backward(False) - peak_of_backward(True)
    assert saved >= 2 * M * N * 2 * 0.9, f"the consuming backward saved only {saved} bytes"
