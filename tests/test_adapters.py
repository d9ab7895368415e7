"""The external-library adapters (backends/adapters.py) and the per-op bench's measurement core
(harness/bench/), on the CPU."""

import importlib.util
import math
import sys

import pytest
import torch

import lmkernels
from lmkernels.backends import adapters
from lmkernels.harness import bench
from lmkernels.registry.core import get_impl, get_op

FLCE = "fused_linear_cross_entropy"
EXPECTED = {
    "liger": ["rms_norm", "layer_norm", "rope", "swiglu", "geglu", FLCE],
    "cce": [FLCE],
    "cce_exact": [FLCE],
    "torch_native": [FLCE],
}


def _inputs(op, dtype=torch.float32, grad=True, **options):
    spec = get_op(op)
    inputs = spec.make_inputs(spec.shapes["quick"][0], dtype, "cpu", 0, **options)
    return bench.prepare_inputs(spec, inputs, "cpu") if grad else inputs


@pytest.mark.parametrize(("backend", "op"), [(b, op) for b, ops in EXPECTED.items() for op in ops])
def test_registered_below_eager(backend, op):
    impl = get_impl(op, backend)
    assert impl.priority < get_impl(op, "eager").priority  # auto never picks an adapter
    assert impl.devices == ("cuda",)
    assert impl.description


def test_listed_by_backend_names():
    names = lmkernels.backend_names()
    for backend in EXPECTED:
        assert backend in names


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
@pytest.mark.parametrize("backend", ["liger", "cce", "cce_exact"])
def test_unavailable_without_cuda(backend):
    reason = get_impl(FLCE, backend).unavailable_reason()
    assert reason and ("CUDA" in reason or "not installed" in reason)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_auto_never_picks_an_adapter():
    assert lmkernels.resolve(FLCE, _inputs(FLCE)).backend != "torch_native"
    with pytest.raises(lmkernels.BackendNotSupportedError, match="device 'cpu' not supported"):
        lmkernels.resolve(FLCE, _inputs(FLCE), backend="torch_native")


def test_missing_package_reason(monkeypatch):
    real = importlib.util.find_spec
    missing = {"liger_kernel", "cut_cross_entropy"}
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in missing else real(name, *a)
    )
    assert adapters.liger_unavailable() == "liger-kernel is not installed (pip install liger-kernel)"
    assert adapters.cce_unavailable() == "cut-cross-entropy is not installed (pip install cut-cross-entropy)"


def test_broken_package_reason(monkeypatch):
    def broken(name, *a, **k):
        raise ImportError("triton version mismatch")

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib, "import_module", broken)
    assert "failed to import (ImportError: triton version mismatch)" in adapters.liger_unavailable()


def test_torch_without_linear_cross_entropy(monkeypatch):
    monkeypatch.delattr(torch.nn.functional, "linear_cross_entropy", raising=False)
    assert "has no torch.nn.functional.linear_cross_entropy" in adapters.torch_native_unavailable()


def _reasons(op, backend, **overrides):
    """supports() alone: the reasons past availability and device, for valid inputs."""
    inputs = _inputs(op, dtype=overrides.pop("dtype", torch.float32))
    inputs.update(overrides)
    return get_impl(op, backend).supports(**inputs)


@pytest.mark.parametrize(("backend", "op"), [(b, op) for b, ops in EXPECTED.items() for op in ops])
def test_default_inputs_supported(backend, op):
    # CCE accumulates dW in the weight dtype only; everything else takes the op's defaults.
    extra = {"grad_accum_dtype": torch.bfloat16, "dtype": torch.bfloat16} if backend.startswith("cce") else {}
    assert _reasons(op, backend, **extra) == []


