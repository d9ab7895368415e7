"""The report of the data files (`lmkernels bench --report DIR`): the markdown tables the README and
the docs quote, the plots beside the data (DIR/<gpu>-*.png) and the validation report per GPU kind
(DIR/<gpu>-validation.md).

The README and the docs hold each table between markers, `<!-- bench:NAME GPU -->` and
`<!-- /bench -->`; `--update FILE` rewrites those blocks from the data and `--check FILE` fails
when one differs (a test runs the check). A table compares rows of one run with each other
(ratios never cross runs); each row of a table names the commit its run measured, and the
caption names the data file, the device, the versions and the commands that made the rows.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from lmkernels.harness.bench import data

FLCE = "fused_linear_cross_entropy"
DESIGN_FLCE = "8192x4096x128256"
OP_TITLES = {
    "rms_norm": "RMSNorm",
    "layer_norm": "LayerNorm",
    "rope": "RoPE",
    "swiglu": "SwiGLU",
    "geglu": "GeGLU",
}
OP_TITLES_ALL = OP_TITLES | {FLCE: "FLCE"}
IMPL_TITLES = {
    "triton": "lmkernels `triton` (default)",
    "triton_lean": "lmkernels `triton_lean`",
    "triton_accum_fp32": "lmkernels `triton`, fp32 weight-gradient sums",
    "compile_naive": "torch.compile of the plain loss",
    "cce": "Cut Cross-Entropy, default call",
    "cce_exact": "Cut Cross-Entropy, `filter_eps=None`",
    "liger": "Liger Kernel, default call",
    "torch_native": "torch `linear_cross_entropy`",
}
REGIME_TITLES = {"uniform": "uniform", "gaussian": "Gaussian", "zipf": "LM-like"}
CONFIG_TITLES = {"plain": "transformers", "lmk": "lmkernels", "liger": "Liger"}
MODE_TITLES = {
    "fsdp": "FSDP2 per layer + root",
    "fsdp_lm_head": "FSDP2, lm_head sharded alone",
    "tp": 'TP (`tp_plan="auto"`)',
    "fsdp_tp_torch": "FSDP2 x TP 2, torch styles + SP",
    "fsdp_tp_hf": "FSDP2 x TP 2, transformers",
    "zero2": "DeepSpeed ZeRO-2",
    "zero3": "DeepSpeed ZeRO-3",
    "pp": "pipeline parallel (1F1B)",
}
DRY_RUN = data.gpu_kind("dry run")  # the kind of --dry-run's rows: the only file whose dry rows count
MARK = re.compile(r"<!-- bench:([\w-]+) ([\w-]+) -->\n.*?<!-- /bench -->", re.S)


# --- helpers ------------------------------------------------------------------------------------------


def _f(v: float | None, digits: int = 3) -> str:
    if v is None:
        return "-"
    if v == 0 or abs(v) >= 100:
        return f"{v:.0f}"
    return f"{v:.{digits}g}"


def _ms(v: float | None) -> str:
    return "-" if v is None else (f"{v:.1f}" if v >= 10 else f"{v:.3g}")


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _span(values: Iterable[float | None], fmt: Callable[[float], str] = lambda v: f"{v:.2f}") -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "-"
    lo, hi = fmt(min(vals)), fmt(max(vals))
    return lo if lo == hi else f"{lo}-{hi}"


def _day(row: dict[str, Any]) -> str:
    return (row.get("date") or "")[:10]


def latest(
    rows: list[dict[str, Any]], key: Callable[[dict[str, Any]], Any]
) -> dict[Any, list[dict[str, Any]]]:
    """Per key: the rows of the latest run (by date) that measured it."""
    runs: dict[Any, dict[str, list[dict[str, Any]]]] = {}
    for r in rows:
        runs.setdefault(key(r), {}).setdefault(r["run"], []).append(r)
    return {k: max(by_run.values(), key=lambda rs: rs[0].get("date") or "") for k, by_run in runs.items()}


def caption(rows: list[dict[str, Any]], path: str, extra: str = "") -> str:
    """Device, versions, the data file, and per run its commit, date and command."""
    if not rows:
        return f"*No rows in `{path}` yet.*"
    first = rows[0]
    v = first["versions"]
    names = [("torch", "torch"), ("triton", "triton"), ("transformers", "transformers")]
    names += [("liger-kernel", "liger-kernel"), ("cut-cross-entropy", "cut-cross-entropy")]
    vers = ", ".join(f"{label} {v[k]}" for k, label in names if v.get(k))
    runs = {}
    for r in rows:
        runs.setdefault(r["run"], r)
    made = "; ".join(
        f"{r['commit'] or 'commit not recorded'} ({_day(r)}): `{r['command']}`"
        for r in sorted(runs.values(), key=lambda r: r.get("date") or "")
    )
    counts = sorted({r.get("gpus", 1) for r in rows})
    gpus = "" if counts == [1] else f"{'/'.join(map(str, counts))} x "
    text = f"{gpus}{first['device']}; {vers}. Data: `{path}`{extra}. Made by {made}."
    return f"<sub>{text}</sub>"


def _table(header: list[str], body: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(row) + " |" for row in body]


def _ok(rows: list[dict[str, Any]], **match) -> dict[str, Any] | None:
    for r in rows:
        if r.get("status") == "ok" and all(r.get(k) == v for k, v in match.items()):
            return r
    return None


# --- FLCE ---------------------------------------------------------------------------------------------


def _flce_run(rows: list[dict[str, Any]], several_regimes: bool) -> list[dict[str, Any]]:
    """The latest FLCE run with the design shape (and with several regimes if asked)."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r["part"] == "flce":
            runs.setdefault(r["run"], []).append(r)
    good = [
        rs
        for rs in runs.values()
        if any(r["shape"] == DESIGN_FLCE for r in rs)
        and (len({r["regime"] for r in rs}) > 1) == several_regimes
    ]
    return max(good, key=lambda rs: rs[0].get("date") or "") if good else []


