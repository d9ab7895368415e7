"""The end-to-end benchmark (`lmkernels-bench e2e`, lmkernels_bench.e2e): the --quick plan covers what it must within its budget; a tiny run
on the CPU goes through workers, reports and plots; rounds, --interleave (with real workers and
with fakes that fail in each way) and the paired speedups."""

from __future__ import annotations

import json
import sys
import threading
import time

import pytest
import torch

from lmkernels_bench import e2e as e2e_train
from lmkernels_bench import e2e_report, e2e_setup, plots
from lmkernels_bench.timeline import allocated_timeline


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
    assert e2e_setup.parse_config("lmk-nocheck-1thread+compile") == e2e_setup.parse_config("lmk+compile")
    assert not e2e_setup.value_checks("lmk-nocheck-1thread") and e2e_setup.value_checks("liger-1thread")
    assert not e2e_setup.backward_threads("plain-1thread") and not e2e_setup.backward_threads(
        "lmk-1thread+compile"
    )
    assert e2e_setup.backward_threads("lmk") and e2e_setup.backward_threads("lmk-nocheck+compile")
    for bad in (
        "lmk-1thread-nocheck",
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


def test_rounds_rotate_configs_and_take_the_median():
    """--rounds: each round runs the configurations in another order; a point's step time is
    the median over the rounds that ran it."""
    e2e = e2e_train
    plan = [("m", "plain", ["p"]), ("m", "lmk", ["p"]), ("m", "liger", ["p"])]
    order = [(w[1], w[3]) for w in e2e.rounds(plan, 3)]
    assert order[:3] == [("plain", 0), ("lmk", 0), ("liger", 0)]
    assert order[3:6] == [("lmk", 1), ("liger", 1), ("plain", 1)] and order[6][0] == "liger"
    row = {"model": "m", "config": "lmk", "sweep": "small", "batch": 2, "seq": 512, "status": "ok"}
    rows = [row | {"round": r, "step_ms": ms, "tokens_per_s": 0.0, "peak_gib": 9.0 + r, "note": ""}
            for r, ms in enumerate((80.0, 64.0, 70.0))]  # fmt: skip
    rows.append(row | {"round": 3, "status": "error", "step_ms": None, "peak_gib": None})
    (median,) = e2e.median_over_rounds(rows)
    assert median["step_ms"] == 70.0 and median["peak_gib"] == 11.0 and "round" not in median
    assert median["tokens_per_s"] == pytest.approx(1024 / 0.070) and "median of 3 rounds" in median["note"]
    (even,) = e2e.median_over_rounds(rows[:2])
    assert even["step_ms"] == 72.0


def test_paired_speedups(tmp_path):
    """Per round, the base's step over the configuration's, where both ran: median, range and
    the rounds it was faster in; pairs for non-base configurations and lmk, against each base."""
    report = e2e_report
    point = {"model": "m", "sweep": "small", "batch": 1, "seq": 512}
    steps = {"plain": (100.0, 120.0, 90.0), "lmk": (80.0, 100.0, 100.0), "lmk-x": (50.0, None, 45.0)}
    rows = [point | {"config": c, "round": r, "step_ms": ms, "status": "ok" if ms else "OOM"}
            for c, per_round in steps.items() for r, ms in enumerate(per_round)]  # fmt: skip
    got = {(p["config"], p["base"]): p for p in report.paired_speedups(rows)}
    assert set(got) == {("lmk", "plain"), ("lmk-x", "plain"), ("lmk-x", "lmk")}  # plain is a base
    lmk = got[("lmk", "plain")]
    assert lmk["median"] == 1.2 and (lmk["min"], lmk["max"]) == (0.9, 1.25) and lmk["faster"] == 2
    x = got[("lmk-x", "lmk")]
    assert x["pairs"] == 2 and x["median"] == pytest.approx((1.6 + 100 / 45) / 2) and x["faster"] == 2
    assert "| m | small | 1 | 512 | lmk | plain | 1.20x [0.90-1.25] | 2/3 |" in report.paired_summary(
        report.paired_speedups(rows)
    )
    png = plots.plot_e2e_paired(report.paired_speedups(rows), tmp_path / "paired.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


FAKE_E2E_WORKER = r"""
import json, sys
spec = json.loads(sys.argv[1])
if spec["config"] == "broken":
    print(json.dumps({"setup_error": "ValueError: no such patch"}), flush=True)
    sys.exit(0)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    point = json.loads(line)
    with open(spec["results"] + ".order", "a") as f:  # what was asked, in order
        f.write(f"{spec['config']} {point['batch']} {point['timeline']}\n")
    oom = spec["config"] == "big" and point["batch"] >= 2
    row = {"model": spec["model_name"], "config": spec["config"], "sweep": point["sweep"],
           "batch": point["batch"], "seq": point["seq"], "tokens_per_s": None if oom else 1.0,
           "peak_gib": None, "step_ms": None if oom else 10.0 * point["batch"], "steps": 2,
           "loss": 1.0, "status": "OOM" if oom else "ok", "note": ""}
    print(json.dumps(row), flush=True)
    if spec["config"] == "dies":
        sys.exit(1)
"""


def test_interleave_takes_turns_per_point(monkeypatch, tmp_path):
    """--interleave: resident workers answer one point at a time; each point goes to every
    configuration in an order rotated per point and round; a point shared by two sweeps is
    measured once; a failed set-up, an OOM, a worker that exits and a start past the deadline
    show in the rows."""
    e2e = e2e_train
    monkeypatch.setattr(
        e2e, "worker_cmd", lambda spec: [sys.executable, "-c", FAKE_E2E_WORKER, json.dumps(spec)]
    )
    args = e2e.parse_args(["--device", "cpu", "--tiny", "--rounds", "2", "--interleave"])
    points = [{"sweep": "batch", "batch": b, "seq": 32, "timeline": b == 2} for b in (1, 2, 4)]
    points.append({"sweep": "small", "batch": 1, "seq": 32})
    configs = ["plain", "lmk", "big", "broken", "dies"]
    rows = e2e.run_interleaved("tiny", configs, points, args, tmp_path, time.time() + 60)

    asked = {
        c: (tmp_path / "raw" / f"tiny_{c}.jsonl.order").read_text().split("\n")[:-1] for c in configs[:3]
    }
    assert asked["plain"] == ["plain 1 False", "plain 2 True", "plain 4 False"] + [
        "plain 1 False", "plain 2 False", "plain 4 False"]  # fmt: skip
    assert asked["big"] == ["big 1 False", "big 2 True", "big 1 False"]  # none as large as an OOM
    assert [r["config"] for r in rows] == sorted((r["config"] for r in rows), key=configs.index)
    assert len(rows) == len(configs) * 2 * 4  # 4 rows a round: batch 1 stands for both sweeps
    by = {(r["config"], r["sweep"], r["batch"], r["round"]): r for r in rows}
    assert by[("lmk", "small", 1, 1)]["step_ms"] == by[("lmk", "batch", 1, 1)]["step_ms"] == 10.0
    assert by[("big", "batch", 4, 0)]["status"] == "skipped" and by[("big", "batch", 2, 0)]["status"] == "OOM"
    assert {by[("broken", "batch", b, r)]["note"] for b in (1, 2, 4) for r in (0, 1)} == {
        "setup: ValueError: no such patch"}  # fmt: skip
    dies = [by[("dies", "batch", b, r)] for r in (0, 1) for b in (1, 2, 4)]
    assert dies[0]["status"] == "ok" and {r["note"] for r in dies[1:]} == {
        "the worker stopped answering (see its output)"}  # fmt: skip

    order = tmp_path / "order.txt"
    monkeypatch.setattr(e2e, "worker_cmd", lambda spec: [sys.executable, "-c", FAKE_E2E_WORKER.replace(
        'spec["results"] + ".order"', repr(str(order))), json.dumps(spec)])  # fmt: skip
    e2e.run_interleaved("tiny", ["plain", "lmk"], points[:2], args, tmp_path, time.time() + 60)
    turns = [line.split()[0] for line in order.read_text().splitlines()]
    assert turns == ["plain", "lmk", "lmk", "plain", "lmk", "plain", "plain", "lmk"]  # rotated

    late = e2e.run_interleaved("tiny", ["plain"], points[:1], args, tmp_path, time.time() - 1)
    assert {(r["status"], r["note"]) for r in late} == {("error", "the worker did not start in time")}


def test_tiny_interleaved_run_on_cpu(tmp_path):
    """--interleave with real workers: both configurations measure every point in each round;
    the paired speedups reach summary.md, e2e.json and their plot."""
    argv = ["--device", "cpu", "--tiny", "--out", str(tmp_path), "--configs", "plain,lmk:eager"]
    argv += ["--sweeps", "small", "--steps", "1", "--warmup-steps", "1", "--min-timed-s", "0"]
    assert e2e_train.main([*argv, "--interleave", "--rounds", "2"]) == 0
    rounds = json.loads((tmp_path / "e2e_rounds.json").read_text())
    assert sorted((r["config"], r["round"], r["status"]) for r in rounds) == [
        (c, r, "ok") for c in ("lmk:eager", "plain") for r in (0, 1)
    ]
    (pair,) = json.loads((tmp_path / "e2e.json").read_text())["paired"]
    assert (pair["config"], pair["base"], pair["pairs"]) == ("lmk:eager", "plain", 2)
    assert "## speedups per round, paired" in (tmp_path / "summary.md").read_text()
    assert (tmp_path / "e2e_paired_tiny.png").exists()


def test_1thread_runs_the_backward_on_the_training_thread():
    seen = {}

    def worker(name):
        e2e_setup.patch(torch.nn.Linear(2, 2), name)
        seen[name] = torch._C._is_multithreading_enabled()

    for name in ("plain-1thread", "plain"):  # each in a fresh thread: the setting is thread-local
        thread = threading.Thread(target=worker, args=(name,))
        thread.start()
        thread.join()
    assert seen == {"plain-1thread": False, "plain": True}


def test_e2e_plots_and_timeline(tmp_path):
    rows = [
        {
            "config": c,
            "sweep": "batch",
            "batch": b,
            "seq": 1024,
            "status": "ok" if b < 64 or c != "plain" else "OOM",
            "tokens_per_s": 1000.0 * b,
            "peak_gib": float(b),
        }
        for c in ("plain", "lmk")
        for b in (4, 16, 64)
    ]
    assert [p.name for p in plots.plot_e2e(rows, tmp_path)] == ["e2e_batch.png"]
    events = [
        {"action": "alloc", "size": 2**20, "time_us": 10},
        {"action": "segment_alloc", "size": 2**30, "time_us": 11},
        {"action": "alloc", "size": 2**21, "time_us": 20},
        {"action": "free_completed", "size": 2**20, "time_us": 30},
    ]
    tl = allocated_timeline(events, base_bytes=2**20)
    assert tl["x"] == pytest.approx([0.0, 0.01, 0.02]) and tl["mib"] == [2.0, 4.0, 3.0]
    path = plots.plot_memory_timeline({"plain": tl, "lmk": tl}, tmp_path / "timeline.png")
    assert path.stat().st_size > 10_000
