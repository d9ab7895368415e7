"""The Triton RMSNorm and LayerNorm kernels: values and gradients against an fp64 truth (error
policy of DESIGN.md), every launch configuration the launchers take (passed to them, as the op
bodies pass the tables'), the torch.library registration (opcheck, torch.compile), the in-place
backward of RMSNorm (memory saved when safe, no corruption when the gradient is shared) and,
on a GPU, 64-bit offsets on tensors of more than 2^31 elements."""

import dataclasses
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from torch._dynamo.testing import AotEagerAndRecordGraphs  # noqa: E402

import lmkernels  # noqa: E402
from lmkernels.ops.layer_norm import layer_norm_reference  # noqa: E402
from lmkernels.ops.rms_norm import rms_norm_reference  # noqa: E402
from lmkernels.registry.core import DEFAULT_TOLERANCES  # noqa: E402
from lmkernels.utils import poison_outputs  # noqa: E402

norms_mod = pytest.importorskip("lmkernels.backends.triton.norms", reason="needs triton")
from lmkernels.backends.triton import triton_unavailable_reason  # noqa: E402

if triton_unavailable_reason() is not None:  # e.g. the CPU interpreter of triton 3.6
    pytest.skip(triton_unavailable_reason(), allow_module_level=True)
from lmkernels.backends.triton.configs import hopper  # noqa: E402
from lmkernels.backends.triton.configs.records import ColumnConfig  # noqa: E402

NORMS = hopper.TABLES.norms  # the measured entries (the default table holds the same)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(3, 5), (37, 96), (4, 1000), (2, 3, 17)]
DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _randn(shape, dtype, seed, scale=1.0, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale + shift).to(device=DEVICE, dtype=dtype)


def _rel_err(out: torch.Tensor, truth: torch.Tensor) -> float:
    diff = (out.double() - truth).norm()
    return (diff / truth.norm().clamp_min(1e-30)).item()


def _assert_close(name, out, eager, truth, dtype):
    """Pass when err(impl) <= factor * err(eager, same dtype) + floor and err(impl) <= bound."""
    assert out.dtype == eager.dtype, f"{name}: dtype {out.dtype}, eager gives {eager.dtype}"
    assert out.shape == eager.shape, f"{name}: shape {tuple(out.shape)}, eager {tuple(eager.shape)}"
    assert torch.isfinite(out).all(), f"{name}: NaN or Inf (an element never written?)"
    tol = DEFAULT_TOLERANCES[dtype]
    err, err_eager = _rel_err(out, truth), _rel_err(eager, truth)
    limit = tol.factor * err_eager + tol.floor
    assert err <= limit and err <= tol.bound, (
        f"{name}: rel err {err:.3g} vs fp64, eager {dtype} {err_eager:.3g}, limit {limit:.3g}"
    )


def _rms_truth(x, weight, eps, offset):
    """Exact RMSNorm in fp64: what every casting mode approximates."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * (weight + offset)


def _ln_truth(x, weight=None, bias=None, eps=1e-5):
    mean = x.mean(-1, keepdim=True)
    y = (x - mean) * torch.rsqrt((x - mean).pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight
    return y if bias is None else y + bias


def _bwd_config(*args, **kwargs):
    """A BwdConfig with the table's column and partial-sum kernels unless given."""
    kwargs = {"column": NORMS.column, "sums": NORMS.sums, **kwargs}
    return norms_mod.BwdConfig(*args, **kwargs)


def _rms_with(fwd, bwd):
    """rms_norm through the launchers with the given configurations, forward and backward."""

    class Forced(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, eps, offset, casting_mode):
            y, rstd = norms_mod.rms_norm_forward(x, weight, eps, offset, casting_mode, fwd)
            ctx.save_for_backward(x, weight, rstd)
            ctx.options = offset, casting_mode
            return y

        @staticmethod
        def backward(ctx, dy):
            x, weight, rstd = ctx.saved_tensors
            dx, dw = norms_mod.rms_norm_backward(dy, x, weight, rstd, *ctx.options, bwd)
            return dx, dw if weight is not None else None, None, None, None

    def fn(x, weight=None, eps=1e-6, offset=0.0, casting_mode="llama"):
        return Forced.apply(x, weight, eps, offset, casting_mode)

    return fn


def _ln_with(fwd, bwd):
    """layer_norm through the launchers with the given configurations, forward and backward."""

    class Forced(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, bias, eps):
            y, mean, rstd = norms_mod.layer_norm_forward(x, weight, bias, eps, fwd)
            ctx.save_for_backward(x, weight, mean, rstd)
            ctx.bias_dtype = bias.dtype if bias is not None else None
            return y

        @staticmethod
        def backward(ctx, dy):
            x, weight, mean, rstd = ctx.saved_tensors
            dx, dw, db = norms_mod.layer_norm_backward(dy, x, weight, mean, rstd, ctx.bias_dtype, bwd)
            return dx, dw if weight is not None else None, db if ctx.bias_dtype is not None else None, None

    def fn(x, weight=None, bias=None, eps=1e-5):
        return Forced.apply(x, weight, bias, eps)

    return fn


