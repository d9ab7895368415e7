"""Triton FLCE (lmkernels/backends/triton/flce.py) against an fp64 ground truth.

On the CPU the kernels run under TRITON_INTERPRET=1. The chunk size is forced small so that
several chunks (and a partial last one) run on tiny shapes. Policy: per output,
err(triton) <= factor * err(eager in the same dtype) + floor and err(triton) <= bound, with err
the relative RMS error against an fp64 computation built on torch.nn.functional.cross_entropy
(independent of both the reference and the kernel); the factors are the FLCE OpSpec's.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton", reason="the Triton backend needs triton")

import lmkernels  # noqa: E402
from flce_common import BACKEND, DEVICE, fix_sizes, make, mode, small_chunks  # noqa: E402, F401
from lmkernels.backends.triton import flce_kernels as kernels  # noqa: E402
from lmkernels.backends.triton import triton_unavailable_reason  # noqa: E402
from lmkernels.ops.flce import SPEC, fused_linear_cross_entropy_reference  # noqa: E402

if triton_unavailable_reason() is not None:
    pytest.skip(triton_unavailable_reason(), allow_module_level=True)
lmkernels.impls()  # loads the backends: registers the lmkernels::flce_triton_* ops opcheck calls

GRAD_NAMES = ("hidden", "weight", "bias")


def truth_fp64(inputs):
    """The loss (and lse) in fp64 by F.cross_entropy + the z-loss term, per the docstring (the
    logits softcapped, then divided by the temperature)."""
    weight = inputs["weight"].double()
    V, H = weight.shape
    h = inputs["hidden"].double().reshape(-1, H)
    t = inputs["target"].reshape(-1)
    ignore_index = inputs.get("ignore_index", -100)
    logits = h @ weight.T
    if inputs.get("bias") is not None:
        logits = logits + inputs["bias"].double()
    if inputs.get("softcap") is not None:
        logits = inputs["softcap"] * torch.tanh(logits / inputs["softcap"])
    logits = logits / inputs.get("temperature", 1.0)
    cw = inputs.get("class_weight")
    cw = cw.double() if cw is not None else None
    per_token = F.cross_entropy(
        logits,
        t.long(),
        weight=cw,
        ignore_index=ignore_index,
        reduction="none",
        label_smoothing=inputs.get("label_smoothing", 0.0),
    )
    lse = torch.logsumexp(logits, -1)
    valid = t != ignore_index
    per_token = per_token + torch.where(valid, inputs.get("z_loss_scale", 0.0) * lse.square(), 0.0)
    reduction = inputs.get("reduction", "mean")
    if reduction == "none":
        loss = per_token.view(inputs["target"].shape)
    elif reduction == "sum":
        loss = per_token.sum()
    else:
        w_t = cw[torch.where(valid, t, 0)] if cw is not None else torch.ones_like(lse)
        denom = torch.where(valid, w_t, 0.0).sum()
        loss = per_token.sum() / denom if denom > 0 else per_token.sum() * 0.0
    return loss, lse.view(inputs["target"].shape)


def run(fn, inputs, grad_seed=1, up_cast=None, live=GRAD_NAMES):
    """Loss, lse (or None) and the gradients of <loss, upstream> for the live grad inputs.

    up_cast: dtype to cast the float inputs to first (fp64 for the ground truth).
    """
    leaves = {}
    call = dict(inputs)
    for name in (*GRAD_NAMES, "class_weight"):
        x = call.get(name)
        if x is None:
            continue
        call[name] = x.detach().to(up_cast) if up_cast is not None else x.detach().clone()
        if name in live:
            leaves[name] = call[name].requires_grad_(True)
    before = {k: v.detach().clone() for k, v in call.items() if isinstance(v, torch.Tensor)}
    out = fn(call)
    loss, lse = (out[0], out[1]) if isinstance(out, tuple) else (out, None)  # stats: checked elsewhere
    g = torch.Generator().manual_seed(grad_seed)
    # Not 1, also for a scalar loss, so the backward's scaling by the upstream is exercised.
    upstream = (torch.rand(loss.shape, generator=g) + 0.5).to(loss.device, loss.dtype)
    grads = torch.autograd.grad(loss, list(leaves.values()), upstream)
    for k, v in before.items():  # neither forward nor backward writes into the caller's tensors
        assert torch.equal(v, call[k]), f"input {k} was modified"
    return loss.detach(), lse, dict(zip(leaves, grads))


def rel_rms(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def check(name, impl, eager, truth, dtype):
    tol = SPEC.tolerances[dtype]
    assert impl.shape == truth.shape, f"{name}: shape {tuple(impl.shape)} != {tuple(truth.shape)}"
    assert impl.dtype == eager.dtype, f"{name}: dtype {impl.dtype} != eager's {eager.dtype}"
    assert torch.isfinite(impl).all(), f"{name}: non-finite values"
    if truth.abs().max() == 0:  # e.g. every token ignored: exactly zero, like the truth
        assert (impl == 0).all(), f"{name}: expected exact zeros"
        return
    err, err_eager = rel_rms(impl, truth), rel_rms(eager, truth)
    assert err_eager <= tol.bound, f"{name}: eager itself is off ({err_eager:.2e}): is the truth right?"
    limit = min(tol.factor * err_eager + tol.floor, tol.bound)
    assert err <= limit, f"{name}: err {err:.2e} > {limit:.2e} (eager {err_eager:.2e})"


def triton_fn(inputs):
    return lmkernels.fused_linear_cross_entropy(**inputs, backend=BACKEND["name"])


def eager_fn(inputs):
    return fused_linear_cross_entropy_reference(**inputs)


def compare(inputs, dtype, live=GRAD_NAMES):
    t_loss, t_lse, t_grads = run(triton_fn, inputs, live=live)
    e_loss, e_lse, e_grads = run(eager_fn, inputs, live=live)
    r_loss, r_lse = truth_fp64(inputs)
    _, _, r_grads = run(lambda i: truth_fp64(i)[0], inputs, up_cast=torch.float64, live=live)
    assert t_loss.dtype == torch.float32
    check("loss", t_loss, e_loss, r_loss, dtype)
    if inputs.get("return_lse"):
        assert not t_lse.requires_grad
        check("lse", t_lse, e_lse, r_lse, dtype)
    assert t_grads.keys() == e_grads.keys()
    for name in t_grads:
        check(f"grad {name}", t_grads[name], e_grads[name], r_grads[name], dtype)


SHAPES = {
    "37x64x131": {"BT": 37, "H": 64, "V": 131},  # 3 chunks, the last one partial
    "2x5x40_V500": {"BT": 10, "H": 40, "V": 500, "hidden_shape": (2, 5)},  # one chunk
    "12x16x5000": {"BT": 12, "H": 16, "V": 5000},  # two BLOCK_V blocks per row, masked tail
}
CASES = {str(i): case for i, case in enumerate(SPEC.cases)}


# Every OpSpec case on the small shapes; on the wide-V one (slow in the interpreter) the cases
# whose per-block sums cross blocks: plain, label smoothing + class weights, softcap + z-loss.
SHAPE_CASES = [(s, c) for s in SHAPES for c in CASES if s != "12x16x5000" or c in ("0", "3", "4")]


@pytest.mark.parametrize(("shape", "case"), SHAPE_CASES, ids=[f"{s}-case{c}" for s, c in SHAPE_CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_fp64(monkeypatch, dtype, shape, case):
    if shape == "12x16x5000":
        # Vocabulary windows of 4500 + 500 columns: the first spans two BLOCK_V blocks of the
        # kernel with a masked tail (48-column windows would mean 105 blocks: slow to interpret).
        monkeypatch.setenv(kernels.BLOCKS_ENV, "16,4500")
    compare(make(SHAPES[shape], dtype, CASES[case]), dtype)


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in CASES])
def test_fast_mode_matches_fp64(monkeypatch, case):
    """The fast mode (gradients in the forward for mean/sum) on every OpSpec case."""
    monkeypatch.setitem(BACKEND, "name", "triton")
    compare(make(SHAPES["37x64x131"], torch.bfloat16, CASES[case]), torch.bfloat16)


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in CASES])
def test_fp16(case):
    compare(make(SHAPES["37x64x131"], torch.float16, CASES[case]), torch.float16)


@pytest.mark.parametrize(
    "options",
    [
        {"reduction": "sum", "label_smoothing": 0.2, "with_class_weight": True, "with_bias": True},
        {"reduction": "none", "softcap": 5.0, "z_loss_scale": 1e-3, "with_bias": True},
        {
            "reduction": "mean",
            "softcap": 3.0,
            "label_smoothing": 0.1,
            "z_loss_scale": 1e-2,
            "ignore_index": 7,
        },
        {"reduction": "none", "label_smoothing": 1.0, "with_class_weight": True},
    ],
    ids=["sum-smooth-cw-bias", "none-softcap-zloss-bias", "mean-all-but-cw", "none-smooth1-cw"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_option_combinations(dtype, options):
    compare(make(SHAPES["37x64x131"], dtype, options), dtype)


def test_int32_target():
    inputs = make(SHAPES["37x64x131"], torch.bfloat16, {"label_smoothing": 0.1, "with_class_weight": True})
    inputs["target"] = inputs["target"].to(torch.int32)
    compare(inputs, torch.bfloat16)


@pytest.mark.parametrize(
    ("chunk", "blocks"),
    [(None, None), (5, (8, 40)), (5, (64, 500))],
    ids=["default-sizes", "chunk5-blocks8x40", "one-block"],
)
@pytest.mark.parametrize("accum", [None, torch.bfloat16], ids=["fp32-accum", "bf16-lean"])
def test_chunk_and_block_sizes(monkeypatch, chunk, blocks, accum, mode):
    fix_sizes(monkeypatch, chunk, blocks)
    case = {"reduction": "mean", "with_bias": True, "label_smoothing": 0.1, "grad_accum_dtype": accum}
    compare(make(SHAPES["37x64x131"], torch.bfloat16, case), torch.bfloat16)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA's sync debug mode: a GPU test")
@pytest.mark.parametrize("budget", [None, 0.0], ids=["own-default", "budget-0"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_no_host_sync(monkeypatch, mode, reduction, budget):
    """Forward and backward never wait for the GPU on the host (torch's sync debug mode raises at
    any synchronizing torch call) with the target check off (its one sync, ops/flce.py); the
    budget 0 splits the tokens into super-chunks and the vocabulary into many blocks."""
    monkeypatch.setenv("LMKERNELS_CHECK_VALUES", "0")
    monkeypatch.delenv(kernels.CHUNK_ENV, raising=False)
    monkeypatch.delenv(kernels.BLOCKS_ENV, raising=False)
    inputs = make({"BT": 4096, "H": 256, "V": 32000}, torch.bfloat16, {"reduction": reduction})
    inputs["memory_budget"] = budget
    hidden, weight = inputs["hidden"].requires_grad_(True), inputs["weight"].requires_grad_(True)
    triton_fn(inputs).sum().backward()  # compiles the kernels (autotuning may sync) outside the check
    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        triton_fn(inputs).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert hidden.grad is not None and weight.grad is not None


def test_budget_chunks_match_fp64(monkeypatch):
    """A budget between the lean mode and the default: the default's bf16 chunks made smaller
    (here 16 chunks of 128 tokens against the default's 8 of 256, the floor lowered from 1024
    so that the interpreter runs it)."""
    fix_sizes(monkeypatch, None, None)
    monkeypatch.setattr(kernels, "MIN_FAST_CHUNK_TOKENS", 128)
    monkeypatch.setitem(BACKEND, "name", "triton")
    BT, H, V = 2048, 16, 64
    budget = 128 * V * 2 / ((BT + V) * H * 2)
    default = kernels.plan(BT, H, V, 2, torch.bfloat16, None, False, None, True, True)
    assert default.chunk_bytes == 256 * V * 2
    p = kernels.plan(BT, H, V, 2, torch.bfloat16, None, False, budget, True, True)
    assert not p.lean and not p.fp32_logits and p.chunk_bytes == 128 * V * 2
    compare(make({"BT": BT, "H": H, "V": V}, torch.bfloat16, {"memory_budget": budget}), torch.bfloat16)


@pytest.mark.skipif(DEVICE != "cuda", reason="16384 rows take 2 minutes in the interpreter: runs on the GPU")
def test_budget_chunks_on_a_long_batch_match_fp64(monkeypatch):
    """16 bf16 chunks of 1024 tokens from a budget (grad_W summed in bf16 16 times)."""
    fix_sizes(monkeypatch, None, None)
    monkeypatch.setitem(BACKEND, "name", "triton")
    BT, H, V = 16384, 32, 256
    budget = 1024 * V * 2 / ((BT + V) * H * 2)
    p = kernels.plan(BT, H, V, 2, torch.bfloat16, None, False, budget, True, True)
    assert not p.lean and not p.fp32_logits and p.chunk_bytes == 1024 * V * 2
    compare(make({"BT": BT, "H": H, "V": V}, torch.bfloat16, {"memory_budget": budget}), torch.bfloat16)


@pytest.mark.skipif(DEVICE != "cuda", reason="32768 rows take 4 minutes in the interpreter: runs on the GPU")
def test_long_batch_matches_fp64(monkeypatch):
    """The default's 16 chunks of 2048 tokens on a long bf16 batch, grad_W summed in bf16 16
    times: within the policy against fp64, like eager bf16."""
    fix_sizes(monkeypatch, None, None)
    monkeypatch.setitem(BACKEND, "name", "triton")
    BT, H, V = 32768, 32, 256
    assert kernels.bf16_logits_chunk(BT, V, torch.bfloat16, 2) == BT // 16
    compare(make({"BT": BT, "H": H, "V": V}, torch.bfloat16, {}), torch.bfloat16)


@pytest.mark.parametrize("budget", [0.0, 0.01, 0.3, 5.0])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_memory_budget_matches_fp64(budget, reduction, mode):
    inputs = make(SHAPES["37x64x131"], torch.bfloat16, {"reduction": reduction, "memory_budget": budget})
    compare(inputs, torch.bfloat16)


@pytest.mark.parametrize("reduction", ["mean", "none"])  # grads in the forward / recomputed
@pytest.mark.parametrize("accum", [None, torch.float32, torch.bfloat16], ids=["none", "fp32", "bf16-lean"])
def test_grad_accum_dtype(accum, reduction, mode):
    # bf16 inputs: the only dtype where the choice changes anything (fp32 lean == fp32 accum).
    inputs = make(SHAPES["37x64x131"], torch.bfloat16, {"reduction": reduction, "grad_accum_dtype": accum})
    compare(inputs, torch.bfloat16)


@pytest.mark.parametrize(
    "accum", [torch.bfloat16, torch.float32, None], ids=["lean", "fp32-accum", "default"]
)
def test_scaled_in_place_without_copy(monkeypatch, accum):
    """Fast mode: the forward's grad_W and grad_hidden buffers are scaled in place and become weight.grad
    and hidden.grad: no copy, on the eager path (a plain autograd.Function, not the custom op)."""
    monkeypatch.setitem(BACKEND, "name", "triton")
    inputs = make(SHAPES["37x64x131"], torch.bfloat16, {"grad_accum_dtype": accum})
    hidden = inputs["hidden"].requires_grad_(True)
    weight = inputs["weight"].requires_grad_(True)
    loss = triton_fn(inputs)
    assert type(loss.grad_fn).__name__ == "FlceTritonFunctionBackward"
    saved = loss.grad_fn.saved_tensors
    ptrs = [g.data_ptr() for g in saved[:2]]
    expected = [g.float() * 3.0 for g in saved[:2]]
    del saved
    loss.backward(torch.tensor(3.0, device=loss.device))
    assert [hidden.grad.data_ptr(), weight.grad.data_ptr()] == ptrs
    torch.testing.assert_close(hidden.grad.float(), expected[0], rtol=2**-8, atol=0)
    torch.testing.assert_close(weight.grad.float(), expected[1], rtol=2**-8, atol=0)


@pytest.mark.parametrize("value", [0.3719, 1.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_scale_rounds_the_fp32_product_once(monkeypatch, dtype, value):
    """scale_ (the backward's in-place scaling by the upstream scalar) rounds x * scale, taken in
    fp32, once, over several programs and a partial last block, and bumps the version counter
    as an in-place torch op does. (torch's own mul_ on CUDA rounds a 0-dim fp32 scale to x's
    dtype first: not the reference.) A scale of 1, which the kernel skips, leaves x's bits."""
    monkeypatch.setattr(kernels, "SCALE_BLOCK", 64)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 41, generator=g) * 3).to(DEVICE, dtype)
    scale = torch.tensor(value, device=DEVICE)
    expected = (x.float() * scale).to(dtype)
    version = x._version
    assert kernels.scale_(x, scale) is x
    assert torch.equal(x, expected)
    assert x._version > version


