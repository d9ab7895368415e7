"""Reports of a bench run: results.csv, results.json (rows + device, versions, reference rates,
command), summary.md, and the tables for the terminal."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmkernels.harness.bench.roofline import BASELINES

if TYPE_CHECKING:
    from rich.table import Table

_RATES = [f"{k}{s}" for s in ("", "_gpu", "_kernel") for k in ("gbps", "pct_copy_bw", "tflops", "pct_matmul")]
CSV_FIELDS = [
    *("op", "shape", "options", "dtype", "backend", "mode", "status"),
    *("ms", "ms_p20", "ms_p80", "gpu_ms", "kernel_ms", "peak_mib"),
    *_RATES,
    *(f"{p}speedup_vs_{b}" for p in ("", "gpu_", "kernel_") for b in BASELINES),
    *(f"mem_vs_{b}" for b in BASELINES),
    "note",
]
META_KEYS = (
    *("date", "device", "torch", "triton", "transformers", "liger-kernel", "cut-cross-entropy"),
    *("cuda", "bench_device", "dtype", "quick", "command", "partial"),
)


def fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return f"{v:.{digits}g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def _rate(row: dict[str, Any], suffix: str = "") -> str:
    if row.get(f"tflops{suffix}") is not None:
        pct = row.get(f"pct_matmul{suffix}")
        return f"{row[f'tflops{suffix}']:.1f} TFLOP/s" + (f" ({pct:.0f}% mm)" if pct is not None else "")
    if row.get(f"gbps{suffix}") is not None:
        pct = row.get(f"pct_copy_bw{suffix}")
        return f"{row[f'gbps{suffix}']:.0f} GB/s" + (f" ({pct:.0f}% copy)" if pct is not None else "")
    return "-"


def _ratios(row: dict[str, Any], prefix: str = "") -> str:
    parts = [
        f"{fmt(row[f'{prefix}speedup_vs_{b}'])}x {b}"
        for b in BASELINES
        if row.get(f"{prefix}speedup_vs_{b}") is not None and row["backend"] != b
    ]
    return ", ".join(parts) or "-"


def _mem_ratios(row: dict[str, Any]) -> str:
    parts = [
        f"{fmt(row[f'mem_vs_{b}'])}x {b}"
        for b in BASELINES
        if row.get(f"mem_vs_{b}") is not None and row["backend"] != b
    ]
    return ", ".join(parts) or "-"


def status_text(row: dict[str, Any]) -> str:
    return "ok" if row["status"] == "ok" else f"{row['status']}: {row['note']}"


def unique(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows without repeats (a shape given twice)."""
    seen, out = set(), []
    for r in rows:
        k = (r["op"], r["shape"], r["options"], r["backend"], r["mode"])
        if k not in seen:
            seen.add(k)
            out.append(r)
    return out


def rich_table(rows: list[dict[str, Any]]) -> Table:
    from rich.table import Table

    table = Table(title="lmkernels bench")
    for col in (
        "op",
        "shape",
        "options",
        "mode",
        "backend",
        "GPU ms",
        "wall ms",
        "peak MiB",
        "rate",
        "speedup",
    ):
        table.add_column(col, overflow="fold")
    table.add_column("status", overflow="fold")
    for r in unique(rows):
        table.add_row(
            *(r["op"], r["shape"], r["options"], r["mode"], r["backend"]),
            *(fmt(r.get("gpu_ms"), 4), fmt(r["ms"], 4), fmt(r["peak_mib"], 4)),
            _rate(r, "_gpu" if r.get("gpu_ms") is not None else ""),
            _ratios(r, "gpu_" if r.get("gpu_ms") is not None else ""),
            status_text(r)[:80],
        )
    return table


def narrow_tables(rows: list[dict[str, Any]]) -> list[Any]:
    """The rows as tables that fit 80 columns: one per case (op, shape, options, mode), one row
    per backend with its GPU time (wall time where there is none), peak memory, rate and
    speedups; rich_table (--wide) has every column. Failed rows say only their status here:
    failure_notes() gives their notes."""
    from rich import box
    from rich.table import Table

    cases: dict[tuple, list[dict[str, Any]]] = {}
    for r in unique(rows):
        cases.setdefault((r["op"], r["shape"], r["options"], r["mode"]), []).append(r)
    tables = []
    for (op, shape, options, mode), group in cases.items():
        title = f"{op} {shape}" + ("" if options == "default" else f" {options}") + f" {mode}"
        t = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left")
        t.add_column("backend")
        t.add_column("GPU ms", justify="right")
        t.add_column("peak MiB", justify="right")
        t.add_column("rate", justify="right")
        t.add_column("speedup", overflow="fold")
        t.add_column("status")
        for r in group:
            gpu = r.get("gpu_ms") is not None
            ms = (
                fmt(r.get("gpu_ms"), 4)
                if gpu
                else (fmt(r["ms"], 4) + (" wall" if r["ms"] is not None else ""))
            )
            t.add_row(
                r["backend"],
                ms,
                fmt(r["peak_mib"], 4),
                _short_rate(r, "_gpu" if gpu else ""),
                _ratios(r, "gpu_" if gpu else "").replace(", ", "\n"),
                "ok" if r["status"] == "ok" else r["status"],
            )
        tables.append(t)
    return tables


