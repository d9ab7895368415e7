"""The FLCE frontier benchmark (`lmkernels-bench frontier`, lmkernels_bench.frontier) on the CPU at
tiny shapes: the whole run (inputs per regime, variants, ratios, reports, plots) with the
cheapest variants."""

from __future__ import annotations

import json

import pytest
import torch

from lmkernels_bench import frontier as flce_frontier


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


def test_frontier_rounds_on_cpu(tmp_path):
    """--rounds: each case runs that many times, the variants' order rotated; a row holds the
    median over rounds and every round's time. --only picks shapes by label."""
    label = flce_frontier.shape_label(*flce_frontier.TINY_SHAPES[0])
    argv = ["--device", "cpu", "--tiny", "--out", str(tmp_path), "--no-progress", "--no-plots"]
    argv += ["--variants", "eager,compile_naive", "--regimes", "gaussian", "--only", label]
    assert flce_frontier.main([*argv, "--rounds", "3"]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["shape"], r["variant"]) for r in rows] == [(label, "eager"), (label, "compile_naive")]
    for r in rows:
        assert r["rounds"] == 3 and len(r["gpu_ms_rounds"]) == 3
    with pytest.raises(SystemExit, match="--only: unknown shapes"):
        flce_frontier.main([*argv[:-1], "1x2x3"])


def test_rounds_rotate_and_take_the_median():
    table = {"a": 1, "b": 2, "c": 3}
    assert [list(flce_frontier.rotated(table, k)) for k in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]
    ]  # fmt: skip

    def row(variant, ms, status="ok"):
        return {"variant": variant, "status": status, "gpu_ms": ms, "ms": ms, "peak_mib": 1.0}

    rounds = [
        [row("a", 1.0), row("b", 5.0)],
        [row("b", 7.0), row("a", 3.0)],
        [row("a", 2.0), row("b", 6.0, "OOM")],
    ]
    a, b = flce_frontier.median_of_rounds(rounds, ["a", "b"])
    assert a["gpu_ms"] == 2.0 and a["gpu_ms_rounds"] == [1.0, 3.0, 2.0] and a["rounds"] == 3
    assert b["status"] == "OOM"  # a failed round is reported, not averaged away

    # Rounds whose alternating pass failed keep their time alone: the median takes one method.
    def alt(ms, alone):
        return row("a", ms) | {"gpu_ms_alone": alone, "gpu_alternating": True, "gpu_sleep_ms": ms + 5}

    failed = row("a", 9.0) | {"gpu_alternating": False, "note": "alternating timing failed"}
    (a,) = flce_frontier.median_of_rounds([[failed], [alt(1.0, 4.0)], [alt(2.0, 6.0)]], ["a"])
    assert a["gpu_ms"] == 1.5 and a["gpu_ms_rounds"] == [1.0, 2.0] and a["gpu_alternating"]
    assert a["gpu_ms_alone"] == 6.0 and a["gpu_sleep_ms"] == 6.5 and a["rounds"] == 3
    assert "note" not in a  # the row of an alternating round, not the failed one's


def test_alternate_times_the_variants_that_passed_or_leaves_a_note(monkeypatch):
    made = {"hidden": torch.zeros(2, 3), "target": torch.zeros(2, dtype=torch.long)}
    monkeypatch.setattr(flce_frontier, "cleanup", lambda device: None)
    monkeypatch.setattr(flce_frontier, "prepare_inputs", lambda spec, inputs, device: dict(inputs))
    monkeypatch.setattr(flce_frontier, "timed_call", lambda op, backend, inputs, mode: backend)
    seen = {}

    def timed(runs, calls):
        seen.update(runs)
        return {"a": 7.0, "b": 8.5}, 3.0, {"b"}

    monkeypatch.setattr(flce_frontier, "interleaved_gpu_ms", timed)

    def rows():
        return [
            {"variant": "a", "gpu_ms": 9.0, "note": ""},
            {"variant": "b", "gpu_ms": 8.0, "note": ""},
            {"variant": "c", "gpu_ms": None, "note": "OOM"},
        ]

    monkeypatch.setattr(flce_frontier, "timed_call", lambda op, backend, inputs, mode: (backend, inputs))
    got = rows()
    opts = {"grad_accum_dtype": torch.bfloat16}
    flce_frontier.alternate(got, {"a": ("triton", {}), "b": ("liger", opts)}, made, "cuda")
    assert {n: r[0][0] for n, r in seen.items()} == {"a": "triton", "b": "liger"}
    assert seen["b"][0][1]["grad_accum_dtype"] == torch.bfloat16  # each variant's own options
    assert "grad_accum_dtype" not in seen["a"][0][1]
    assert got[0] | {} == {"variant": "a", "gpu_ms": 7.0, "gpu_ms_alone": 9.0, "note": "",
                           "gpu_alternating": True, "gpu_sleep_ms": 3.0, "gpu_host_waits": False}  # fmt: skip
    assert got[1]["gpu_ms"] == 8.5 and got[1]["gpu_ms_alone"] == 8.0 and got[1]["gpu_host_waits"]
    assert got[2] == {"variant": "c", "gpu_ms": None, "note": "OOM", "gpu_alternating": False}

    one = rows()  # one variant, or the CPU: nothing to alternate, said so
    flce_frontier.alternate(one, {"a": ("triton", {})}, made, "cuda")
    assert one[0]["gpu_ms"] == 9.0 and one[0]["gpu_alternating"] is False
    cpu = rows()
    flce_frontier.alternate(cpu, {"a": ("triton", {}), "b": ("liger", {})}, made, "cpu")
    assert cpu[1]["gpu_ms"] == 8.0 and cpu[1]["gpu_alternating"] is False

    def fails(runs, calls):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(flce_frontier, "interleaved_gpu_ms", fails)
    monkeypatch.setattr(
        flce_frontier, "timed_call", lambda op, backend, inputs, mode: 1 / 0
    )  # a rebuild fails
    rebuilt = rows()
    flce_frontier.alternate(rebuilt, {"a": ("triton", {}), "b": ("liger", {})}, made, "cuda")
    assert rebuilt[0]["gpu_ms"] == 9.0 and "failed (ZeroDivisionError" in rebuilt[0]["note"]
    monkeypatch.setattr(flce_frontier, "timed_call", lambda op, backend, inputs, mode: backend)
    failed = rows()
    flce_frontier.alternate(failed, {"a": ("triton", {}), "b": ("liger", {})}, made, "cuda")
    assert failed[0]["gpu_ms"] == 9.0 and failed[0]["gpu_alternating"] is False
    assert "alternating timing failed (OutOfMemoryError" in failed[1]["note"]
    assert failed[2]["note"] == "OOM"


