"""The in-place backward of the Triton SwiGLU/GeGLU: d_gate over gate, d_up over up (or over the
incoming gradient), only where nobody else can see that memory. See glu.py and _exclusive.py."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

pytest.importorskip("triton", reason="the Triton backend needs triton")

import lmkernels  # noqa: E402
from lmkernels.backends.triton import _exclusive  # noqa: E402
from lmkernels.backends.triton import glu as glu_mod  # noqa: E402
from lmkernels.harness.bench import peak_memory_bytes  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

D, H = 16, 40  # model and MLP widths: tiny, the interpreter is slow


def swiglu(gate, up):
    return lmkernels.swiglu(gate, up, backend="triton")


class MLP(torch.nn.Module):
    """Llama's MLP: down(swiglu(gate_proj(x), up_proj(x))), gate and up temporaries."""

    def __init__(self, dtype, fused=False):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        make = lambda i, o: torch.nn.Parameter(  # noqa: E731
            (torch.randn(o, i, generator=g) / i**0.5).to(DEVICE, dtype)
        )
        self.fused = fused
        if fused:  # one gate_up projection, chunked: gate and up are views of one buffer
            self.gate_up = make(D, 2 * H)
        else:
            self.gate, self.up = make(D, H), make(D, H)
        self.down = make(H, D)

    def forward(self, x, act=swiglu):
        if self.fused:
            gate, up = torch.nn.functional.linear(x, self.gate_up).chunk(2, dim=-1)
            return torch.nn.functional.linear(act(gate, up), self.down)
        linear = torch.nn.functional.linear
        return linear(act(linear(x, self.gate), linear(x, self.up)), self.down)


def _x(dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 5, D, generator=g).to(DEVICE, dtype).requires_grad_()


def _grads(mlp, dtype, checkpointed=False, act=swiglu):
    x = _x(dtype)
    y = checkpoint(mlp, x, act, use_reentrant=False) if checkpointed else mlp(x, act)
    (y.float().square().sum() / 2).backward()
    grads = [x.grad] + [p.grad for p in mlp.parameters()]
    mlp.zero_grad(set_to_none=True)
    return grads


@pytest.fixture
def out_of_place(monkeypatch):
    """A function computing the same gradients with the in-place backward switched off."""

    def run(*args, **kwargs):
        with monkeypatch.context() as m:
            m.setattr(glu_mod, "IN_PLACE_BACKWARD", False)
            grads = _grads(*args, **kwargs)
            assert glu_mod.last_backward_buffers() == ("new", "new")
        return grads

    return run


def _assert_equal(got, expected):
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


# --- engages where it is safe --------------------------------------------------------------------


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpoint"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mlp_backward_writes_over_gate_and_up(checkpointed, dtype, out_of_place):
    """gate and up are temporaries only autograd holds (under non-reentrant checkpointing: the
    recomputed ones, handed over by the unpack hook): d_gate and d_up go over them, and the
    gradients are bitwise those of the out-of-place backward."""
    assert glu_mod.IN_PLACE_BACKWARD  # on by default
    mlp = MLP(dtype)
    got = _grads(mlp, dtype, checkpointed)
    assert glu_mod.last_backward_buffers() == ("gate", "up")
    _assert_equal(got, out_of_place(mlp, dtype, checkpointed))


def test_geglu_in_place(out_of_place):
    mlp = MLP(torch.float32)
    act = lambda a, b: lmkernels.geglu(a, b, approximate="none", backend="triton")  # noqa: E731
    got = _grads(mlp, torch.float32, act=act)
    assert glu_mod.last_backward_buffers() == ("gate", "up")
    _assert_equal(got, out_of_place(mlp, torch.float32, act=act))


def test_gradients_land_in_the_memory_of_gate_and_up():
    """No allocation for d_gate and d_up: they are gate's and up's memory."""
    mlp = MLP(torch.float32)
    addresses = {}

    def act(gate, up):
        addresses.update(gate=gate.data_ptr(), up=up.data_ptr())  # ints: no reference kept
        gate.register_hook(lambda g: addresses.update(d_gate=g.data_ptr()))
        up.register_hook(lambda g: addresses.update(d_up=g.data_ptr()))
        return swiglu(gate, up)

    _grads(mlp, torch.float32, act=act)
    assert addresses["d_gate"] == addresses["gate"] and addresses["d_up"] == addresses["up"]


