"""Bad input gets an LMKernelsError that names the argument and what was expected, from every
backend: each op's table of bad calls (OpSpec.error_inputs, OpInfo's idea), run against every
registered backend of the op that is available here. A new op or backend is covered with no
edits."""

import importlib

import pytest
import torch

import lmkernels
from lmkernels import LMKernelsError
from lmkernels.ops._common import dispatch
from lmkernels.ops.rope import rope_tables
from lmkernels.registry.core import impls, ops


def _cases():
    for spec in ops():
        if spec.error_inputs is None:
            continue
        for impl in impls(spec.name):
            if not impl.external:  # peers' own refusals are theirs (validate reports them)
                yield pytest.param(spec, impl, id=f"{spec.name}-{impl.backend}")


def _device_for(impl, triton_device):
    """Where this backend's calls run here: Triton on the interpreter (CPU) or the GPU."""
    return triton_device if impl.backend.startswith("triton") else "cpu"


@pytest.mark.parametrize(("spec", "impl"), list(_cases()))
def test_every_backend_refuses_the_error_inputs(spec, impl, triton_device):
    reason = impl.unavailable_reason()
    if reason:
        pytest.skip(f"{impl.backend} unavailable here: {reason}")
    device = _device_for(impl, triton_device)
    if device not in impl.devices:
        pytest.skip(f"{impl.backend} does not run on {device}")
    table = spec.error_inputs(device)
    assert table, f"{spec.name}: empty error table"
    for bad in table:
        with pytest.raises(LMKernelsError, match=bad.match):
            dispatch(spec.name, impl.backend, **bad.kwargs)


def test_every_op_has_an_error_table():
    missing = [spec.name for spec in ops() if spec.error_inputs is None]
    assert not missing, f"ops without error_inputs: {missing}"


# --- with value checks off: nan, never an out-of-bounds read or an index error -------------------


def _available(op):
    return [i.backend for i in impls(op) if not i.unavailable_reason() and not i.external]


@pytest.mark.parametrize("backend", ["eager", "compile", "triton", "triton_lean"])
def test_unchecked_out_of_range_targets_give_nan(monkeypatch, backend, triton_device):
    if backend not in _available("fused_linear_cross_entropy"):
        pytest.skip(f"{backend} unavailable here")
    monkeypatch.setenv("LMKERNELS_CHECK_VALUES", "0")
    device = triton_device if backend.startswith("triton") else "cpu"
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 8, generator=g).to(device)
    weight = torch.randn(11, 8, generator=g).to(device)
    target = torch.tensor([0, 1, 11, 3, -5, -100], device=device)
    per_token = lmkernels.fused_linear_cross_entropy(
        hidden, weight, target, reduction="none", backend=backend
    )
    assert per_token[[2, 4]].isnan().all() and per_token[[0, 1, 3]].isfinite().all()
    assert per_token[5].item() == 0.0  # ignored
    for reduction in ("mean", "sum"):
        loss = lmkernels.fused_linear_cross_entropy(
            hidden, weight, target, reduction=reduction, backend=backend
        )
        assert loss.isnan()
    # An ignored-only batch is not an error either: "mean" is 0 (see the op's docstring).
    ignored = torch.full((6,), -100, device=device)
    assert lmkernels.fused_linear_cross_entropy(hidden, weight, ignored, backend=backend).item() == 0.0


@pytest.mark.parametrize("backend", ["eager", "compile", "triton"])
@pytest.mark.parametrize("layout", ["neox", "interleaved"])
def test_unchecked_out_of_range_positions_give_nan_rows(monkeypatch, backend, layout, triton_device):
    if backend not in _available("rope"):
        pytest.skip(f"{backend} unavailable here")
    monkeypatch.setenv("LMKERNELS_CHECK_VALUES", "0")
    device = triton_device if backend == "triton" else "cpu"
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 4, 8, generator=g).to(device)
    k = torch.randn(1, 1, 4, 8, generator=g).to(device)
    cos, sin = (t.to(device) for t in rope_tables(torch.arange(6), 8, layout))
    position_ids = torch.tensor([[0, 6, 2, -1]], device=device)
    q_out, k_out = lmkernels.rope(q, k, cos, sin, position_ids=position_ids, layout=layout, backend=backend)
    for out in (q_out, k_out):
        assert out[:, :, [1, 3]].isnan().all()
        assert out[:, :, [0, 2]].isfinite().all()
    # The rows in range equal eager's on the same positions.
    ok = torch.tensor([[0, 0, 2, 2]], device=device)
    q_ref, _ = lmkernels.rope(q, k, cos, sin, position_ids=ok, layout=layout, backend="eager")
    torch.testing.assert_close(q_out[:, :, [0, 2]], q_ref[:, :, [0, 2]])


def test_repeated_position_ids_are_checked_once_while_unchanged():
    rope_op = importlib.import_module("lmkernels.ops.rope")

    cos, sin = rope_tables(torch.arange(6), 8, "neox")
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8)
    ids = torch.tensor([[0, 1, 2]])
    lmkernels.rope(q, k, cos, sin, position_ids=ids, backend="eager")
    assert rope_op._CHECKED[0]() is ids
    ids[0, 2] = 7  # changed in place: its version moves on, so it is checked again
    with pytest.raises(LMKernelsError, match="found 7 at"):
        lmkernels.rope(q, k, cos, sin, position_ids=ids, backend="eager")
    # A smaller table than the one the ids were checked against: checked again.
    ids = torch.tensor([[0, 1, 5]])
    lmkernels.rope(q, k, cos, sin, position_ids=ids, backend="eager")
    with pytest.raises(LMKernelsError, match=r"expected positions in \[0, 4\)"):
        lmkernels.rope(q, k, cos[:4], sin[:4], position_ids=ids, backend="eager")


def test_a_repeated_per_op_backend_is_an_error():
    from lmkernels.registry import parse_backend_spec

    with pytest.raises(LMKernelsError, match="'rms_norm' is given more than one backend"):
        parse_backend_spec("eager,rms_norm=eager,rms_norm=compile")
    with pytest.raises(LMKernelsError, match="more than one global backend"):
        parse_backend_spec("eager,triton")
