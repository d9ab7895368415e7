"""Plot a host_overhead.json (scripts/host_overhead.py): wall / GPU time per op and backend.

    python scripts/host_overhead_plot.py DIR [DIR ...]

Writes DIR/host_overhead.png beside each DIR/host_overhead.json: a column per shape set
(design, small), a group of bars per op, a bar per backend (log scale): wall / GPU time with the
1.1x target drawn, and the wall time itself.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def plot(folder: Path) -> Path:
    from lmkernels.harness.plots import _pyplot, save_figure

    plt = _pyplot()
    data = json.loads((folder / "host_overhead.json").read_text())
    rows = [r for r in data["rows"] if "wall_over_gpu" in r]
    sets = list(dict.fromkeys(r["shape_set"] for r in rows))
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    fig, axes = plt.subplots(2, len(sets), figsize=(6 * len(sets), 8), squeeze=False)
    width = 0.8 / max(len(backends), 1)
    panels = (("wall_over_gpu", "wall / GPU time"), ("wall_ms", "wall ms (do_bench median)"))
    for row, (key, ylabel) in enumerate(panels):
        for ax, shape_set in zip(axes[row], sets):
            ops = list(dict.fromkeys(r["op"] for r in rows if r["shape_set"] == shape_set))
            for j, backend in enumerate(backends):
                got = {r["op"]: r for r in rows if r["shape_set"] == shape_set and r["backend"] == backend}
                xs = [i + j * width for i, op in enumerate(ops) if op in got]
                ax.bar(xs, [got[op][key] for op in ops if op in got], width, label=backend)
            if key == "wall_over_gpu":
                ax.axhline(1.1, color="k", linestyle="--", linewidth=1)
                ax.set_title(f"{shape_set} shapes, fwd + bwd, bf16 (dashed: 1.1x)")
            ax.set_yscale("log")
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(ops))])
            shape = {r["op"]: r["shape"] for r in rows if r["shape_set"] == shape_set}
            ax.set_xticklabels([f"{op}\n{shape[op]}" for op in ops], fontsize=8)
            ax.set_ylabel(ylabel)
    axes[0][0].legend(fontsize=7, ncol=2)
    meta = data.get("meta", {})
    chain = f", {meta['chain']}" if "chain" in meta else ""
    fig.suptitle(f"{meta.get('device', '')}, torch {meta.get('torch', '')}{chain}", fontsize=9)
    return save_figure(fig, folder / "host_overhead.png", dpi=110)


def main(argv: list[str] | None = None) -> int:
    folders = [Path(a) for a in (argv if argv is not None else sys.argv[1:])]
    if not folders:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    for folder in folders:
        print(f"wrote {plot(folder)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