def test_run_case_alternates_only_the_variants_that_passed(monkeypatch, tmp_path):
    passed = {}
    monkeypatch.setattr(flce_frontier, "alternate", lambda rows, p, made, device: passed.update(p))
    table = {"eager": ("eager", {}), "nope": ("no_such_backend", {})}
    rows = flce_frontier.run_case(
        table, (64, 32, 256, None), "gaussian", torch.float32, "cpu", {}, _NoBar(), None
    )
    assert [r["status"] for r in rows] == ["ok", "unsupported"] and list(passed) == ["eager"]


def test_data_rows_keep_both_gpu_times():
    from lmkernels_bench.parts_perf import flce_rows

    native = {"variant": "triton", "backend": "triton", "options": "default", "shape": "64x32x256"}
    native |= {"status": "ok", "gpu_ms": 1.0, "gpu_ms_alone": 1.2, "gpu_alternating": True}
    native |= {"gpu_sleep_ms": 3.0, "dims": {"BT": 64, "H": 32, "V": 256}}
    (row,) = flce_rows([native], {"dtype": "bf16"})
    assert (row["gpu_ms"], row["gpu_ms_alone"], row["gpu_alternating"], row["gpu_sleep_ms"]) == (
        1.0,
        1.2,
        True,
        3.0,
    )


class _NoBar:
    def update(self, *a, **k):
        pass

    def advance(self, *a, **k):
        pass


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


def _row(variant, backend, ms, mib, regime="gaussian", shape="8x4x16"):
    return dict(
        variant=variant, backend=backend, gpu_ms=ms, peak_mib=mib, regime=regime, shape=shape, status="ok"
    )


def test_pareto_verdicts_find_dominating_peers_and_matching_budgets(tmp_path):
    from lmkernels_bench import frontier_report as report

    rows = [
        _row("triton", "triton", 10.0, 2000.0),
        _row("budget_0", "triton", 14.0, 900.0),
        _row("budget_0.5", "triton", 10.5, 1200.0),
        _row("compile_naive", "compile_naive", 9.0, 3000.0),  # faster but larger: no
        _row("liger", "liger", 9.7, 1000.0),  # 3% faster and leaner: dominates; nothing matches
        _row("cce", "cce", 20.0, 850.0),  # leaner than all of ours: no match, no closest
        _row("liger", "liger", 5.0, 100.0, regime="uniform"),  # dominates, not counted
        _row("triton", "triton", 10.0, 2000.0, regime="uniform"),
    ]
    verdicts = {(v["peer"]["variant"], v["regime"]): v for v in report.pareto_verdicts(rows)}
    assert not verdicts[("compile_naive", "gaussian")]["dominates_default"]
    assert verdicts[("compile_naive", "gaussian")]["match"] is None
    liger = verdicts[("liger", "gaussian")]
    assert liger["dominates_default"] and liger["match"] is None
    assert liger["closest"]["variant"] == "budget_0"
    cce = verdicts[("cce", "gaussian")]
    assert not cce["dominates_default"] and cce["match"] is None and cce["closest"] is None
    assert (
        verdicts[("liger", "uniform")]["dominates_default"] and not verdicts[("liger", "uniform")]["counted"]
    )
    # A peer 1% faster and leaner does not dominate (noise); a setting that is as fast and as lean matches.
    rows[4] = _row("liger", "liger", 9.95, 1200.0)
    liger = {(v["peer"]["variant"], v["regime"]): v for v in report.pareto_verdicts(rows)}[
        ("liger", "gaussian")
    ]
    assert not liger["dominates_default"] and liger["match"] is None
    rows[4] = _row("liger", "liger", 10.5, 1200.0)
    liger = {(v["peer"]["variant"], v["regime"]): v for v in report.pareto_verdicts(rows)}[
        ("liger", "gaussian")
    ]
    assert liger["match"]["variant"] == "budget_0.5"
    # The lean end: our fastest setting within 1.1x cce's peak, against compile_naive's time.
    (end,) = report.lean_end([r for r in rows if r["regime"] == "gaussian"])
    assert end["best"]["variant"] == "budget_0" and end["time_vs_base"] == 14.0 / 9.0
    summary = report.summary_markdown(rows, {})
    assert "dominating the default: 0" in summary  # rows[4] no longer dominates
    assert "MISS 1.56x" in summary
    paths = report.write_reports(rows, {"device": "test"}, tmp_path)
    assert (tmp_path / "pareto_gaussian.png").stat().st_size > 10_000 and len(paths) >= 5
