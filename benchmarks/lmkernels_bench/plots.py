"""PNG plots of benchmark results (matplotlib, Agg backend: no display needed).

- plot_e2e: tokens/s and peak memory of the end-to-end training benchmark per sweep, against
  the batch size or the sequence length, one line per configuration.
- plot_ratio_panels: a ratio to a baseline per shape, one panel per logit regime (FLCE frontier).
- plot_memory_timeline: allocated memory over one training step, one line per configuration.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, dpi: int = 100) -> Path:
    """Lay `fig` out, write it to `path` (its folder made where missing) and close it (pyplot keeps
    every open figure alive)."""
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", text).strip("_")


def _size_axis(ax, sizes: Sequence[int], label: str) -> None:
    """A log2 x axis labelled with the sizes themselves (1024, not 2^10)."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(sizes))
    ax.set_xticklabels([str(s) for s in sizes], rotation=30)
    ax.minorticks_off()
    ax.set_xlabel(label)
    ax.grid(True, alpha=0.3)


def _failures(rows: Sequence[dict[str, Any]], x: str) -> str:
    """' (OOM at 64, 128)' style suffix for a legend entry."""
    bad = [r for r in rows if r.get("status") not in ("ok", None)]
    if not bad:
        return ""
    by_status: dict[str, list[str]] = {}
    for r in bad:
        by_status.setdefault(r["status"], []).append(str(r.get(x)))
    return " (" + "; ".join(f"{s} at {', '.join(v)}" for s, v in by_status.items()) + ")"