def _compare_three_ways(name, triton_fn, reference, truth_fn, inputs, grad_names):
    """Run the Triton op, the eager reference in the same dtypes and the fp64 truth on the same
    input values and upstream gradient; check the output and every gradient."""
    dtype = inputs["x"].dtype
    present = [k for k in grad_names if inputs.get(k) is not None]

    def run(fn, to64):
        args = {}
        for k, v in inputs.items():
            if isinstance(v, torch.Tensor):
                v = v.detach().double() if to64 else v.detach().clone()
                v.requires_grad_(k in present)
            args[k] = v
        out = fn(**args)
        dy = _randn(out.shape, dtype, 99).to(out.dtype)  # the same values for all three runs
        grads = torch.autograd.grad(out, [args[k] for k in present], dy)
        return out, dict(zip(present, grads))

    with poison_outputs():  # outputs start as NaN: an element the kernels skip fails
        out, grads = run(triton_fn, False)
    eager_out, eager_grads = run(reference, False)
    truth_out, truth_grads = run(truth_fn, True)
    _assert_close(f"{name} y", out, eager_out, truth_out, dtype)
    for k in present:
        # x's dtype sets the tolerance: an fp32 dweight of a bf16 x carries bf16 rounding.
        _assert_close(f"{name} d{k}", grads[k], eager_grads[k], truth_grads[k], dtype)


# --- RMSNorm values and gradients ---------------------------------------------------------------

RMS_CASES = {
    "llama": dict(casting_mode="llama"),
    "llama-offset": dict(casting_mode="llama", offset=0.5),
    "gemma": dict(casting_mode="gemma", offset=1.0),
    "none": dict(casting_mode="none"),
    "none-offset": dict(casting_mode="none", offset=1.0),
    "no-weight": dict(weight=None),
    "no-weight-none": dict(weight=None, casting_mode="none"),
}


def _rms_inputs(shape, dtype, weight_dtype=None, **options):
    inputs = {
        "x": _randn(shape, dtype, 0),
        "weight": _randn(shape[-1:], weight_dtype or dtype, 1, scale=0.5, shift=1.0),
        "eps": 1e-6,
        "offset": 0.0,
        "casting_mode": "llama",
    }
    inputs.update(options)
    return inputs


def _check_rms(shape, dtype, name, weight_dtype=None, fn=None, **options):
    """fn: the Triton function checked (default: rms_norm's triton backend)."""
    inputs = _rms_inputs(shape, dtype, weight_dtype, **options)

    def triton_fn(**kw):
        return fn(**kw) if fn is not None else lmkernels.rms_norm(**kw, backend="triton")

    def truth_fn(x, weight, eps, offset, casting_mode):
        return _rms_truth(x, weight, eps, offset)

    _compare_three_ways(name, triton_fn, rms_norm_reference, truth_fn, inputs, ("x", "weight"))


