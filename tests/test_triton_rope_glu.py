"""The Triton RoPE, SwiGLU and GeGLU kernels against fp64 references, plus opcheck and compile.

Policy (DESIGN.md): err = relative RMS error against an fp64 computation on the same inputs;
pass when err(triton) <= factor * err(eager in the same dtype) + floor and err(triton) <= bound.
Runs on the CPU through the Triton interpreter (TRITON_INTERPRET=1), on CUDA when a GPU is used.
"""

import os

import torch

# Without a GPU the kernels run on the Triton interpreter, which must be on before triton (and
# lmkernels) is imported. Same rule as conftest.py: on a CUDA machine the real kernels run
# (unless TRITON_INTERPRET=1 is set explicitly), so the GPU-only test below is not skipped.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402
import zlib  # noqa: E402

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch._dynamo.testing import AotEagerAndRecordGraphs  # noqa: E402

pytest.importorskip("triton", reason="the Triton backend needs triton")
from lmkernels.backends.triton import triton_unavailable_reason  # noqa: E402

if triton_unavailable_reason() is not None:  # e.g. the CPU interpreter of triton 3.6
    pytest.skip(triton_unavailable_reason(), allow_module_level=True)

import lmkernels  # noqa: E402
from lmkernels.backends.triton import glu as glu_mod  # noqa: E402
from lmkernels.backends.triton import rope as rope_mod  # noqa: E402
from lmkernels.backends.triton.configs import hopper  # noqa: E402
from lmkernels.backends.triton.configs.records import RopePosConfig, RopeTable, RopeTileConfig  # noqa: E402
from lmkernels.ops.glu import geglu_reference, swiglu_reference  # noqa: E402
from lmkernels.ops.rope import rope_reference, rope_tables  # noqa: E402
from lmkernels.registry.core import DEFAULT_TOLERANCES, BackendNotSupportedError  # noqa: E402
from lmkernels.utils import poison_outputs  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
DTYPES = [torch.float32, torch.bfloat16]
# numpy (the interpreter) warns when exp overflows to inf in sigmoid(x) = 1 / (1 + exp(-x)) for
# very negative x; the result, 0, is the right limit (and the GPU does the same silently).
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_close(name: str, impl: torch.Tensor, eager: torch.Tensor, ref64: torch.Tensor) -> None:
    tol = DEFAULT_TOLERANCES[impl.dtype]
    assert impl.shape == ref64.shape, name
    assert torch.isfinite(impl).all(), f"{name}: NaN/Inf (or an element the kernel never wrote)"
    err_impl, err_eager = rel_rms(impl, ref64), rel_rms(eager, ref64)
    # Guards the fp64 reference of this file: eager must agree with it.
    assert err_eager <= tol.bound, f"{name}: eager vs fp64 reference {err_eager:.2e}"
    limit = min(tol.factor * err_eager + tol.floor, tol.bound)
    assert err_impl <= limit, f"{name}: err {err_impl:.2e} > {limit:.2e} (eager {err_eager:.2e})"


# --- RoPE ----------------------------------------------------------------------------------------