def _short_rate(row: dict[str, Any], suffix: str = "") -> str:
    """% of the matmul rate or of the copy bandwidth (else TFLOP/s or GB/s)."""
    for pct, value, unit, what in (
        ("pct_matmul", "tflops", "TF/s", "mm"),
        ("pct_copy_bw", "gbps", "GB/s", "bw"),
    ):
        if row.get(f"{pct}{suffix}") is not None:
            return f"{row[f'{pct}{suffix}']:.0f}% {what}"
        if row.get(f"{value}{suffix}") is not None:
            return f"{row[f'{value}{suffix}']:.0f} {unit}"
    return "-"


def failure_notes(rows: list[dict[str, Any]]) -> list[str]:
    """One line per row that did not run ok: case, backend, status and note."""
    return [
        f"{r['op']} {r['shape']} {r['options']} {r['mode']} {r['backend']}: {status_text(r)}"
        for r in unique(rows)
        if r["status"] != "ok"
    ]


def summary_markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = ["# lmkernels bench", ""]
    lines += [f"- {k}: {meta[k]}" for k in META_KEYS if k in meta]
    if meta.get("copy_gbps"):
        lines.append(f"- copy bandwidth (device-to-device, read+write): {meta['copy_gbps']:.0f} GB/s")
    if meta.get("matmul_tflops"):
        lines.append(f"- bf16 matmul 8192^3: {meta['matmul_tflops']:.0f} TFLOP/s")
    lines += [
        "",
        "Speedup vs X = time(X) / time(backend): above 1 is faster than X. GPU: device time of one "
        "call with the launch queue filled ahead (a sleep kernel before the start event); wall: "
        "triton.testing.do_bench median (host launch gaps included); kernel: the profiler's sum "
        "of kernel times. Peak: max_memory_allocated above the inputs. Rates for fwd+bwd only.",
    ]
    for op in dict.fromkeys(r["op"] for r in rows):
        lines += ["", f"## {op}", ""]
        lines.append(
            "| shape | options | mode | backend | GPU ms | GPU rate | GPU speedup | wall ms (p20-p80) "
            "| wall speedup | kernel ms | peak MiB | peak vs | status |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in unique([r for r in rows if r["op"] == op]):
            ms = f"{r['ms']:.3f} ({r['ms_p20']:.3f}-{r['ms_p80']:.3f})" if r["ms"] is not None else "-"
            lines.append(
                f"| {r['shape']} | {r['options']} | {r['mode']} | {r['backend']} | "
                f"{fmt(r.get('gpu_ms'), 4)} | {_rate(r, '_gpu')} | {_ratios(r, 'gpu_')} | {ms} | "
                f"{_ratios(r)} | {fmt(r.get('kernel_ms'), 4)} | {fmt(r['peak_mib'], 4)} | "
                f"{_mem_ratios(r)} | {status_text(r).replace('|', '/')} |"
            )
    if meta.get("not_run"):
        lines += ["", "## Backends not run", ""]
        for op, skipped in meta["not_run"].items():
            lines += [f"- {op} / {backend}: {reason}" for backend, reason in skipped.items()]
    return "\n".join(lines) + "\n"


def write_tables(
    rows: list[dict[str, Any]], meta: dict[str, Any], out_dir: Path, fields: list[str], summary: str
) -> list[Path]:
    """results.csv (the columns `fields`), results.json (meta and rows) and summary.md (the text
    `summary`) in out_dir, made where missing; returns their paths. Benchmarks with columns of
    their own write through it too."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "results.csv", out_dir / "results.json", out_dir / "summary.md"]
    with open(paths[0], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    paths[1].write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    paths[2].write_text(summary)
    return paths


def write_reports(rows: list[dict[str, Any]], meta: dict[str, Any], out_dir: Path) -> list[Path]:
    """results.csv, results.json and summary.md of a bench run in out_dir."""
    return write_tables(rows, meta, out_dir, CSV_FIELDS, summary_markdown(rows, meta))
