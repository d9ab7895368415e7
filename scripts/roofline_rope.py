"""RoPE's tile-kernel candidates for scripts/roofline_tune.py and the table entry that its
timings suggest (rope.TILE_TUNED), one per (rotary half width, copy) key."""

from __future__ import annotations

import math

# (tile elements, warps, least programs, tables kept over the head loop, head-loop stages):
# rope.TILE_TUNED's values. 2048 programs: ~2.5 waves of programs looping over many heads; 8192: ~10 waves, a few
# heads each (a shorter tail); 2**30: one head per program (its tables from L2 each time).
# scripts/roofline_ptxas.py --ops rope: 32-74 registers, no spills for sm_90.
TILE_CANDIDATES = [
    (e, w, p, once, 1)
    for e, w in ((1024, 2), (1024, 4), (2048, 4), (2048, 8), (4096, 8))
    for p, once in ((2048, True), (8192, True), (8192, False), (2**30, True))
]
POS = "pos table"  # the position kernel at its own table


def tile_name(cfg):
    e, w, p, once, stages = cfg
    return f"2d e{e} w{w} p{p} {'once' if once else 'reload'}" + (f" st{stages}" if stages > 1 else "")


def parse_tile_name(name):
    _, e, w, p, once, *stages = name.split()
    return int(e[1:]), int(w[1:]), int(p[1:]), once == "once", int(stages[0][2:]) if stages else 1


def table_key(shape):
    """rope.TILE_TUNED's key of a (B, Hq, Hkv, T, D, rotary_dim) point."""
    D, R = shape[4], shape[5] or shape[4]
    return R // 2, D > R


def suggestions(rows):
    """Per table key: the variant (tile candidate or the position kernel) with the least
    geometric mean of its time over the fastest variant's at each point of that key, and how it
    compares with torch.compile there. Returns markdown lines."""
    points = {}
    for r in rows:
        if r["op"] == "rope" and r["status"] == "ok" and "ms" in r:
            points.setdefault(tuple(r["shape"]), {})[r["variant"]] = r["ms"]
    by_key = {}
    for shape, times in points.items():
        by_key.setdefault(table_key(shape), []).append((shape, times))
    lines = ["", "## RoPE: suggested rope.TILE_TUNED entries (geometric mean of time / best)", ""]
    for key, pts in sorted(by_key.items()):
        names = [n for n in pts[0][1] if n == POS or n.startswith("2d ")]
        names = [n for n in names if all(n in t for _, t in pts)]
        if not names:
            continue

        def score(n, pts=pts, names=names):
            return math.exp(sum(math.log(t[n] / min(t[m] for m in names)) for _, t in pts) / len(pts))

        now = ", ".join(f"{n} {score(n):.3f}" for n in ("table", POS) if all(n in t for _, t in pts))

        ranked = sorted(names, key=score)
        best = ranked[0]
        if best == POS:
            entry = f"no entry for {key} in TILE_TUNED (the position kernel)"
        else:
            entry = f"TILE_TUNED[{key}] = {parse_tile_name(best)}"
        vs = ", ".join(
            f"{'x'.join(str(s) for s in shape if s is not None)}: {t[best]:.4f} ms, "
            f"compile {t['compile']:.4f}"
            if "compile" in t
            else ""
            for shape, t in pts
        )
        runner = ", ".join(f"{n} {score(n):.3f}" for n in ranked[1:4])
        lines.append(f"- {key}: **{best}** ({score(best):.3f}) -> {entry}; {vs}; next: {runner}; now: {now}")
    return lines
