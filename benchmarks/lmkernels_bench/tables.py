"""The report of the data files (`lmkernels-bench report DIR`): the markdown tables the README and
the docs quote, the plots beside the data (DIR/<gpu>-*.png) and the validation report per GPU kind
(DIR/<gpu>-validation.md).

The README and the docs hold each table between markers, `<!-- bench:NAME GPU -->` and
`<!-- /bench -->`; `--update FILE` rewrites those blocks from the data and `--check FILE` fails
when one differs (a test runs the check). A table compares rows of one run with each other
(ratios never cross runs); each row of a table names the commit its run measured, and the
caption names the data file, the device, the versions and the commands that made the rows.

This module holds the table registry (TABLES), the marked-block update and the report's entry
point; the tables themselves are in tables_perf.py and tables_validation.py (what they share:
tables_common.py), the plots in tables_plots.py.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmkernels_bench import data
from lmkernels_bench.tables_perf import (
    compare_table,
    dist_table,
    e2e_compile,
    e2e_table,
    flce_budgets,
    flce_design,
    flce_pareto,
    flce_ranges,
    flce_regimes,
    ops_summary,
)
from lmkernels_bench.tables_plots import plots
from lmkernels_bench.tables_validation import validation_report, validation_summary

DRY_RUN = data.gpu_kind("dry run")  # the kind of --dry-run's rows: the only file whose dry rows count
MARK = re.compile(r"<!-- bench:([\w-]+) ([\w-]+) -->\n.*?<!-- /bench -->", re.S)


# --- the blocks in the README and the docs ------------------------------------------------------------

TABLES: dict[str, Callable[[list[dict[str, Any]], str], str]] = {
    "flce": flce_design,
    "flce-budgets": flce_budgets,
    "flce-ranges": flce_ranges,
    "flce-regimes": flce_regimes,
    "flce-pareto": flce_pareto,
    "compare": compare_table,
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


# --- the command ----------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lmkernels-bench report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("folder", help="the folder of the data files, e.g. benchmarks/data")
    p.add_argument("--update", action="append", metavar="FILE", help="rewrite FILE's marked tables")
    p.add_argument("--check", action="append", metavar="FILE", help="fail if FILE's marked tables differ")
    p.add_argument("--no-plots", action="store_true", help="the validation reports only")
    return p


def main(argv: list[str] | None = None) -> int:
    """Plots and validation reports in the folder; --update / --check the documents' tables."""
    args = parser().parse_args(argv)
    folder = Path(args.folder)
    written = report(folder, args.folder, plots_too=not args.no_plots)
    print(f"wrote {len(written)} files to {folder}")
    stale = []
    for name in [*(args.update or []), *(args.check or [])]:
        path = Path(name)
        text = path.read_text()
        new = update_blocks(text, folder, args.folder)
        if new != text and name in (args.update or []):
            path.write_text(new)
            print(f"updated the tables of {path}")
        elif new != text:
            stale.append(name)
    for name in stale:
        print(f"{name}: its tables differ from the data (--update {name} rewrites them)", file=sys.stderr)
    return 1 if stale else 0
