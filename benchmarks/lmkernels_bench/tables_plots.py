"""The plots of the report (`lmkernels-bench report DIR`), beside the data files: the ops'
share of the copy bandwidth, FLCE's time against torch.compile, end-to-end throughput and peak
(DIR/<gpu>-ops.png, -flce.png, -e2e.png)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmkernels_bench.tables_common import CONFIG_TITLES, OP_TITLES, _ok, latest
from lmkernels_bench.tables_perf import _flce_run


def plot_ops(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """% of the copy bandwidth per point of the tuning grid, one panel per op."""
    from lmkernels_bench.plots import pyplot, save_figure

    ops_rows = [
        r
        for r in rows
        if r["part"] == "ops" and r.get("grid") == "final" and r.get("layout") in (None, "bhtd")
    ]
    points = latest(ops_rows, lambda r: (r["op"], r["shape"], r["impl"]))
    ops = [op for op in ("rms_norm", "layer_norm", "rope") if any(k[0] == op for k in points)]
    if not ops:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, len(ops), figsize=(6 * len(ops), 4.5), squeeze=False)
    for ax, op in zip(axes[0], ops):
        shapes = sorted({k[1] for k in points if k[0] == op}, key=lambda s: (_bytes_of(points, op, s), s))
        for impl in ("triton", "compile", "liger", "copy_floor"):
            pts = [
                (i, (_ok(points.get((op, s, impl), [])) or {}).get("pct_copy")) for i, s in enumerate(shapes)
            ]
            pts = [(i, v) for i, v in pts if v is not None]
            if pts:
                label = {"triton": "lmkernels", "copy_floor": "2 plain copies"}.get(impl, impl)
                ax.plot(*zip(*pts), marker="o", linestyle="-" if impl != "copy_floor" else ":", label=label)
        ax.axhline(85, color="black", linewidth=0.8)
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels(shapes, rotation=70, ha="right", fontsize=6)
        ax.set(title=f"{OP_TITLES[op]} fwd+bwd, bf16", ylabel="% of copy bandwidth", ylim=(0, 105))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(fig, path)


def _bytes_of(points, op, shape) -> int:
    r: dict[str, Any] = next((rs[0] for k, rs in points.items() if k[0] == op and k[1] == shape), {})
    return r.get("bytes") or 0


def plot_flce(rows: list[dict[str, Any]], path: Path) -> Path | None:
    from lmkernels_bench.plots import plot_ratio_panels

    run = _flce_run(rows)
    base = {(r["shape"], r["regime"]): r for r in run if r["impl"] == "compile_naive" and r["status"] == "ok"}
    pts = [
        {"shape": r["shape"], "regime": r["regime"], "variant": r["impl"]}
        | {"ratio": r["gpu_ms"] / base[(r["shape"], r["regime"])]["gpu_ms"]}
        for r in run
        if r["status"] == "ok" and (r["shape"], r["regime"]) in base and r["impl"] != "compile_naive"
    ]
    title = f"FLCE fwd+bwd GPU time / torch.compile of the plain loss, {run[0]['device']}" if run else ""
    return plot_ratio_panels(pts, "ratio", path, "time / torch.compile", title)


def plot_flce_pareto(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """Time against peak memory per shape (Gaussian logits), the latest FLCE run."""
    from lmkernels_bench.plots import plot_pareto_panels

    run = [r for r in _flce_run(rows) if r["regime"] == "gaussian" and r["status"] == "ok"]
    cases: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in run:
        cases.setdefault((r["shape"], r["regime"]), {})[r["impl"]] = r | {"ms": r.get("wall_ms")}
    title = f"FLCE fwd+bwd, time against peak memory, {run[0]['device']}, Gaussian logits" if run else ""
    return plot_pareto_panels(cases, ("triton", "triton_lean"), path, title)


def plot_e2e(rows: list[dict[str, Any]], path: Path) -> Path | None:
    from lmkernels_bench.plots import pyplot, save_figure

    e2e = [r for r in rows if r["part"] == "e2e" and r["sweep"] in ("small", "batch") and r["status"] == "ok"]
    points = latest(e2e, lambda r: (r["sweep"], r["batch"], r["seq"]))
    if not points:
        return None
    plt = pyplot()
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
    keys = sorted(points, key=lambda k: (k[1] * k[2], k[2]))
    for config in ("plain", "lmk", "liger"):
        found = [(i, _ok(points[k], config=config)) for i, k in enumerate(keys)]
        pts = [(i, r) for i, r in found if r]
        if pts:
            label = CONFIG_TITLES[config]
            ax_t.plot([i for i, _ in pts], [r["tokens_per_s"] / 1e3 for _, r in pts], marker="o", label=label)
            ax_m.plot([i for i, _ in pts], [r["peak_mib"] / 1024 for _, r in pts], marker="o", label=label)
    for ax, ylabel in ((ax_t, "k tokens/s"), (ax_m, "peak GiB")):
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels([f"{b}x{s}" for _, b, s in keys], rotation=45)
        ax.set(xlabel="batch x sequence", ylabel=ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"end-to-end training, Llama-3.2-1B shape, {e2e[0]['device']}")
    return save_figure(fig, path)


def plots(rows: list[dict[str, Any]], folder: Path, gpu: str) -> list[Path]:
    out = [
        plot_ops(rows, folder / f"{gpu}-ops.png"),
        plot_flce(rows, folder / f"{gpu}-flce.png"),
        plot_flce_pareto(rows, folder / f"{gpu}-flce-pareto.png"),
        plot_e2e(rows, folder / f"{gpu}-e2e.png"),
    ]
    return [p for p in out if p is not None]
