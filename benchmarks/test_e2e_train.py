"""benchmarks/e2e_train.py: the --quick plan covers what it must within its budget, and a tiny
run on the CPU goes through workers, reports and plots."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e_setup  # noqa: E402
import e2e_train  # noqa: E402


def test_quick_plan_covers_the_issue_points_within_budget():
    args = e2e_train.parse_args(["--quick"])
    workers = e2e_train.plan_workers(args)
    by = {(m, c): pts for m, c, pts in workers}
    base = by[("llama-1b", "lmk")]
    assert [p["batch"] for p in base if p["sweep"] == "batch"] == [1, 2, 4, 8, 16, 32, 64]
    assert {p["batch"] for p in base if p["sweep"] == "seq"} == {4}
    assert {(p["batch"], p["seq"]) for p in base if p["sweep"] == "small"} == {
        (b, s) for b in (1, 2, 4) for s in (512, 1024)
    }
    assert [p["batch"] for p in base if p.get("timeline")] == [32]
    assert {c for m, c in by if m == "llama-1b-v256k"} == {"plain", "lmk", "liger"}
    assert 2 <= len(by[("llama-1b-v256k", "lmk")]) <= 3
    for config in ("plain+compile", "lmk+compile"):
        assert [p["batch"] for p in by[("llama-1b", config)]] == [8, 32]
    assert sum(e2e_train.cost(c, p) for _, c, p in workers) <= args.budget == 360


def test_parse_config():
    assert e2e_setup.parse_config("lmk:triton-noflce+compile") == (
        "lmk",
        "triton",
        ("rms_norm", "rope", "mlp", "causal_mask"),
        True,
    )
    assert e2e_setup.parse_config("plain+compile")[3] is True
    assert e2e_setup.parse_config("lmk-noflce-nocheck+compile") == e2e_setup.parse_config(
        "lmk-noflce+compile"
    )
    assert not e2e_setup.value_checks("lmk-noflce-nocheck+compile") and not e2e_setup.value_checks(
        "lmk-nocheck"
    )
    assert e2e_setup.value_checks("lmk") and e2e_setup.value_checks("lmk-noflce+compile")
    for bad in (
        "plain-noflce",
        "plain:triton",
        "fast",
        "lmk+compiled",
        "liger-nocheck",
        "lmk-nocheck-noflce",
    ):
        with pytest.raises(ValueError, match="unknown configuration"):
            e2e_setup.parse_config(bad)


def test_tiny_run_on_cpu(tmp_path):
    argv = ["--device", "cpu", "--tiny", "--out", str(tmp_path), "--configs", "plain,lmk:eager"]
    argv += ["--compile-configs", "", "--sweeps", "batch,small", "--steps", "1", "--min-timed-s", "0"]
    assert e2e_train.main(argv) == 0
    rows = json.loads((tmp_path / "e2e.json").read_text())["rows"]
    assert {(r["config"], r["sweep"], r["batch"], r["seq"]) for r in rows} == {
        (c, s, b, q)
        for c in ("plain", "lmk:eager")
        for s, b, q in (("batch", 1, 32), ("batch", 2, 32), ("small", 1, 16))
    }
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in rows), rows
    lmk = next(r for r in rows if r["config"] == "lmk:eager" and r["batch"] == 2)
    assert lmk["speedup_vs_plain"] > 0 and abs(lmk["loss"] - 6.9) < 0.5  # ln(1000) at random init
    summary = (tmp_path / "summary.md").read_text()
    assert "## small batches" in summary and "command:" in summary
    assert {p.name for p in tmp_path.glob("*.png")} == {"e2e_batch.png", "e2e_small.png"}