def rope64(q, k, cos, sin, position_ids=None, layout="neox", rotary_dim=None):
    """fp64 RoPE written independently of the reference: out[j] = x[j] cos[j] + sign[j] x[p(j)] sin[j]."""
    R = q.shape[-1] if rotary_dim is None else rotary_dim
    if position_ids is not None:
        cos, sin = cos[position_ids], sin[position_ids]
    cos, sin = cos.double(), sin.double()
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
    j = torch.arange(R, device=q.device)
    if layout == "neox":
        partner, first = (j + R // 2) % R, j < R // 2
    else:
        partner, first = j ^ 1, j % 2 == 0
    sign = torch.where(first, -1.0, 1.0).double()

    def apply(x):
        x = x.double()
        xr = x[..., :R]
        return torch.cat((xr * cos + xr[..., partner] * sign * sin, x[..., R:]), dim=-1)

    return apply(q), apply(k)


def rope_inputs(
    shape,
    dtype,
    layout="neox",
    partial=False,
    positions=None,
    transposed=False,
    tables="rope",
    cos_dtype=None,
):
    B, Hq, Hkv, T, D = shape
    g = torch.Generator().manual_seed(
        zlib.crc32(repr((shape, layout, partial, positions, transposed, tables)).encode())
    )
    R = 2 * math.ceil(D / 4) if partial else D

    def x(H):
        if transposed:  # (B, T, H, D) projection viewed as (B, H, T, D), as transformers does
            return torch.randn(B, T, H, D, generator=g).to(DEVICE, dtype).transpose(1, 2)
        return torch.randn(B, H, T, D, generator=g).to(DEVICE, dtype)

    q, k = x(Hq), x(Hkv)
    n_rows = {"ids": T + 5, "ids32": T + 5, "batched": B * T}.get(positions, T)
    if tables == "rope":
        cos, sin = rope_tables(torch.arange(n_rows) * 3 + 1, R, layout)
    else:  # arbitrary tables: the two dims of a pair see different values (exercises the transpose)
        cos, sin = torch.rand(n_rows, R, generator=g) * 2 - 1, torch.rand(n_rows, R, generator=g) * 2 - 1
    if positions == "batched":
        cos, sin = cos.view(B, T, R), sin.view(B, T, R)
    cos, sin = cos.to(DEVICE, cos_dtype or dtype), sin.to(DEVICE, cos_dtype or dtype)
    out = {"q": q, "k": k, "cos": cos, "sin": sin, "layout": layout, "rotary_dim": R if partial else None}
    if positions in ("ids", "ids32"):
        ids = torch.randint(0, n_rows, (B, T), generator=g)
        out["position_ids"] = ids.to(DEVICE, torch.int32 if positions == "ids32" else torch.int64)
    return out


ROPE_SHAPES = {"gqa": (2, 4, 2, 7, 16), "mha": (1, 3, 3, 7, 24)}
ROPE_CASES = {
    "neox": {},
    "interleaved": {"layout": "interleaved"},
    "partial": {"partial": True},
    "partial-interleaved": {"partial": True, "layout": "interleaved"},
    "ids": {"positions": "ids"},
    "ids-interleaved-partial": {"positions": "ids", "layout": "interleaved", "partial": True},
    "batched": {"positions": "batched"},
    "batched-interleaved": {"positions": "batched", "layout": "interleaved"},
    "transposed": {"transposed": True},
    "transposed-interleaved-ids": {"transposed": True, "layout": "interleaved", "positions": "ids"},
    "random-tables": {"tables": "random"},
    "random-tables-interleaved-partial": {"tables": "random", "layout": "interleaved", "partial": True},
    "fp32-tables": {"cos_dtype": torch.float32},
    "int32-ids-interleaved": {"positions": "ids32", "layout": "interleaved"},
}


def rope_with(cfg):
    """rope through the launcher with the launch configuration cfg, forward and backward (the
    inverse rotation): a RopeTileConfig runs the tile kernel whatever the layout."""

    class Forced(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, cos, sin, position_ids, interleaved, rotary_dim, q_bthd, k_bthd):
            ctx.args = (cos, sin, position_ids, interleaved, rotary_dim)
            ctx.layouts = (q_bthd, k_bthd)
            return rope_mod.rope_rotate_with(
                q, k, cos, sin, position_ids, interleaved, rotary_dim, False, q_bthd, k_bthd, cfg
            )

        @staticmethod
        def backward(ctx, dq, dk):
            dq, dk = rope_mod.rope_rotate_with(dq, dk, *ctx.args, True, *ctx.layouts, cfg)
            return dq, dk, None, None, None, None, None, None, None

    def fn(q, k, cos, sin, position_ids=None, layout="neox", rotary_dim=None):
        R = q.shape[-1] if rotary_dim is None else rotary_dim
        flags = (layout == "interleaved", R, rope_mod.is_bthd(q), rope_mod.is_bthd(k))
        return Forced.apply(q, k, cos, sin, position_ids, *flags)

    return fn


def run_rope_check(shape, dtype, case, fn=None):
    """fn: the Triton function checked (default: rope's triton backend)."""
    inputs = rope_inputs(shape, dtype, **case)
    q, k = inputs["q"], inputs["k"]
    q_before, k_before = q.clone(), k.clone()
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(t.shape, generator=g).to(DEVICE, dtype) for t in (q, k)]

    def run(fn, cast=None):
        leaves = [(t if cast is None else t.to(cast)).detach().requires_grad_() for t in (q, k)]
        outs = fn(**{**inputs, "q": leaves[0], "k": leaves[1]})
        torch.autograd.backward(outs, [gr if cast is None else gr.to(cast) for gr in grads])
        return [o.detach() for o in outs], [t.grad for t in leaves]

    with poison_outputs():
        outs, dx = run(fn or (lambda **kw: lmkernels.rope(**kw, backend="triton")))
    eager_outs, eager_dx = run(rope_reference)
    ref_outs, ref_dx = run(rope64, cast=torch.float64)
    for name, a, b, c in zip(
        ("q_out", "k_out", "dq", "dk"), outs + dx, eager_outs + eager_dx, ref_outs + ref_dx
    ):
        check_close(name, a, b, c)
        assert a.dtype == dtype, name
    # Outputs in the inputs' layout: a (B, T, H, D) transpose stays one, anything else contiguous.
    for o, t in zip(outs, (q, k)):
        assert o.stride() == t.stride() if rope_mod.is_bthd(t) else o.is_contiguous()
    # Fresh outputs; the caller's tensors are untouched.
    assert all(o.data_ptr() not in (q.data_ptr(), k.data_ptr()) for o in outs)
    assert torch.equal(q, q_before) and torch.equal(k, k_before)


