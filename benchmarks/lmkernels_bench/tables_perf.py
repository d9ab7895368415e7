"""The performance tables of the report (tables.py): FLCE against its peers (the design shape,
every shape, the logit regimes), the ops against torch.compile, Liger and the copy bandwidth,
end-to-end training and the distributed runs."""

from __future__ import annotations

import re
import statistics
from typing import Any, TypeGuard

from lmkernels_bench.frontier_report import COUNTED_REGIMES, pareto_verdicts
from lmkernels_bench.parts_perf import COMPARE_OLD_ENV
from lmkernels_bench.scale import DEFAULT_SIZE
from lmkernels_bench.tables_common import (
    CONFIG_TITLES,
    IMPL_TITLES,
    MODE_TITLES,
    OP_TITLES,
    REGIME_TITLES,
    _f,
    _ms,
    _ok,
    _span,
    _table,
    _x,
    caption,
    latest,
    retired,
    suite_command,
)

DESIGN_FLCE = "8192x4096x128256"
FLCE_RERUN = suite_command("readme", "flce")
OURS = ("triton", "triton_lean")


# --- FLCE ---------------------------------------------------------------------------------------------


def _flce_run(
    rows: list[dict[str, Any]], several_regimes: bool | None = None, with_impl: str | None = None
) -> list[dict[str, Any]]:
    """The latest FLCE run with the design shape (with several regimes, or one, if asked; with
    a row of impl `with_impl`, if given)."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r["part"] == "flce":
            runs.setdefault(r["run"], []).append(r)
    good = [
        rs
        for rs in runs.values()
        if any(r["shape"] == DESIGN_FLCE for r in rs)
        and (several_regimes is None or (len({r["regime"] for r in rs}) > 1) == several_regimes)
        and (with_impl is None or any(r["impl"] == with_impl for r in rs))
    ]
    return max(good, key=lambda rs: rs[0].get("date") or "") if good else []


def _impl_order(rows: list[dict[str, Any]]) -> list[str]:
    seen = list(dict.fromkeys(r["impl"] for r in rows))
    return [i for i in IMPL_TITLES if i in seen] + [i for i in seen if i not in IMPL_TITLES]


def flce_design(rows: list[dict[str, Any]], path: str, budgets: bool = False) -> str:
    """Every implementation at the design shape, Gaussian logits (or the run's one regime); the
    memory_budget settings with budgets=True (the latest run that measured the whole range)."""
    if budgets:
        run = _flce_run(rows, with_impl="budget_0")
    else:
        run = [r for r in _flce_run(rows) if not r["impl"].startswith("budget_")]
    regime = "gaussian" if any(r["regime"] == "gaussian" for r in run) else (run[0]["regime"] if run else "")
    here = [r for r in run if r["shape"] == DESIGN_FLCE and r["regime"] == regime]
    base, cce = _ok(here, impl="compile_naive"), _ok(here, impl="cce")
    body = []
    for impl in _impl_order(here):
        r = next(r for r in here if r["impl"] == impl)
        if r["status"] != "ok":
            body.append([IMPL_TITLES.get(impl, impl), r["status"], "-", "-", "-"])
            continue
        t = r["gpu_ms"] / base["gpu_ms"] if base else None
        m = r["peak_mib"] / cce["peak_mib"] if cce else None
        body.append([IMPL_TITLES.get(impl, impl), _ms(r["gpu_ms"]), f"{r['peak_mib']:.0f}", _x(t), _x(m)])
    header = ["FLCE, 8192 x 4096 x 128256", "GPU ms", "peak MiB", "time / compile", "peak / CCE"]
    extra = f", part flce, {REGIME_TITLES.get(regime, regime)} logits"
    return "\n".join([*_table(header, body), "", caption(here, path, extra, FLCE_RERUN)])


def flce_budgets(rows: list[dict[str, Any]], path: str) -> str:
    return flce_design(rows, path, budgets=True)


def flce_ranges(rows: list[dict[str, Any]], path: str) -> str:
    """Per implementation, over every shape of the same run: time and peak against
    torch.compile of the plain loss, peak against CCE's default call."""
    run = [r for r in _flce_run(rows) if r["regime"] in COUNTED_REGIMES]
    by_case: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in run:
        if r["status"] == "ok":
            by_case.setdefault((r["shape"], r["regime"]), {})[r["impl"]] = r
    body = []
    for impl in _impl_order(run):
        t, m, c = [], [], []
        for case in by_case.values():
            got, base, cce = case.get(impl), case.get("compile_naive"), case.get("cce")
            if got is None:
                continue
            if base:
                t.append(got["gpu_ms"] / base["gpu_ms"])
                m.append(got["peak_mib"] / base["peak_mib"])
            if cce:
                c.append(got["peak_mib"] / cce["peak_mib"])
        if impl != "compile_naive":
            body.append([IMPL_TITLES.get(impl, impl), str(len(t)), _span(t), _span(m), _span(c)])
    header = ["FLCE, every shape", "cases", "time / compile", "peak / compile", "peak / CCE"]
    regimes = ", ".join(REGIME_TITLES.get(g, g) for g in dict.fromkeys(r["regime"] for r in run))
    return "\n".join(
        [*_table(header, body), "", caption(run, path, f", part flce, {regimes} logits", FLCE_RERUN)]
    )


def flce_regimes(rows: list[dict[str, Any]], path: str) -> str:
    """GPU ms at the design shape in each logit regime (the latest run with several)."""
    run = _flce_run(rows, several_regimes=True)
    here = [r for r in run if r["shape"] == DESIGN_FLCE]
    regimes = [g for g in REGIME_TITLES if any(r["regime"] == g for r in here)]
    body = []
    for impl in _impl_order(here):
        cells = [_ms((_ok(here, impl=impl, regime=g) or {}).get("gpu_ms")) for g in regimes]
        peak = (_ok(here, impl=impl) or {}).get("peak_mib")
        name = next(r.get("label") for r in here if r["impl"] == impl) or IMPL_TITLES.get(impl, impl)
        body.append([name, *cells, _f(peak, 4)])
    header = [
        "FLCE, 8192 x 4096 x 128256, GPU ms",
        *(f"{REGIME_TITLES[g]} logits" for g in regimes),
        "peak MiB",
    ]
    return "\n".join([*_table(header, body), "", caption(here, path, ", part flce", FLCE_RERUN)])


def _flce_cell(r: dict[str, Any] | None, name: bool = False) -> str:
    if r is None:
        return "-"
    what = f"{_ms(r['gpu_ms'])} ms / {r['peak_mib']:.0f}"
    return f"{what} ({IMPL_TITLES.get(r['impl'], r['impl']).removeprefix('lmkernels ')})" if name else what


def flce_pareto(rows: list[dict[str, Any]], path: str) -> str:
    """Per shape (Gaussian logits): the default, our fastest and our leanest setting, the peers,
    and which peer is >= 2% faster than the default at less memory."""
    run = [r for r in _flce_run(rows) if r["regime"] == "gaussian" and r["status"] == "ok"]
    verdicts = pareto_verdicts([r | {"variant": r["impl"]} for r in run])
    body = []
    for shape in dict.fromkeys(r["shape"] for r in run):
        here = [r for r in run if r["shape"] == shape]
        ours = [r for r in here if r["backend"] in OURS]
        fastest = min(ours, key=lambda r: r["gpu_ms"], default=None)
        leanest = min(ours, key=lambda r: (r["peak_mib"], r["gpu_ms"]), default=None)
        peers = [_flce_cell(_ok(here, impl=i)) for i in ("compile_naive", "liger", "cce")]
        beaten = [v["peer"]["impl"] for v in verdicts if v["shape"] == shape and v["dominates_default"]]
        names = ", ".join(IMPL_TITLES.get(i, i).split(",")[0] for i in beaten) or "none"
        body.append(
            [
                shape,
                _flce_cell(_ok(here, impl="triton")),
                _flce_cell(fastest, True),
                _flce_cell(leanest, True),
                *peers,
                names,
            ]
        )
    header = [
        "shape (BT x H x V)",
        "default",
        "fastest of ours",
        "leanest of ours",
        "torch.compile",
        "Liger",
        "CCE",
    ]
    header.append("faster and leaner than the default")
    return "\n".join(
        [
            *_table(header, body),
            "",
            caption(run, path, ", part flce, Gaussian logits; GPU ms / peak MiB", FLCE_RERUN),
        ]
    )


def compare_table(rows: list[dict[str, Any]], path: str) -> str:
    """The before/after comparison of two source trees (`lmkernels-bench compare-trees`): per case
    the latest run that measured it, its commit beside it."""
    runs = latest([r for r in rows if r["part"] == "compare"], lambda r: r["case"])
    run = [rs[0] for rs in runs.values()]
    body = [
        [
            r["case"],
            f"{r['old_ms']:.4g}",
            f"{r['new_ms']:.4g}",
            f"{r['ratio']:.3f}",
            f"{r['noise'] * 100:.1f}%" if r["rounds"] > 1 else "-",  # one round: no spread to read
            f"{r['old_peak_mib']:.0f} / {r['new_peak_mib']:.0f}",
            f"{r['rounds']}",
            r["commit"] or "-",
        ]
        for r in run
    ]
    header = ["case", "before ms", "after ms", "after / before", "noise", "peak MiB before / after"]
    header += ["rounds", "after: commit"]
    before = ", ".join(dict.fromkeys(r["old_tree"] for r in run))
    extra = f", part compare, before: {before}" if run else ""  # the methods: each row's "method"
    rerun = f"{COMPARE_OLD_ENV}=OLD/src {suite_command('readme', 'compare')}"
    return "\n".join([*_table(header, body), "", caption(run, path, extra, rerun)])


# --- ops ----------------------------------------------------------------------------------------------


def _point_key(r: dict[str, Any]) -> tuple:
    return (r["op"], r["shape"], r.get("layout"), r.get("grid"))


def ops_summary(rows: list[dict[str, Any]], path: str) -> str:
    """Per op and grid, over the latest run of each point: how often ours is faster than
    torch.compile and Liger, by how much, its share of the copy bandwidth, and the points under
    85% where plain copies of the same bytes in the op's two launches reach under 85% too."""
    ops_rows = [r for r in rows if r["part"] == "ops"]
    points = latest([r for r in ops_rows if r["impl"] != "copy_floor"], _point_key)
    floors = latest([r for r in ops_rows if r["impl"] == "copy_floor"], _point_key)
    groups: dict[tuple, list[list[dict[str, Any]]]] = {}
    for key, rs in points.items():
        op, _, layout, grid = key
        groups.setdefault((op, grid, layout), []).append(rs + floors.get(key, []))
    order = {"final": 0, "offgrid": 1}
    body, used = [], []
    for (op, grid, layout), pts in sorted(
        groups.items(), key=lambda g: (order.get(g[0][1], 2), g[0][2] or "", list(OP_TITLES).index(g[0][0]))
    ):
        ours = [_ok(p, impl="triton") for p in pts]
        vs = {peer: [(_ok(p, impl=peer), o) for p, o in zip(pts, ours) if o] for peer in ("compile", "liger")}
        ratios = {peer: [b["gpu_ms"] / o["gpu_ms"] for b, o in pairs if b] for peer, pairs in vs.items()}
        pct = [o["pct_copy"] for o in ours if o and o.get("pct_copy") is not None]
        floor = [_ok(p, impl="copy_floor") for p in pts]
        misses = [
            (o, f) for o, f in zip(ours, floor) if o and o.get("pct_copy") is not None and o["pct_copy"] < 85
        ]
        capped = sum(1 for _, f in misses if f and f.get("pct_copy") is not None and f["pct_copy"] < 85)
        name = OP_TITLES[op] + (" on (B, T, H, D)" if layout == "bthd" else "")
        where = {"final": "tuning grid", "offgrid": "off the grid"}.get(grid, grid or "")
        faster = {p: f"{sum(x > 1 for x in r)}/{len(r)}" if r else "-" for p, r in ratios.items()}
        body.append(
            [f"{name}, {where}", str(len(pts)), faster["compile"], _span(ratios["compile"]), faster["liger"]]
            + [
                _span(ratios["liger"]),
                _span(pct, lambda v: f"{v:.0f}"),
                f"{sum(v >= 85 for v in pct)}/{len(pct)}",
            ]
            + [f"{capped}/{len(misses)}" if misses else "-"]
        )
        used += [r for p in pts for r in p]
    header = ["fwd+bwd, bf16", "shapes", "faster than compile", "compile / ours", "faster than Liger"]
    header += ["Liger / ours", "% of copy", ">= 85% of copy", "misses under the copy floor"]
    return "\n".join(
        [
            *_table(header, body),
            "",
            caption(used, path, ", part ops", suite_command("readme", "ops", "ops-offgrid", "rope-bthd")),
        ]
    )


# --- end to end ---------------------------------------------------------------------------------------


def _ran(r: dict[str, Any] | None) -> TypeGuard[dict[str, Any]]:
    return r is not None and r["status"] == "ok"


def paired(base: dict[str, Any], ours: dict[str, Any]) -> str:
    """Speedup of `ours` over `base` (base's step time / ours): paired by round, median
    [range], when both ran the same rounds; else the ratio of the medians."""
    pairs = [
        b / o for b, o in zip(base.get("round_step_ms") or [], ours.get("round_step_ms") or []) if b and o
    ]
    if len(pairs) > 1:
        return f"{statistics.median(pairs):.2f}x [{min(pairs):.2f}-{max(pairs):.2f}]"
    return _x(base["step_ms"] / ours["step_ms"])


def _cell(r: dict[str, Any] | None, bold: bool = False) -> str:
    if r is None:
        return "-"
    tps = f"{r['tokens_per_s'] / 1e3:.1f}k"
    return f"{'**' + tps + '**' if bold else tps}, {r['peak_mib'] / 1024:.1f}"


def e2e_table(
    rows: list[dict[str, Any]], path: str, sweeps=("small", "batch"), configs=("plain", "lmk", "liger")
) -> str:
    """Per point of the sweeps (latest run each): tokens/s and peak per configuration; ours
    against each other configuration, paired by round."""
    e2e = [r for r in rows if r["part"] == "e2e" and r["sweep"] in sweeps and r["config"] in configs]
    points = latest(e2e, lambda r: (r["sweep"], r["batch"], r["seq"]))
    ours, others = configs[1], [configs[0], *configs[2:]]
    body, used = [], []
    for (_, batch, seq), rs in sorted(points.items(), key=lambda p: (p[0][2] * p[0][1], p[0][2])):
        by = {c: _ok(rs, config=c) for c in configs}
        found = {c: r for c, r in by.items() if r}
        best = max(found, key=lambda c: found[c]["tokens_per_s"], default=None)
        cells = [_cell(by[c], c == best) for c in configs]
        ratios = [paired(found[c], found[ours]) if c in found and ours in found else "-" for c in others]
        body.append([f"{batch} x {seq}", *cells, *ratios, rs[0]["commit"] or "-"])
        used += rs
    header = ["batch x seq", *(f"{CONFIG_TITLES.get(c, c)}" for c in configs)]
    header += [f"{CONFIG_TITLES.get(ours, ours)} / {CONFIG_TITLES.get(c, c)}" for c in others] + ["commit"]
    return "\n".join(
        [
            *_table(header, body),
            "",
            caption(used, path, ", part e2e", suite_command("readme", *(f"e2e-{s}" for s in sweeps))),
        ]
    )


def e2e_compile(rows: list[dict[str, Any]], path: str) -> str:
    return e2e_table(rows, path, ("compile",), ("plain+compile", "lmk+compile"))


# --- distributed --------------------------------------------------------------------------------------


def _dist_size(r: dict[str, Any]) -> tuple[int, int, int]:
    return tuple(r.get(field, default) for field, default in zip(("batch", "seq", "layers"), DEFAULT_SIZE))


def _dist_size_label(size: tuple[int, int, int]) -> str:
    """What a run's size changes from the default, for its row's title."""
    words = [
        f"{value} {what}"
        for value, default, what in zip(size, DEFAULT_SIZE, ("sequences", "tokens each", "layers"))
        if value != default
    ]
    return ", " + ", ".join(words) if words else ""


def _dist_rerun(points: dict[tuple, list[dict[str, Any]]]) -> str:
    """The distributed benchmark's command for the table's GPU counts (all the wrappings), its
    rows appended to the data file; then the sizes other than the default."""
    gpus = ",".join(str(n) for n in sorted({k[0] for k in points}))
    command = f"lmkernels-bench dist-scale --gpus {gpus} --out OUT --data {{out}}"
    flags = (("--batch", 0), ("--seq", 1), ("--layers", 2))
    others = sorted({k[2] for k in points} - {DEFAULT_SIZE})
    more = [" ".join(f"{f} {size[i]}" for f, i in flags if size[i] != DEFAULT_SIZE[i]) for size in others]
    return command + "".join(f"`, then with `{m}" for m in more)


def dist_table(rows: list[dict[str, Any]], path: str) -> str:
    """Per GPU count and wrapping (the latest run of each): tokens/s/GPU, peak, ratios, loss
    differences."""
    # Rows of a script no longer in the tree stay in the data file, out of the table: a table's
    # rows come from commands in the tree.
    dist = [r for r in rows if r["part"] == "dist" and not retired(r.get("command"))]
    points = latest(dist, lambda r: (r["gpus"], r["mode"], _dist_size(r)))
    # A wrapping whose plain run fails there is the environment's problem, with nothing to
    # compare: its rows stay in the data file (docs/scaling.md cites them), out of the table.
    points = {
        k: rs for k, rs in points.items() if any(r["config"] == "plain" and r["status"] == "ok" for r in rs)
    }
    order = {m: i for i, m in enumerate(MODE_TITLES)}
    body, used = [], []
    for gpus, mode, size in sorted(points, key=lambda k: (k[0], order.get(k[1], len(order)), k[1], k[2])):
        rs = points[gpus, mode, size]
        used += rs
        by = {c: next((r for r in rs if r["config"] == c), None) for c in ("plain", "lmk", "liger")}
        cells, peaks = [], []
        for r in by.values():
            if r is None:
                cells.append("-")
                peaks.append("-")
            elif r["status"] != "ok":
                why = re.sub(r"^\w+Error: ", "", r.get("note") or r["status"]).split(",")[0]
                cells.append(f"fails: {why[:64]}")
                peaks.append("-")
            else:
                cells.append(f"{r['tokens_per_s_per_gpu'] / 1e3:.1f}k")
                peaks.append(f"{r['peak_mib'] / 1024:.1f}")
        lmk, plain, liger = by["lmk"], by["plain"], by["liger"]
        vs = [
            _x(lmk["tokens_per_s_per_gpu"] / b["tokens_per_s_per_gpu"]) if _ran(lmk) and _ran(b) else "-"
            for b in (plain, liger)
        ]
        diff = "-"
        if _ran(lmk) and _ran(plain) and lmk.get("losses") and plain.get("losses"):
            diff = f"{max(abs(a - b) for a, b in zip(lmk['losses'], plain['losses'])):.1e}"
        body.append(
            [
                MODE_TITLES.get(mode, mode) + _dist_size_label(size),
                str(gpus),
                *cells,
                *vs,
                " / ".join(peaks),
                diff,
                rs[0]["commit"] or "-",
            ]
        )
    header = [
        "tokens/s/GPU",
        "GPUs",
        "transformers",
        "lmkernels",
        "Liger",
        "lmkernels / transformers",
        "lmkernels / Liger",
    ]
    header += ["peak GiB", "loss diff", "commit"]
    return "\n".join([*_table(header, body), "", caption(used, path, ", part dist", _dist_rerun(points))])
