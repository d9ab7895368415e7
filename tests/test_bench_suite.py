"""`lmkernels bench --suite` and its data files: every part's plan runs dry (made-up timings, no
GPU) into rows with their provenance, a part resumes where it stopped, the report renders every
table and plot from such rows; the committed data files hold measurements only, and the README's
and the docs' tables are the ones their data files generate. The tuner's candidates and report
are checked on the CPU too."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from lmkernels import cli
from lmkernels.harness.bench import data, families, suite, tables

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data"
PROVENANCE = ("part", "device", "gpu", "gpus", "versions", "commit", "date", "command", "run")
DOCS = ("README.md", "docs/performance.md", "docs/distributed.md")


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    """Every part of both suites, dry, into one folder."""
    out = tmp_path_factory.mktemp("dry")
    written = {}
    for name, table in suite.SUITES.items():
        for part in table:
            written[part] = suite.run_part(name, part, out, dry_run=True, command="test", log=lambda _: None)
    return out, written


def test_every_part_writes_rows_with_their_provenance(dry):
    out, written = dry
    assert all(n > 0 for n in written.values()), written
    rows = data.read_rows(out / "dry-run.jsonl")
    assert {r["part"] for r in rows} == {"ops", "flce", "e2e", "dist"}
    assert all(r["dry_run"] and all(k in r for k in PROVENANCE) for r in rows)
    assert all(r["peer"] for r in rows if r["part"] in ("ops", "flce"))
    ops = [r for r in rows if r["part"] == "ops" and r["impl"] == "triton"]
    assert len(ops) == 32 * 2 + 13 + 3 + 24 * 2 + 12 + 25  # final, design, offgrid, (B, T, H, D)
    assert all(r["pct_copy"] > 0 and r["bytes"] > 0 for r in ops)
    e2e = [r for r in rows if r["part"] == "e2e" and r["sweep"] == "small"]
    assert {len(r["round_step_ms"]) for r in e2e} == {7}
    records = data.read_rows(out / "dry-run-validation.jsonl")
    assert {r["part"] for r in records} == {
        "grid",
        "converge",
        "families",
        "stepcheck",
        "dist-checks",
        "tests",
    }


def test_a_part_resumes_and_again_measures_anew(dry):
    out, written = dry
    assert suite.run_part("readme", "flce", out, dry_run=True, log=lambda _: None) == 0
    again = suite.run_part("readme", "flce", out, dry_run=True, again=True, log=lambda _: None)
    assert again == written["flce"]


def test_the_report_renders_every_table_and_plot(dry):
    out, _ = dry
    for name in tables.TABLES:
        text = tables.render(name, "dry-run", out, "DATA")
        assert "| " in text and "No rows" not in text, name
        assert "Data: `DATA/dry-run" in text
    paths = tables.report(out)
    assert {p.name for p in paths} == {
        "dry-run-ops.png",
        "dry-run-flce.png",
        "dry-run-e2e.png",
        "dry-run-validation.md",
    }
    assert "## Validation grid" in (out / "dry-run-validation.md").read_text()


def test_paired_speedups_and_ratios():
    base = {"step_ms": 100.0, "round_step_ms": [100.0, 120.0, 90.0]}
    ours = {"step_ms": 80.0, "round_step_ms": [80.0, 100.0, 100.0]}
    assert tables.paired(base, ours) == "1.20x [0.90-1.25]"
    assert tables.paired({"step_ms": 100.0}, {"step_ms": 80.0}) == "1.25x"
    assert (
        tables.pytest_counts("567 passed, 16 skipped, 1 warning in 210.86s (0:03:30)")
        == "567 passed, 16 skipped"
    )


def test_gpu_kinds():
    assert data.gpu_kind("NVIDIA H200") == "h200"
    assert data.gpu_kind("NVIDIA H100 80GB HBM3") == "h100"
    assert data.gpu_kind("NVIDIA A100-SXM4-80GB") == "a100"
    assert data.gpu_kind("dry run") == "dry-run"


def test_the_committed_data_files_hold_measurements_only():
    files = sorted(DATA.glob("*.jsonl"))
    assert {p.name for p in files} >= {"h200.jsonl", "h200-validation.jsonl"}
    for path in files:
        rows = data.read_rows(path)
        assert rows, path
        for r in rows:
            assert not r.get("dry_run"), f"{path.name}: a dry run's row"
            assert all(k in r for k in PROVENANCE), (path.name, r)
            assert path.stem.removesuffix("-validation") == r["gpu"] == data.gpu_kind(r["device"])


@pytest.mark.parametrize("doc", DOCS)
def test_the_docs_tables_are_the_data(doc):
    text = (ROOT / doc).read_text()
    assert tables.MARK.search(text), f"{doc} has no generated table"
    assert tables.update_blocks(text, DATA, "benchmarks/data") == text, (
        f"{doc}'s tables differ from benchmarks/data: lmkernels bench --report benchmarks/data --update {doc}"
    )


def test_readme_keeps_the_commands_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    setup = 'pip install "torch==2.13.0" -e ".[triton,hf,test]" && lmkernels validate --device cpu --quick'
    assert f"```bash\npython3 -m venv .venv && . .venv/bin/activate && {setup}\n```" in readme
    assert "```bash\npytest -q -n auto --dist loadfile\n```" in readme


def test_cli_runs_a_part_dry_and_checks_a_document(tmp_path, capsys):
    assert (
        cli.main(["bench", "--suite", "readme", "--part", "dist", "--out", str(tmp_path), "--dry-run"]) == 0
    )
    assert cli.main(["bench", "--list-parts"]) == 0
    assert "e2e-compile" in capsys.readouterr().out
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- bench:dist dry-run -->\nstale\n<!-- /bench -->\n")
    assert cli.main(["bench", "--report", str(tmp_path), "--check", str(doc)]) == 1
    assert cli.main(["bench", "--report", str(tmp_path), "--update", str(doc)]) == 0
    assert "FSDP2 per layer + root" in doc.read_text()
    assert cli.main(["bench", "--report", str(tmp_path), "--check", str(doc)]) == 0
    assert cli.main(["bench", "--part", "dist"]) == 2  # --part without --suite


def test_stepcheck_verdict():
    def step(patched, plain):
        loss = {"patched": 1.0 + patched, "plain_bf16": 1.0 + plain, "fp32": 1.0}
        return {"loss": loss, "grad_err": {"w": (patched, plain)}, "module_err": 0.001, "module": "mlp"}

    runs = [[step(1e-3, 1e-3), step(2e-3, 1e-3)]] * 2
    v = families.stepcheck_verdict(runs)
    assert v["passed"] and v["repeatable"] and v["module"] == [0.001, "mlp"]
    assert not families.stepcheck_verdict([[step(1e-1, 1e-3)]])["passed"]


def _tuner():
    spec = importlib.util.spec_from_file_location("tune_norms", ROOT / "benchmarks" / "tune_norms.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tuner_candidates_and_report():
    tune = _tuner()
    for op in ("rms_norm", "layer_norm"):
        for n in (1024, 3584, 5120, 11008, 16384, 32768):
            fwd, bwd = tune.norm_fwd_candidates(n, op), tune.norm_bwd_candidates(n, op)
            assert fwd and bwd
            names = [tune.fwd_name(f) for f in fwd] + [tune.bwd_name(b) for b in bwd]
            assert len(set(names)) == len(names), (op, n)
    assert len({tune.tile_name(c) for c in tune.TILE_CANDIDATES}) == len(tune.TILE_CANDIDATES)
    shape = [1, 32, 8, 4096, 128, None]
    rows = [
        {"op": "rope", "shape": shape, "variant": v, "kind": "triton", "status": "ok", "ms": ms, "config": c}
        | {"pct_copy": 80.0}
        for v, ms, c in (
            ("table", 1.0, None),
            ("pos table", 1.1, None),
            ("tile e1024 w2 p2048 once", 0.9, [1024, 2, 2048, True, 1]),
        )
    ]
    md = tune.markdown(
        rows, {"device": "GPU", "command": "tune", "torch": "2", "triton": "3", "copy_gbps": 4000.0}
    )
    assert "TILE_TUNED[(64, False)] = (1024, 2, 2048, True, 1)" in md
    assert "| rope | 1x32x8x4096x128 | 1.0000 |" in md
    json.dumps(rows)
