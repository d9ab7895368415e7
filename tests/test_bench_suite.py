"""`lmkernels bench --suite` and its data files: every part's plan runs dry (made-up timings, no
GPU) into rows with their provenance, a part resumes where it stopped, the report renders every
table and plot from such rows; the committed data files hold measurements only, and the README's
and the docs' tables are the ones their data files generate. The tuner's candidates and report
are checked on the CPU too."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmkernels import cli
from lmkernels.harness.bench import data, families, suite, tables, tables_perf, tables_validation

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
    assert {r["part"] for r in rows} == {"ops", "flce", "e2e", "dist", "compare"}
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
        "dry-run-flce-pareto.png",
        "dry-run-e2e.png",
        "dry-run-validation.md",
    }
    assert "## Validation grid" in (out / "dry-run-validation.md").read_text()


def test_paired_speedups_and_ratios():
    base = {"step_ms": 100.0, "round_step_ms": [100.0, 120.0, 90.0]}
    ours = {"step_ms": 80.0, "round_step_ms": [80.0, 100.0, 100.0]}
    assert tables_perf.paired(base, ours) == "1.20x [0.90-1.25]"
    assert tables_perf.paired({"step_ms": 100.0}, {"step_ms": 80.0}) == "1.25x"
    assert (
        tables_validation.pytest_counts("567 passed, 16 skipped, 1 warning in 210.86s (0:03:30)")
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


def _tuner(monkeypatch):
    """`lmkernels tune`'s module and its candidates."""
    from lmkernels.harness.tune import candidates, norms

    return norms, candidates


def test_tuner_candidates_and_report(monkeypatch):
    tune, cand = _tuner(monkeypatch)
    for op in ("rms_norm", "layer_norm"):
        for n in (1024, 3584, 5120, 11008, 16384, 32768):
            fwd, bwd = cand.norm_fwd_candidates(n, op), cand.norm_bwd_candidates(n, op)
            assert fwd and bwd
            names = [cand.fwd_name(f) for f in fwd] + [cand.bwd_name(b) for b in bwd]
            assert len(set(names)) == len(names), (op, n)
            table = cand.tables().norms
            assert all(cand.norm_table_with(table, c) is not table for c in fwd + bwd)  # a valid table
    shape = [1, 32, 8, 4096, 128, None]
    rope = cand.rope_candidates(shape)
    assert len({cand.rope_name(c) for c in rope}) == len(rope)
    tile = next(c for c in rope if cand.rope_name(c) == "tile e1024 w2 p2048")
    meta = {"device": "GPU", "command": "tune", "torch": "2", "triton": "3", "copy_gbps": 4000.0}

    def row(op, shape, variant, ms, record):
        config = cand.as_json(record)
        return {"op": op, "shape": shape, "variant": variant, "kind": "triton", "status": "ok", "ms": ms,
                "config": config, "pct_copy": 80.0}  # fmt: skip

    rows = [row("rope", shape, "table", 1.0, None), row("rope", shape, cand.rope_name(tile), 0.9, tile)]
    md = tune.markdown(rows, meta)
    assert "| rope | 1x32x8x4096x128 | 1.0000 |" in md
    assert "RopeTileConfig(\n            half=64,\n            tile_elements=1024,\n" in md
    assert 'why="fwd+bwd 1.11x the entry it replaces (1 shape)",' in md
    json.dumps(rows)

    # Norms: the entry of the key's points (two widths of one entry) timed at both, with the
    # forward of the fastest forward candidate and the backward of the fastest backward one.
    base = cand.base_entry(cand.tables().norms, "rms_norm", 4096)
    fwd = next(f for f in cand.norm_fwd_candidates(4096, "rms_norm") if f.fwd_warps != base.fwd_warps)
    bwd = next(b for b in cand.norm_bwd_candidates(4096, "rms_norm") if b.stages == base.stages + 1)
    rows = []
    for M, table_ms in ((16384, 1.0), (65536, 4.0)):
        point = [row("rms_norm", [M, 4096], "table", table_ms, base)]
        point += [row("rms_norm", [M, 4096], cand.fwd_name(fwd), table_ms * 0.95, fwd)]
        point += [row("rms_norm", [M, 4096], cand.bwd_name(bwd), table_ms * 0.9, bwd)]
        tuned = tune.tuned_entry(point, base)
        assert (tuned.fwd_warps, tuned.stages) == (fwd.fwd_warps, bwd.stages)
        rows += point + [row("rms_norm", [M, 4096], "tuned", table_ms * 0.8, tuned)]
    rows.append(
        row("rms_norm", [16384, 4096], "bwd one point only", 0.5, dataclasses.replace(bwd, bwd_warps=32))
    )
    md = tune.markdown(rows, meta)
    assert f"bwd_warps={base.bwd_warps}," in md and "cols=(3073, 4096)," in md
    assert f"fwd_warps={fwd.fwd_warps}," in md and f"stages={bwd.stages}," in md
    assert 'why="fwd+bwd 1.25x the entry it replaces (2 shapes)",' in md
    assert "bwd_warps=32," not in md  # timed at one of the key's points only
    assert tune.tuned_entry(rows[:2], base) is None  # one half improved: a candidate already timed