# Every case in fp32; in bf16 (same code path plus the casts) a subset, to keep the
# interpreter run short.
BF16_ROPE_CASES = ("neox", "partial-interleaved", "ids", "transposed-interleaved-ids", "batched")
ROPE_PARAMS = [
    pytest.param(ROPE_CASES[case], shape, dtype, id=f"{case}-{shape_id}-{str(dtype)[6:]}")
    for dtype in DTYPES
    for case in ROPE_CASES
    for shape_id, shape in ROPE_SHAPES.items()
    if dtype == torch.float32 or case in BF16_ROPE_CASES
]


@pytest.mark.parametrize("case,shape,dtype", ROPE_PARAMS)
def test_rope(case, shape, dtype):
    run_rope_check(shape, dtype, case)


@pytest.mark.parametrize(
    "shape,tile,min_programs",
    [("gqa", 16, 1), ("gqa", 16, 28), ("gqa", 32, 1), ("mha", 64, 1)],
    ids=[
        "one-head-groups-one-program-per-position", "two-splits", "grouped-heads-one-program",
        "q-and-k-rows-in-one-group",
    ],
)  # fmt: skip
@pytest.mark.parametrize("case", ["neox", "partial-interleaved"])
def test_rope_launch_configs(shape, tile, min_programs, case):
    """The head-group loop: a program looping over several groups, groups split over programs,
    and (3 q + 3 k heads in groups of 2) a group that holds a q row and a k row."""
    B, Hq, Hkv, T, D = ROPE_SHAPES[shape]
    R = 2 * math.ceil(D / 4) if ROPE_CASES[case].get("partial") else D
    cfg = RopePosConfig(tile_elements=tile, num_warps=4, min_programs=min_programs)
    is_tile, block_h, splits, _ = rope_mod._plan(cfg, B, T, Hq, Hkv, R, D)
    n_groups = math.ceil((Hq + Hkv) / block_h)
    assert not is_tile and n_groups > splits  # some program handles several groups
    if shape == "mha":
        assert Hq % block_h  # the group of the last q head holds a k head too
    run_rope_check(ROPE_SHAPES[shape], torch.float32, ROPE_CASES[case], fn=rope_with(cfg))


