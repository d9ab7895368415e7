#!/usr/bin/env python3
"""Summarize a roofline_tune.py run for the committed configuration tables (CPU only).

Each point's time is the run's "table" row, or, for the runs before --lean (runs 1-4), where the
committed table adopted a variant that the run measured against that table (same fwd+bwd call,
same run), that variant's row. A --lean run times the committed table as is, and where the
table changed in this session also the previous one ("previous table"): the "before" column.
Usage: python3 scripts/roofline_report.py RUN_DIR/roofline.json [--plot PNG] > SUMMARY.md
--plot: % of the copy bandwidth per point (ours, torch.compile, Liger), one panel per op.
"""

from __future__ import annotations

import json
import sys

# Variants adopted into the table after run 3, per (op, N): each is the fwd+bwd
# combination the run timed (the other half of the call at the run's table choice).
ADOPTED = {
    ("rms_norm", 5120): "bwd regs-rw r1 b8192 w16 p1",
    ("rms_norm", 11008): "fwd-wide b4096 w8",
    ("layer_norm", 5120): "fwd-wide b2048 w4",
    ("layer_norm", 11008): "fwd-wide b4096 w8",
    ("layer_norm", 16384): "fwd-wide b4096 w8",
}
# Points of a --lean run, per run date, where the committed table picks the previous
# configuration: the tune2 final run was made before the FEW_ROWS entries of _norms.py (faster
# there in that run) were in the code.
LEAN_PREVIOUS = {"2026-11-23 11:13:17 UTC": {("layer_norm", "1024x16384")}}
TARGET_PCT = 85.0


def shape_key(op, shape):
    return "x".join(str(s) for s in shape if s is not None)


def plot(data, points, path):
    """points: (op, shape key, {"ours" / "compile" / "liger": % of copy})."""
    from lmkernels.harness.plots import _pyplot, save_figure

    plt = _pyplot()
    ops = list(dict.fromkeys(op for op, _, _ in points))
    fig, axes = plt.subplots(len(ops), 1, figsize=(14, 3.6 * len(ops)), squeeze=False)
    for ax, op in zip(axes[:, 0], ops):
        mine = [(key, pct) for o, key, pct in points if o == op]
        xs = range(len(mine))
        for name, marker in (("ours", "o"), ("compile", "s"), ("liger", "^")):
            ax.plot(xs, [pct.get(name) for _, pct in mine], marker=marker, lw=1, ms=4, label=name)
        ax.axhline(TARGET_PCT, color="gray", ls="--", lw=0.8)
        ax.set_xticks(list(xs), [key for key, _ in mine], rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("% of copy bandwidth")
        ax.set_ylim(0, 105)
        ax.set_title(f"{op}: fwd+bwd bf16 GPU time as % of a device copy ({data['copy_gbps']:.0f} GB/s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    save_figure(fig, path)


def main(path, plot_path=None):
    data = json.load(open(path))
    bw = data["copy_gbps"]
    by_point = {}
    for r in data["rows"]:
        if r["status"] == "ok":
            by_point.setdefault((r["op"], shape_key(r["op"], r["shape"])), {})[r["variant"]] = r
    meta = data["meta"]
    print(f"# Committed tables: fwd+bwd GPU time, {meta['device']}, copy bandwidth {bw:.0f} GB/s\n")
    print(
        f"torch {meta['torch']}, triton {meta['triton']}, liger-kernel {meta['liger']}; run {meta['date']}."
    )
    print(f"Source: `{path}` (command: `{meta['command']}`).\n")
    lean = "--lean" in meta["command"]
    adopted = {} if lean else ADOPTED
    before_head = " before ms | % copy |" if lean else ""
    print(f"| op | shape | ms | % copy |{before_head} compile ms | x compile | Liger ms | x Liger | target |")
    print("|---|---|---|---|" + ("---|---|" if lean else "") + "---|---|---|---|---|")
    counts = {}
    points = []
    for s in data["summary"]:
        op, key = s["op"], s["shape"]
        rows = by_point[(op, key)]
        n = int(key.split("x")[1]) if op != "rope" else None
        variant = adopted.get((op, n), "table")
        if lean and (op, key) in LEAN_PREVIOUS.get(meta["date"], ()):
            variant = "previous table"
        ms = rows[variant]["ms"]
        pct = 100 * s["bytes"] / (ms * 1e-3) / 1e9 / bw
        comp = rows.get("compile", {}).get("ms")
        lig = rows.get("liger", {}).get("ms")
        faster = all(p is None or p > ms for p in (comp, lig))
        met = pct >= TARGET_PCT and faster
        why = (
            "met"
            if met
            else ", ".join(
                w
                for w, bad in ((f"<{TARGET_PCT:.0f}%", pct < TARGET_PCT), ("slower than a peer", not faster))
                if bad
            )
        )
        points.append(
            (
                op,
                key,
                {
                    name: 100 * s["bytes"] / (t * 1e-3) / 1e9 / bw
                    for name, t in (("ours", ms), ("compile", comp), ("liger", lig))
                    if t
                },
            )
        )
        c = counts.setdefault(op, [0, 0, 0])
        c[0] += 1
        c[1] += met
        c[2] += faster

        def ratio(p, ms=ms):
            return f"{p / ms:.2f}" if p else "-"

        def fmt(v):
            return f"{v:.4f}" if v else "-"

        before = ""
        if lean:
            prev = rows.get("previous table", {}).get("ms")
            before = (
                f" {fmt(prev)} | {100 * s['bytes'] / (prev * 1e-3) / 1e9 / bw:.0f} |" if prev else " - | - |"
            )
        print(
            f"| {op} | {key} | {ms:.4f} | {pct:.0f} |{before} {fmt(comp)} | {ratio(comp)} | {fmt(lig)} | "
            f"{ratio(lig)} | {why} |"
        )
    print("\nx compile / x Liger: peer time over ours (> 1: ours faster).")
    if lean:
        print("before: the table before this session's changes, timed in the same run (where it changed).")
    print()
    for op, (n, met, faster) in counts.items():
        print(f"- {op}: {met}/{n} points meet both targets; faster than every peer at {faster}/{n}.")
    if plot_path:
        plot(data, points, plot_path)


if __name__ == "__main__":
    args = sys.argv[1:]
    plot_path = None
    if "--plot" in args:
        i = args.index("--plot")
        plot_path = args[i + 1]
        del args[i : i + 2]
    main(args[0], plot_path)
