"""`lmkernels-bench suite` and its data files: every part's plan runs dry (made-up timings, no
GPU) into rows with their provenance, a part resumes where it stopped, the report renders every
table and plot from such rows; the committed data files hold measurements only, and the README's
and the docs' tables are the ones their data files generate."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmkernels_bench import cli, compare_trees, data, families, suite, tables, tables_perf, tables_validation

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "benchmarks" / "data"
PROVENANCE = ("part", "device", "gpu", "gpus", "versions", "commit", "date", "command", "run")
DOCS = ("README.md", "docs/performance.md", "docs/distributed.md", "docs/scaling.md")


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
    assert {r["part"] for r in rows} == {"ops", "flce", "e2e", "dist", "compare", "generic"}
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


def test_captions_are_one_line_with_the_command_that_measures_again():
    """A caption: device, dates, commits, data file, and the suite's command for the rows; rows
    of a script no longer in the tree (tables_common.RETIRED) are said to be so."""
    from lmkernels_bench.tables_common import caption, suite_command

    def row(day, command, commit):
        return dict(
            device="GPU", run=f"r{day}", command=command, commit=commit, date=f"2026-01-0{day}T10:00:00"
        )

    rows = [
        row(1, "scripts/copy_floor.py --out X", "a1"),
        row(2, "lmkernels-bench suite readme --part ops", "b2"),
    ]
    rerun = suite_command("readme", "ops")
    text = caption(rows, "benchmarks/data/h200.jsonl", ", part ops", rerun)
    assert text == (
        "<sub>GPU, 2026-01-01 to 2026-01-02, commits a1, b2. Data: `benchmarks/data/h200.jsonl`, part ops. "
        "1 of 2 runs made by a script no longer in the tree; rerun with "
        "`lmkernels-bench suite readme --part ops --out benchmarks/data`.</sub>"
    )
    assert "Made by a script no longer in the tree; rerun with `" in caption(rows[:1], "d/x.jsonl", "", rerun)
    only_new = caption(rows[1:], "d/x.jsonl", "", rerun)
    assert only_new.endswith(
        "commit b2. Data: `d/x.jsonl`. Rerun: `lmkernels-bench suite readme --part ops --out d`.</sub>"
    )
    many = [row(i, "c", f"c{i}") for i in range(1, 6)]
    assert "5 commits, c1 to c5" in caption(many, "d/x.jsonl") and "\n" not in caption(many, "d/x.jsonl")


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
        f"{doc}'s tables differ from benchmarks/data: lmkernels-bench report benchmarks/data --update {doc}"
    )


def test_cli_runs_a_part_dry_and_checks_a_document(tmp_path, capsys):
    assert cli.main(["suite", "readme", "--part", "dist", "--out", str(tmp_path), "--dry-run"]) == 0
    assert cli.main(["suite", "--list"]) == 0
    assert "e2e-compile" in capsys.readouterr().out
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- bench:dist dry-run -->\nstale\n<!-- /bench -->\n")
    assert cli.main(["report", str(tmp_path), "--check", str(doc)]) == 1
    assert cli.main(["report", str(tmp_path), "--update", str(doc)]) == 0
    assert "FSDP2 per layer + root" in doc.read_text()
    assert cli.main(["report", str(tmp_path), "--check", str(doc)]) == 0
    with pytest.raises(SystemExit) as e:  # --part without a suite
        cli.main(["suite", "--part", "dist", "--out", str(tmp_path)])
    assert e.value.code == 2
    assert "needs a suite" in capsys.readouterr().err
    assert cli.main(["nope"]) == 2 and "unknown command 'nope'" in capsys.readouterr().err


def test_stepcheck_verdict():
    def step(patched, plain):
        loss = {"patched": 1.0 + patched, "plain_bf16": 1.0 + plain, "fp32": 1.0}
        return {"loss": loss, "grad_err": {"w": (patched, plain)}, "module_err": 0.001, "module": "mlp"}

    runs = [[step(1e-3, 1e-3), step(2e-3, 1e-3)]] * 2
    v = families.stepcheck_verdict(runs)
    assert v["passed"] and v["repeatable"] and v["module"] == [0.001, "mlp"]
    assert not families.stepcheck_verdict([[step(1e-1, 1e-3)]])["passed"]


def test_trajectory_noise_runs_change_only_the_row_order():
    """The plain bf16 runs that measure the rounding noise see every batch's rows in another
    order, never other rows; the distance reads the second half of the steps."""
    import torch

    from lmkernels.convergence.data import Batches

    batches = Batches(
        train=[torch.arange(12).view(4, 3) + 100 * i for i in range(3)], eval=[], vocab_size=500
    )
    assert families.permuted(batches, 0) is batches
    other = families.permuted(batches, 1)
    for a, b in zip(batches.train, other.train):
        assert sorted(map(tuple, a.tolist())) == sorted(map(tuple, b.tolist()))
    assert any(not torch.equal(a, b) for a, b in zip(batches.train, other.train))
    assert families.distance([9.0, 9.0, 1.5, 2.0], [0.0, 0.0, 1.0, 1.0]) == 0.75


def test_compare_trees_summary_pairs_rounds():
    """`lmkernels-bench compare-trees`: per case the median of the per-round ratios, and the old
    tree's own spread as the noise."""
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
    root = ROOT
    script = f"""
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("ct", {compare_trees.__file__!r})
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
    stays out, and so do rows of a script no longer in the tree."""

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
    retired = [row("tp", c, 1024, 50.0, "r4") for c in ("plain", "lmk")]
    rows += [r | {"command": "python benchmarks/dist_train.py --tp 2"} for r in retired]
    text = tables_perf.dist_table(rows, "data.jsonl")
    assert "| TP" not in text and "no longer in the tree" not in text, text
    body = [line for line in text.splitlines() if line.startswith("| pipeline") or line.startswith("| FSDP2")]
    assert len(body) == 2, text
    assert body[0].startswith("| pipeline parallel (1F1B) | 2 |") and "| 1.10x |" in body[0]
    assert body[1].startswith("| pipeline parallel (1F1B), 4096 tokens each | 2 |") and "| 1.25x |" in body[1]