def test_tune_cli_errors_name_the_argument(capsys):
    """`lmkernels tune`: a typo names the option and the known values; no GPU is one line."""
    with pytest.raises(SystemExit) as e:
        cli.main(["tune", "--out", "x", "--ops", "rmsnorm"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--ops: unknown op 'rmsnorm' (did you mean" in err and "Traceback" not in err
    assert cli.main(["tune", "--out", "x", "--ops", "rms_norm", "--grid", "tiles"]) == 2
    assert "--grid tiles has no points for rms_norm" in capsys.readouterr().err
    if not __import__("torch").cuda.is_available():
        assert cli.main(["tune", "--out", "x"]) == 2
        assert "on a CUDA GPU; none is visible here" in capsys.readouterr().err


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU interpreter")
def test_tuner_runs_candidates_through_the_launchers(monkeypatch):
    """Each kind of candidate, passed to the launchers, matches the fp32 reference (the
    interpreter on the CPU)."""
    tune, cand = _tuner(monkeypatch)
    for op, shape in (("rms_norm", (4, 1024)), ("layer_norm", (4, 1024)), ("rope", (1, 4, 2, 16, 64, None))):
        case = tune.Case(op, shape)
        named = dict(cand.variants(op, case, table_only=False)[1:])
        kinds = ("fwd", "bwd") if op != "rope" else ("tile", "pos")
        for kind in kinds:
            name = next(n for n in named if n.startswith(kind))
            assert case.check(case.launch(named[name])) is None, (op, name)
    assert case.check(lambda q, k: (q * 1.01, k)) is not None  # the check can fail


def test_compare_trees_summary_pairs_rounds():
    """benchmarks/compare_trees.py: per case the median of the per-round ratios, and the old
    tree's own spread as the noise."""

    spec = importlib.util.spec_from_file_location(
        "compare_trees", Path(__file__).parent.parent / "benchmarks" / "compare_trees.py"
    )
    compare_trees = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare_trees)
    case = compare_trees.CASES[0][0]
    run = lambda ms: (
        {c: {"ms": 1.0, "peak_mib": 5.0} for c, _, _ in compare_trees.CASES}
        | {case: {"ms": ms, "peak_mib": 5.0}}
    )  # noqa: E731
    runs = {"old": [run(1.0), run(1.2), run(1.0)], "new": [run(1.1), run(1.2), run(0.9)]}
    (row,) = [r for r in compare_trees.summarize(runs, ["old", "new"]) if r["case"] == case]
    assert row["ratio"] == pytest.approx(1.0)  # per-round ratios 1.1, 1.0, 0.9
    assert row["noise"] == pytest.approx(0.2) and row["rounds"] == 3
    assert row["old_ms"] == 1.0 and row["new_ms"] == 1.1


def test_compare_trees_same_process_keeps_each_tree_its_own(tmp_path):
    """compare_trees --same-process: a renamed copy of a tree imports beside the tree itself
    (own package, own torch.library namespace), and with both models patched (side_by_side)
    each runs its own tree's ops, also those patched in transformers' modeling module (rope),
    and its own causal-mask skip (no mask built). The two patched models compute the same loss.
    A second side_by_side in the process is refused (the trees' module patches are in place)."""
    root = Path(__file__).parent.parent
    script = f"""
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("ct", {str(root / "benchmarks" / "compare_trees.py")!r})
ct = importlib.util.module_from_spec(spec); spec.loader.exec_module(ct)
sys.path[:0] = [ct.renamed_tree({str(root / "src")!r}, {str(tmp_path)!r})]
import lmkernels, lmkold
import lmkernels.integrations.transformers as new_hf, lmkold.integrations.transformers as old_hf
assert lmkold.__file__.startswith({str(tmp_path)!r}), lmkold.__file__
from transformers import LlamaConfig, LlamaForCausalLM, masking_utils
import transformers.models.llama.modeling_llama
calls = []
for package in (lmkold, lmkernels):
    real = package.rope
    package.rope = lambda *a, _real=real, _name=package.__name__, **k: (calls.append(_name), _real(*a, **k))[1]
real_find = masking_utils.find_packed_sequence_indices
masking_utils.find_packed_sequence_indices = lambda *a, **k: (calls.append("mask"), real_find(*a, **k))[1]
cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16)
ids = torch.randint(0, 300, (2, 16))
def build(hf):
    torch.manual_seed(0)
    return hf.apply(LlamaForCausalLM(cfg), backend="eager")
models, use = ct.side_by_side({{"old": lambda: build(old_hf), "new": lambda: build(new_hf)}})
losses = {{}}
for tree, package in (("old", "lmkold"), ("new", "lmkernels"), ("old", "lmkold")):
    use(tree)
    calls.clear()
    losses[tree] = models[tree](input_ids=ids, labels=ids).loss.item()
    assert calls and set(calls) == {{package}}, (tree, calls)
assert losses["old"] == losses["new"], losses
# A second call in this process, while a model of the first lives, would leave the new tree's
# functions out (it installs them only once): refused.
keep = models["new"]
del models, use
try:
    ct.side_by_side({{"new": lambda: build(new_hf)}})
except RuntimeError as e:
    assert "live model(s) patched by lmkernels" in str(e) and "one call per process" in str(e), e
else:
    raise AssertionError("a second side_by_side ran")
"""
    env = dict(os.environ, PYTHONPATH=str(root / "src"))
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_dist_table_rows_per_size():
    """The distributed table: one row per GPU count, wrapping and run size (the latest run of
    each), a size other than the default named in the row; a wrapping whose plain run failed
    stays out."""

    def row(mode, config, seq, tps, run, status="ok"):
        return (
            dict(part="dist", mode=mode, config=config, gpus=2, batch=8, seq=seq, layers=8, status=status)
            | dict(
                tokens_per_s_per_gpu=tps,
                peak_mib=1024.0,
                losses=[1.0, 2.0],
                note="",
                run=run,
                date=run,
                commit="c",
            )
            | dict(device="GPU", gpu="h200", versions={"torch": "2.11"}, command="cmd")
        )

    rows = [row("pp", c, 1024, t, "r1") for c, t in (("plain", 100.0), ("lmk", 110.0))]
    rows += [row("pp", c, 4096, t, "r2") for c, t in (("plain", 100.0), ("lmk", 125.0))]
    rows += [row("pp", "lmk", 1024, 90.0, "r0")]  # an older run of the same size: replaced
    rows += [row("fsdp", "plain", 1024, 0.0, "r3", status="failed"), row("fsdp", "lmk", 1024, 1.0, "r3")]
    text = tables_perf.dist_table(rows, "data.jsonl")
    body = [line for line in text.splitlines() if line.startswith("| pipeline") or line.startswith("| FSDP2")]
    assert len(body) == 2, text
    assert body[0].startswith("| pipeline parallel (1F1B) | 2 |") and "| 1.10x |" in body[0]
    assert body[1].startswith("| pipeline parallel (1F1B), 4096 tokens each | 2 |") and "| 1.25x |" in body[1]
