"""`lmkernels bench` (and `python -m lmkernels.harness.bench`): arguments, the run, the reports."""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lmkernels import cliargs
from lmkernels.harness.bench import suite
from lmkernels.harness.bench.backends import PSEUDO_BACKENDS, backends_for
from lmkernels.harness.bench.measure import MIN_TIMED_RUNS
from lmkernels.harness.bench.plan import DTYPES, MODES
from lmkernels.harness.bench.report import failure_notes, narrow_tables, rich_table, write_reports
from lmkernels.harness.bench.run import run_bench
from lmkernels.harness.bench.suite import SUITES
from lmkernels.registry.core import LMKernelsError, get_op
from lmkernels.registry.core import ops as all_ops

WIDE_COLUMNS = 200  # the console width of --wide, whatever the terminal's

DESCRIPTION = """\
Time and peak memory of every backend on reference shapes or sweeps (CUDA).

Backends: every registered one available here (the peer adapters liger, cce,
cce_exact, torch_native included) plus, for FLCE, compile_naive: torch.compile
of F.cross_entropy((x @ W.T).float(), y), which materializes the logits.

Per case: GPU time (queue filled ahead), wall time (do_bench median, p20-p80),
profiler kernel time, peak memory above the inputs; for fwd+bwd, % of the copy
bandwidth or of the bf16 matmul rate measured in the same run, and ratios to
compile, compile_naive, liger and cce. Writes results.csv, results.json,
summary.md and PNG plots.

Suites (--suite, one --part per 10-minute call): the measurements the README and
the docs cite, appended as rows to one data file per GPU kind in --out
(<gpu>.jsonl: commit, device, versions and the peers' configurations per row),
and the validation evidence (<gpu>-validation.jsonl). --report DIR draws the
plots and writes the validation reports from those files; --update FILE rewrites
FILE's marked tables from them and --check FILE fails where one differs.
"""


def parse_options(items: Sequence[str] | None) -> dict[str, Any] | None:
    """--set key=value: Python literals, dtype names (bf16, fp32, fp16) as torch dtypes."""
    if not items:
        return None
    out: dict[str, Any] = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep:
            raise LMKernelsError(f"--set: expected key=value, got {item!r}")
        out[k.strip()] = DTYPES[v] if v in DTYPES else cliargs.key_value(item)[1]
    return out


def _set_item(text: str) -> str:
    cliargs.key_value(text)  # an argparse error unless it is key=value
    return text


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench",
        help="time and peak memory of every backend (CUDA)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--op", action="extend", type=cliargs.op_names, help="op (repeatable or comma-separated); default all"
    )
    p.add_argument(
        "--backend",
        action="extend",
        type=cliargs.backend_names_type(extra=list(PSEUDO_BACKENDS)),
        help="backend (repeatable or comma-separated); default every available one, "
        "adapters and compile_naive included",
    )
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    p.add_argument(
        "--mode",
        default="full",
        choices=[*MODES, "all"],
        help="fwd, bwd (backward alone), full (fwd+bwd, default) or all three",
    )
    p.add_argument(
        "--grid",
        default="design",
        choices=["design", "sweep"],
        help="design: one reference shape per op, Llama-3-8B-like (default); "
        "sweep: sizes 1k..16k (FLCE: tokens and vocab)",
    )
    p.add_argument(
        "--set",
        action="append",
        type=_set_item,
        metavar="KEY=VALUE",
        help="op options for every point instead of the default cases, e.g. grad_accum_dtype=bf16 "
        "or regime=zipf (FLCE's logit regime: uniform, gaussian, zipf)",
    )
    p.add_argument("--out", help="report directory (default lmkernels-results/bench-<date>)")
    p.add_argument(
        "--quick", action="store_true", help="short timings, 3 sizes per sweep, default options only"
    )
    p.add_argument(
        "--warmup", type=cliargs.positive_float, help="do_bench warmup in ms (default 25, quick 5)"
    )
    p.add_argument(
        "--rep",
        type=cliargs.positive_float,
        help=f"do_bench rep in ms (default 100, quick 25; >= {MIN_TIMED_RUNS} runs)",
    )
    p.add_argument(
        "--budget",
        type=cliargs.positive_float,
        help="seconds: points not started by then are recorded as skipped (default 540; "
        "with --suite, the part's own)",
    )
    s = p.add_argument_group("suites and their data files")
    s.add_argument("--suite", choices=list(SUITES), help="run parts of a suite (needs --part and --out)")
    s.add_argument(
        "--part",
        action="extend",
        type=_part_names,
        help="the suite's parts (repeatable or comma-separated; all: every part); --list-parts",
    )
    s.add_argument("--list-parts", action="store_true", help="print the suites' parts and exit")
    s.add_argument("--again", action="store_true", help="measure points the data file already has")
    s.add_argument("--dry-run", action="store_true", help="made-up timings, no GPU: a check of the plumbing")
    s.add_argument("--report", metavar="DIR", help="plots and validation reports from DIR's data files")
    s.add_argument(
        "--update", action="append", metavar="FILE", help="with --report: rewrite FILE's marked tables"
    )
    s.add_argument(
        "--check", action="append", metavar="FILE", help="with --report: fail if FILE's marked tables differ"
    )
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--wide", action="store_true", help="one table with every column (wall and kernel time; > 80 columns)"
    )
    p.set_defaults(func=run)
    return p


