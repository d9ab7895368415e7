"""Reports of the end-to-end benchmark (e2e.py): ratios between configurations, e2e.csv, e2e.json,
summary.md, the sweep plots and the memory timeline."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path
from typing import Any

# speedup_vs_X / mem_vs_X: against configuration X on the same model, batch and sequence.
BASES = ("plain", "liger", "plain+compile", "lmk")
FIELDS = [
    *("model", "config", "sweep", "batch", "seq", "status", "tokens_per_s", "peak_gib"),
    *("step_ms", "steps", "loss"),
    *(f"speedup_vs_{b}" for b in BASES),
    *(f"mem_vs_{b}" for b in BASES),
    "note",
]
SWEEP_TITLES = {
    "batch": "batch sweep",
    "seq": "sequence sweep (batch 4)",
    "small": "small batches (the host-bound regime)",
    "vocab": "large vocabulary",
    "compile": "torch.compile(model)",
}


def add_ratios(rows: list[dict[str, Any]]) -> None:
    by_point = {(r["model"], r["batch"], r["seq"], r["config"]): r for r in rows if r["status"] == "ok"}
    for r in rows:
        for base in BASES:
            ref = by_point.get((r["model"], r["batch"], r["seq"], base)) or {}  # (none: no ratios)
            ok = bool(ref) and r["tokens_per_s"] and r["config"] != base
            r[f"speedup_vs_{base}"] = r["tokens_per_s"] / ref["tokens_per_s"] if ok else None
            ok = ok and ref["peak_gib"] and r["peak_gib"]
            r[f"mem_vs_{base}"] = r["peak_gib"] / ref["peak_gib"] if ok else None


def paired_speedups(round_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per point, configuration and base (BASES): the speedups base step / configuration step of
    the rounds that ran both, as pairs. With --interleave the two ran seconds apart, so a pair
    shares the host's state: the median of the pairs is steadier than the ratio of the medians.
    Pairs are formed for the configurations that are not bases, and for lmk."""
    steps = {
        (r["model"], r["sweep"], r["batch"], r["seq"], r["config"], r["round"]): r["step_ms"]
        for r in round_rows
        if r["status"] == "ok"
    }
    configs = list(dict.fromkeys(r["config"] for r in round_rows))
    out = []
    for point in dict.fromkeys((r["model"], r["sweep"], r["batch"], r["seq"]) for r in round_rows):
        rounds = sorted({k[5] for k in steps if k[:4] == point})
        for config in [c for c in configs if c not in BASES or c == "lmk"]:
            for base in [b for b in BASES if b in configs and b != config]:
                pairs = [
                    steps[point + (base, r)] / steps[point + (config, r)]
                    for r in rounds
                    if point + (base, r) in steps and point + (config, r) in steps
                ]
                if pairs:
                    out.append(
                        dict(zip(("model", "sweep", "batch", "seq"), point))
                        | {"config": config, "base": base, "median": statistics.median(pairs)}
                        | {"min": min(pairs), "max": max(pairs), "faster": sum(x > 1 for x in pairs)}
                        | {"pairs": len(pairs)}
                    )
    return out


def paired_summary(paired: list[dict[str, Any]]) -> list[str]:
    lines = ["## speedups per round, paired (median [range], rounds faster)", ""]
    lines += ["| model | sweep | batch | seq | config | vs | speedup | faster in |"]
    lines += ["|---|---|---|---|---|---|---|---|"]
    for p in paired:
        lines.append(
            f"| {p['model']} | {p['sweep']} | {p['batch']} | {p['seq']} | {p['config']} | {p['base']} | "
            f"{p['median']:.2f}x [{p['min']:.2f}-{p['max']:.2f}] | {p['faster']}/{p['pairs']} |"
        )
    return [*lines, ""]


def _rel(r: dict[str, Any], base: str) -> str:
    speed, mem = r.get(f"speedup_vs_{base}"), r.get(f"mem_vs_{base}")
    parts = ([f"{speed:.2f}x speed"] if speed else []) + ([f"{mem:.2f}x mem"] if mem else [])
    return ", ".join(parts) or "-"


def summary(rows: list[dict[str, Any]], meta: dict[str, Any], paired=()) -> str:
    lines = ["# End-to-end training benchmark", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items() if not isinstance(v, (dict, list))]
    lines += [f"- model {k}: {v}" for k, v in meta.get("models", {}).items()]
    lines += [
        "",
        "k tokens/s and peak GiB per point; ratios against other configurations at the same point.",
        "",
    ]
    for sweep in dict.fromkeys(r["sweep"] for r in rows):
        group = [r for r in rows if r["sweep"] == sweep]
        bases = [b for b in BASES if any(r.get(f"speedup_vs_{b}") or r["config"] == b for r in group)]
        lines += [f"## {SWEEP_TITLES.get(sweep, sweep)}", ""]
        lines.append(
            "| model | config | batch | seq | k tokens/s | peak GiB | "
            + " | ".join(f"vs {b}" for b in bases)
            + " | status |"
        )
        lines.append("|---|---|---|---|---|---|" + "---|" * len(bases) + "---|")
        for r in group:
            tps = f"{r['tokens_per_s'] / 1e3:.1f}" if r["tokens_per_s"] else "-"
            peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
            status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r['note']}"
            rel = " | ".join(_rel(r, b) for b in bases)
            lines.append(
                f"| {r['model']} | {r['config']} | {r['batch']} | {r['seq']} | {tps} | {peak} | {rel} | "
                f"{status.replace('|', '/')[:120]} |"
            )
        lines.append("")
    if paired:
        lines += paired_summary(paired)
    return "\n".join(lines)


def write_reports(rows: list[dict[str, Any]], meta: dict[str, Any], out: Path, round_rows=()) -> list[Path]:
    """round_rows: the rows of each round (--rounds), for the paired speedups."""
    from lmkernels_bench.plots import plot_e2e, plot_e2e_paired, plot_memory_timeline

    out = Path(out)
    add_ratios(rows)
    paired = paired_speedups(list(round_rows))
    with open(out / "e2e.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    (out / "e2e.json").write_text(json.dumps({"meta": meta, "rows": rows, "paired": paired}, indent=1))
    (out / "summary.md").write_text(summary(rows, meta, paired))
    paths = [out / "e2e.csv", out / "e2e.json", out / "summary.md", *plot_e2e(rows, out)]
    for model in dict.fromkeys(p["model"] for p in paired):
        mine = [p for p in paired if p["model"] == model]
        title = f"end-to-end training, {model}: speedups paired by round (median, range)"
        paths.append(plot_e2e_paired(mine, out / f"e2e_paired_{model}.png", title))
    timelines = {}
    for path in sorted((out / "raw").glob("timeline_*.json")):
        tl = json.loads(path.read_text())
        timelines[f"{tl['config']} (peak {max(tl['mib'], default=0) / 1024:.1f} GiB)"] = tl
    if timelines:
        first = next(iter(timelines.values()))
        title = f"allocated memory over one step, batch {first['batch']}, seq {first['seq']}"
        paths.append(plot_memory_timeline(timelines, out / "memory_timeline.png", title))
    return paths
