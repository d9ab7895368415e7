"""The distributed benchmark (`lmkernels-bench dist-scale`, lmkernels_bench.scale) without GPUs: its plan of runs (--dry-run), its argument checks, and
one tiny run on the CPU (gloo) through torchrun, the path every GPU run takes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the benchmark trains transformers models")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available in this torch build", allow_module_level=True)

from lmkernels_bench import scale as dist_scale  # noqa: E402
from lmkernels_bench import scale_worker as dist_scale_worker  # noqa: E402


def _rows(out: Path) -> tuple[dict, list[dict]]:
    data = json.loads((out / "dist_scale.json").read_text())
    return data["environment"], data["runs"]


def test_dry_run_plans_every_wrapping(tmp_path):
    assert dist_scale.main(["--out", str(tmp_path), "--dry-run", "--configs", "plain,lmk"]) == 0
    env, rows = _rows(tmp_path)
    for key in ("device", "torch", "transformers", "deepspeed", "lmkernels_commit", "command"):
        assert key in env
    status = {(r["gpus"], r["mode"], r["config"]): r for r in rows}
    assert len(status) == 3 * len(dist_scale.MODES) * 2
    zero_ok, titan_ok = find_spec("deepspeed") is not None, find_spec("torchtitan") is not None
    for (n, mode, _), r in status.items():
        least, even, _ = dist_scale.MODES[mode]
        runnable = n >= least and not (even and n % 2) and (zero_ok or not mode.startswith("zero"))
        runnable &= titan_ok or not mode.startswith("titan")
        assert r["status"] == ("planned" if runnable else "n/a"), (n, mode, r)
        if runnable:
            assert f"--nproc-per-node {n} " in r["command"] and f"--mode {mode} " in r["command"]
        else:
            assert r["error"]
    assert "needs >= 4 GPUs" in status[(2, "fsdp_tp_torch", "lmk")]["error"]
    if not titan_ok:
        assert status[(2, "titan_pp", "lmk")]["error"] == "torchtitan is not installed"
    assert (tmp_path / "dist_scale.md").read_text().count("| planned |") == sum(
        r["status"] == "planned" for r in rows
    )


def test_torchtitan_runs_named_where_they_cannot_run(tmp_path):
    """Liger has no torchtitan integration, and the torchtitan runs need GPUs: both are rows
    that say why, whatever is installed."""
    assert dist_scale.run_problem("titan_fsdp", "liger", tiny=False) == "Liger has no torchtitan integration"
    assert "GPUs" in dist_scale.run_problem("titan_pp", "lmk", tiny=True)
    assert dist_scale.run_problem("titan_tp", "lmk", tiny=False) is None
    assert dist_scale.run_problem("pp", "liger", tiny=True) is None
    assert dist_scale.main(["--out", str(tmp_path), "--tiny", "--gpus", "2", "--modes", "titan_pp"]) == 0
    _, rows = _rows(tmp_path)
    assert [r["status"] for r in rows] == ["n/a"] * 3
    assert dist_scale_worker.replicas("titan_pp", 4) == 2 and dist_scale_worker.replicas("titan_fsdp", 4) == 4


def test_torchtitan_peaks_of_the_timed_steps():
    """The peak of a torchtitan run: after the warmup steps, or every step's under CUDA graphs
    (their replays allocate nothing new)."""
    from lmkernels_bench.scale_titan import step_peaks

    assert step_peaks([9, 5, 3, 4], graphs=False, warmup=2) == (4, 9)
    assert step_peaks([9, 5, 3, 4], graphs=True, warmup=2) == (9, 9)
    assert step_peaks([], graphs=False, warmup=2) == (0, 0)


def test_arguments_checked_before_any_run(tmp_path):
    assert "unknown backend 'trition'" in dist_scale.check_config("lmk:eager/flce=trition")
    assert "unknown configuration" in dist_scale.check_config("lmkernels")
    assert dist_scale.check_config("lmk:triton/flce=eager") is None
    assert dist_scale.main(["--out", str(tmp_path), "--modes", "fsdp,zero4", "--dry-run"]) == 2
    assert dist_scale.mode_problem("pp", 4, layers=2) == "needs >= 4 layers for 4 stages"
    assert dist_scale_worker.replicas("fsdp_tp_hf", 8) == 4 and dist_scale_worker.replicas("tp", 4) == 1


def test_comparisons_and_table():
    run = lambda mode, config, tok, peak, losses: {  # noqa: E731
        "gpus": 4,
        "mode": mode,
        "config": config,
        "status": "ok",
        "tokens_per_s_per_gpu": tok,
        "peak_gib": peak,
        "losses": losses,
    }
    rows = [
        run("fsdp", "lmk", 200.0, 10.0, [2.0, 1.0]),
        run("fsdp_tp_torch", "plain", 100.0, 20.0, [2.0, 1.0]),
        run("fsdp_tp_torch", "lmk", 150.0, 8.0, [2.0, 1.001]),
        run("fsdp_tp_torch", "liger", 120.0, 10.0, [2.0, 1.0]),
        {"gpus": 4, "mode": "zero3", "config": "liger", "status": "error", "error": "RuntimeError: x | y"},
    ]
    dist_scale.compare_rows(rows)
    lmk = rows[2]
    assert lmk["tokens_vs_plain"] == 1.5 and lmk["peak_vs_plain"] == 0.4
    assert lmk["tokens_vs_liger"] == 1.25 and lmk["peak_vs_liger"] == 0.8
    assert lmk["tokens_vs_fsdp"] == 0.75 and lmk["peak_vs_fsdp"] == 0.8
    assert abs(lmk["max_loss_rel_diff_vs_plain"] - 1e-3) < 1e-12
    table = dist_scale.summary(rows, {"device": "X"})
    assert "| fsdp_tp_torch | 4 | lmk | 150 | 1.50x | 1.25x | 0.75x | 8.0 | 0.40x | 1.0e-03 | ok |" in table
    assert "error: RuntimeError: x / y" in table


def test_tiny_cpu_run(tmp_path):
    """One run through torchrun on the CPU (2 processes, pipeline parallel, lmkernels' loss on
    the last stage): a row with the losses, throughput and the environment."""
    argv = ["--out", str(tmp_path), "--tiny", "--gpus", "2", "--modes", "pp", "--configs", "lmk"]
    argv += ["--steps", "3", "--batch", "4", "--seq", "16", "--layers", "2", "--budget", "300"]
    assert dist_scale.main(argv) == 0
    env, rows = _rows(tmp_path)
    assert env["device"] == "cpu"
    assert [r["status"] for r in rows] == ["ok"], rows
    (row,) = rows
    assert len(row["losses"]) == 3 and all(5 < x < 8 for x in row["losses"]), row  # ln(1000) = 6.9
    assert row["tokens_per_s_per_gpu"] > 0 and row["step_ms"] > 0
    assert len(row["rank_peaks_gib"]) == 2 and row["peak_gib"] == max(row["rank_peaks_gib"])  # 0 on the CPU
    assert "| pp | 2 | lmk |" in (tmp_path / "dist_scale.md").read_text()
    (data_row,) = [json.loads(line) for line in (tmp_path / "data.jsonl").read_text().splitlines()]
    assert data_row["part"] == "dist" and data_row["mode"] == "pp" and data_row["losses"] == row["losses"]
    for key in ("device", "gpu", "gpus", "versions", "commit", "date", "command", "run", "peer"):
        assert data_row[key] is not None, key
    assert data_row["peer"].startswith("lmkernels") and data_row["gpus"] == 2


def test_a_failing_rank_ends_the_run(tmp_path):
    """A rank that fails while another waits for it in a collective writes the row and ends the
    job at once, not at the run's timeout (transformers' loading of a 2-D model failed on 2 of 4
    ranks while the other two waited)."""
    script = tmp_path / "fails_on_rank_1.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys, types
            import torch.distributed as dist
            from lmkernels_bench.scale_worker import run_worker

            def train(args, result, device, rank, world):
                if rank == 1:
                    raise ValueError("rank 1 cannot")
                dist.barrier()

            run_worker(types.SimpleNamespace(json=sys.argv[1], tiny=True, mode="fsdp", config="lmk"), train)
            """
        )
    )
    row = tmp_path / "row.json"
    start = time.monotonic()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.run([*cmd, str(script), str(row)], timeout=300, capture_output=True, text=True)
    assert proc.returncode != 0
    result = json.loads(row.read_text())
    assert result["status"] == "error" and result["error"] == "ValueError: rank 1 cannot", result
    assert time.monotonic() - start < 120