def plot_e2e(rows: Sequence[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Per sweep (e2e_<sweep>.png): tokens/s and peak memory against the sequence length (sweep
    "seq") or the batch size (the others), one line per configuration (and sequence length,
    where a sweep has several)."""
    plt = pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for sweep in dict.fromkeys(r.get("sweep") for r in rows):
        group = [r for r in rows if r.get("sweep") == sweep]
        x = "seq" if sweep == "seq" else "batch"
        other = "batch" if x == "seq" else "seq"
        several = len({r[other] for r in group}) > 1
        series = lambda r, other=other, several=several: (
            r["config"] + (f", {other} {r[other]}" if several else "")
        )
        fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
        for name in dict.fromkeys(series(r) for r in group):
            pts = sorted((r for r in group if series(r) == name), key=lambda r: r[x])
            ok = [r for r in pts if r["status"] == "ok"]
            label = name + _failures(pts, x)  # a config with no result still gets its legend entry
            ax_t.plot([r[x] for r in ok], [r["tokens_per_s"] for r in ok], marker="o", label=label)
            mem = [r for r in ok if r.get("peak_gib") is not None]
            ax_m.plot([r[x] for r in mem], [r["peak_gib"] for r in mem], marker="o", label=label)
        for ax in (ax_t, ax_m):
            _size_axis(ax, sorted({r[x] for r in group}), "batch size" if x == "batch" else "sequence length")
        ax_t.set_ylabel("tokens / s")
        ax_m.set_ylabel("peak memory (GiB)")
        ax_t.legend(fontsize=8)
        fixed = "" if several else f", {other} {group[0][other]}"
        model = f"{group[0]['model']}, " if group[0].get("model") else ""
        fig.suptitle(f"end-to-end training, {model}{sweep} sweep{fixed}")
        paths.append(save_figure(fig, out_dir / f"e2e_{_slug(str(sweep))}.png"))
    return paths


def plot_e2e_paired(paired: Sequence[dict[str, Any]], path: Path, title: str = "") -> Path:
    """Speedups paired by round (e2e_report.paired_speedups): one panel per base,
    a point per (configuration, batch x sequence), the median with the rounds' range as a bar."""
    plt = pyplot()
    bases = list(dict.fromkeys(p["base"] for p in paired))
    points = list(dict.fromkeys((p["model"], p["batch"], p["seq"]) for p in paired))
    configs = list(dict.fromkeys(p["config"] for p in paired))
    fig, axes = plt.subplots(1, len(bases), figsize=(6 * len(bases), 4.5), squeeze=False)
    for ax, base in zip(axes[0], bases):
        for j, config in enumerate(configs):
            mine = {
                (p["model"], p["batch"], p["seq"]): p
                for p in paired
                if p["base"] == base and p["config"] == config
            }
            xs = [i + 0.8 * (j + 0.5) / len(configs) - 0.4 for i, key in enumerate(points) if key in mine]
            got = [mine[key] for key in points if key in mine]
            if not got:
                continue
            med = [p["median"] for p in got]
            bars = [[m - p["min"] for m, p in zip(med, got)], [p["max"] - m for m, p in zip(med, got)]]
            ax.errorbar(xs, med, yerr=bars, fmt="o", capsize=3, label=config)
        ax.axhline(1.0, color="gray", lw=1)
        ax.set_xticks(range(len(points)), [f"{b} x {s}" for _, b, s in points], rotation=30)
        ax.set_xlabel("batch x sequence")
        ax.set_ylabel(f"speedup vs {base} (per round, paired)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or "end-to-end speedups, paired by round: median and range")
    return save_figure(fig, path)


def plot_memory_timeline(timelines: dict[str, dict[str, list[float]]], path: Path, title: str = "") -> Path:
    """timelines: label -> {"x": [...], "mib": [...], "x_label": ...}: allocated memory (MiB)
    after each allocator event, x in ms (or the event index where torch gives no timestamps)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for label, tl in timelines.items():
        ax.step(tl["x"], [m / 1024 for m in tl["mib"]], where="post", label=label)
    ax.set_xlabel(next(iter(timelines.values())).get("x_label", "time in the step (ms)") if timelines else "")
    ax.set_ylabel("allocated (GiB)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or "allocated memory over one training step")
    return save_figure(fig, path)


def plot_ratio_panels(
    rows: Sequence[dict[str, Any]], key: str, path: Path, ylabel: str, title: str = ""
) -> Path | None:
    """One panel per logit regime: rows[key] (a ratio to a baseline, 1 = parity) per shape, one
    line per variant (the FLCE frontier's time and memory ratios). None when nothing to plot."""
    plt = pyplot()
    ok = [r for r in rows if r.get(key) is not None]
    if not ok:
        return None
    regimes = list(dict.fromkeys(r["regime"] for r in rows))
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in ok))
    fig, axes = plt.subplots(1, len(regimes), figsize=(6 * len(regimes), 5), sharey=True, squeeze=False)
    for ax, regime in zip(axes[0], regimes):
        for variant in variants:
            pts = [r for r in ok if r["regime"] == regime and r["variant"] == variant]
            xs = [shapes.index(r["shape"]) for r in pts]
            ax.plot(xs, [r[key] for r in pts], marker="o", linestyle="-", label=variant)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels(shapes, rotation=60, ha="right", fontsize=7)
        ax.set_yscale("log")
        ax.set_title(f"{regime} logits")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel(ylabel)
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(title or ylabel)
    return save_figure(fig, path)


def plot_pareto_panels(
    cases: dict[tuple, dict[str, dict[str, Any]]], ours: Sequence[str], path: Path, title: str
) -> Path | None:
    """One panel per shape: GPU time against peak memory, one marker per variant; lmkernels'
    settings (backends in `ours`) joined by a line in order of memory. cases: (shape, regime) ->
    variant -> row. None when nothing to plot."""
    plt = pyplot()
    if not cases:
        return None
    cols = min(4, len(cases))
    n_rows = -(-len(cases) // cols)
    fig, axes = plt.subplots(n_rows, cols, figsize=(4.2 * cols, 3.6 * n_rows), squeeze=False)
    markers = "osD^v<>pP*hX"
    names = list(dict.fromkeys(v for variants in cases.values() for v in variants))
    for ax, ((shape, _), variants) in zip(axes.flat, cases.items()):
        mine = sorted((r for r in variants.values() if r["backend"] in ours), key=lambda r: r["peak_mib"])
        ax.plot(
            [r["peak_mib"] for r in mine], [r.get("gpu_ms") or r["ms"] for r in mine], color="0.6", zorder=1
        )
        for name, r in variants.items():
            ax.scatter(
                r["peak_mib"],
                r.get("gpu_ms") or r["ms"],
                marker=markers[names.index(name) % len(markers)],
                color=f"C{names.index(name) % 10}",
                label=name,
                zorder=2,
            )
        ax.set_title(shape, fontsize=9)
        ax.set_xlabel("peak MiB above the inputs", fontsize=8)
        ax.set_ylabel("GPU ms (fwd+bwd)", fontsize=8)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(cases) :]:
        ax.axis("off")
    handles: dict[str, Any] = {}
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    fig.legend(
        list(handles.values()), list(handles), loc="lower center", ncol=min(6, len(handles)), fontsize=8
    )
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.12 / n_rows, 1, 1))
    return save_figure(fig, path)
