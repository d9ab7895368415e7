"""`lmkernels-bench posttrain` and `posttrain-steps` on the CPU: tiny shapes, every implementation
recorded (run, refused with its reason, or not installed), the loss values of the ones that run
equal."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("trl", reason="TRL is in the hf extra")

from lmkernels_bench import posttrain  # noqa: E402


@pytest.mark.triton
def test_posttrain_tiny(tmp_path):
    rows = posttrain.run(
        ["--tiny", "--device", "cpu", "--out", str(tmp_path), "--rep", "1", "--warmup", "0",
         "--impls", "plain,trl,liger,verl,triton,triton_lean,eager"]
    )  # fmt: skip
    assert {(r["op"], r["impl"]) for r in rows} == {
        (op, impl) for op in posttrain.LOSSES for impl in posttrain.IMPLS
    }
    by = {(r["op"], r["impl"]): r for r in rows}
    for op in posttrain.LOSSES:
        ran = [r for r in rows if r["op"] == op and r["status"] == "ok"]
        assert {"plain", "trl", "eager"} <= {r["impl"] for r in ran}, op
        for r in ran:  # the same loss in every implementation (fp32 on the CPU)
            assert math.isclose(r["loss"], by[(op, "plain")]["loss"], rel_tol=1e-4, abs_tol=1e-5), (
                op,
                r["impl"],
            )
            assert r["wall_ms"] > 0 and r["gpu_ms"] is None and r["peak_mib"] is None
        assert by[(op, "verl")]["status"] in ("needs CUDA", "no such loss")
        assert by[(op, "liger")]["status"] in ("ok", "not installed")
        assert all(r["part"] == "posttrain" and "versions" in r for r in rows)
    assert {by[("dpo", "triton")]["status"], by[("jsd", "triton")]["status"]} == {"ok"}
    grpo = by[("grpo", "triton")]
    if grpo["status"] != "ok":  # the Triton FLCE without temperature / the entropy's gradient yet
        assert grpo["status"] == "unsupported" and "temperature" in grpo["note"]
    assert by[("jsd", "triton_lean")]["status"] == "unsupported"
    saved = json.loads((tmp_path / "posttrain.json").read_text())["rows"]
    assert len(saved) == len(rows) and (tmp_path / "posttrain.md").read_text().startswith("| loss |")
    assert len((tmp_path / "data.jsonl").read_text().splitlines()) == len(rows)


def test_posttrain_budget_and_arguments(tmp_path):
    rows = posttrain.run(
        ["--tiny", "--device", "cpu", "--out", str(tmp_path), "--budget", "0", "--losses", "dpo"]
    )
    assert rows and {r["status"] for r in rows[1:]} <= {"skipped"}
    with pytest.raises(SystemExit):
        posttrain.parse_args(["--out", str(tmp_path), "--losses", "ppo"])


@pytest.mark.parametrize("trainer", ["grpo", "dpo", "gkd"])
def test_posttrain_steps_tiny(trainer, tmp_path):
    from lmkernels_bench import posttrain_steps

    out = tmp_path / "steps.json"
    argv = [
        "--trainer",
        trainer,
        "--device",
        "cpu",
        "--tiny",
        "--dtype",
        "fp32",
        "--batch",
        "4",
        "--seq",
        "16",
    ]
    argv += ["--steps", "1", "--warmup", "1", "--in-process", "--backend", "eager", "--json", str(out)]
    rows = posttrain_steps.run(argv)
    by = {r["config"]: r for r in rows}
    assert set(by) == set(posttrain_steps.CONFIGS)
    lmk, trl = by["lmkernels"], by["trl"]
    assert lmk["status"] == trl["status"] == "ok" and by["trl_liger"]["status"] in ("ok", "not installed")
    assert abs(lmk["loss"] - trl["loss"]) <= 1e-3  # same model, batch and loss: fp32 on the CPU
    assert lmk["tokens_per_s"] > 0 and "lmkernels.fused_linear" in lmk["path"]
    assert json.loads(out.read_text())["rows"] == rows
    with pytest.raises(SystemExit):
        posttrain_steps.parse_args(["--trainer", "grpo", "--batch", "3"])
