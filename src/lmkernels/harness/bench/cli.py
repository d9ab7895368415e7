"""`lmkernels bench` (and `python -m lmkernels.harness.bench`): arguments, the run, the reports."""

from __future__ import annotations

import argparse
import ast
import datetime
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lmkernels.harness.bench.backends import PSEUDO_BACKENDS
from lmkernels.harness.bench.measure import MIN_TIMED_RUNS
from lmkernels.harness.bench.plan import DESIGN_SHAPES, DTYPES, MODES
from lmkernels.harness.bench.report import rich_table, write_reports
from lmkernels.harness.bench.run import run_bench
from lmkernels.registry.core import LMKernelsError, backend_names
from lmkernels.registry.dispatch import canonical_op

DESCRIPTION = """\
Time and peak memory of every backend on DESIGN.md's shapes or sweeps (CUDA).

Backends: every registered one available here (the peer adapters liger, cce,
cce_exact, torch_native included) plus, for FLCE, compile_naive: torch.compile
of F.cross_entropy((x @ W.T).float(), y), which materializes the logits.

Per case: GPU time (queue filled ahead), wall time (do_bench median, p20-p80),
profiler kernel time, peak memory above the inputs; for fwd+bwd, % of the copy
bandwidth or of the bf16 matmul rate measured in the same run, and ratios to
compile, compile_naive, liger and cce. Writes results.csv, results.json,
summary.md and PNG plots. benchmarks/flce_frontier.py: the FLCE frontier grid.
"""


def _split(values: Sequence[str] | None) -> list[str] | None:
    if not values:
        return None
    return [v.strip() for item in values for v in item.split(",") if v.strip()]


def parse_options(items: Sequence[str] | None) -> dict[str, Any] | None:
    """--set key=value: Python literals, dtype names (bf16, fp32, fp16) as torch dtypes."""
    if not items:
        return None
    out: dict[str, Any] = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep:
            raise LMKernelsError(f"--set: expected key=value, got {item!r}")
        if v in DTYPES:
            out[k] = DTYPES[v]
            continue
        try:
            out[k] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            out[k] = v
    return out


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench",
        help="time and peak memory of every backend (CUDA)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--op", action="append", help="op (repeatable or comma-separated); default all")
    p.add_argument(
        "--backend",
        action="append",
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
        help="design: DESIGN.md's shapes (default); sweep: sizes 1k..16k (FLCE: tokens and vocab)",
    )
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="op options for every point instead of the default cases, e.g. grad_accum_dtype=bf16 "
        "or regime=zipf (FLCE's logit regime: uniform, gaussian, zipf)",
    )
    p.add_argument("--out", help="report directory (default benchmarks/results/<date>)")
    p.add_argument(
        "--quick", action="store_true", help="short timings, 3 sizes per sweep, default options only"
    )
    p.add_argument("--warmup", type=float, help="do_bench warmup in ms (default 25, quick 5)")
    p.add_argument(
        "--rep", type=float, help=f"do_bench rep in ms (default 100, quick 25; >= {MIN_TIMED_RUNS} runs)"
    )
    p.add_argument(
        "--budget",
        type=float,
        default=540,
        help="seconds: points not started by then are recorded as skipped (default 540)",
    )
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(width=200) if not sys.stdout.isatty() else Console()
    if not torch.cuda.is_available():
        console.print(
            "[red]lmkernels bench needs a CUDA device; none is available here.[/] "
            "On the CPU, `pytest benchmarks/test_bench_cpu.py` runs the small benchmark suite."
        )
        return 2
    ops = [canonical_op(o) for o in (_split(args.op) or list(DESIGN_SHAPES))]
    known = [*backend_names(), *PSEUDO_BACKENDS]
    unknown = [b for b in _split(args.backend) or [] if b not in known]
    if unknown:
        raise LMKernelsError(f"--backend: unknown {unknown}; known backends: {known}")
    modes = list(MODES) if args.mode == "all" else [args.mode]
    out = Path(args.out or f"benchmarks/results/{datetime.datetime.now():%Y%m%d-%H%M%S}")
    command = " ".join(sys.argv)

    def save_partial(rows, meta):  # after each point: a run stopped from outside keeps its results
        write_reports(rows, meta | {"command": command, "partial": True}, out, plots=False)

    rows, meta = run_bench(
        ops,
        _split(args.backend),
        DTYPES[args.dtype],
        modes,
        args.grid,
        args.quick,
        parse_options(args.set),
        warmup=args.warmup,
        rep=args.rep,
        console=console,
        progress=not args.no_progress,
        budget_s=args.budget,
        on_point=save_partial,
    )
    meta["command"] = command
    console.print(rich_table(rows))
    paths = write_reports(rows, meta, out, plots=not args.no_plots)
    console.print(f"wrote {len(paths)} files to {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lmkernels.harness.bench")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(argv if argv is not None else sys.argv[1:])])
    return int(args.func(args) or 0)
