"""Reports of the FLCE frontier benchmark (frontier.py): results.csv, results.json, summary.md and the ratio plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmkernels.harness.bench.report import write_tables

# The run's settings (frontier.py writes them into meta; this module imports nothing of it).
TIME_BASE, MEM_BASE = "compile_naive", "cce"
OURS = ("triton",)
REGIMES = ("uniform", "gaussian", "zipf")

FIELDS = [
    *("shape", "BT", "H", "V", "softcap", "regime", "entropy", "variant", "backend", "options"),
    *("status", "gpu_ms", "ms", "ms_p20", "ms_p80", "peak_mib", "tflops_gpu", "pct_matmul_gpu"),
    *(f"time_vs_{TIME_BASE}", f"time_vs_{MEM_BASE}", f"mem_vs_{TIME_BASE}", f"mem_vs_{MEM_BASE}"),
    "note",
]
META_KEYS = ("date", "device", "torch", "cuda", "triton", "liger-kernel", "cut-cross-entropy", "lmkernels")
META_KEYS += ("dtype", "command", "seconds", "partial")


def _f(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    return (
        f"{v:.{digits}g}"
        if isinstance(v, float) and abs(v) < 1000
        else f"{v:.0f}"
        if isinstance(v, float)
        else str(v)
    )


def _status(r: dict[str, Any]) -> str:
    return "ok" if r["status"] == "ok" else f"{r['status']}: {r.get('note', '')}".replace("|", "/")[:90]


def _targets(rows: list[dict[str, Any]]) -> list[str]:
    """Per case, our best variant against the targets (time <= compile_naive, peak <= 1.1x cce)."""
    lines = [
        "## Targets: GPU time <= compile_naive, peak <= 1.1x cce (our best variant per case)",
        "",
        f"| shape | regime | entropy | best of {', '.join(OURS)} | GPU ms | time / {TIME_BASE} "
        f"| peak MiB | peak / {MEM_BASE} | met |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    cases: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        cases.setdefault((r["shape"], r["regime"]), []).append(r)
    for (shape, regime), group in cases.items():
        ours = [r for r in group if r["backend"] in OURS and r["status"] == "ok"]
        if not ours:
            continue
        t = lambda r: r.get("gpu_ms") or r.get("ms") or float("inf")
        best = min(ours, key=t)
        tv, mv = best.get(f"time_vs_{TIME_BASE}"), best.get(f"mem_vs_{MEM_BASE}")
        met = []
        if tv is not None:
            met.append("time ok" if tv <= 1.0 else f"time MISS {tv:.2f}x")
        if mv is not None:
            met.append("mem ok" if mv <= 1.1 else f"mem MISS {mv:.2f}x")
        lines.append(
            f"| {shape} | {regime} | {_f(best.get('entropy'))} | {best['variant']} | {_f(t(best), 4)} "
            f"| {_f(tv)} | {_f(best.get('peak_mib'), 4)} | {_f(mv)} | {', '.join(met) or '-'} |"
        )
    return lines


def summary_markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = ["# FLCE frontier", ""]
    lines += [f"- {k}: {meta[k]}" for k in META_KEYS if k in meta]
    if meta.get("copy_gbps"):
        lines.append(
            f"- copy bandwidth {meta['copy_gbps']:.0f} GB/s, bf16 matmul {meta['matmul_tflops']:.0f} TFLOP/s"
        )
    lines += [f"- variant {n}: {d}" for n, d in meta.get("variants", {}).items()]
    lines += [f"- not run: {b}: {why}" for b, why in meta.get("not_run", {}).items()]
    lines += [
        "",
        "fwd+bwd. GPU time: device time of one call with the launch queue filled ahead; wall: "
        "do_bench median (host gaps included); peak: max_memory_allocated above the inputs; "
        "x / X: ratio to variant X in the same case (time: GPU time, or wall on the CPU); "
        "% mm: 6*BT*H*V flops per GPU second against the bf16 matmul rate. Peers run their default "
        "call (grad_accum_dtype = weight dtype). Entropy: mean softmax entropy of the inputs (nats).",
        "",
        *_targets(rows),
    ]
    for regime in REGIMES:
        group = [r for r in rows if r["regime"] == regime]
        if not group:
            continue
        lines += [
            "",
            f"## {regime} logits",
            "",
            f"| shape | variant | GPU ms | wall ms | peak MiB | time / {TIME_BASE} | time / {MEM_BASE} "
            f"| peak / {MEM_BASE} | peak / {TIME_BASE} | % mm | status |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in group:
            lines.append(
                f"| {r['shape']} | {r['variant']} | {_f(r.get('gpu_ms'), 4)} | {_f(r.get('ms'), 4)} "
                f"| {_f(r.get('peak_mib'), 4)} | {_f(r.get(f'time_vs_{TIME_BASE}'))} "
                f"| {_f(r.get(f'time_vs_{MEM_BASE}'))} | {_f(r.get(f'mem_vs_{MEM_BASE}'))} "
                f"| {_f(r.get(f'mem_vs_{TIME_BASE}'))} | {_f(r.get('pct_matmul_gpu'), 2)} | {_status(r)} |"
            )
    return "\n".join(lines) + "\n"


def write_reports(
    rows: list[dict[str, Any]], meta: dict[str, Any], out: Path, plots: bool = True
) -> list[Path]:
    out = Path(out)
    paths = write_tables(rows, meta, out, FIELDS, summary_markdown(rows, meta))
    if plots:
        from lmkernels.harness.plots import plot_ratio_panels

        title = f"FLCE fwd+bwd, {meta.get('device', '')}"
        paths += [
            p
            for p in (
                plot_ratio_panels(
                    rows, f"time_vs_{TIME_BASE}", out / "time_ratio.png", f"time / {TIME_BASE}", title
                ),
                plot_ratio_panels(
                    rows, f"mem_vs_{MEM_BASE}", out / "memory_ratio.png", f"peak / {MEM_BASE}", title
                ),
            )
            if p is not None
        ]
    return paths