@pytest.mark.parametrize("frozen", ["weight", "hidden"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_partial_grads(reduction, frozen):
    """With a frozen input only the other gradients are computed, and they are right."""
    inputs = make(SHAPES["37x64x131"], torch.bfloat16, {"reduction": reduction, "with_bias": True})
    compare(inputs, torch.bfloat16, live=tuple(n for n in GRAD_NAMES if n != frozen))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_no_grad_forward_matches(reduction):
    """Under no_grad (loss and lse only) the values equal those of the gradient-computing run."""
    inputs = make(SHAPES["37x64x131"], torch.bfloat16, {"reduction": reduction, "return_lse": True})
    with torch.no_grad():
        loss, lse = triton_fn(inputs)
    inputs["hidden"].requires_grad_(True)
    g_loss, g_lse = triton_fn(inputs)
    assert torch.equal(loss, g_loss.detach()) and torch.equal(lse, g_lse)


def test_second_backward_raises(monkeypatch):
    """Fast mode: mean/sum scale the stored gradients in place: a second backward must fail loudly."""
    monkeypatch.setitem(BACKEND, "name", "triton")
    inputs = make(SHAPES["37x64x131"], torch.float32, {})
    inputs["hidden"].requires_grad_(True)
    loss = triton_fn(inputs)
    loss.backward(retain_graph=True)
    with pytest.raises(lmkernels.ConsumedInputsError, match="What recomputes instead"):
        loss.backward()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored(reduction):
    inputs = make(SHAPES["37x64x131"], torch.bfloat16, {"reduction": reduction, "ignore_fraction": 1.0})
    loss, _, grads = run(triton_fn, inputs)
    assert (loss == 0).all()
    assert all((g == 0).all() for g in grads.values())


@pytest.mark.parametrize("with_class_weight", [False, True], ids=["no-cw", "cw"])
def test_out_of_range_target_gives_nan(monkeypatch, with_class_weight):
    monkeypatch.setenv("LMKERNELS_CHECK_VALUES", "0")
    shape = SHAPES["37x64x131"]
    inputs = make(shape, torch.float32, {"reduction": "none", "with_class_weight": with_class_weight})
    bad = torch.zeros(shape["BT"], dtype=torch.bool, device=DEVICE)
    bad[[3, 20]] = True
    inputs["target"][3] = shape["V"] + 1000
    inputs["target"][20] = -5
    inputs["target"][5] = -100  # still ignored, not out of range
    loss, _, grads = run(triton_fn, inputs)
    assert loss[bad].isnan().all()
    assert torch.isfinite(loss[~bad]).all() and loss[5] == 0
    assert grads["hidden"][bad].isnan().all()  # the gradient of a nan loss is nan too
    loss_mean = lmkernels.fused_linear_cross_entropy(**{**inputs, "reduction": "mean"}, backend="triton")
    assert loss_mean.isnan()


def test_unsupported_class_weight_grad():
    inputs = make(SHAPES["37x64x131"], torch.float32, {"with_class_weight": True})
    inputs["class_weight"].requires_grad_(True)
    with pytest.raises(lmkernels.BackendNotSupportedError, match="class_weight"):
        lmkernels.fused_linear_cross_entropy(**inputs, backend="triton")


def test_second_backward_lean_recomputes():
    """Lean mode keeps only inputs and lse: a retained graph gives the same gradients twice."""
    inputs = make(SHAPES["37x64x131"], torch.float32, {})
    hidden = inputs["hidden"].requires_grad_(True)
    loss = triton_fn(inputs)
    (first,) = torch.autograd.grad(loss, hidden, retain_graph=True)
    (second,) = torch.autograd.grad(loss, hidden)
    assert torch.equal(first, second)


def _forward_args(inputs, reduction, grads, lean, stats=True, temperature=0.7):
    H = inputs["weight"].shape[1]
    return (
        inputs["hidden"].reshape(-1, H),
        inputs["weight"],
        inputs["target"].reshape(-1),
        inputs.get("bias"),
        inputs.get("class_weight"),
        -100,
        reduction,
        0.1,
        20.0,
        1e-4,
        grads,
        grads,
        grads and inputs.get("bias") is not None,
        True,
        lean,
        0 if not lean else 1 << 20,  # chunk_bytes (0: the default's) and block_bytes: kernels.plan's
        lean,  # fp32_logits: the fast mode takes the input dtype's (bf16 inputs: bf16 logits)
        1 << 20,
        stats,
        temperature,
    )


# Every pair of (reduction, mode, dtype) values in four cases (an orthogonal array): each case
# runs opcheck's four checks through the interpreted kernels.
@pytest.mark.parametrize(
    ("reduction", "lean", "dtype"),
    [
        ("mean", False, torch.bfloat16),
        ("none", False, torch.float32),
        ("mean", True, torch.float32),
        ("none", True, torch.bfloat16),
    ],
    ids=["mean-fast-bf16", "none-fast-fp32", "mean-lean-fp32", "none-lean-bf16"],
)
def test_opcheck_forward(reduction, lean, dtype):
    """The forward op's schema, fake and autograd registration; bf16 fast: bf16 logits chunks."""
    inputs = make({"BT": 12, "H": 16, "V": 40}, dtype, {"with_bias": True, "with_class_weight": True})
    for name in GRAD_NAMES:
        inputs[name].requires_grad_(True)
    torch.library.opcheck(
        torch.ops.lmkernels.flce_triton_forward.default, _forward_args(inputs, reduction, True, lean)
    )
    args = _forward_args(
        {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()},
        reduction,
        False,
        lean,
    )
    torch.library.opcheck(torch.ops.lmkernels.flce_triton_forward.default, args)


@pytest.mark.parametrize("entropy", [False, True], ids=["loss", "loss_and_entropy"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_opcheck_backward(reduction, entropy):
    inputs = make({"BT": 12, "H": 16, "V": 40}, torch.bfloat16, {"with_bias": True})
    logits = (inputs["hidden"].float() @ inputs["weight"].float().T + inputs["bias"].float()) / 0.7
    lse = torch.logsumexp(logits, -1)
    grad_shape = (12,) if reduction == "none" else ()
    g = torch.Generator().manual_seed(1)
    grad_entropy = torch.randn(12, generator=g).to(DEVICE) if entropy else None
    entropy_values = (torch.softmax(logits, -1) * (lse[:, None] - logits)).sum(-1) if entropy else None
    args = (
        torch.randn(grad_shape, generator=torch.Generator().manual_seed(0)).to(DEVICE),
        inputs["hidden"],
        inputs["weight"],
        inputs["target"],
        inputs["bias"],
        None,
        lse,
        -100,
        reduction,
        0.0,
        None,
        0.0,
        True,
        True,
        True,
        False,
        True,
        0.7,
        grad_entropy,
        entropy_values,
    )
    torch.library.opcheck(torch.ops.lmkernels.flce_triton_backward.default, args)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compile_fullgraph_matches_eager(reduction, mode):
    torch._dynamo.reset()
    inputs = make(SHAPES["2x5x40_V500"], torch.bfloat16, {"reduction": reduction, "with_bias": True})

    def fn(i):
        return lmkernels.fused_linear_cross_entropy(**i, backend=BACKEND["name"])

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    loss, _, grads = run(fn, inputs)
    c_loss, _, c_grads = run(compiled, inputs)
    torch.testing.assert_close(c_loss, loss, rtol=0, atol=0)
    for name in grads:
        torch.testing.assert_close(c_grads[name], grads[name], rtol=0, atol=0)


# Every pair of (reduction, accumulator, mode) values in six cases: each reduction with both
# accumulators and both modes, each accumulator with both modes.
@pytest.mark.parametrize(
    ("reduction", "accum", "mode"),
    [
        ("mean", None, "fast"),
        ("mean", torch.float16, "lean"),
        ("sum", None, "lean"),
        ("sum", torch.float16, "fast"),
        ("none", None, "fast"),
        ("none", torch.float16, "lean"),
    ],
    ids=[
        "mean-fp32-fast",
        "mean-fp16-lean",
        "sum-fp32-lean",
        "sum-fp16-fast",
        "none-fp32-fast",
        "none-fp16-lean",
    ],
    indirect=["mode"],
)
def test_fp16_tiny_dlogits(monkeypatch, reduction, accum, mode):
    """fp16 dlogits must not underflow. Probabilities ~1/V = 4.9e-4 times a per-token scale of
    1/256 (mean's 1 / tokens; for "sum"/"none" the loss is multiplied by 1/256 so that the
    upstream gradient carries it) put most unscaled dlogits below fp16's normal range
    (6.1e-5), which gave errors several times eager's. The kernel scales them up and the
    gradients back down."""
    fix_sizes(monkeypatch, 128, (128, 1024))
    inputs = make({"BT": 256, "H": 32, "V": 2048}, torch.float16, {"reduction": reduction})
    inputs["grad_accum_dtype"] = accum
    c = 1.0 if reduction == "mean" else 1.0 / 256

    def scaled(fn):
        return lambda i: fn(i) * c

    _, _, t_grads = run(scaled(triton_fn), inputs)
    _, _, e_grads = run(scaled(eager_fn), inputs)
    _, _, r_grads = run(scaled(lambda i: truth_fp64(i)[0]), inputs, up_cast=torch.float64)
    for name in t_grads:
        check(f"grad {name}", t_grads[name], e_grads[name], r_grads[name], torch.float16)


@pytest.mark.parametrize("n", [65, 131, 132])
def test_dlogits_gemms_read_only_the_row(n):
    """The in-place 16-bit dlogits of a row are followed by the rest of its fp32 logits, here all
    nan. The GEMMs must not read them: the CPU's bf16 GEMM read past such rows (torch 2.13 on an
    AVX512-BF16 CPU), which turned whole rows of grad_hidden into nan."""
    g = torch.Generator().manual_seed(0)
    logits = torch.full((37, n), float("nan"), device=DEVICE)  # that CPU GEMM: from 32 rows on
    dlogits = kernels._dlogits_view(logits, torch.bfloat16)
    dlogits.copy_(torch.randn(37, n, generator=g).to(DEVICE, torch.bfloat16))
    weight = torch.randn(n, 64, generator=g).to(DEVICE, torch.bfloat16)
    out = torch.mm(kernels._gemm_ready(dlogits), weight)
    expected = dlogits.double() @ weight.double()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("logits_dtype", [torch.bfloat16, torch.float32])
def test_row_kernel_wide_launch_matches_fp64(logits_dtype):
    """Hopper's launch for rows of 64k+ columns (blocks of 32768, 32 warps) and the narrow one
    write the same logsumexp, loss and dlogits, each against fp64: the row kernel alone, over
    bf16 logits in place and over fp32 logits (bf16 dlogits in their bytes), with label
    smoothing and a softcap, one ignored row."""
    from lmkernels.backends.triton.configs import default, hopper

    rows, V, cap, smoothing = 3, 70001, 30.0, 0.1
    assert hopper.FLCE.rows_launch(V) == (32768, 32)
    gen = torch.Generator().manual_seed(0)
    raw = (torch.randn(rows, V, generator=gen) * 4).to(logits_dtype).to(DEVICE)
    target = torch.tensor([5, V - 1, -100], device=DEVICE)
    z = raw.double().requires_grad_()
    ref_loss = F.cross_entropy(cap * torch.tanh(z / cap), target, reduction="none", label_smoothing=smoothing)
    ref_loss.sum().backward()
    ref_lse = torch.logsumexp(cap * torch.tanh(raw.double() / cap), dim=1)
    for table in (hopper.FLCE, default.FLCE):
        logits = raw.clone()
        dlogits = kernels._dlogits_view(logits, torch.bfloat16)
        lse = torch.empty(rows, device=DEVICE)
        loss = torch.empty(rows, device=DEVICE)
        launcher = kernels.Rows(target, None, None, -100, smoothing, cap, 0.0, V, table)
        launcher.launch(logits, dlogits, slice(0, rows), lse, loss, torch.ones((), device=DEVICE), 0, False)
        torch.testing.assert_close(lse[:2].double(), ref_lse[:2], rtol=1e-6, atol=0)
        torch.testing.assert_close(loss.double(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dlogits.double(), z.grad, rtol=2**-8, atol=1e-9)