@pytest.mark.parametrize("case", list(RMS_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rms_norm_values_and_grads(shape, dtype, case):
    _check_rms(shape, dtype, f"rms_norm {case}", **RMS_CASES[case])


@pytest.mark.parametrize("mode", ["llama", "gemma", "none"])
def test_rms_norm_fp32_weight_with_bf16_x(mode):
    """Output in x's dtype, dweight in the weight's dtype (fp32)."""
    _check_rms(
        (37, 96),
        torch.bfloat16,
        f"rms_norm mixed {mode}",
        weight_dtype=torch.float32,
        casting_mode=mode,
        offset=1.0 if mode == "gemma" else 0.0,
    )


@pytest.mark.parametrize("mode", ["llama", "none"])
def test_rms_norm_fp16(mode):
    _check_rms((9, 200), torch.float16, f"rms_norm fp16 {mode}", casting_mode=mode)


def test_rms_norm_non_contiguous_input():
    x = _randn((96, 37), torch.bfloat16, 0).t()  # (37, 96), column-major
    assert not x.is_contiguous()
    _check_rms((37, 96), torch.bfloat16, "rms_norm non-contiguous", x=x)


def _narrow_table():
    """The table with its wide path from 65 columns on, in blocks of 32 (the interpreter stays
    fast on rows that take it)."""
    return dataclasses.replace(
        NORMS, entries=(), max_fused_n=64, wide=dataclasses.replace(NORMS.wide, block=32)
    )


def _wide_configs(op, N):
    table = _narrow_table()
    fwd, bwd = norms_mod.fwd_config(table, op, N), norms_mod.bwd_config(table, op, N)
    assert not fwd.single_block and not bwd.single_block and bwd.block == 32
    return fwd, bwd


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", ["llama", "none-offset", "no-weight"])
def test_rms_norm_wide_rows_loop_over_blocks(case, dtype):
    """Rows wider than the table's max_fused_n take the blocked path."""
    fn = _rms_with(*_wide_configs("rms_norm", 300))
    _check_rms((7, 300), dtype, f"rms_norm wide {case}", fn=fn, **RMS_CASES[case])


def test_rms_norm_wide_rows_default_config():
    assert not norms_mod.bwd_config(NORMS, "rms_norm", 16411).single_block
    _check_rms((2, 16411), torch.bfloat16, "rms_norm 16411 wide", casting_mode="gemma", offset=1.0)


def _round_bf16(t):
    return t.to(torch.bfloat16).float()


def _rms_none_rounded_like_gpu_eager(x, weight, eps, offset):
    """Casting mode "none" spelled out: every eager op in bf16 is an fp32 op, rounded once."""
    xf = x.float()
    mean_sq = _round_bf16(_round_bf16(xf * xf).sum(-1, keepdim=True) / x.shape[-1])
    rstd = _round_bf16(torch.rsqrt(_round_bf16(mean_sq + eps)))
    factor = _round_bf16(_round_bf16(weight.float()) + offset)
    return _round_bf16(_round_bf16(xf * rstd) * factor).to(torch.bfloat16)


def test_rms_norm_rounds_where_each_casting_mode_says():
    """The error policy cannot tell the modes apart (each approximates the same exact value), so
    check the roundings themselves: bf16 outputs equal the mode's own rounding sequence (up to
    rare ties that another summation order flips), and the modes do give different outputs."""
    x = _randn((32, 256), torch.bfloat16, 0)
    w = _randn((256,), torch.bfloat16, 1, scale=0.5, shift=1.0)
    outputs = {}
    for mode in ("llama", "gemma", "none"):
        y = lmkernels.rms_norm(x, w, offset=1.0, casting_mode=mode, backend="triton")
        if mode == "none":
            expected = _rms_none_rounded_like_gpu_eager(x, w, 1e-6, 1.0)
        else:
            expected = rms_norm_reference(x, w, offset=1.0, casting_mode=mode)
        same = (y == expected).float().mean().item()
        assert same >= 0.96, f"{mode}: only {same:.1%} of elements round as the mode says"
        outputs[mode] = y
    for a, b in (("llama", "gemma"), ("llama", "none"), ("gemma", "none")):
        assert (outputs[a] == outputs[b]).float().mean().item() < 0.9, f"{a} and {b} round alike"


def test_rms_norm_backward_is_deterministic():
    x = _randn((37, 96), torch.bfloat16, 0).requires_grad_()
    w = _randn((96,), torch.bfloat16, 1).requires_grad_()
    dy = _randn((37, 96), torch.bfloat16, 2)
    grads = [torch.autograd.grad(lmkernels.rms_norm(x, w, backend="triton"), (x, w), dy) for _ in range(2)]
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_rms_norm_saves_fp32_rstd():
    x = _randn((5, 33), torch.bfloat16, 0)
    y, rstd = torch.ops.lmkernels.rms_norm_fwd(x, None, 1e-6, 0.0, "gemma")
    assert rstd.dtype == torch.float32 and rstd.shape == (5,)
    expected = torch.rsqrt(x.float().pow(2).mean(-1) + 1e-6)
    torch.testing.assert_close(rstd, expected, rtol=1e-6, atol=0)


# --- LayerNorm values and gradients -------------------------------------------------------------

LN_CASES = {
    "weight-bias": {},
    "no-bias": dict(bias=None),
    "no-weight": dict(weight=None),
    "neither": dict(weight=None, bias=None),
}


def _check_ln(shape, dtype, name, weight_dtype=None, bias_dtype=None, fn=None, **options):
    """fn: the Triton function checked (default: layer_norm's triton backend)."""
    inputs = {
        "x": _randn(shape, dtype, 0, shift=0.5),
        "weight": _randn(shape[-1:], weight_dtype or dtype, 1, scale=0.5, shift=1.0),
        "bias": _randn(shape[-1:], bias_dtype or dtype, 2, scale=0.5),
        "eps": 1e-5,
    }
    inputs.update(options)

    def triton_fn(**kw):
        return fn(**kw) if fn is not None else lmkernels.layer_norm(**kw, backend="triton")

    _compare_three_ways(name, triton_fn, layer_norm_reference, _ln_truth, inputs, ("x", "weight", "bias"))


@pytest.mark.parametrize("case", list(LN_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_layer_norm_values_and_grads(shape, dtype, case):
    _check_ln(shape, dtype, f"layer_norm {case}", **LN_CASES[case])


def test_layer_norm_mixed_parameter_dtypes():
    """fp32 weight, bf16 bias, bf16 x: dweight fp32, dbias bf16, y bf16."""
    _check_ln((37, 96), torch.bfloat16, "layer_norm mixed", weight_dtype=torch.float32)
    _check_ln((37, 96), torch.bfloat16, "layer_norm mixed bias", bias_dtype=torch.float32)


def test_layer_norm_fp16_and_non_contiguous():
    _check_ln((9, 200), torch.float16, "layer_norm fp16")
    x = _randn((96, 37), torch.bfloat16, 0, shift=0.5).t()
    _check_ln((37, 96), torch.bfloat16, "layer_norm non-contiguous", x=x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", ["weight-bias", "no-weight"])
def test_layer_norm_wide_rows_loop_over_blocks(case, dtype):
    fn = _ln_with(*_wide_configs("layer_norm", 300))
    _check_ln((7, 300), dtype, f"layer_norm wide {case}", fn=fn, **LN_CASES[case])


def test_layer_norm_wide_rows_default_config():
    _check_ln((2, 16411), torch.bfloat16, "layer_norm 16411 wide")


def test_layer_norm_fma_forms_where_they_measured_faster():
    """LayerNorm's backward takes its fused multiply-add forms at 8193-11264 columns (the 16384
    block's "part-11/16" entry) and 12289-16384, not at 11265-12288 where they measured slower
    (their values: the forced "fma" paths below)."""
    fma = {
        N: norms_mod.bwd_config(NORMS, "layer_norm", N).fma
        for N in (8192, 11008, 11264, 11265, 12288, 13824, 16384)
    }
    assert fma == {
        8192: False,
        11008: True,
        11264: True,
        11265: False,
        12288: False,
        13824: True,
        16384: True,
    }
    assert not any(norms_mod.bwd_config(NORMS, "rms_norm", N).fma for N in (11008, 16384))


# Every backward path and a multi-row tile (the table picks them only for wide rows on the GPU),
# passed to the launchers: 3 interpreter programs over 6 tiles loop over several; rows = 4 with
# M = 21 leaves a partial last tile. "tail": the row of 100 as register blocks of 64 and 64 (36
# used). "wide": the row in column blocks of 32 (the last one partial), read twice, the
# gradient sums left to the column kernel (2 row ranges of 11 rows, each 8 + 3, two column
# blocks of 64, the second partial); its forward too, with eviction hints. "stages": the loops
# software-pipelined (a GPU-only transformation; the interpreter runs the same loops). A
# one-row tile ("rows1") is held as 1-D blocks, more rows as 2-D tiles. "const-n": both kernels
# compiled for N = 100 (a constexpr), the padded lanes of the block masked at compile time.
# "reload-x": the backward reads x and dy a second time after the row sums instead of holding
# them; "hold-x": it holds them as loaded (bf16) and widens them again by their bits (RMSNorm
# only). "fma": LayerNorm's x_hat and dx as fused multiply-adds (LayerNorm only).
PATH_SHAPE = (21, 100)
_PATHS = {
    "regs-rows4": dict(rows=4),
    "regs-reload-w-stages2": dict(rows=2, reload_w=True, stages=2),
    "regs-tail-rows2": dict(rows=2, tail=64),
    "tail-reload-w-stages3": dict(reload_w=True, tail=64, stages=3),
    "wide-rows1-stages2": dict(wide=True, stages=2),
    "wide-rows4": dict(rows=4, wide=True),
    "wide-rows2-stages3": dict(rows=2, wide=True, stages=3),
    "regs-reload-w-const-n": dict(reload_w=True, const_n=True),
    "tail-const-n": dict(tail=64, const_n=True),
    "regs-rows2-const-n-stages3": dict(rows=2, stages=3, const_n=True),
    "wide-rows2-const-n": dict(rows=2, wide=True, stages=3, const_n=True),
    "tail-reload-x": dict(reload_w=True, tail=64, const_n=True, reload_x=True),
    "regs-rows2-reload-x-stages2": dict(rows=2, stages=2, reload_x=True),
    "tail-hold-x": dict(reload_w=True, tail=64, const_n=True, reload_x=True, hold_x=True),
    "regs-rows2-hold-x-stages2": dict(rows=2, stages=2, hold_x=True),
    "tail-reload-x-fma": dict(reload_w=True, tail=64, const_n=True, reload_x=True, fma=True),
    "regs-rows4-fma": dict(rows=4, fma=True),
}


def bwd_fields(name: str) -> dict:
    """The BwdConfig fields (but the column and partial-sum kernels') of path `name`."""
    fields = {"rows": 1, **_PATHS[name]}
    wide = fields.pop("wide", False)
    path = norms_mod.PATH_WIDE if wide else norms_mod.PATH_REGS
    block = 32 if wide else 64 if fields.get("tail") else 128
    return dict(block=block, path=path, num_warps=4, programs_per_sm=1, **fields)


@pytest.fixture
def forced_config(request):
    """The launch configurations (forward, backward) of the path named by the test's parameter."""
    fields = bwd_fields(request.param)
    column = ColumnConfig(block_m=8, block_n=64, num_warps=4, programs_per_sm=1)
    bwd = _bwd_config(**fields, column=column)
    const_n = fields.get("const_n", False)
    fwd = (
        norms_mod.FwdConfig(1, 32, False, 4, hints=True, const_n=const_n)
        if not bwd.single_block
        else norms_mod.FwdConfig(fields["rows"], 128, True, 4, const_n=const_n)
    )
    return request.param, fwd, bwd


@pytest.mark.parametrize("forced_config", [p for p in _PATHS if "fma" not in _PATHS[p]], indirect=True)
@pytest.mark.parametrize("case", ["llama", "none-offset", "no-weight"])
def test_rms_norm_backward_paths(forced_config, case):
    name, fwd, bwd = forced_config
    _check_rms(
        PATH_SHAPE, torch.bfloat16, f"rms_norm {name} {case}", fn=_rms_with(fwd, bwd), **RMS_CASES[case]
    )


@pytest.mark.parametrize("forced_config", [p for p in _PATHS if "hold_x" not in _PATHS[p]], indirect=True)
@pytest.mark.parametrize("case", ["weight-bias", "no-bias", "no-weight"])
def test_layer_norm_backward_paths(forced_config, case):
    name, fwd, bwd = forced_config
    _check_ln(
        PATH_SHAPE, torch.bfloat16, f"layer_norm {name} {case}", fn=_ln_with(fwd, bwd), **LN_CASES[case]
    )


@pytest.mark.parametrize(
    "bwd",
    [
        dict(block=32, path=norms_mod.PATH_WIDE),
        dict(block=64, tail=64, reload_w=True, reload_x=True),
    ],
    ids=["wide-column-kernel", "tail-reload-x"],
)
def test_rms_norm_in_place_backward(bwd):
    """dx written over dy (the in-place backward): the column kernel must read dy first, and a
    backward that reads a row's dy twice (reload_x) must read each block before writing its dx."""
    column = ColumnConfig(block_m=16, block_n=64, num_warps=4, programs_per_sm=1)
    bwd = {"path": norms_mod.PATH_REGS, **bwd}
    cfg = _bwd_config(1, num_warps=4, programs_per_sm=1, column=column, **bwd)
    x, w, dy = (
        _randn((41, 100), torch.bfloat16, 0),
        _randn((100,), torch.bfloat16, 1),
        _randn((41, 100), torch.bfloat16, 2),
    )
    _, rstd = norms_mod._rms_norm_fwd(x, w, 1e-6, 0.0, "llama")
    dx, dw = norms_mod.rms_norm_backward(dy, x, w, rstd, 0.0, "llama", cfg)
    shared = dy.clone()
    dw_in_place = norms_mod.rms_norm_backward_into(shared, x, w, rstd, 0.0, "llama", shared, cfg)
    assert torch.equal(shared, dx) and torch.equal(dw_in_place, dw)


def test_config_table_covers_the_sweep_widths():
    """Every row width of the tuned sweep (1024-16384) gets a table entry, not the fallback;
    a forward in chunks is a chunked (wide) one, the backward always keeps the row whole."""
    for op in ("rms_norm", "layer_norm"):
        for N in (1024, 2048, 3584, 4096, 5120, 8192, 11008, 16384):
            assert NORMS.entry(op, N) is not None
            fwd, bwd = norms_mod.fwd_config(NORMS, op, N), norms_mod.bwd_config(NORMS, op, N)
            assert (fwd.block >= N) == fwd.single_block and bwd.single_block and bwd.block + bwd.tail >= N
    # Rows that fill at most 3/4 of a 2048 or 4096 block take an entry of their own: compiled for the width.
    for op, N in (("rms_norm", 1536), ("layer_norm", 1536), ("layer_norm", 2304), ("layer_norm", 3072)):
        block = 1 << (N - 1).bit_length()
        assert NORMS.entry(op, N).cols == (block // 2 + 1, block * 3 // 4)
        assert norms_mod.fwd_config(NORMS, op, N).const_n and norms_mod.bwd_config(NORMS, op, N).const_n
    # LayerNorm above 8192 columns: both gradient sums in registers, x and dy read again after
    # the row sums (reload_x); at 16384 as two register blocks.
    for N, tail in ((11008, 0), (12288, 0), (13824, 8192), (16384, 8192)):
        cfg = norms_mod.bwd_config(NORMS, "layer_norm", N)
        assert (cfg.path, cfg.reload_x, cfg.tail) == (norms_mod.PATH_REGS, True, tail)
    # RMSNorm rows of at most 5/8 of the 8192 block take an entry of their own: two register
    # blocks that fit the row, read again after the row sum; 6144 columns keep the 3/4 entry.
    assert NORMS.entry("rms_norm", 5120).cols == (4097, 5120)
    assert NORMS.entry("rms_norm", 6144).cols == (5121, 6144)
    cfg = norms_mod.bwd_config(NORMS, "rms_norm", 5120)
    assert (cfg.block, cfg.tail, cfg.reload_x) == (4096, 1024, True)
    assert NORMS.entry("layer_norm", 5120).cols == (4097, 6144)


def test_prefetch_entries_and_where_it_runs():
    """The 16384 block's backward asks L2 for its next row (both norms, 8193-16384 columns);
    nothing else does. The PTX is never issued off CUDA devices (the interpreter cannot run
    it)."""
    on = {
        (op, N)
        for op in ("rms_norm", "layer_norm")
        for N in (1024, 2048, 4096, 5120, 8192, 11008, 12288, 13824, 16384)
        if norms_mod.bwd_config(NORMS, op, N).prefetch
    }
    assert on == {(op, N) for op in ("rms_norm", "layer_norm") for N in (11008, 12288, 13824, 16384)}
    x = torch.empty(2, 16384, device="cpu")
    assert not norms_mod.can_prefetch(norms_mod.bwd_config(NORMS, "layer_norm", 16384), x)


@pytest.mark.skipif(DEVICE != "cuda", reason="the prefetch is PTX: it runs on CUDA devices only")
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_prefetch_changes_no_result(op):
    """The prefetch is a hint: with and without it, every output is bit for bit the same, over
    enough rows that each program prefetches many times, at a row width that is not a multiple
    of 8 elements (16-byte unaligned rows)."""
    M, N = 3000, 12285
    x, dy = _randn((M, N), torch.bfloat16, 0), _randn((M, N), torch.bfloat16, 2)
    w = _randn((N,), torch.bfloat16, 1)
    base = _bwd_config(1, 16384, norms_mod.PATH_REGS, 16, 1, True, const_n=True, reload_x=True)
    results = []
    for cfg in (base, dataclasses.replace(base, prefetch=True)):
        if op == "rms_norm":
            _, rstd = norms_mod._rms_norm_fwd(x, w, 1e-6, 0.0, "llama")
            results.append(norms_mod.rms_norm_backward(dy, x, w, rstd, 0.0, "llama", cfg))
        else:
            _, mean, rstd = norms_mod._layer_norm_fwd(x, w, w, 1e-5)
            results.append(norms_mod.layer_norm_backward(dy, x, w, mean, rstd, torch.bfloat16, cfg))
    assert norms_mod.can_prefetch(dataclasses.replace(base, prefetch=True), x)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_layer_norm_large_mean_is_stable():
    """Two-pass variance: a row mean 1000x its spread does not cancel catastrophically."""
    x = _randn((8, 512), torch.float32, 0, shift=1000.0)
    _check_ln((8, 512), torch.float32, "layer_norm shifted", x=x)


@pytest.mark.parametrize(
    "shape", [(7,), (0, 5), (3, 0, 4), (4, 1)], ids=["1d", "no-rows", "no-rows-3d", "N=1"]
)
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_edge_shapes(op, shape):
    x = _randn(shape, torch.float32, 0).requires_grad_()
    w = _randn(shape[-1:], torch.float32, 1).requires_grad_()
    reference = rms_norm_reference if op == "rms_norm" else layer_norm_reference
    outputs = []
    for fn in (lambda *a: getattr(lmkernels, op)(*a, backend="triton"), reference):
        with poison_outputs():
            y = fn(x, w)
            outputs.append((y, *torch.autograd.grad(y, (x, w), torch.ones_like(y))))
    for got, expected in zip(*outputs):
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


# --- registration: opcheck, torch.compile, supports ---------------------------------------------


def _opcheck(op, args):
    # schema, fake tensor, autograd registration and AOT dispatch (static and dynamic shapes).
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("weighted", [True, False], ids=["weight", "no-weight"])
def test_rms_norm_opcheck(weighted):
    x = _randn((2, 3, 17), torch.float32, 0).requires_grad_()
    w = _randn((17,), torch.float32, 1).requires_grad_() if weighted else None
    _opcheck(torch.ops.lmkernels.rms_norm_fwd.default, (x, w, 1e-6, 1.0, "none"))
    y, rstd = torch.ops.lmkernels.rms_norm_fwd(x.detach(), w, 1e-6, 0.0, "llama")
    dy = _randn(y.shape, y.dtype, 2)
    w = w.detach() if w is not None else None
    _opcheck(torch.ops.lmkernels.rms_norm_bwd.default, (dy, x.detach(), w, rstd, 0.0, "llama"))


@pytest.mark.parametrize("params", ["weight-bias", "bias-only"])
def test_layer_norm_opcheck(params):
    x = _randn((2, 3, 17), torch.float32, 0).requires_grad_()
    w = _randn((17,), torch.float32, 1).requires_grad_() if params == "weight-bias" else None
    b = _randn((17,), torch.float32, 2).requires_grad_()
    _opcheck(torch.ops.lmkernels.layer_norm_fwd.default, (x, w, b, 1e-5))
    y, mean, rstd = torch.ops.lmkernels.layer_norm_fwd(x.detach(), w, b, 1e-5)
    dy = _randn(y.shape, y.dtype, 3)
    w = w.detach() if w is not None else None
    _opcheck(torch.ops.lmkernels.layer_norm_bwd.default, (dy, x.detach(), w, mean, rstd, torch.float32))
    _opcheck(torch.ops.lmkernels.layer_norm_bwd.default, (dy, x.detach(), w, mean, rstd, None))


def _compiled_matches_eager(fn, tensors):
    """fullgraph torch.compile (aot_eager: AOTAutograd traces forward and backward) runs the
    same kernels as eager: results and gradients are bitwise equal."""
    results = []
    for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        out = f(*leaves)
        out.backward(_randn(out.shape, out.dtype, 5))
        results.append((out.detach(), [t.grad for t in leaves]))
    (out, grads), (c_out, c_grads) = results
    assert torch.equal(out, c_out)
    for g, c in zip(grads, c_grads):
        assert torch.equal(g, c)


def test_rms_norm_fullgraph_compile():
    torch._dynamo.reset()

    def fn(x, w):
        return lmkernels.rms_norm(x * 2.0, w, casting_mode="gemma", offset=1.0, backend="triton") + 1.0

    _compiled_matches_eager(fn, [_randn((2, 5, 24), torch.float32, 0), _randn((24,), torch.float32, 1)])


def test_layer_norm_fullgraph_compile():
    torch._dynamo.reset()

    def fn(x, w, b):
        return lmkernels.layer_norm(x * 2.0, w, b, backend="triton") + 1.0

    shapes = [(2, 5, 24), (24,), (24,)]
    _compiled_matches_eager(fn, [_randn(s, torch.float32, i) for i, s in enumerate(shapes)])


def _forbid_custom_ops(monkeypatch, module, *names):
    """Replace the module's custom op objects by functions that fail the test when called."""

    def forbidden(*args):
        raise AssertionError("an eager call went through a torch.library custom op")

    for name in names:
        monkeypatch.setattr(module, name, forbidden)


def _lmkernels_ops(graphs) -> set[str]:
    return {str(n.target) for g in graphs for n in g.graph.nodes if str(n.target).startswith("lmkernels.")}


@pytest.mark.filterwarnings("ignore:Your compiler for AOTAutograd:UserWarning")
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_eager_calls_skip_the_custom_ops_compiled_calls_use_them(monkeypatch, op):
    """Eager calls run the launchers through an autograd.Function (the custom op's dispatch costs
    host time); the graphs torch.compile traces, forward and backward, call the custom ops."""
    module = norms_mod

    def fn(x, w):
        return getattr(lmkernels, op)(x, w, backend="triton")

    def leaves():
        return _randn((2, 5, 24), torch.float32, 0).requires_grad_(), _randn(
            (24,), torch.float32, 1
        ).requires_grad_()

    torch._dynamo.reset()
    graphs = AotEagerAndRecordGraphs()
    x, w = leaves()
    torch.compile(fn, backend=graphs, fullgraph=True)(x, w).sum().backward()
    assert _lmkernels_ops(graphs.fw_graphs) == {f"lmkernels.{op}_fwd.default"}
    assert _lmkernels_ops(graphs.bw_graphs) == {f"lmkernels.{op}_bwd.default"}
    compiled_grads = (x.grad, w.grad)

    _forbid_custom_ops(monkeypatch, module, f"{op}_fwd", f"{op}_bwd")
    x, w = leaves()
    y = fn(x, w)
    y.sum().backward()
    assert torch.equal(x.grad, compiled_grads[0]) and torch.equal(w.grad, compiled_grads[1])
    with torch.no_grad():  # no graph to record: the raw launcher alone
        assert torch.equal(fn(x, w), y)


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_double_backward_fails_clearly(op):
    """The backward kernels have no derivative: create_graph=True gives the exact first-order
    gradients, and differentiating them is refused with an error that names the backends that
    have a second order, not answered with terms silently cut from the graph."""
    x = _randn((3, 8), torch.float32, 0).requires_grad_()
    w = _randn((8,), torch.float32, 1).requires_grad_()
    y = getattr(lmkernels, op)(x, w, backend="triton")
    (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    (expected,) = torch.autograd.grad(getattr(lmkernels, op)(x, w, backend="triton").square().sum(), x)
    assert torch.equal(gx.detach(), expected)
    with pytest.raises(lmkernels.HigherOrderGradientError, match=rf"{op}: backend 'triton' .*\['eager'\]"):
        torch.autograd.grad(gx.sum(), (x, w))


def test_supports_reports_shape_limits():
    wide = torch.empty(2, 2**31, device="meta")
    many_rows = torch.empty(2**31, 1, device="meta")
    rms_supports = lmkernels.get_impl("rms_norm", "triton").supports
    ln_supports = lmkernels.get_impl("layer_norm", "triton").supports
    assert any("columns" in r for r in rms_supports(x=wide))
    assert any("rows" in r for r in ln_supports(x=many_rows))
    assert rms_supports(x=torch.empty(4, 8, device="meta")) == []


# --- GPU: more than 2^31 elements ---------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tensors of > 2^31 elements)")
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("N", [16384, 32768], ids=["fused", "wide"])
def test_more_than_2_31_elements(op, N):
    """Rows past element 2^31 are only right with 64-bit offsets: check the last rows."""
    M = 2**31 // N + 1
    assert M * N > 2**31
    torch.manual_seed(0)
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = (torch.rand(N, device="cuda") + 0.5).to(torch.bfloat16).requires_grad_()
    fn = getattr(lmkernels, op)
    ref = rms_norm_reference if op == "rms_norm" else layer_norm_reference
    y = fn(x, w, backend="triton")
    dy = torch.randn_like(y)
    y.backward(dy)
    rows = torch.tensor([0, 1, M // 2, M - 2, M - 1], device="cuda")
    xs = x.detach()[rows].requires_grad_()
    ws = w.detach().clone().requires_grad_()
    y_ref = ref(xs, ws)
    y_ref.backward(dy[rows])
    bound = DEFAULT_TOLERANCES[torch.bfloat16].bound
    assert _rel_err(y.detach()[rows], y_ref.double()) < bound
    assert _rel_err(x.grad[rows], xs.grad.double()) < bound
    # dweight sums over every row: compare with an fp32 chunked reference.
    dw = torch.zeros(N, device="cuda", dtype=torch.float32)
    for start in range(0, M, 8192):
        xc = x.detach()[start : start + 8192].float()
        if op == "rms_norm":
            x_hat = (xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16).float()
        else:
            mean = xc.mean(-1, keepdim=True)
            x_hat = (xc - mean) * torch.rsqrt((xc - mean).pow(2).mean(-1, keepdim=True) + 1e-5)
        dw += (dy[start : start + 8192].float() * x_hat).sum(0)
    assert _rel_err(w.grad, dw.double()) < bound


class _OnCuda:
    """What pipeline_stages reads of a tensor (its device and element size), without a GPU."""

    def __init__(self, element_size):
        self.device = torch.device("cuda", 0)
        self.dtype = {2: torch.bfloat16, 4: torch.float32}[element_size]
        self._element_size = element_size

    def element_size(self):
        return self._element_size


@pytest.mark.parametrize(
    ("limit", "bf16_stages", "fp32_stages", "reload_x_stages"),
    [(232448, 3, 2, 2), (167936, 2, 1, 2), (101376, 1, 1, 1)],  # H100/H200, A100, consumer parts
    ids=["227KiB", "164KiB", "99KiB"],
)
def test_pipeline_stages_fit_the_shared_memory(monkeypatch, limit, bf16_stages, fp32_stages, reload_x_stages):
    """The table's stages were tuned on an H200 in bf16: each stage of LayerNorm's 16384-column
    backward buffers x, dy and the reloaded weight (96 KiB in bf16), so fp32 inputs or a GPU
    with less shared memory must run fewer stages or the kernel would fail to launch. With
    reload_x the second reads of x and dy get buffers too (160 KiB a stage: three stages failed
    to launch on an H200), unless hold_x keeps bf16 rows in registers instead (fp32 ones are
    still read again)."""
    monkeypatch.setattr(norms_mod, "_max_shared_bytes", lambda index: limit)
    norms_mod._fit_stages.cache_clear()
    cfg = _bwd_config(1, 16384, norms_mod.PATH_REGS, 16, 2, True, stages=3)
    assert norms_mod.pipeline_stages(cfg, _OnCuda(2), _OnCuda(2)) == bf16_stages
    assert norms_mod.pipeline_stages(cfg, _OnCuda(4), _OnCuda(4)) == fp32_stages
    reload_x = dataclasses.replace(cfg, reload_x=True)
    assert norms_mod.pipeline_stages(reload_x, _OnCuda(2), _OnCuda(2)) == reload_x_stages
    hold_x = dataclasses.replace(reload_x, hold_x=True)
    assert norms_mod.pipeline_stages(hold_x, _OnCuda(2), _OnCuda(2)) == bf16_stages
    assert norms_mod.pipeline_stages(hold_x, _OnCuda(4), _OnCuda(4)) == 1  # 320 KiB a stage
    x = torch.zeros(2, 16384)  # the CPU interpreter has no such limit
    assert norms_mod.pipeline_stages(cfg, x, x[0]) == 3
    # A loop that runs once per program has nothing to overlap.
    assert norms_mod.pipeline_stages(cfg, _OnCuda(2), _OnCuda(2), iterations=1) == 1
    norms_mod._fit_stages.cache_clear()  # answers for the limit patched in


@pytest.mark.skipif(not torch.cuda.is_available(), reason="shared-memory limits exist only on a GPU")
@pytest.mark.parametrize("shape", [(64, 16384), (64, 8192), (64, 5120)])
def test_fp32_rows_launch_with_the_table_stages(shape):
    """fp32 doubles the pipeline buffers of the bf16-tuned table (LayerNorm at 16384 columns
    would need 384 KiB of shared memory at 3 stages)."""
    _check_ln(shape, torch.float32, f"layer_norm fp32 {shape}")
    _check_rms(shape, torch.float32, f"rms_norm fp32 {shape}")
