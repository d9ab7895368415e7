"""The FLCE frontier benchmark (lmkernels.harness.bench.frontier, benchmarks/flce_frontier.py) on the CPU at tiny shapes: the whole run (inputs per regime,
variants, ratios, reports, plots) with the cheapest variants."""

from __future__ import annotations

import json

import pytest

from lmkernels.harness.bench import frontier as flce_frontier


def test_frontier_tiny_on_cpu(tmp_path):
    argv = ["--device", "cpu", "--tiny", "--out", str(tmp_path), "--no-progress"]
    argv += ["--variants", "eager,compile_naive,cce", "--regimes", "uniform,zipf"]
    assert flce_frontier.main(argv) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    rows = data["rows"]
    assert {(r["shape"], r["regime"]) for r in rows} == {
        (flce_frontier.shape_label(*s), g) for s in flce_frontier.TINY_SHAPES for g in ("uniform", "zipf")
    }
    ok = [r for r in rows if r["status"] == "ok"]
    assert {r["variant"] for r in ok} == {"eager", "compile_naive"}  # cce: not installed / no CUDA
    assert "cce" in data["meta"]["not_run"]
    for r in ok:
        assert r["ms"] > 0 and r["entropy"] > 0
        assert (r["time_vs_compile_naive"] == 1.0) == (r["variant"] == "compile_naive")
    zipf = [r["entropy"] for r in ok if r["regime"] == "zipf"]
    uniform = [r["entropy"] for r in ok if r["regime"] == "uniform"]
    assert max(zipf) < min(uniform)
    summary = (tmp_path / "summary.md").read_text()
    assert "## zipf logits" in summary and "sc30" in summary and "command:" in summary
    assert (tmp_path / "time_ratio.png").stat().st_size > 10_000
    assert (tmp_path / "results.csv").read_text().startswith("shape,BT,H,V,softcap,regime,entropy")


def test_variants_table_and_unknown_names():
    table = flce_frontier.variants(None)
    assert list(table)[: len(flce_frontier.VARIANTS)] == list(flce_frontier.VARIANTS)
    assert {"compile", "triton", "compile_naive", "cce", "cce_exact", "liger", "torch_native"} <= set(table)
    assert "eager" not in table and flce_frontier.variants(["eager"]) == {"eager": ("eager", {})}
    with pytest.raises(SystemExit, match="unknown"):
        flce_frontier.variants(["nope"])


def test_fewer_repeats_for_big_shapes():
    small = flce_frontier.repeats(6 * 1024 * 2048 * 32000, "cuda", 800.0)
    big = flce_frontier.repeats(6 * 8192 * 4096 * 128256, "cuda", 800.0)
    assert big["gpu_runs"] < small["gpu_runs"] and big["min_runs"] < small["min_runs"]


def test_compile_naive_computes_the_loss_with_softcap():
    import torch

    from lmkernels.harness.bench import naive_flce
    from lmkernels.registry.core import get_op

    spec = get_op("fused_linear_cross_entropy")
    x = spec.make_inputs({"BT": 37, "H": 64, "V": 131}, torch.float32, "cpu", 0, softcap=5.0, regime="zipf")
    want = spec.reference(**x)
    got = naive_flce(x["hidden"], x["weight"], x["target"], softcap=5.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