def _impl_order(rows: list[dict[str, Any]]) -> list[str]:
    seen = list(dict.fromkeys(r["impl"] for r in rows))
    return [i for i in IMPL_TITLES if i in seen] + [i for i in seen if i not in IMPL_TITLES]


def flce_design(rows: list[dict[str, Any]], path: str) -> str:
    """Every implementation at the design shape, Gaussian logits (or the run's one regime)."""
    run = _flce_run(rows, several_regimes=False) or _flce_run(rows, several_regimes=True)
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
    return "\n".join([*_table(header, body), "", caption(here, path, extra)])


def flce_ranges(rows: list[dict[str, Any]], path: str) -> str:
    """Per implementation, over every shape of the same run: time and peak against
    torch.compile of the plain loss, peak against CCE's default call."""
    run = _flce_run(rows, several_regimes=False) or _flce_run(rows, several_regimes=True)
    by_case: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in run:
        if r["status"] == "ok":
            by_case.setdefault((r["shape"], r["regime"]), {})[r["impl"]] = r
    body = []
    for impl in _impl_order(run):
        t, m, c = [], [], []
        for case in by_case.values():
            r, base, cce = case.get(impl), case.get("compile_naive"), case.get("cce")
            if r is None:
                continue
            if base:
                t.append(r["gpu_ms"] / base["gpu_ms"])
                m.append(r["peak_mib"] / base["peak_mib"])
            if cce:
                c.append(r["peak_mib"] / cce["peak_mib"])
        if impl != "compile_naive":
            body.append([IMPL_TITLES.get(impl, impl), str(len(t)), _span(t), _span(m), _span(c)])
    header = ["FLCE, every shape", "cases", "time / compile", "peak / compile", "peak / CCE"]
    regimes = ", ".join(REGIME_TITLES.get(g, g) for g in dict.fromkeys(r["regime"] for r in run))
    return "\n".join([*_table(header, body), "", caption(run, path, f", part flce, {regimes} logits")])


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
    return "\n".join([*_table(header, body), "", caption(here, path, ", part flce")])


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
    return "\n".join([*_table(header, body), "", caption(used, path, ", part ops")])


