"""What the report's tables (tables.py) share: how they name ops, implementations, regimes,
configurations and wrappings; number formats; the latest run of each point; the caption that
names a table's data file, device, versions and commands; the markdown table itself."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

FLCE = "fused_linear_cross_entropy"
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
    **{
        f"budget_{f}": f"lmkernels `triton`, memory_budget={f}"
        for f in ("0", "0.15", "0.25", "0.4", "0.5", "1", "2")
    },
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


# Scripts whose code is no longer in the tree (their rows stay in the data files; the suite's
# parts measure the same points): scripts/copy_floor.py and scripts/roofline_tune.py (the ops
# grids), scripts/families_gpu.py and scripts/families_stepcheck.py (the families), scripts/gpu_tests.sh
# (the GPU test groups), benchmarks/dist_train.py (the first distributed runs). The scripts of
# benchmarks/ that became `lmkernels-bench` commands (flce_frontier.py, e2e_train.py,
# dist_scale.py, gpu_tests.py, compare_trees.py, trl_head.py) are not among them.
RETIRED = ("scripts/", "benchmarks/dist_train.py")


def retired(command: str | None) -> bool:
    """Whether a row's command ran a script no longer in the tree (RETIRED)."""
    return any(script in (command or "") for script in RETIRED)


def suite_command(suite: str, *parts: str) -> str:
    """The suite's command for `parts`, its --out left as {out} (caption fills it in)."""
    return f"lmkernels-bench suite {suite} --part {','.join(parts)} --out {{out}}"


def caption(rows: list[dict[str, Any]], path: str, extra: str = "", rerun: str = "") -> str:
    """One line: device, dates, commits, the data file, and the command of the maintained suite
    that measures the rows again (`rerun`, its {out} the data file's folder); where runs of a
    script no longer in the tree made rows, it says so. The commands of each run are in the
    data file."""
    if not rows:
        return f"*No rows in `{path}` yet.*"
    counts = sorted({r.get("gpus", 1) for r in rows})
    gpus = "" if counts == [1] else f"{'/'.join(map(str, counts))} x "
    days = sorted({_day(r) for r in rows if _day(r)})
    when = days[0] if len(days) == 1 else f"{days[0]} to {days[-1]}"
    by_date = sorted(rows, key=lambda r: r.get("date") or "")
    commits = list(dict.fromkeys(r["commit"] for r in by_date if r.get("commit")))
    if not commits:
        made = "commit not recorded"
    elif len(commits) == 1:
        made = f"commit {commits[0]}"
    elif len(commits) <= 3:
        made = f"commits {', '.join(commits)}"
    else:
        made = f"{len(commits)} commits, {commits[0]} to {commits[-1]}"
    if commits and any(not r.get("commit") for r in rows):
        made += " (some not recorded)"
    text = f"{gpus}{rows[0]['device']}, {when}, {made}. Data: `{path}`{extra}."
    if rerun:
        command = rerun.format(out=path.rpartition("/")[0] or ".")
        runs = {r["run"]: r for r in rows}
        old = sum(retired(r.get("command")) for r in runs.values())
        if old == len(runs):
            text += f" Made by a script no longer in the tree; rerun with `{command}`."
        elif old:
            text += (
                f" {old} of {len(runs)} runs made by a script no longer in the tree; rerun with `{command}`."
            )
        else:
            text += f" Rerun: `{command}`."
    return f"<sub>{text}</sub>"


def _table(header: list[str], body: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(row) + " |" for row in body]


def _ok(rows: list[dict[str, Any]], **match) -> dict[str, Any] | None:
    for r in rows:
        if r.get("status") == "ok" and all(r.get(k) == v for k, v in match.items()):
            return r
    return None
