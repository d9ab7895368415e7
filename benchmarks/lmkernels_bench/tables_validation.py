"""The validation evidence in the report (tables.py): the one-line-per-kind summary the README
quotes, and the full report per GPU kind (<gpu>-validation.md): the validation grid,
convergence, the families, the distributed checks and the GPU test runs."""

from __future__ import annotations

import re
from typing import Any

from lmkernels_bench.suite import GRID_PARTS, TEST_PARTS
from lmkernels_bench.tables_common import (
    OP_TITLES_ALL,
    _day,
    _f,
    _table,
    caption,
    latest,
    retired,
    suite_command,
)


def _latest_part(records: list[dict[str, Any]], part: str, unit=lambda r: ()) -> list[dict[str, Any]]:
    return [r for rs in latest([r for r in records if r["part"] == part], unit).values() for r in rs]


def pytest_counts(summary: str) -> str:
    """ "567 passed, 16 skipped" of pytest's last line (no warnings, no time)."""
    parts = [p.strip() for p in re.sub(r" in [\d.]+s.*", "", summary).split(",")]
    return ", ".join(p for p in parts if not p.endswith(("warning", "warnings"))) or summary


def _summed_counts(runs: list[dict[str, Any]]) -> str:
    """pytest's counts over one or more runs, summed ("deselected" left out)."""
    counts: dict[str, int] = {}
    for r in runs:
        for n, word in re.findall(r"(\d+) (\w+)", pytest_counts(r["pytest"])):
            counts[word] = counts.get(word, 0) + int(n)
    return ", ".join(f"{n} {word}" for word, n in counts.items() if word != "deselected")


def validation_summary(records: list[dict[str, Any]], path: str) -> str:
    """One line per kind of evidence: what passed, on which commit. Runs of scripts no longer in
    the tree are left out (the suite's parts measure the same; the full report keeps them)."""
    records = [r for r in records if not retired(r.get("command"))]
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
    plain = [r for r in tests if r["tool"] == "none"]
    for group in dict.fromkeys(r["group"] for r in plain):
        # A group the suite runs in shards (-k selections, TEST_PARTS) in one line: the counts of
        # its current shards summed (a shard since renamed or split is not counted again).
        runs = [r for r in plain if r["group"] == group]
        shards = [a[3] for a in TEST_PARTS.values() if a[:2] == ["suite", group] and len(a) > 3]
        if shards:
            runs = [r for r in runs if r.get("select") in shards]
            if runs:
                what = f"GPU tests, group {group}, {len(runs)} of {len(shards)} shards"
                add(what, runs, _summed_counts(runs))
            continue
        for r in runs:
            select = f" (-k {r['select']})" if r.get("select") else ""
            add(f"GPU tests, group {group}{select}", [r], _summed_counts([r]))
    for tool in dict.fromkeys(r["tool"] for r in tests if r["tool"] != "none"):
        # A sanitizer's runs (selections of groups) in one line: their counts summed.
        runs = [r for r in tests if r["tool"] == tool]
        errors = sum(r.get("sanitizer_errors") or 0 for r in runs)
        groups = ", ".join(dict.fromkeys(r["group"] for r in runs))
        add(
            f"GPU tests under compute-sanitizer {tool}, {len(runs)} runs (groups {groups})",
            runs,
            f"{_summed_counts(runs)}, {errors} sanitizer errors",
        )
    header = ["evidence", "result", "commit (date)"]
    return "\n".join(
        [*_table(header, body), "", caption(used, path, rerun=suite_command("validation", "all"))]
    )


def _distance_cell(distance: dict[str, Any] | None) -> str:
    """A trajectory's distances from fp32: "patched 0.0221 / limit 0.0471 (plain 0.0165-0.0314)"."""
    if not distance:
        return ""
    plain = distance["plain_bf16"]
    return (
        f"patched {_f(distance['patched'], 3)} / limit {_f(distance['limit'], 3)} "
        f"(plain {_f(min(plain), 3)}-{_f(max(plain), 3)})"
    )


def _checks_cell(checks: list[dict[str, Any]] | None) -> str:
    """A run's checks as "metric value/limit; ...": the converge and families verdicts."""
    return "; ".join(f"{c['metric']} {_f(c['value'])}/{_f(c['limit'])}" for c in checks or [])


def validation_report(records: list[dict[str, Any]], gpu: str, path: str) -> str:
    """<gpu>-validation.md: the summary, then each kind of evidence in full."""
    lines = [
        f"# Validation on {gpu.upper()}",
        "",
        "Generated by `lmkernels-bench report` from",
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
        lines += [
            *_table(header, body),
            "",
            caption(grid, path, rerun=suite_command("validation", *GRID_PARTS)),
            "",
        ]
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
                _checks_cell(r["checks"]),
                r["commit"] or "-",
            ]
            for r in conv
        ]
        lines += [
            *_table(["family", "dtype", "ops", "verdict", "checks", "commit"], body),
            "",
            caption(conv, path, rerun=suite_command("validation", "converge")),
            "",
        ]
    fam = _latest_part(records, "families", lambda r: r["family"])
    if fam:
        lines += [
            "## Families, bf16 trajectories",
            "",
            "fp32 plain, then bf16 plain (several runs: rows of each batch reordered) and bf16",
            "patched from one init; each bf16 run's distance from fp32: mean |loss - fp32 loss|",
            "over the second half of the steps. Pass when the patched run's distance is within",
            "the limit the plain runs' spread sets (rows of the earlier criterion, 2 x one plain",
            "run's error + floor: error / limit in the checks column).",
            "",
        ]
        body = [
            [r["family"], "pass" if r["passed"] else "FAIL", ", ".join(r.get("ops") or [])]
            + [
                _distance_cell(r.get("distance")) or _checks_cell(r.get("checks")),
                r["commit"] or "-",
            ]
            for r in fam
        ]
        lines += [
            *_table(["family", "verdict", "patched", "distance or checks", "commit"], body),
            "",
            caption(fam, path, rerun=suite_command("validation", "families")),
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
            if r.get("loss")
            else [r["family"], "FAIL", r.get("note") or "no result", "-", "-", "-", r["commit"] or "-"]
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
        lines += [
            *_table(header, body),
            "",
            caption(step, path, rerun=suite_command("validation", "stepcheck")),
            "",
        ]
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
        lines += [
            *_table(header, body),
            "",
            caption(dist, path, rerun=suite_command("validation", "dist-checks")),
            "",
        ]
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
        lines += [
            *_table(header, body),
            "",
            caption(tests, path, rerun=suite_command("validation", *TEST_PARTS)),
            "",
        ]
    return "\n".join(lines).rstrip() + "\n"