# The tile kernel (positions x head dims per head), passed to the launcher whatever the layout.
# T = 7 is no multiple of BLOCK_T = 64 // 16 = 4, so the last tile of each sequence is partly
# masked.
def _tile(tile_elements, num_warps, min_programs, head_stages):
    return RopeTileConfig(
        tile_elements=tile_elements, num_warps=num_warps, min_programs=min_programs, head_stages=head_stages
    )


TILE_CONFIGS = {
    "loop-heads-tables-once": _tile(64, 1, 1, 1),  # every program loops over all 6 heads
    "head-per-program": _tile(64, 1, 2**30, 1),  # splits = Hq + Hkv
    "two-splits": _tile(32, 1, 8, 1),  # BLOCK_T = 2, 8 tiles, 3 heads each
    "loop-heads-pipelined": _tile(64, 1, 1, 2),  # the head loop software-pipelined (GPU)
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_tile_kernel(case):
    """Every case (GQA, partial rotary, interleaved, position ids, batched tables, (B, T, H, D)
    transposes, ...) through the tile kernel, several positions and heads per program."""
    fn = rope_with(TILE_CONFIGS["loop-heads-tables-once"])
    run_rope_check(ROPE_SHAPES["gqa"], torch.float32, ROPE_CASES[case], fn=fn)


@pytest.mark.parametrize("case", ["neox", "interleaved"])
def test_rope_tile_kernel_head_dim_off_pow2(case):
    """A head dim whose rotary half (12) is no power of two: the tile kernel's masked lanes."""
    fn = rope_with(TILE_CONFIGS["loop-heads-tables-once"])
    run_rope_check(ROPE_SHAPES["mha"], torch.float32, ROPE_CASES[case], fn=fn)


@pytest.mark.parametrize("config", list(TILE_CONFIGS)[1:])
@pytest.mark.parametrize("case", ["neox", "partial-interleaved", "ids-interleaved-partial"])
def test_rope_tile_kernel_configs(config, case):
    B, Hq, Hkv, T, D = ROPE_SHAPES["gqa"]
    is_tile, block_t, n_t_blocks, splits, *_ = rope_mod._plan(TILE_CONFIGS[config], B, T, Hq, Hkv, D, D)
    assert is_tile and T % block_t and n_t_blocks == math.ceil(T / block_t)
    run_rope_check(ROPE_SHAPES["gqa"], torch.float32, ROPE_CASES[case], fn=rope_with(TILE_CONFIGS[config]))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_rope_tile_kernel_strided_rows(dtype):
    """q and k that are column slices of wider tensors (rows along T not contiguous) and a
    non-contiguous head stride, through the tile kernel, forward and backward."""
    tile_fn = rope_with(TILE_CONFIGS["two-splits"])
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 7, 24, generator=g).to(DEVICE, dtype)[..., 4:20]  # row stride 24
    k = torch.randn(2, 4, 7, 16, generator=g).to(DEVICE, dtype)[:, ::2]  # head stride 2 * T * D
    cos, sin = (t.to(DEVICE, dtype) for t in rope_tables(torch.arange(7) * 3 + 1, 8, "neox"))
    grads = [torch.randn(t.shape, generator=g).to(DEVICE, dtype) for t in (q, k)]

    def run(fn, cast=None):
        leaves = [(t if cast is None else t.to(cast)).detach().requires_grad_() for t in (q, k)]
        outs = fn(leaves[0], leaves[1], cos, sin, rotary_dim=8)
        torch.autograd.backward(outs, [gr if cast is None else gr.to(cast) for gr in grads])
        return [o.detach() for o in outs] + [t.grad for t in leaves]

    got = run(tile_fn)
    expected = zip(run(rope_reference), run(rope64, torch.float64))
    for name, x, (e, r) in zip(("q_out", "k_out", "dq", "dk"), got, expected):
        check_close(name, x, e, r)