UNSUPPORTED = [
    ("liger", "rms_norm", {"x": torch.randn(2, 65537)}, "last dim 65537"),
    ("liger", "layer_norm", {"bias": None}, "always takes both"),
    ("liger", "rope", {"layout": "interleaved"}, "only the neox"),
    ("liger", "swiglu", {"gate": torch.randn(1, 70000), "up": torch.randn(1, 70000)}, "last dim 70000"),
    ("liger", "geglu", {"approximate": "none"}, "only the tanh"),
    ("liger", FLCE, {"return_lse": True}, "logsumexp"),
    (
        "liger",
        FLCE,
        {"class_weight": torch.ones(131), "z_loss_scale": 1e-4},
        "z-loss by the number of tokens",
    ),
    ("liger", FLCE, {"hidden": torch.randn(37, 64)}, "hidden does not"),
    ("cce", FLCE, {"bias": torch.zeros(131)}, "no bias"),
    ("cce", FLCE, {"label_smoothing": 0.1}, "no label smoothing"),
    ("cce", FLCE, {"z_loss_scale": 1e-4}, "no z-loss"),
    ("cce", FLCE, {"class_weight": torch.ones(131)}, "no class weights"),
    ("cce", FLCE, {"return_lse": True}, "logsumexp"),
    ("cce", FLCE, {}, "accumulates the weight gradient in the weight's dtype"),
    ("torch_native", FLCE, {"softcap": 30.0}, "softcapping"),
    ("torch_native", FLCE, {"z_loss_scale": 1e-4}, "no z-loss"),
    ("torch_native", FLCE, {"return_lse": True}, "logsumexp"),
    ("torch_native", FLCE, {"label_smoothing": 0.1}, "materializing the logits"),
]


@pytest.mark.parametrize(
    ("backend", "op", "overrides", "match"), UNSUPPORTED, ids=[f"{u[0]}-{u[1]}-{u[3]}" for u in UNSUPPORTED]
)
def test_unsupported_options_give_reasons(backend, op, overrides, match):
    reasons = _reasons(op, backend, **overrides)
    assert any(match in r for r in reasons), reasons


def _fake_module(monkeypatch, name, fn_name, calls):
    """A stand-in module `name` whose `fn_name` records its keyword arguments."""
    import types

    def fn(*args, **kwargs):
        calls.append(kwargs)
        return args[0].float().sum() * 0 + 1.0

    module = types.ModuleType(name)
    setattr(module, fn_name, fn)
    monkeypatch.setitem(sys.modules, name, module)


def test_cce_is_the_default_call_and_cce_exact_unfiltered(monkeypatch):
    calls = []
    _fake_module(monkeypatch, "cut_cross_entropy", "linear_cross_entropy", calls)
    inputs = _inputs(FLCE, dtype=torch.bfloat16, grad=False)
    get_impl(FLCE, "cce").fn(**inputs)
    get_impl(FLCE, "cce_exact").fn(**inputs)
    # cce: CCE's defaults (filter_eps "high", impl "cce") left to CCE; cce_exact: filter_eps=None.
    assert "filter_eps" not in calls[0] and "impl" not in calls[0]
    assert calls[1]["filter_eps"] is None
    assert "default call" in get_impl(FLCE, "cce").description
    assert "filter_eps=None" in get_impl(FLCE, "cce_exact").description


def test_liger_flce_default_accumulation_when_lean(monkeypatch):
    calls = []
    _fake_module(
        monkeypatch, "liger_kernel.transformers.functional", "liger_fused_linear_cross_entropy", calls
    )
    get_impl(FLCE, "liger").fn(**_inputs(FLCE, dtype=torch.bfloat16, grad=False, lean=True))
    get_impl(FLCE, "liger").fn(**_inputs(FLCE, dtype=torch.bfloat16, grad=False))
    assert calls[0]["accum_dtype"] is None  # Liger's default
    assert calls[1]["accum_dtype"] is torch.float32  # our default fp32 accumulation
    assert "accum_dtype=None" in get_impl(FLCE, "liger").description


def test_liger_flce_reduction_none_and_sum_supported():
    assert _reasons(FLCE, "liger", reduction="none") == []
    assert (
        _reasons(FLCE, "liger", reduction="sum", bias=torch.zeros(131), label_smoothing=0.1, softcap=30.0)
        == []
    )


def test_mean_denominator_matches_reference():
    target = torch.tensor([1, -100, 2, 2])
    w = torch.tensor([0.5, 1.0, 2.0])
    assert adapters._mean_denominator(target, -100, None).item() == 3
    assert adapters._mean_denominator(target, -100, w).item() == 5.0
    assert adapters._mean_denominator(torch.full((3,), -100), -100, None).item() == 1  # all ignored