def test_uses_the_baseline_of_an_exclusive_saved_tensor(monkeypatch):
    """The counts of gate and up in the MLP are exactly those the probe measures on tensors only
    its saved-tensor slots hold."""
    seen = []
    counts = _exclusive.saved_tensors_and_counts
    monkeypatch.setattr(glu_mod, "saved_tensors_and_counts", lambda ctx: seen.append(counts(ctx)) or seen[-1])
    _grads(MLP(torch.float32), torch.float32)
    baseline = _exclusive.exclusive_saved_counts(torch.device(DEVICE))
    assert baseline is not None and seen[0][1] == [baseline, baseline]


def test_a_shifted_baseline_is_measured_again(monkeypatch):
    """Counts above the baseline make the probe measure again, once per pattern: a process-wide
    shift of the counts (seen after long pytest sessions) is absorbed, a real holder is not."""
    device = torch.device(DEVICE)
    true = _exclusive.exclusive_saved_counts(device)
    stale = (true[0], true[1], true[2] - 1)  # as if every count had grown since it was measured
    monkeypatch.setitem(_exclusive.EXCLUSIVE_SAVED_COUNTS, device.type, stale)
    monkeypatch.setitem(_exclusive._SAVED_MISMATCHES, device.type, set())
    _grads(MLP(torch.float32), torch.float32)
    assert glu_mod.last_backward_buffers() == ("gate", "up")
    assert _exclusive.EXCLUSIVE_SAVED_COUNTS[device.type] == true

    probe_runs = []  # True for each call that measures (nothing cached for the device)
    measure = _exclusive.exclusive_saved_counts
    monkeypatch.setattr(
        _exclusive,
        "exclusive_saved_counts",
        lambda d: probe_runs.append(d.type not in _exclusive.EXCLUSIVE_SAVED_COUNTS) or measure(d),
    )
    gate, up, grad = _inputs()
    gate_before = gate.clone()
    for _ in range(3):  # the caller keeps gate and up: one more probe run at most, never in place
        kept = [t.detach().requires_grad_() * 1.0 for t in (gate, up)]  # non-leaves we hold
        torch.autograd.grad(swiglu(*kept), kept, grad)
        assert glu_mod.last_backward_buffers() != ("gate", "up")
    assert sum(probe_runs) <= 1 and torch.equal(gate, gate_before)


def test_without_a_baseline_nothing_is_overwritten(monkeypatch):
    monkeypatch.setitem(_exclusive.EXCLUSIVE_SAVED_COUNTS, torch.device(DEVICE).type, None)
    _grads(MLP(torch.float32), torch.float32)
    assert glu_mod.last_backward_buffers()[1] != "up"


# --- stays away from memory others can see -------------------------------------------------------


def _inputs(seed=2, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5, H, generator=g).to(DEVICE, dtype) for _ in range(3)]


def test_leaves_are_not_overwritten():
    """Leaves requiring grad are the caller's (and their AccumulateGrad nodes hold them). The
    gradient from the caller (out.backward(grad)) is not overwritten either."""
    gate, up, grad = _inputs()
    before = [t.clone() for t in (gate, up, grad)]
    gate.requires_grad_(), up.requires_grad_()
    swiglu(gate, up).backward(grad)
    assert glu_mod.last_backward_buffers() == ("new", "new")
    for t, b in zip((gate, up, grad), before):
        assert torch.equal(t, b)
    expected = [t.detach().clone().requires_grad_() for t in before[:2]]
    swiglu(*expected).backward(before[2])
    assert torch.equal(gate.grad, expected[0].grad) and torch.equal(up.grad, expected[1].grad)


