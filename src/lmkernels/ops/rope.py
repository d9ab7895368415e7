"""Rotary position embedding applied to q and k.

q: (B, Hq, T, D), k: (B, Hkv, T, D), Hq a multiple of Hkv (GQA) or not; both rotated in one call.
cos, sin: (T, R) or (B, T, R) with R = rotary_dim (default D), the full-width tables that
transformers builds (neox: [f, f] halves; interleaved: each frequency repeated twice). With
position_ids (B, T), cos and sin are tables (P, R) looked up at those positions, which must be
in [0, P): checked unless LMKERNELS_CHECK_VALUES=0, and read as nan rows (never out of bounds)
when unchecked. Only the first R dims of each head rotate; dims R..D pass through unchanged.

out[..., :R] = x[..., :R] * cos + rotate(x[..., :R]) * sin, where rotate pairs dim j with
j + R/2 (layout "neox": rotate_half) or 2i with 2i+1 (layout "interleaved", GPT-J style):
rotate(x) = [-x2, x1]. Computed in fp32, rounded once to q's dtype. Gradients: q and k.
"""

from __future__ import annotations

import math
import weakref

import torch

from lmkernels.ops._common import generator, op_function, randn, upcast
from lmkernels.registry.core import ErrorInput, OpSpec, register_op
from lmkernels.types import RopeLayout
from lmkernels.utils import (
    check_choice,
    check_same_device,
    check_tensor,
    checked_values,
    data_checks_enabled,
    fail,
)

LAYOUTS = ("neox", "interleaved")