def _part_names(text: str) -> list[str]:
    names = cliargs.split_commas(text)
    known = {p for table in SUITES.values() for p in table} | {"all"}
    for name in names:
        if name not in known:
            raise argparse.ArgumentTypeError(cliargs.unknown("part", name, sorted(known)))
    return names


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    console = Console()
    if args.list_parts:
        print(suite.describe())
        return 0
    if args.report:
        return run_report(args, console)
    if args.suite:
        return run_suite(args, console)
    if args.part or args.update or args.check:
        raise LMKernelsError("--part goes with --suite; --update and --check with --report")
    ops = args.op or [spec.name for spec in all_ops()]
    options = parse_options(args.set)
    if options:
        cliargs.check_options([get_op(op) for op in ops], options)
    if not torch.cuda.is_available():
        console.print(
            "[red]lmkernels bench times the kernels on a CUDA device; none is available here.[/] "
            "On the CPU, `lmkernels validate` checks them (the Triton kernels under "
            "TRITON_INTERPRET=1, the CPU interpreter, which is too slow to time)."
        )
        return 2
    skipped: dict[str, str] = {}
    for op in ops:
        skipped.update(backends_for(op, args.backend, "cuda")[1])
    if skipped:
        console.print(f"not run here: {escape(cliargs.summarize_skipped(skipped))}")
        hint = cliargs.triton_hint(skipped.values())
        if hint:
            console.print(hint)
    modes = list(MODES) if args.mode == "all" else [args.mode]
    args.budget = args.budget or 540
    out = Path(args.out or f"lmkernels-results/bench-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    command = " ".join(sys.argv)

    def save_partial(rows, meta):  # after each point: a run stopped from outside keeps its results
        write_reports(rows, meta | {"command": command, "partial": True}, out, plots=False)

    rows, meta = run_bench(
        ops,
        args.backend,
        DTYPES[args.dtype],
        modes,
        args.grid,
        args.quick,
        options,
        warmup=args.warmup,
        rep=args.rep,
        console=console,
        progress=not args.no_progress,
        budget_s=args.budget,
        on_point=save_partial,
    )
    meta["command"] = command
    print_tables(rows, console, args.wide)
    paths = write_reports(rows, meta, out, plots=not args.no_plots)
    console.print(f"wrote {len(paths)} files to {out}")
    return 0


def run_suite(args: argparse.Namespace, console) -> int:
    """--suite: each part in turn, its rows appended to the GPU kind's data file in --out."""
    table = SUITES[args.suite]
    if not args.part or not args.out:
        raise LMKernelsError(
            f"--suite {args.suite} needs --part (one of {', '.join(table)}, or all) and --out DIR"
        )
    parts = list(table) if "all" in args.part else args.part
    wrong = [p for p in parts if p not in table]
    if wrong:
        raise LMKernelsError(f"--part: {', '.join(wrong)} not in suite {args.suite} ({', '.join(table)})")
    rest = sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]  # lmkernels bench / -m ...bench
    command = shlex.join(["lmkernels", "bench", *rest])
    for part in parts:
        suite.run_part(
            args.suite,
            part,
            Path(args.out),
            dry_run=args.dry_run,
            again=args.again,
            budget=args.budget,
            command=command,
            log=console.print,
        )
    return 0


def run_report(args: argparse.Namespace, console) -> int:
    """--report DIR: plots and validation reports; --update / --check the marked tables."""
    from lmkernels.harness.bench import tables

    folder = Path(args.report)
    written = tables.report(folder, args.report)
    console.print(f"wrote {len(written)} files to {folder}")
    stale = []
    for name in [*(args.update or []), *(args.check or [])]:
        path = Path(name)
        text = path.read_text()
        new = tables.update_blocks(text, folder, args.report)
        if new != text and name in (args.update or []):
            path.write_text(new)
            console.print(f"updated the tables of {path}")
        elif new != text:
            stale.append(name)
    for name in stale:
        console.print(f"[red]{name}: its tables differ from the data[/] (--update {name} rewrites them)")
    return 1 if stale else 0


def print_tables(rows: list[dict[str, Any]], console, wide: bool = False) -> None:
    """The results: narrow tables (80 columns) and the failures' notes, or with `wide` one
    table with every column, printed past the terminal's width."""
    from rich.console import Console
    from rich.markup import escape

    if wide:
        Console(
            file=console.file,
            width=max(console.width, WIDE_COLUMNS),
            force_terminal=console.is_terminal,
            color_system=console.color_system,
        ).print(rich_table(rows))
        return
    for table in narrow_tables(rows):
        console.print(table)
    for line in failure_notes(rows):
        console.print(escape(line))
    console.print("--wide: wall and kernel times, memory ratios and notes in one table")


def main(argv: Sequence[str] | None = None) -> int:
    parser = cliargs.Parser(prog="python -m lmkernels.harness.bench")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(argv if argv is not None else sys.argv[1:])])
    return cliargs.invoke(args)