def test_tensors_the_caller_keeps_are_not_overwritten(out_of_place):
    """Non-leaf gate and up the caller still holds: untouched. d_gate goes into the incoming
    gradient (the product's gradient, a fresh tensor only this backward sees), d_up is new."""
    a, b, w = _inputs()
    a.requires_grad_()
    gate, up = a * 2, a * 3
    kept = gate.clone(), up.clone()
    (swiglu(gate, up) * w).sum().backward()
    assert glu_mod.last_backward_buffers() == ("grad", "new")
    assert torch.equal(gate, kept[0]) and torch.equal(up, kept[1])
    a2 = a.detach().clone().requires_grad_()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(glu_mod, "IN_PLACE_BACKWARD", False)
        (swiglu(a2 * 2, a2 * 3) * w).sum().backward()
    assert torch.equal(a.grad, a2.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chunks_of_a_fused_projection(dtype, out_of_place):
    """gate and up as chunk(2, dim=-1) of one gate_up buffer: strided views, never written; the
    backward copies them for the kernel, and those copies (its own) take d_gate and d_up."""
    mlp = MLP(dtype, fused=True)
    got = _grads(mlp, dtype)
    assert glu_mod.last_backward_buffers() == ("copy", "copy")
    _assert_equal(got, out_of_place(mlp, dtype))


def test_contiguous_views_are_not_overwritten_the_gradient_buffer_is():
    """gate and up contiguous views of one larger buffer: not overwritten (the storage is more
    than they are); the incoming gradient, a fresh product only this backward sees, takes
    d_gate, so one allocation instead of two."""
    a, _, w = _inputs()
    a.requires_grad_()
    gate_up = torch.stack([a * 2, a * 3])
    before = gate_up.detach().clone()
    (swiglu(gate_up[0], gate_up[1]) * w).sum().backward()
    assert glu_mod.last_backward_buffers() == ("grad", "new")
    assert torch.equal(gate_up, before)
    b = a.detach().clone().requires_grad_()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(glu_mod, "IN_PLACE_BACKWARD", False)
        (swiglu(b * 2, b * 3) * w).sum().backward()
    assert torch.equal(a.grad, b.grad)


def _saved_by_another_node():
    """gate = exp(z): exp's backward reads its saved result, i.e. gate's memory, after the GLU
    backward ran (it runs later). up is also read by a product's backward."""
    z, u0, w = _inputs()
    z.requires_grad_(), u0.requires_grad_()
    gate = z.exp()
    up = u0 * 1.5
    loss = (swiglu(gate, up) * w).sum() + (up * w).sum()
    del gate, up
    loss.backward()
    return z.grad, u0.grad


def test_tensors_other_nodes_saved_are_not_overwritten(monkeypatch):
    z_grad, u_grad = _saved_by_another_node()
    assert glu_mod.last_backward_buffers()[0] != "gate"
    monkeypatch.setattr(glu_mod, "IN_PLACE_BACKWARD", False)
    expected = _saved_by_another_node()
    assert torch.equal(z_grad, expected[0]) and torch.equal(u_grad, expected[1])


def test_other_node_case_does_catch_an_unsafe_write(monkeypatch):
    """The case above can fail: skipping the exclusivity check corrupts exp's gradient."""
    monkeypatch.setattr(glu_mod, "saved_is_exclusive", lambda t, counts: True)
    z_grad, _ = _saved_by_another_node()
    assert glu_mod.last_backward_buffers()[0] == "gate"
    monkeypatch.setattr(glu_mod, "IN_PLACE_BACKWARD", False)
    assert not torch.equal(z_grad, _saved_by_another_node()[0])


def test_same_tensor_as_gate_and_up():
    a, _, w = _inputs()
    a.requires_grad_()
    (swiglu(a * 2, a * 2) * w).sum().backward()  # two products: each exclusive
    assert glu_mod.last_backward_buffers() == ("gate", "up")
    got = a.grad
    b = a.detach().clone().requires_grad_()
    twice = lambda t: swiglu(t, t)  # noqa: E731
    (twice(b * 2) * w).sum().backward()  # one product saved twice: not exclusive
    assert glu_mod.last_backward_buffers() == ("grad", "new")
    torch.testing.assert_close(b.grad, got, rtol=0, atol=0)


def test_tensors_a_pack_hook_keeps_are_not_overwritten(out_of_place):
    """A saved-tensor pack hook that keeps what it saves holds gate and up."""
    mlp = MLP(torch.float32)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        y = mlp(_x(torch.float32))
    copies = [t.clone() for t in kept]
    (y.square().sum() / 2).backward()
    assert glu_mod.last_backward_buffers()[0] != "gate"
    assert all(torch.equal(t, c) for t, c in zip(kept, copies, strict=True))
    got = [p.grad for p in mlp.parameters()]
    mlp.zero_grad(set_to_none=True)
    _assert_equal(got, out_of_place(mlp, torch.float32)[1:])


# --- backward twice, create_graph, the switch ----------------------------------------------------


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpoint"])
def test_retain_graph_keeps_gate_and_up(checkpointed, out_of_place):
    """retain_graph=True: a later backward reads gate and up again, so they are not overwritten
    and both backwards are right. (The incoming gradient is not used either: here it is a view
    of the 2-D matmul result of down's backward, and a view's storage has two holders.)"""
    mlp = MLP(torch.float32)
    expected = out_of_place(mlp, torch.float32)
    x = _x(torch.float32)
    y = checkpoint(mlp, x, swiglu, use_reentrant=False) if checkpointed else mlp(x)
    loss = y.float().square().sum() / 2
    loss.backward(retain_graph=True)
    assert glu_mod.last_backward_buffers() == ("new", "new")
    first = [t.grad.clone() for t in (x, *mlp.parameters())]
    loss.backward()
    _assert_equal(first, expected)
    _assert_equal([t.grad for t in (x, *mlp.parameters())], [2 * e for e in expected])


def test_unknown_retain_graph_keeps_gate_and_up(monkeypatch):
    """A torch that cannot say whether the graph is retained: the saved tensors are kept."""
    monkeypatch.setattr(glu_mod, "graph_is_retained", lambda: None)
    _grads(MLP(torch.float32), torch.float32)
    assert glu_mod.last_backward_buffers() == ("new", "new")


def test_backward_after_an_in_place_backward_raises(monkeypatch):
    """Should gate and up be overwritten anyway while the graph lives on (here by faking the
    retain_graph answer), a second backward refuses to read them."""
    monkeypatch.setattr(glu_mod, "graph_is_retained", lambda: False)
    mlp = MLP(torch.float32)
    loss = mlp(_x(torch.float32)).square().sum()
    loss.backward(retain_graph=True)
    assert glu_mod.last_backward_buffers() == ("gate", "up")
    with pytest.raises(RuntimeError, match="already wrote its gradients over the saved gate"):
        loss.backward()


def test_second_backward_without_retain_graph_is_autograds_error():
    loss = MLP(torch.float32)(_x(torch.float32)).square().sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


def test_create_graph_is_functional():
    a, _, w = _inputs()
    a.requires_grad_()
    (d_a,) = torch.autograd.grad((swiglu(a * 2, a * 3) * w).sum(), a, create_graph=True)
    assert glu_mod.last_backward_buffers() == ("new", "new")


def test_switch_reads_the_environment(monkeypatch):
    monkeypatch.delenv("LMKERNELS_GLU_INPLACE_BWD", raising=False)
    assert glu_mod.in_place_backward_from_env()
    monkeypatch.setenv("LMKERNELS_GLU_INPLACE_BWD", "0")
    assert not glu_mod.in_place_backward_from_env()
    monkeypatch.setenv("LMKERNELS_GLU_INPLACE_BWD", "1")
    assert glu_mod.in_place_backward_from_env()


def test_switched_off_allocates(monkeypatch):
    monkeypatch.setattr(glu_mod, "IN_PLACE_BACKWARD", False)
    _grads(MLP(torch.float32), torch.float32)
    assert glu_mod.last_backward_buffers() == ("new", "new")


# --- GPU: memory ---------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs a CUDA GPU (peak memory)")
def test_in_place_backward_lowers_peak_memory(monkeypatch):
    M, N = 8192, 8192

    def peak_of_backward(in_place):
        monkeypatch.setattr(glu_mod, "IN_PLACE_BACKWARD", in_place)
        a = torch.randn(M, 1, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        # gate and up: temporaries only the GLU holds; the product's gradient is fresh too.
        loss = (swiglu(a.expand(M, N) * 2, a.expand(M, N) * 3) * w).sum()
        return peak_memory_bytes(loss.backward, [], "cuda")

    saved = peak_of_backward(False) - peak_of_backward(True)
    assert saved >= 2 * M * N * 2 * 0.9, f"in-place backward saved only {saved} bytes"
