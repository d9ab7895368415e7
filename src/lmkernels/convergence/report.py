"""Showing a convergence Report: a rich table, a JSON file and a PNG of the loss curves."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmkernels.convergence.compare import METRICS, Report
from lmkernels.convergence.train import RunResult

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

SHORT_METRICS = {"loss curve": "curve", "eval loss": "eval", "top-k log-probs": "logp", "params": "params"}
WIDE_COLUMNS = 140  # the console width --wide prints at, whatever the terminal's


def table(report: Report, wide: bool = True) -> Table:
    """One row per run. wide: each metric cell is the error, under a header with its fp32
    limit (bf16 limits depend on the bf16 baseline's own error, so bf16 cells show "error /
    limit"), and the ops each run patched. Narrow (fits 80 columns): each cell is error / limit,
    a pass when <= 1."""
    from rich.table import Table

    from lmkernels.convergence.compare import TOLERANCES_FP32

    cfg = report.config
    fp32 = cfg.dtype == "fp32"
    t = Table(
        title=f"convergence: {report.backend} vs transformers, {cfg.dtype}, {cfg.steps} steps, "
        f"batch {cfg.batch_size}x{cfg.seq_len}, {cfg.device}",
        caption=None if wide else "metrics: error / limit, pass <= 1 (--wide: the errors and limits)",
    )
    t.add_column("family")
    t.add_column("variant")
    if wide:
        t.add_column("ops", overflow="fold")
    t.add_column("final loss" if wide else "loss", justify="right")
    for metric in METRICS:
        if wide:
            t.add_column(f"{metric}\n<= {TOLERANCES_FP32[metric]:.0e}" if fp32 else metric, justify="right")
        else:
            t.add_column(SHORT_METRICS[metric], justify="right")
    t.add_column("verdict")
    short = {"rms_norm": "norm", "rope": "rope", "mlp": "mlp", "flce": "flce"}
    for fam in report.families:
        base = [fam.family, "baseline", *(["none"] if wide else []), f"{fam.baseline.losses[-1]:.4f}"]
        t.add_row(*base, *[""] * len(METRICS), "")
        for case in fam.cases:
            cells = []
            for check in case.checks:
                if wide:
                    text = f"{check.value:.1e}" if fp32 else f"{check.value:.1e}/{check.limit:.1e}"
                else:
                    text = _ratio(check.value, check.limit)
                cells.append(text if check.passed else f"[bold red]{text}[/]")
            verdict = "[green]PASS[/]" if case.passed else "[bold red]FAIL[/]"
            ops = [",".join(short[o] for o in case.ops) or "-"] if wide else []
            t.add_row("", case.variant, *ops, f"{case.losses[-1]:.4f}", *cells, verdict)
    return t


def _ratio(value: float, limit: float) -> str:
    r = value / limit if limit > 0 else float("inf")
    return f"{r:.2f}" if r < 100 else f"{r:.0e}"


def print_report(report: Report, console: Console | None = None, wide: bool = False) -> None:
    """The report as a table on `console` (default: stdout), 80 columns unless `wide`."""
    from rich.console import Console
    from rich.markup import escape

    console = console or Console()
    if wide:  # past the terminal's width: rich would otherwise squeeze the columns and cut numbers
        Console(
            file=console.file,
            width=max(console.width, WIDE_COLUMNS),
            force_terminal=console.is_terminal,
            color_system=console.color_system,  # type: ignore[arg-type]  # (rich: str property, Literal argument)
        ).print(table(report, wide))
    else:
        console.print(table(report, wide))
    for case in report.cases:
        if case.notes:
            console.print(f"{case.family} {case.variant}: {escape(case.notes)}")
        for check in case.checks:
            if not check.passed:
                console.print(
                    f"[red]{case.family} {case.variant}: {check.metric} {check.value:.3g} > limit "
                    f"{check.limit:.3g} ({escape(check.detail)})[/]"
                )
    verdict = "[green]PASS[/]" if report.passed else "[bold red]FAIL[/]"
    console.print(f"convergence verdict: {verdict}")


def to_dict(report: Report) -> dict[str, Any]:
    """The report as plain data (what write_json writes)."""

    def run(r: RunResult | None) -> dict[str, Any] | None:
        if r is None:
            return None
        return {
            "label": r.label,
            "dtype": r.dtype,
            "losses": r.losses,
            "grad_norms": r.grad_norms,
            "eval_loss": r.eval_loss,
            "seconds": r.seconds,
        }

    return {
        "backend": report.backend,
        "passed": report.passed,
        "config": {k: v for k, v in dataclasses.asdict(report.config).items() if k != "family"},
        "families": [
            {
                "family": fam.family,
                "baseline": run(fam.baseline),
                "reference_fp32": run(fam.reference),
                "cases": [
                    {
                        "variant": c.variant,
                        "ops": list(c.ops),
                        "passed": c.passed,
                        "notes": c.notes,
                        "losses": c.losses,
                        "eval_loss": c.eval_loss,
                        "seconds": c.seconds,
                        "checks": [dataclasses.asdict(ch) for ch in c.checks],
                    }
                    for c in fam.cases
                ],
            }
            for fam in report.families
        ],
    }


def write_json(report: Report, path: str | Path) -> Path:
    """Write to_dict(report) to `path` as JSON (parents created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_dict(report), indent=2))
    return path


def plot(report: Report, path: str | Path) -> Path:
    """Top row: loss curves per family. Bottom row: each variant's relative loss difference
    from the baseline per step (log scale; exact zeros are drawn at the axis floor)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    n = len(report.families)
    fig, axes = plt.subplots(2, n, figsize=(4.5 * n, 7), squeeze=False, sharex="col")
    floor = 1e-9
    for col, fam in enumerate(report.families):
        top, bottom = axes[0][col], axes[1][col]
        steps = range(len(fam.baseline.losses))
        top.plot(steps, fam.baseline.losses, color="black", lw=2, label=f"transformers {fam.baseline.dtype}")
        if fam.reference is not None:
            top.plot(steps, fam.reference.losses, color="gray", lw=1, label="transformers fp32")
        highest = floor
        for case in fam.cases:
            label = f"{case.backend} {case.variant}"
            top.plot(steps, case.losses, ls="--", label=label)
            rel = [max(abs(c - b) / abs(b), floor) for c, b in zip(case.losses, fam.baseline.losses)]
            bottom.semilogy(steps, rel, label=label)
            highest = max(highest, *rel)
        top.set_title(fam.family)
        top.set_ylabel("training loss")
        top.legend(fontsize=7)
        bottom.set_xlabel("step")
        bottom.set_ylabel("|loss - baseline| / baseline")
        if report.config.dtype == "fp32":
            from lmkernels.convergence.compare import TOLERANCES_FP32

            limit = TOLERANCES_FP32["loss curve"]
            bottom.axhline(limit, color="red", ls=":", lw=1, label="fp32 limit")
            highest = max(highest, limit)
        bottom.set_ylim(floor / 2, highest * 5)
        bottom.legend(fontsize=7)
    fig.suptitle(f"lmkernels convergence: {report.backend} vs transformers ({report.config.dtype})")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)  # pyplot keeps every open figure alive
    return path
