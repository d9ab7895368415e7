"""`lmkernels-bench trl-head` on the CPU: a tiny model through both heads, in this process."""

from __future__ import annotations

import pytest

pytest.importorskip("trl", reason="TRL is in the hf extra")

from lmkernels_bench import trl_head  # noqa: E402


def test_both_heads_one_step_each(tmp_path):
    out = tmp_path / "rows.json"
    argv = [
        "--device",
        "cpu",
        "--tiny",
        "--dtype",
        "fp32",
        "--batch",
        "2",
        "--seq",
        "16",
        "--steps",
        "2",
        "--warmup",
        "1",
    ]
    rows = trl_head.run([*argv, "--in-process", "--backend", "eager", "--json", str(out)])
    assert [r["head"] for r in rows] == ["trl", "lmkernels"]
    trl, lmk = rows
    assert "TRL's fused LM head kept (trl_head='trl')" in trl["path"]
    assert "runs on lmkernels.fused_linear_cross_entropy (backend eager)" in lmk["path"]
    assert len(lmk["step_ms_all"]) == 2 and lmk["step_ms"] > 0 and lmk["tokens_per_s"] > 0
    assert lmk["peak_gib"] is None  # CUDA only
    assert abs(trl["loss"] - lmk["loss"]) <= 1e-4  # same model, batch and loss: fp32 on the CPU
    assert out.is_file() and "environment" in out.read_text()
    assert trl_head._worker_argv(argv, "plain")[-2:] == ["--one", "plain"]


def test_arguments_checked():
    with pytest.raises(SystemExit):
        trl_head.parse_args(["--heads", "trl,fast"])
    with pytest.raises(SystemExit):
        trl_head.parse_args(["--steps", "0"])