def test_rope_kernel_choice():
    """A table's tile entries take the tile kernel where each head's positions are contiguous
    rows and T fills a tile; (B, T, H, D) memory, short sequences and other rotary widths the
    position kernel."""
    tile = RopeTileConfig(half=32, tile_elements=2048, num_warps=4, min_programs=2048, why="test")
    table = RopeTable(position=hopper.ROPE.position, tile=(tile,))
    assert rope_mod.rope_config(table, 8192, 64, 64, True) is tile
    assert rope_mod._table_plan(table, 2, 8192, 16, 16, 64, 64, True) == (True, 32, 256, 4, 4, 1)
    position = table.position_config(32, False)
    assert rope_mod.rope_config(table, 8192, 64, 64, False) is position  # (B, T, H, D) memory
    assert rope_mod.rope_config(table, 16, 64, 64, True) is position  # T < BLOCK_T = 32
    assert rope_mod.rope_config(table, 8192, 128, 128, True) is table.position_config(64, False)  # no entry
    assert rope_mod.rope_config(table, 8192, 48, 48, True) is not tile  # the key is the exact half, 24
    assert rope_mod.rope_config(table, 8192, 64, 128, True) is table.position_config(32, True)  # partial


@pytest.mark.parametrize("layout", ["neox", "interleaved"])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 4), (3, 2, 1, 2, 6)], ids=["rotary_dim2-T1", "B3-D6"])
def test_rope_edge_shapes(shape, layout):
    """Sizes of 1 (which Triton compiles as constants) and a single rotation pair per head."""
    run_rope_check(shape, torch.float32, {"layout": layout, "partial": shape[-1] == 4})


def test_rope_rejects_cos_grad():
    inputs = rope_inputs(ROPE_SHAPES["gqa"], torch.float32)
    inputs["cos"].requires_grad_()
    with pytest.raises(BackendNotSupportedError, match="cos/sin"):
        lmkernels.rope(**inputs, backend="triton")


def test_rope_opcheck():
    for case in ({}, {"positions": "ids", "transposed": True, "layout": "interleaved", "partial": True}):
        i = rope_inputs(ROPE_SHAPES["gqa"], torch.float32, **case)
        R = i["rotary_dim"] or i["q"].shape[-1]
        args = (
            i["q"].requires_grad_(), i["k"].requires_grad_(), i["cos"], i["sin"], i.get("position_ids"),
            i["layout"] == "interleaved", R, False, rope_mod.is_bthd(i["q"]), rope_mod.is_bthd(i["k"]),
        )  # fmt: skip
        torch.library.opcheck(torch.ops.lmkernels.rope_rotate.default, args)