@pytest.mark.skipif(
    adapters.torch_native_unavailable() is not None, reason="torch has no linear_cross_entropy"
)
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"reduction": "sum", "with_bias": True},
        {"reduction": "none"},
        {"with_class_weight": True},
        {"ignore_fraction": 1.0},
    ],
)
def test_torch_native_mapping_fp32(options):
    """The torch_native mapping (mean denominator, reductions, class weights, bias) in fp32 on the
    CPU, where its device check is bypassed by calling the function itself."""
    spec = get_op(FLCE)
    inputs = spec.make_inputs({"BT": 37, "H": 64, "V": 131}, torch.float32, "cpu", 0, **options)
    got = adapters.torch_native_flce(**inputs)
    want = spec.reference(**inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got.dtype == torch.float32


# --- bench ----------------------------------------------------------------------------------------


ROW_FIELDS = {"backend", "mode", "status", "ms", "ms_p20", "ms_p80", "peak_mib", "note"}


@pytest.mark.parametrize("mode", bench.MODES)
def test_measure_on_cpu(mode):
    row = bench.measure("rms_norm", "eager", _inputs("rms_norm"), mode, warmup=1, rep=2)
    assert ROW_FIELDS <= set(row)
    assert row["status"] == "ok", row["note"]
    assert 0 < row["ms_p20"] <= row["ms"] <= row["ms_p80"]
    assert row["peak_mib"] is None  # no allocator statistics on the CPU


def test_measure_compile_naive_and_unsupported():
    row = bench.measure(FLCE, "compile_naive", _inputs(FLCE), "full", warmup=1, rep=2)
    assert row["status"] == "ok", row["note"]
    row = bench.measure(FLCE, "compile_naive", _inputs(FLCE, label_smoothing=0.1), "full", warmup=1, rep=2)
    assert row["status"] == "unsupported" and "label_smoothing" in row["note"]
    row = bench.measure("rms_norm", "liger", _inputs("rms_norm"), "full", warmup=1, rep=2)
    assert row["status"] == "unsupported" and row["note"]


def test_measure_reports_errors_not_raises():
    lmkernels.register("rms_norm", "broken_for_bench", lambda **kw: 1 / 0, priority=-100)
    try:
        row = bench.measure("rms_norm", "broken_for_bench", _inputs("rms_norm"), "full", warmup=1, rep=2)
    finally:
        lmkernels.registry.unregister("rms_norm", "broken_for_bench")
    assert row["status"] == "error" and "ZeroDivisionError" in row["note"]


def test_plan_shapes():
    design = bench.plan(FLCE, None, torch.bfloat16, quick=False, options=None)
    assert [p.shape for p in design] == [bench.DESIGN_SHAPES[FLCE]] * 2
    assert [p.options for p in design] == [{}, {"grad_accum_dtype": torch.bfloat16}]
    given = [{"M": 8, "N": 64}, {"M": 3, "N": 100}]
    assert [p.shape for p in bench.plan("rms_norm", given, torch.bfloat16, quick=True, options=None)] == given
    opts = {"casting_mode": "gemma"}
    assert [p.options for p in bench.plan("rms_norm", given, torch.bfloat16, False, opts)] == [opts, opts]
    for op in bench.DESIGN_SHAPES:  # every design shape is one make_inputs understands
        assert set(bench.DESIGN_SHAPES[op]) == set(get_op(op).shapes["quick"][0])
    for spec in lmkernels.ops():  # every op has a default shape, a design one or its largest
        assert set(bench.default_shape(spec.name)) == set(spec.shapes["quick"][0])


def test_parse_options():
    assert bench.parse_options(["grad_accum_dtype=bf16", "softcap=30.0", "casting_mode=gemma"]) == {
        "grad_accum_dtype": torch.bfloat16,
        "softcap": 30.0,
        "casting_mode": "gemma",
    }


def _fake_rows():
    rows = []
    for size in (1024, 2048, 4096):
        for backend, ms, peak in (("compile", 1.0, 100.0), ("triton", 0.5, 50.0), ("liger", 0.8, 60.0)):
            rows.append(
                {
                    "op": "rms_norm",
                    "shape": f"16384x{size}",
                    "dims": {"M": 16384, "N": size},
                    "options": "default",
                    "dtype": "bf16",
                    "backend": backend,
                    "mode": "full",
                    "status": "ok",
                    "ms": ms * size / 1024,
                    "ms_p20": ms,
                    "ms_p80": ms,
                    "peak_mib": peak,
                    "note": "",
                }
            )
    rows.append(
        dict(rows[-1], backend="eager", status="OOM", ms=None, peak_mib=None, note="CUDA out of memory")
    )
    return rows


def test_rooflines_and_ratios():
    rows = _fake_rows()
    bench.add_rooflines(rows, torch.bfloat16, copy_gbps=3000.0, mm_tflops=None)
    bench.add_ratios(rows)
    triton = next(r for r in rows if r["backend"] == "triton" and r["dims"]["N"] == 1024)
    assert math.isclose(triton["gbps"], 5 * 16384 * 1024 * 2 / 0.5e-3 / 1e9)
    assert math.isclose(triton["pct_copy_bw"], 100 * triton["gbps"] / 3000)
    assert triton["speedup_vs_compile"] == 2.0 and triton["speedup_vs_liger"] == pytest.approx(1.6)
    assert triton["mem_vs_liger"] == pytest.approx(50 / 60)
    assert triton["speedup_vs_compile_naive"] is None  # not measured
    assert triton["tflops"] is None  # RMSNorm has a byte model, not a flop model


def test_reports_from_fake_rows(tmp_path):
    rows = _fake_rows()
    bench.add_rooflines(rows, torch.bfloat16, copy_gbps=3000.0, mm_tflops=900.0)
    bench.add_ratios(rows)
    meta = {"device": "fake", "not_run": {"rms_norm": {"cce": "no CUDA device"}}}
    paths = bench.write_reports(rows, meta, tmp_path)
    assert {p.name for p in paths} == {"results.csv", "results.json", "summary.md"}
    summary = (tmp_path / "summary.md").read_text()
    assert "2x compile" in summary and "OOM: CUDA out of memory" in summary and "no CUDA device" in summary
    assert bench.rich_table(rows).row_count == len(rows)


def test_run_bench_on_cpu_with_tiny_shapes(tmp_path):
    """The whole bench loop (plan, inputs per backend, modes, ratios, reports) on tiny shapes."""
    rows, meta = bench.run_bench(
        FLCE,
        [{"BT": 16, "H": 32, "V": 64}, {"BT": 5, "H": 8, "V": 100}],
        ["eager", "compile_naive", "liger"],
        torch.float32,
        ["fwd", "full"],
        device="cpu",
        warmup=1,
        rep=2,
        progress=False,
    )
    by = {(r["shape"], r["backend"], r["mode"]): r for r in rows}
    assert {s for s, _, _ in by} == {"16x32x64", "5x8x100"}
    assert by[("16x32x64", "eager", "full")]["status"] == "ok"
    assert by[("5x8x100", "compile_naive", "fwd")]["status"] == "ok"
    assert "liger" in meta["not_run"][FLCE]  # unavailable on the CPU: reported, not run
    assert by[("16x32x64", "eager", "full")]["tflops"] > 0
    paths = bench.write_reports(rows, meta, tmp_path)
    assert "compile_naive" in (tmp_path / "summary.md").read_text()
    assert len(paths) == 3
    rows, meta = bench.run_bench(
        "rms_norm", [{"M": 8, "N": 64}], ["eager", "compile_naive"], torch.float32, ["full"],
        device="cpu", warmup=1, rep=2, progress=False,
    )  # fmt: skip
    assert [r["backend"] for r in rows] == ["eager"]  # a pseudo-backend only for its op


def test_run_bench_budget_and_partial_writes():
    calls = []
    rows, _ = bench.run_bench(
        "rms_norm",
        [{"M": 8, "N": 64}, {"M": 4, "N": 32}],
        ["eager"],
        torch.float32,
        ["full"],
        quick=True,
        device="cpu",
        warmup=1,
        rep=2,
        progress=False,
        budget_s=1e-9,
        on_point=lambda rows, meta: calls.append(len(rows)),
    )
    assert [r["status"] for r in rows] == ["skipped", "skipped"] and rows[0]["note"] == "time budget"
    assert calls == [1, 2]