# --- end to end ---------------------------------------------------------------------------------------


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
        best = max((c for c in configs if by[c]), key=lambda c: by[c]["tokens_per_s"], default=None)
        cells = [_cell(by[c], c == best) for c in configs]
        ratios = [paired(by[c], by[ours]) if by[c] and by[ours] else "-" for c in others]
        body.append([f"{batch} x {seq}", *cells, *ratios, rs[0]["commit"] or "-"])
        used += rs
    header = ["batch x seq", *(f"{CONFIG_TITLES.get(c, c)}" for c in configs)]
    header += [f"{CONFIG_TITLES.get(ours, ours)} / {CONFIG_TITLES.get(c, c)}" for c in others] + ["commit"]
    return "\n".join([*_table(header, body), "", caption(used, path, ", part e2e")])


def e2e_compile(rows: list[dict[str, Any]], path: str) -> str:
    return e2e_table(rows, path, ("compile",), ("plain+compile", "lmk+compile"))


# --- distributed --------------------------------------------------------------------------------------


def dist_table(rows: list[dict[str, Any]], path: str) -> str:
    """Per GPU count and wrapping (the latest run of each): tokens/s/GPU, peak, ratios, loss
    differences."""
    points = latest([r for r in rows if r["part"] == "dist"], lambda r: (r["gpus"], r["mode"]))
    order = {m: i for i, m in enumerate(MODE_TITLES)}
    body, used = [], []
    for gpus, mode in sorted(points, key=lambda k: (k[0], order.get(k[1], len(order)), k[1])):
        rs = points[gpus, mode]
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
        ok = lambda r: r is not None and r["status"] == "ok"  # noqa: E731
        vs = [
            _x(lmk["tokens_per_s_per_gpu"] / b["tokens_per_s_per_gpu"]) if ok(lmk) and ok(b) else "-"
            for b in (plain, liger)
        ]
        diff = "-"
        if ok(lmk) and ok(plain) and lmk.get("losses") and plain.get("losses"):
            diff = f"{max(abs(a - b) for a, b in zip(lmk['losses'], plain['losses'])):.1e}"
        body.append(
            [
                MODE_TITLES.get(mode, mode),
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
    return "\n".join([*_table(header, body), "", caption(used, path, ", part dist")])


# --- validation ---------------------------------------------------------------------------------------


def _latest_part(records: list[dict[str, Any]], part: str, unit=lambda r: ()) -> list[dict[str, Any]]:
    return [r for rs in latest([r for r in records if r["part"] == part], unit).values() for r in rs]


def pytest_counts(summary: str) -> str:
    """ "567 passed, 16 skipped" of pytest's last line (no warnings, no time)."""
    parts = [p.strip() for p in re.sub(r" in [\d.]+s.*", "", summary).split(",")]
    return ", ".join(p for p in parts if not p.endswith(("warning", "warnings"))) or summary


def validation_summary(records: list[dict[str, Any]], path: str) -> str:
    """One line per kind of evidence: what passed, on which commit."""
    body, used = [], []

    def add(what: str, rs: list[dict[str, Any]], result: str):
        if rs:
            used.extend(rs)
            commits = ", ".join(sorted({f"{r['commit'] or 'not recorded'} ({_day(r)})" for r in rs}))
            body.append([what, result, commits])

    grid = _latest_part(records, "grid", lambda r: (r["op"], r["impl"], r["dtype"]))
    grid = [r for r in grid if r["impl"].startswith("triton") and r.get("grid", "full") == "full"]
    add(
        "`validate --full`, triton, every op x shape x option x dtype",
        grid,
        f"{sum(r['passed'] for r in grid)} of {sum(r['cases'] - r['unsupported'] for r in grid)} cases pass",
    )
    conv = _latest_part(records, "converge", lambda r: (r["family"], r["dtype"]))
    add(
        f"`converge`, {len({r['family'] for r in conv})} families, bf16 and fp32",
        conv,
        f"{sum(r['passed'] for r in conv)} of {len(conv)} pass",
    )
    fam = _latest_part(records, "families", lambda r: r["family"])
    add(
        "bf16 trajectories of patched families vs plain",
        fam,
        f"{sum(r['passed'] for r in fam)} of {len(fam)} pass",
    )
    step = _latest_part(records, "stepcheck", lambda r: r["family"])
    add(
        "the same families per step on shared weights",
        step,
        f"{sum(r['passed'] for r in step)} of {len(step)} pass",
    )
    dist = _latest_part(records, "dist-checks", lambda r: (r["check"], r["impl"]))
    for impl in dict.fromkeys(r["impl"] for r in dist):
        mine = [r for r in dist if r["impl"] == impl]
        add(
            f"distributed checks on {mine[0]['gpus']} GPUs, NCCL, {impl}",
            mine,
            f"{sum(r['ok'] for r in mine)} of {len(mine)} pass",
        )
    tests = _latest_part(records, "tests", lambda r: (r["group"], r["tool"], r.get("select")))
    for r in tests:
        tool = "" if r["tool"] == "none" else f" under compute-sanitizer {r['tool']}"
        errors = "" if r.get("sanitizer_errors") is None else f", {r['sanitizer_errors']} sanitizer errors"
        select = f" (-k {r['select']})" if r.get("select") else ""
        add(f"GPU tests, group {r['group']}{select}{tool}", [r], f"{pytest_counts(r['pytest'])}{errors}")
    header = ["evidence", "result", "commit (date)"]
    return "\n".join([*_table(header, body), "", caption(used, path)])


def validation_report(records: list[dict[str, Any]], gpu: str, path: str) -> str:
    """<gpu>-validation.md: the summary, then each kind of evidence in full."""
    lines = [
        f"# Validation on {gpu.upper()}",
        "",
        "Generated by `lmkernels bench --report` from",
        f"`{path}`.",
        "",
    ]
    lines += ["## Summary", "", validation_summary(records, path), ""]
    grid = _latest_part(records, "grid", lambda r: (r["op"], r["impl"], r["dtype"]))
    order = [*OP_TITLES_ALL, "fp32", "bf16", "fp16"]
    grid.sort(
        key=lambda r: (
            not r["impl"].startswith("triton"),
            r["impl"],
            order.index(r["op"]),
            order.index(r["dtype"]),
        )
    )
    if grid:
        lines += [
            "## Validation grid",
            "",
            "Values and every input gradient against fp64 (the harness's policy),",
        ]
        lines += ["outputs poisoned, inputs checked unmodified, a fullgraph compile check per op and dtype;"]
        lines += ["the full grid for ours, the quick grid for the peers.", ""]
        body = [
            [
                OP_TITLES_ALL.get(r["op"], r["op"]),
                r["impl"],
                r.get("grid", "full"),
                r["dtype"],
                str(r["cases"]),
            ]
            + [str(r["passed"]), str(r["failed"]), str(r["unsupported"]), _f(r.get("worst_ratio"), 2)]
            + [r["commit"] or "-"]
            for r in grid
        ]
        header = ["op", "backend", "grid", "dtype", "cases", "passed", "failed", "unsupported"]
        header += ["worst error / allowed", "commit"]
        lines += [*_table(header, body), "", caption(grid, path), ""]
    conv = _latest_part(records, "converge", lambda r: (r["family"], r["dtype"]))
    if conv:
        lines += [
            "## Convergence",
            "",
            "Tiny models trained plain and patched (`lmkernels converge`): error / limit.",
            "",
        ]
        body = [
            [r["family"], r["dtype"], r["variant"], "pass" if r["passed"] else "FAIL"]
            + [
                "; ".join(f"{c['metric']} {_f(c['value'])}/{_f(c['limit'])}" for c in r["checks"]),
                r["commit"] or "-",
            ]
            for r in conv
        ]
        lines += [
            *_table(["family", "dtype", "ops", "verdict", "checks", "commit"], body),
            "",
            caption(conv, path),
            "",
        ]
    fam = _latest_part(records, "families", lambda r: r["family"])
    if fam:
        lines += [
            "## Families, bf16 trajectories",
            "",
            "fp32 plain, bf16 plain and bf16 patched from one init;",
        ]
        lines += ["pass when err(patched) <= 2 x err(plain bf16) + floor, both against fp32.", ""]
        body = [
            [r["family"], "pass" if r["passed"] else "FAIL", ", ".join(r.get("ops") or [])]
            + [
                "; ".join(f"{c['metric']} {_f(c['value'])}/{_f(c['limit'])}" for c in r.get("checks") or []),
                r["commit"] or "-",
            ]
            for r in fam
        ]
        lines += [
            *_table(["family", "verdict", "patched", "error / limit", "commit"], body),
            "",
            caption(fam, path),
            "",
        ]
    step = _latest_part(records, "stepcheck", lambda r: r["family"])
    if step:
        lines += [
            "## Families, per step on shared weights",
            "",
            "Errors against plain fp32 on the patched run's",
        ]
        lines += ["weights, RMS over steps: patched / limit (2 x plain bf16's + floor).", ""]
        body = [
            [r["family"], "pass" if r["passed"] else "FAIL", f"{_f(r['loss'][0], 2)} / {_f(r['loss'][1], 2)}"]
            + [
                f"{_f(r['grad'][1], 2)} / {_f(r['grad'][2], 2)} ({r['grad'][0]})",
                f"{_f(r['module'][0], 2)} ({r['module'][1]})",
            ]
            + ["yes" if r.get("repeatable") else "no", r["commit"] or "-"]
            for r in step
        ]
        header = [
            "family",
            "verdict",
            "loss",
            "worst gradient",
            "worst module output",
            "repeatable",
            "commit",
        ]
        lines += [*_table(header, body), "", caption(step, path), ""]
    dist = _latest_part(records, "dist-checks", lambda r: (r["check"], r["impl"]))
    if dist:
        lines += [
            "## Distributed checks",
            "",
            "Relative errors against plain transformers in one process (worst rank).",
            "",
        ]
        body = [
            [r["check"], r["impl"], "ok" if r["ok"] else "FAIL"]
            + [
                _f(r.get(k), 2)
                for k in ("loss_rel_err", "param_rel_err", "param_update_rel_err", "other_err")
            ]
            + [r["commit"] or "-"]
            for r in dist
        ]
        header = ["check", "backend", "result", "loss", "params", "params / update", "other", "commit"]
        lines += [*_table(header, body), "", caption(dist, path), ""]
    tests = _latest_part(records, "tests", lambda r: (r["group"], r["tool"], r.get("select")))
    if tests:
        lines += ["## GPU test runs", ""]
        body = [
            [
                r["group"] + (f" (-k {r['select']})" if r.get("select") else ""),
                r["tool"],
                r["pytest"],
                str(r.get("sanitizer_errors", "-")),
                r.get("note") or "",
                r["commit"] or "-",
            ]
            for r in tests
        ]
        header = ["group", "tool", "pytest", "sanitizer errors", "note", "commit"]
        lines += [*_table(header, body), "", caption(tests, path), ""]
    return "\n".join(lines).rstrip() + "\n"


# --- plots --------------------------------------------------------------------------------------------


def plot_ops(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """% of the copy bandwidth per point of the tuning grid, one panel per op."""
    from lmkernels.harness.plots import _pyplot, save_figure

    ops_rows = [
        r
        for r in rows
        if r["part"] == "ops" and r.get("grid") == "final" and r.get("layout") in (None, "bhtd")
    ]
    points = latest(ops_rows, lambda r: (r["op"], r["shape"], r["impl"]))
    ops = [op for op in ("rms_norm", "layer_norm", "rope") if any(k[0] == op for k in points)]
    if not ops:
        return None
    plt = _pyplot()
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
    r = next((rs[0] for k, rs in points.items() if k[0] == op and k[1] == shape), {})
    return r.get("bytes") or 0


def plot_flce(rows: list[dict[str, Any]], path: Path) -> Path | None:
    from lmkernels.harness.plots import plot_ratio_panels

    run = _flce_run(rows, several_regimes=False) or _flce_run(rows, several_regimes=True)
    base = {(r["shape"], r["regime"]): r for r in run if r["impl"] == "compile_naive" and r["status"] == "ok"}
    pts = [
        {"shape": r["shape"], "regime": r["regime"], "variant": r["impl"]}
        | {"ratio": r["gpu_ms"] / base[(r["shape"], r["regime"])]["gpu_ms"]}
        for r in run
        if r["status"] == "ok" and (r["shape"], r["regime"]) in base and r["impl"] != "compile_naive"
    ]
    title = f"FLCE fwd+bwd GPU time / torch.compile of the plain loss, {run[0]['device']}" if run else ""
    return plot_ratio_panels(pts, "ratio", path, "time / torch.compile", title)


def plot_e2e(rows: list[dict[str, Any]], path: Path) -> Path | None:
    from lmkernels.harness.plots import _pyplot, save_figure

    e2e = [r for r in rows if r["part"] == "e2e" and r["sweep"] in ("small", "batch") and r["status"] == "ok"]
    points = latest(e2e, lambda r: (r["sweep"], r["batch"], r["seq"]))
    if not points:
        return None
    plt = _pyplot()
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
    keys = sorted(points, key=lambda k: (k[1] * k[2], k[2]))
    for config in ("plain", "lmk", "liger"):
        pts = [(i, _ok(points[k], config=config)) for i, k in enumerate(keys)]
        pts = [(i, r) for i, r in pts if r]
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
        plot_e2e(rows, folder / f"{gpu}-e2e.png"),
    ]
    return [p for p in out if p is not None]


# --- the blocks in the README and the docs ------------------------------------------------------------

TABLES: dict[str, Callable[[list[dict[str, Any]], str], str]] = {
    "flce": flce_design,
    "flce-ranges": flce_ranges,
    "flce-regimes": flce_regimes,
    "ops": ops_summary,
    "e2e": e2e_table,
    "e2e-compile": e2e_compile,
    "dist": dist_table,
    "validation": validation_summary,
}


def render(name: str, gpu: str, folder: Path, shown: str) -> str:
    """Table `name` from GPU kind `gpu`'s data file in `folder`; `shown`: how captions name it."""
    path = data.data_path(folder, gpu, validation=name == "validation")
    rows = [r for r in data.read_rows(path) if not r.get("dry_run") or gpu == DRY_RUN]
    return TABLES[name](rows, f"{shown.rstrip('/')}/{path.name}")


def update_blocks(text: str, folder: Path, shown: str) -> str:
    """`text` with every marked block rewritten from the data."""

    def block(m: re.Match) -> str:
        name, gpu = m.group(1), m.group(2)
        if name not in TABLES:
            raise ValueError(f"unknown table {name!r} in a bench marker; known: {', '.join(TABLES)}")
        return f"<!-- bench:{name} {gpu} -->\n{render(name, gpu, folder, shown)}\n<!-- /bench -->"

    return MARK.sub(block, text)


def report(folder: Path, shown: str | None = None, plots_too: bool = True) -> list[Path]:
    """Plots and the validation report of every GPU kind with a data file in `folder`."""
    folder = Path(folder)
    shown = shown or str(folder)
    written = []
    for gpu, path in data.data_files(folder).items():
        rows = [r for r in data.read_rows(path) if not r.get("dry_run") or gpu == DRY_RUN]
        if plots_too:
            written += plots(rows, folder, gpu)
    for gpu, path in data.data_files(folder, validation=True).items():
        out = folder / f"{gpu}-validation.md"
        out.write_text(validation_report(data.read_rows(path), gpu, f"{shown.rstrip('/')}/{path.name}"))
        written.append(out)
    return written