@pytest.mark.parametrize("transposed", [False, True], ids=["bhtd", "bthd"])
def test_rope_outputs_and_grads_keep_the_input_layout(transposed):
    """q/k that are transposes of (B, T, H, D) projections (transformers' attention) get outputs
    and gradients in that layout: the projection's view then takes its gradient without a copy.
    Values against the reference."""
    inputs = rope_inputs(ROPE_SHAPES["gqa"], torch.float32, transposed=transposed)
    q, k = inputs["q"].detach().requires_grad_(), inputs["k"].detach().requires_grad_()
    q_out, k_out = lmkernels.rope(q, k, inputs["cos"], inputs["sin"], backend="triton")
    grads = torch.randn_like(q_out), torch.randn_like(k_out)  # contiguous, as sdpa's backward gives
    dq, dk = torch.autograd.grad((q_out, k_out), (q, k), grads)
    for out, grad, inp in ((q_out, dq, q), (k_out, dk, k)):
        assert rope_mod.is_bthd(out) == transposed and rope_mod.is_bthd(grad) == transposed
        assert out.stride() == inp.stride() and grad.stride() == inp.stride()
    ref_q, ref_k = rope_reference(q, k, inputs["cos"], inputs["sin"])
    ref_dq, ref_dk = torch.autograd.grad((ref_q, ref_k), (q, k), grads)
    for got, want in ((q_out, ref_q), (k_out, ref_k), (dq, ref_dq), (dk, ref_dk)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# --- SwiGLU / GeGLU ------------------------------------------------------------------------------

GLU_OPS = {
    "swiglu": (lmkernels.swiglu, swiglu_reference, lambda a: F.silu(a), {}),
    "geglu-tanh": (lmkernels.geglu, geglu_reference, lambda a: F.gelu(a, approximate="tanh"), {}),
    "geglu-none": (lmkernels.geglu, geglu_reference, lambda a: F.gelu(a), {"approximate": "none"}),
}
GLU_SHAPES = {"37x96": (37, 96), "3x1001": (3, 1001), "3d": (2, 5, 33)}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", GLU_SHAPES.values(), ids=GLU_SHAPES.keys())
@pytest.mark.parametrize("op", GLU_OPS, ids=GLU_OPS.keys())
def test_glu(op, shape, dtype):
    fn, reference, act64, kwargs = GLU_OPS[op]
    g = torch.Generator().manual_seed(len(shape) * 1000 + shape[-1])
    # Scale 3 reaches the saturated tails of sigmoid / erf as well as the middle.
    gate = (torch.randn(shape, generator=g) * 3).to(DEVICE, dtype)
    up = torch.randn(shape, generator=g).to(DEVICE, dtype)
    grad = torch.randn(shape, generator=g).to(DEVICE, dtype)
    gate_before, up_before = gate.clone(), up.clone()

    def run(f, cast=None):
        a, b = ((t if cast is None else t.to(cast)).detach().requires_grad_() for t in (gate, up))
        out = f(a, b)
        out.backward(grad if cast is None else grad.to(cast))
        return out.detach(), a.grad, b.grad

    with poison_outputs():
        got = run(lambda a, b: fn(a, b, backend="triton", **kwargs))
    eager = run(lambda a, b: reference(a, b, **kwargs))
    ref = run(lambda a, b: act64(a) * b, cast=torch.float64)
    for name, a, b, c in zip(("out", "d_gate", "d_up"), got, eager, ref):
        check_close(name, a, b, c)
        assert a.dtype == dtype
    assert torch.equal(gate, gate_before) and torch.equal(up, up_before)


def test_glu_saves_only_inputs():
    """The backward recomputes the activation: the graph saves gate and up and nothing else."""
    gate = torch.randn(37, 96, device=DEVICE, requires_grad=True)
    up = torch.randn(37, 96, device=DEVICE, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = lmkernels.swiglu(gate, up, backend="triton")
    assert sorted(t.data_ptr() for t in saved) == sorted((gate.data_ptr(), up.data_ptr()))
    out.backward(torch.ones_like(out))
    assert gate.grad.data_ptr() not in (gate.data_ptr(), up.data_ptr())


def test_glu_noncontiguous_and_expanded_grad():
    gate = torch.randn(96, 37, device=DEVICE).t().requires_grad_()  # strided input
    up = torch.randn(37, 96, device=DEVICE, requires_grad=True)
    out = lmkernels.geglu(gate, up, backend="triton")
    out.sum().backward()  # the upstream gradient is an expanded (stride 0) tensor
    gate2, up2 = gate.detach().clone().requires_grad_(), up.detach().clone().requires_grad_()
    ref = geglu_reference(gate2, up2)
    ref.sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gate.grad, gate2.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(up.grad, up2.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu"])
def test_glu_opcheck(activation):
    gate = torch.randn(5, 33, device=DEVICE, requires_grad=True)
    up = torch.randn(5, 33, device=DEVICE, requires_grad=True)
    torch.library.opcheck(torch.ops.lmkernels.glu_forward.default, (gate, up, activation))
    grad = torch.randn(5, 33, device=DEVICE)
    args = (grad, gate.detach(), up.detach(), activation)
    torch.library.opcheck(torch.ops.lmkernels.glu_backward.default, args)


# --- torch.compile ---------------------------------------------------------------------------------


def test_compile_fullgraph_matches_eager():
    rope_in = rope_inputs(ROPE_SHAPES["gqa"], torch.float32, positions="ids", transposed=True)
    gate = torch.randn(7, 40, device=DEVICE)
    up = torch.randn(7, 40, device=DEVICE)

    def f(q, k, cos, sin, position_ids, gate, up):
        q_out, k_out = lmkernels.rope(q, k, cos, sin, position_ids, backend="triton")
        h = lmkernels.swiglu(gate, up, backend="triton")
        return (q_out * 2).sum() + k_out.square().sum() + (h * h).sum()

    def run(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (rope_in["q"], rope_in["k"], gate, up)]
        q, k, a, b = leaves
        loss = fn(q, k, rope_in["cos"], rope_in["sin"], rope_in["position_ids"], a, b)
        loss.backward()
        return [loss.detach()] + [t.grad for t in leaves]

    torch._dynamo.reset()
    compiled = run(torch.compile(f, fullgraph=True, backend="aot_eager"))
    eager = run(f)
    for c, e in zip(compiled, eager):
        torch.testing.assert_close(c, e, rtol=1e-6, atol=1e-6)


# --- eager path around the custom ops ---------------------------------------------------------------


def _forbid_custom_ops(monkeypatch, module, *names):
    """Replace the module's custom op objects by functions that fail the test when called."""

    def forbidden(*args):
        raise AssertionError("an eager call went through a torch.library custom op")

    for name in names:
        monkeypatch.setattr(module, name, forbidden)


def _lmkernels_ops(graphs) -> set[str]:
    return {str(n.target) for g in graphs for n in g.graph.nodes if str(n.target).startswith("lmkernels.")}


def _rope_case():
    i = rope_inputs(ROPE_SHAPES["gqa"], torch.float32, positions="ids", layout="interleaved")

    def fn(q, k):
        q_out, k_out = lmkernels.rope(
            q, k, i["cos"], i["sin"], i["position_ids"], "interleaved", backend="triton"
        )
        return q_out * 2 + 1, k_out

    return fn, (i["q"], i["k"])


def _glu_case():
    g = torch.Generator().manual_seed(3)
    gate, up = (torch.randn(7, 40, generator=g).to(DEVICE) for _ in range(2))
    return (lambda a, b: (lmkernels.swiglu(a, b, backend="triton") * 2,)), (gate, up)


EAGER_CASES = {
    "rope": (_rope_case, rope_mod, {"rope_rotate"}, {"rope_rotate"}),
    "swiglu": (_glu_case, glu_mod, {"glu_forward"}, {"glu_backward"}),
}


@pytest.mark.filterwarnings("ignore:Your compiler for AOTAutograd:UserWarning")
@pytest.mark.parametrize("case", EAGER_CASES)
def test_eager_calls_skip_the_custom_ops_compiled_calls_use_them(monkeypatch, case):
    """Eager calls run the launchers through an autograd.Function (the custom op's dispatch costs
    host time); the graphs torch.compile traces, forward and backward, call the custom ops."""
    make, module, fw_ops, bw_ops = EAGER_CASES[case]
    fn, tensors = make()

    def run(f):
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        outs = f(*leaves)
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        return [o.detach() for o in outs] + [t.grad for t in leaves]

    torch._dynamo.reset()
    graphs = AotEagerAndRecordGraphs()
    compiled = run(torch.compile(fn, backend=graphs, fullgraph=True))
    assert _lmkernels_ops(graphs.fw_graphs) == {f"lmkernels.{op}.default" for op in fw_ops}
    assert _lmkernels_ops(graphs.bw_graphs) == {f"lmkernels.{op}.default" for op in bw_ops}

    _forbid_custom_ops(monkeypatch, module, *fw_ops, *bw_ops)
    eager = run(fn)
    for c, e in zip(compiled, eager):
        assert torch.equal(c, e)
    with torch.no_grad():  # no graph to record: the raw launcher alone
        for c, e in zip(fn(*tensors), compiled):
            assert torch.equal(c, e)


def test_rope_double_backward():
    """The backward of the rotation is the inverse rotation, itself differentiable: second-order
    gradients (create_graph=True) match the eager reference's."""
    inputs = rope_inputs(ROPE_SHAPES["gqa"], torch.float32, tables="random", layout="interleaved")
    g = torch.Generator().manual_seed(5)
    weights = [torch.randn(t.shape, generator=g).to(DEVICE) for t in (inputs["q"], inputs["k"])]

    def second_order(fn):
        q, k = (inputs[n].detach().clone().requires_grad_() for n in ("q", "k"))
        w = [t.clone().requires_grad_() for t in weights]
        q_out, k_out = fn(**{**inputs, "q": q, "k": k})
        loss = (q_out * w[0]).sum() + (k_out * w[1]).sum()
        dq, dk = torch.autograd.grad(loss, (q, k), create_graph=True)
        ((dq * dq).sum() + (dk * dk).sum()).backward()
        return w[0].grad, w[1].grad

    got = second_order(lambda **kw: lmkernels.rope(**kw, backend="triton"))
    expected = second_order(rope_reference)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_glu_double_backward_fails_clearly():
    """The backward kernel has no derivative: differentiating the gradients a create_graph=True
    backward gives is refused clearly, not answered with terms silently cut from the graph."""
    gate = torch.randn(5, 33, device=DEVICE, requires_grad=True)
    up = torch.randn(5, 33, device=DEVICE, requires_grad=True)
    (d_gate,) = torch.autograd.grad(
        lmkernels.swiglu(gate, up, backend="triton").sum(), gate, create_graph=True
    )
    with pytest.raises(lmkernels.HigherOrderGradientError, match="swiglu: backend 'triton'"):
        torch.autograd.grad(d_gate.sum(), (gate, up))


# --- > 2^31 elements (GPU) ------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or INTERPRET,
    reason="needs a CUDA GPU (not the interpreter) and ~30 GB of GPU memory",
)
def test_swiglu_64bit_offsets():
    rows, cols = 65537, 32768  # 2^31 + 32768 elements: the last row lies past 2^31
    g = torch.Generator(device="cuda").manual_seed(0)
    gate = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    up = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    grad = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, generator=g)
    out = lmkernels.swiglu(gate, up, backend="triton")
    out.backward(grad)
    for r in (0, 1, 32767, 65535, 65536):
        a, b = (t.detach()[r].clone().requires_grad_() for t in (gate, up))
        eager = swiglu_reference(a, b)
        eager.backward(grad[r])
        a64, b64 = (t.detach()[r].double().requires_grad_() for t in (gate, up))
        ref = F.silu(a64) * b64
        ref.backward(grad[r].double())
        check_close(f"out[{r}]", out[r].detach(), eager.detach(), ref.detach())
        check_close(f"d_gate[{r}]", gate.grad[r], a.grad, a64.grad)
        check_close(f"d_up[{r}]", up.grad[r], b.grad, b64.grad)


def test_rope_refuses_an_amd_gpu_whose_compiler_fails_on_its_kernel(monkeypatch):
    """On a ROCm build of torch with a Triton before 3.8 (whose AMD backend cannot compile the RoPE
    kernel: tests/test_compile_targets.py), the Triton RoPE is unavailable, with the reason."""
    import triton

    from lmkernels.backends.triton import rope as rope_mod

    monkeypatch.setattr(rope_mod, "triton_unavailable_reason", lambda: None)
    monkeypatch.setattr(torch.version, "hip", "7.1.0")
    monkeypatch.setattr(triton, "__version__", "3.7.1")
    assert rope_mod._available() == rope_mod.amd_compile_failure("3.7.1") is not None
    assert "needs >= 3.8" in rope_mod._available()
    monkeypatch.setattr(triton, "__version__", "3.8.0")
    assert rope_mod._available() is None
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(triton, "__version__", "3.7.1")
    assert rope_mod._available() is None  # NVIDIA: 3.6 and 3.7 compile it
