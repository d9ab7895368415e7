"""`lmkernels-bench generic` on the CPU (--device cpu --tiny, the kernels interpreted): each
target's generic tables forced through the public op, beside this device's tables and
torch.compile, rows appended to the data file with their provenance, and the summary that fills
configs.generic.PREFER_COMPILE."""

from __future__ import annotations

import pytest

from lmkernels_bench import data, generic


@pytest.mark.triton
def test_generic_tiny_on_cpu(tmp_path):
    argv = [
        "--device",
        "cpu",
        "--tiny",
        "--out",
        str(tmp_path),
        "--ops",
        "rms_norm,rope",
        "--targets",
        "sm_80,gfx942",
    ]
    assert generic.main(argv) == 0
    rows = data.read_rows(tmp_path / "cpu.jsonl")
    impls = {(r["op"], r["impl"]): r for r in rows}
    for op in ("rms_norm", "rope"):
        assert impls[op, "triton"]["status"] == "ok" and impls[op, "triton"]["tables"] == "default"
        for target in ("sm_80", "gfx942"):
            row = impls[op, f"triton@{target}"]
            assert row["status"] == "ok", row
            assert row["target"] == target and row["tables"] == f"generic {target}"
        assert impls[op, "compile"]["status"] == "ok"
        assert impls[op, "compile"]["vs_compile"] == 1.0
    assert all(
        r["part"] == "generic" and r["commit"] is not None and r["wall_ms"]
        for r in rows
        if r["status"] == "ok"
    )
    text = (tmp_path / "cpu-generic.md").read_text()
    assert "| sm_80 | rms_norm | 1 |" in text and "PREFER_COMPILE = {" in text


def test_summary_names_the_ops_generic_tables_lose_to_compile():
    def row(impl, target, op, shape, ms):
        return {"impl": impl, "target": target, "op": op, "shape": shape, "status": "ok", "gpu_ms": ms}

    rows = []
    for shape, (own, generic_ms, compiled) in {
        "a": (1.0, 1.3, 1.2),
        "b": (1.0, 1.1, 1.0),
        "c": (1.0, 1.0, 1.5),
    }.items():
        point = [
            row("triton", None, "rms_norm", shape, own),
            row("triton@sm_86", "sm_86", "rms_norm", shape, generic_ms),
        ]
        point.append(row("compile", None, "rms_norm", shape, compiled))
        generic.add_ratios(point)
        rows += point
    text = generic.summary(rows)
    assert "| sm_86 | rms_norm | 3 | 2 | 2 | 0.91x |" in text
    assert "\"sm_86\": frozenset(['rms_norm'])," in text