def rotate(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "neox":
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def rope_tables_at(cos, sin, position_ids=None):
    """The cos/sin rows the rotation uses, in the compute dtype: looked up at position_ids in a
    (P, R) table, or the (T, R) / (B, T, R) tables as given. A position outside [0, P) (only
    possible with value checks off) is never read: its rows are nan."""
    if position_ids is not None:
        in_range = ((position_ids >= 0) & (position_ids < cos.shape[0]))[..., None]
        safe = torch.where(in_range[..., 0], position_ids, 0)
        cos = torch.where(in_range, upcast(cos[safe]), float("nan"))
        sin = torch.where(in_range, upcast(sin[safe]), float("nan"))
    cos, sin = upcast(cos), upcast(sin)
    if cos.dim() == 3:  # (B, T, R) -> (B, 1, T, R), broadcast over heads
        cos, sin = cos[:, None], sin[:, None]
    return cos, sin


def rope_apply(x, cos, sin, layout, rotary_dim):
    """x rotated by the tables of rope_tables_at, rounded once to x's dtype."""
    x32 = upcast(x)
    xr, rest = x32[..., :rotary_dim], x32[..., rotary_dim:]
    return torch.cat((xr * cos + rotate(xr, layout) * sin, rest), dim=-1).to(x.dtype)


def rope_reference(q, k, cos, sin, position_ids=None, layout="neox", rotary_dim=None):
    rdim = q.shape[-1] if rotary_dim is None else rotary_dim
    cos, sin = rope_tables_at(cos, sin, position_ids)
    return rope_apply(q, cos, sin, layout, rdim), rope_apply(k, cos, sin, layout, rdim)


def check_inputs(q, k, cos, sin, position_ids=None, layout="neox", rotary_dim=None):
    check_tensor("q", q, ndim=4)
    check_tensor("k", k, ndim=4)
    B, Hq, T, D = q.shape
    if k.shape[0] != B or k.shape[2:] != (T, D):
        fail(f"k: expected shape ({B}, Hkv, {T}, {D}) to match q {tuple(q.shape)}, got {tuple(k.shape)}")
    if k.dtype != q.dtype:
        fail(f"k: expected dtype {q.dtype} (same as q), got {k.dtype}")
    check_choice("layout", layout, LAYOUTS)
    rdim = D if rotary_dim is None else rotary_dim
    if not (isinstance(rdim, int) and 0 < rdim <= D and rdim % 2 == 0):
        fail(f"rotary_dim: expected an even int in (0, {D}], got {rotary_dim!r}")
    check_tensor("cos", cos, ndim=(2, 3))
    check_tensor("sin", sin, ndim=(2, 3))
    if cos.shape != sin.shape:
        fail(f"sin: expected the shape of cos {tuple(cos.shape)}, got {tuple(sin.shape)}")
    if cos.shape[-1] != rdim:
        fail(f"cos: expected last dim {rdim} (rotary_dim), got shape {tuple(cos.shape)}")
    if position_ids is not None:
        check_tensor("position_ids", position_ids, ndim=2, dtypes=(torch.int32, torch.int64))
        if tuple(position_ids.shape) != (B, T):
            fail(f"position_ids: expected shape ({B}, {T}), got {tuple(position_ids.shape)}")
        if cos.dim() != 2:
            fail(f"cos: with position_ids, expected a (positions, {rdim}) table, got {tuple(cos.shape)}")
    elif cos.dim() == 2 and cos.shape[0] != T:
        fail(f"cos: expected shape ({T}, {rdim}) or ({B}, {T}, {rdim}), got {tuple(cos.shape)}")
    elif cos.dim() == 3 and tuple(cos.shape[:2]) != (B, T):
        fail(f"cos: expected shape ({B}, {T}, {rdim}), got {tuple(cos.shape)}")
    check_same_device(q=q, k=k, cos=cos, sin=sin, position_ids=position_ids)


# The position_ids last checked: (weak reference, version, table rows). The same tensor reaches
# the op once per layer; while it is unchanged its values need no second host sync.
_CHECKED: list = [None, -1, -1]


def check_values(q, k, cos, sin, position_ids=None, **_):
    """position_ids inside the table: reads values (a host sync on CUDA), so the dispatcher runs
    it on every call; LMKERNELS_CHECK_VALUES=0 skips it (out-of-range positions then give nan
    rows, never an out-of-bounds read)."""
    if position_ids is None or not position_ids.numel() or not data_checks_enabled():
        return
    P = cos.shape[0]
    position_ids = checked_values(position_ids)
    ref, version, rows = _CHECKED
    if ref is not None and ref() is position_ids and version == position_ids._version and rows <= P:
        return
    bad = (position_ids < 0) | (position_ids >= P)
    if bool(bad.any()):
        where = [int(i) for i in bad.nonzero()[0]]
        fail(
            f"position_ids: expected positions in [0, {P}) (the rows of cos/sin), found "
            f"{int(position_ids[tuple(where)])} at {where} ({int(bad.sum())} out of range)"
        )
    _CHECKED[:] = [weakref.ref(position_ids), position_ids._version, P]


def rope_tables(positions: torch.Tensor, rdim: int, layout: str, base: float = 10000.0):
    """cos/sin tables (len(positions), rdim) in the layout's full-width form, fp32."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rdim, 2, dtype=torch.float64) / rdim))
    angles = positions.double()[:, None] * inv_freq[None]
    if layout == "neox":
        angles = torch.cat((angles, angles), dim=-1)
    else:
        angles = angles.repeat_interleave(2, dim=-1)
    return angles.cos().float(), angles.sin().float()


def make_inputs(shape, dtype, device, seed=0, layout="neox", partial=False, positions=None, **options):
    """positions: None (cos/sin (T, R)), "batched" ((B, T, R)) or "ids" (position_ids + table)."""
    g = generator(seed)
    B, Hq, Hkv, T, D = shape["B"], shape["Hq"], shape["Hkv"], shape["T"], shape["D"]
    rdim = 2 * math.ceil(D / 4) if partial else D
    q = randn((B, Hq, T, D), dtype, device, g)
    k = randn((B, Hkv, T, D), dtype, device, g)
    out = {"q": q, "k": k, "layout": layout, "rotary_dim": rdim if partial else None, **options}
    if positions == "ids":
        table_len = T + 7
        position_ids = torch.randint(0, table_len, (B, T), generator=g)
        cos, sin = rope_tables(torch.arange(table_len), rdim, layout)
        out["position_ids"] = position_ids.to(device)
    elif positions == "batched":
        offsets = torch.randint(0, 100, (B, 1), generator=g)
        cos, sin = rope_tables((offsets + torch.arange(T)).flatten(), rdim, layout)
        cos, sin = cos.view(B, T, rdim), sin.view(B, T, rdim)
    else:
        cos, sin = rope_tables(torch.arange(T), rdim, layout)
    out["cos"], out["sin"] = cos.to(device, dtype), sin.to(device, dtype)
    return out


def sample(draw):
    partial = draw.booleans()
    D = draw.sampled_from((2, 4, 6, 16, 24, 64, 96, 128, 256) + ((3, 5, 80) if partial else ()))
    long = draw.booleans()  # many positions, few heads
    T = draw.sampled_from((0, 1, 5, 31, 257, 1031) if long else (0, 1, 2, 3, 7, 8, 13, 16))
    Hkv = draw.sampled_from((1, 2) if long else (0, 1, 2, 3, 8))
    Hq = Hkv * draw.sampled_from((1, 2, 3)) if Hkv and draw.booleans() else draw.sampled_from((1, 2, 5))
    shape = {"B": draw.integers(0, 1 if long else 3), "Hq": Hq, "Hkv": Hkv, "T": T, "D": D}
    options = {
        "layout": draw.sampled_from(LAYOUTS),
        "partial": partial,
        "positions": draw.sampled_from((None, "batched", "ids")),
    }
    return shape, options


def error_inputs(device):
    def args(**over):
        base = {
            "q": torch.randn(1, 2, 3, 8, device=device),
            "k": torch.randn(1, 1, 3, 8, device=device),
            "cos": torch.randn(3, 8, device=device),
            "sin": torch.randn(3, 8, device=device),
        }
        return {**base, **over}

    table = torch.randn(6, 8, device=device)
    ids = torch.tensor([[0, 1, 2]], device=device)
    return [
        ErrorInput(args(q=torch.randn(2, 3, 8, device=device)), "q: expected 4 dims"),
        ErrorInput(args(k=torch.randn(1, 2, 4, 8, device=device)), "k: expected shape"),
        ErrorInput(args(k=torch.randn(1, 1, 3, 8, device=device).half()), "k: expected dtype torch.float32"),
        ErrorInput(
            args(cos=torch.randn(3, 6, device=device), sin=torch.randn(3, 6, device=device)),
            "cos: expected last dim 8",
        ),
        ErrorInput(args(sin=torch.randn(4, 8, device=device)), "sin: expected the shape of cos"),
        ErrorInput(
            args(cos=torch.randn(4, 8, device=device), sin=torch.randn(4, 8, device=device)),
            "cos: expected shape",
        ),
        ErrorInput(args(rotary_dim=5), "rotary_dim: expected an even int"),
        ErrorInput(args(rotary_dim=10), "rotary_dim: expected an even int"),
        ErrorInput(args(layout="gptj"), "layout: expected one of"),
        ErrorInput(
            args(cos=table, sin=table, position_ids=ids[:, :2]), r"position_ids: expected shape \(1, 3\)"
        ),
        ErrorInput(args(cos=table, sin=table, position_ids=ids.float()), "position_ids: expected dtype in"),
        ErrorInput(
            args(cos=table, sin=table, position_ids=ids + 4), r"position_ids: expected positions in \[0, 6\)"
        ),
        ErrorInput(
            args(cos=table, sin=table, position_ids=ids - 1), r"position_ids: .* found -1 at \[0, 0\]"
        ),
        ErrorInput(args(sin=torch.randn(3, 8, device="meta")), f"sin: expected device {device}"),
    ]


SPEC = register_op(
    OpSpec(
        name="rope",
        reference=rope_reference,
        make_inputs=make_inputs,
        check_inputs=check_inputs,
        check_values=check_values,
        grad_inputs=("q", "k"),
        shapes={
            "tiny": [{"B": 1, "Hq": 2, "Hkv": 1, "T": 3, "D": 4}],
            "quick": [
                {"B": 2, "Hq": 4, "Hkv": 2, "T": 7, "D": 16},
                {"B": 1, "Hq": 3, "Hkv": 3, "T": 5, "D": 24},
            ],
            "full": [
                {"B": 2, "Hq": 4, "Hkv": 2, "T": 7, "D": 16},
                {"B": 1, "Hq": 3, "Hkv": 3, "T": 5, "D": 24},
                {"B": 2, "Hq": 32, "Hkv": 8, "T": 1023, "D": 128},
                {"B": 4, "Hq": 12, "Hkv": 12, "T": 512, "D": 64},
                {"B": 1, "Hq": 32, "Hkv": 8, "T": 8192, "D": 128},
            ],
        },
        cases=[
            {},
            {"layout": "interleaved"},
            {"partial": True},
            {"positions": "ids"},
            {"positions": "batched", "layout": "interleaved"},
        ],
        bytes_moved=lambda s, dtype: 4 * s["B"] * s["T"] * s["D"] * (s["Hq"] + s["Hkv"]) * dtype.itemsize,
        error_inputs=error_inputs,
        sample=sample,
        description="rotary embedding of q and k (neox/interleaved, partial, GQA, position_ids)",
    )
)


@op_function("rope")  # writes the body: check the inputs, pick the backend, call it
def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    layout: RopeLayout = "neox",
    rotary_dim: int | None = None,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of q and k, in one call.

    ``out[..., :R] = x[..., :R] * cos + rotate(x[..., :R]) * sin`` for x in (q, k), with
    ``rotate(x) = [-x2, x1]`` over the pairs of the layout; dims R..D pass through unchanged.
    Computed in fp32, rounded once to q's dtype.

    Args:
        q: Queries, shape (B, Hq, T, D); float32, bfloat16 or float16.
        k: Keys, shape (B, Hkv, T, D), q's dtype (Hq need not be a multiple of Hkv).
        cos: Cosine table, shape (T, R) or (B, T, R), in the full-width form transformers
            builds (neox: the frequencies twice, [f, f]; interleaved: each frequency twice in
            a row). With position_ids: a table (P, R) of P positions.
        sin: Sine table, cos's shape.
        position_ids: Optional int32/int64 (B, T): the rows of the (P, R) tables each token
            uses, in [0, P) (checked unless LMKERNELS_CHECK_VALUES=0; an unchecked position
            out of range gives nan rows, never an out-of-bounds read). None: the tables are
            per position as given.
        layout: Which dims rotate together: "neox" pairs dim j with j + R/2 (rotate_half);
            "interleaved" (GPT-J) pairs 2i with 2i + 1.
        rotary_dim: R, the number of leading dims of each head that rotate: even, in (0, D];
            None for D.
        backend: The backend that runs the op ("triton", "compile", "eager", ...). None: the
            choice of ``use_backend()`` / ``set_backend()``, else of LMKERNELS_BACKEND, else the
            highest-priority backend that can take the inputs. A backend asked for that cannot
            take them raises BackendNotSupportedError (never a silent fallback).

    Returns:
        (q_out, k_out), with q's and k's shapes and dtype. Differentiable with respect to q and
        k (not cos and sin).

    Raises:
        LMKernelsError: An input of the wrong type, shape, dtype or device, or an option out of
            range; the message names the argument.
    """