def test_commit_of_an_exported_tree_is_not_the_enclosing_repository(tmp_path, monkeypatch):
    """A copy of the tree without its git history, placed inside another repository, has no
    commit of its own: none is recorded (LMKERNELS_COMMIT names it), never the enclosing one's."""
    import subprocess

    monkeypatch.delenv("LMKERNELS_COMMIT", raising=False)
    outer = tmp_path / "outer"
    (outer / "export" / "src" / "lmkernels").mkdir(parents=True)
    env = {
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    for args in (["init", "-q"], ["commit", "-q", "--allow-empty", "-m", "outer"]):
        subprocess.run(["git", *args], cwd=outer, check=True, env={**__import__("os").environ, **env})
    assert data.commit(outer / "export") is None
    assert data.commit(outer) is not None  # the repository's own root: its commit
    monkeypatch.setenv("LMKERNELS_COMMIT", "abc1234")
    assert data.commit(outer / "export") == "abc1234"


def test_stepcheck_runs_a_family_with_sliding_window_layers():
    """The step check's module hook re-runs each patched module on its own arguments; with a
    cache in them, gemma3's sliding-window attention saw more keys than its mask (a GPU run
    failed so). One step of the tiny model on the CPU."""
    from lmkernels_bench import families

    batches = families.make_batches(1, 2, 32)
    (run,) = families.stepcheck_runs("gemma3_text", "eager", batches, 32, 1, "cpu")
    assert len(run) == 1 and run[0]["module"] and 0 <= run[0]["module_err"] < 0.05


def test_validation_summary_sums_sanitizer_runs_and_leaves_out_retired_scripts():
    """The README's summary: one line per sanitizer and per group run in shards (counts summed),
    no runs of scripts no longer in the tree; the full report shows a trajectory's distances and a step
    check that crashed (no numbers) with its note."""

    def row(part, run, command="lmkernels-bench suite validation", **fields):
        base = dict(part=part, run=run, command=command, commit="abc1234", device="GPU")
        return base | dict(date="2026-01-01T10:00:00") | fields

    def test_row(run, group, tool, pytest_line, errors=None, command="lmkernels-bench suite validation"):
        fields = dict(group=group, tool=tool, select=run, pytest=pytest_line, sanitizer_errors=errors)
        return row("tests", run, command, **fields)

    norms, flce = (suite.TEST_PARTS[p][3] for p in ("props-long-norms", "props-long-flce"))
    shards = sum(1 for a in suite.TEST_PARTS.values() if a[1] == "properties-long")
    records = [
        test_row("a", "kernels", "memcheck", "10 passed, 5 deselected in 1.0s", 0),
        test_row("b", "large", "memcheck", "1 failed, 3 passed in 2.0s", 2),
        test_row("c", "kernels", "none", "7 passed in 1.0s"),
        test_row("g", "properties-long", "none", "12 passed, 90 deselected in 500.0s") | {"select": norms},
        test_row("h", "properties-long", "none", "1 failed, 5 passed in 400.0s") | {"select": flce},
        test_row("i", "properties-long", "none", "40 passed in 400.0s") | {"select": "a retired shard"},
        test_row("d", "correctness", "none", "9 passed in 1.0s", command="bash scripts/gpu_tests.sh x"),
        row("families", "e", family="llama", passed=True, ops=["rope"],
            distance={"patched": 0.02, "plain_bf16": [0.01, 0.03], "limit": 0.045}),
        row("stepcheck", "f", family="gemma3_text", passed=False, loss=None, note="crashed in the harness"),
    ]  # fmt: skip
    summary = tables_validation.validation_summary(records, "DATA/x.jsonl")
    assert "memcheck, 2 runs (groups kernels, large) | 13 passed, 1 failed, 2 sanitizer errors" in summary
    assert "group kernels (-k c) | 7 passed" in summary and "correctness" not in summary
    assert f"group properties-long, 2 of {shards} shards | 17 passed, 1 failed |" in summary
    assert "per step on shared weights | 0 of 1 pass" in summary
    report = tables_validation.validation_report(records, "x", "DATA/x.jsonl")
    assert "patched 0.02 / limit 0.045 (plain 0.01-0.03)" in report
    assert "| gemma3_text | FAIL | crashed in the harness |" in report
