"""`lmkernels bench` (and `python -m lmkernels.harness.bench`): arguments, the run, the reports."""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lmkernels import cliargs
from lmkernels.harness.bench.backends import PSEUDO_BACKENDS, backends_for
from lmkernels.harness.bench.measure import MIN_TIMED_RUNS
from lmkernels.harness.bench.plan import DTYPES, MODES, default_shape
from lmkernels.harness.bench.report import failure_notes, narrow_tables, rich_table, write_reports
from lmkernels.harness.bench.run import run_bench
from lmkernels.registry.core import LMKernelsError, get_op

if TYPE_CHECKING:
    from rich.console import Console

WIDE_COLUMNS = 200  # the console width of --wide, whatever the terminal's

DESCRIPTION = """\
Time and peak memory of every backend of one op at the shapes you give (CUDA).

Backends: every registered one available here (the peer adapters liger, cce,
cce_exact, torch_native included) plus, for FLCE, compile_naive: torch.compile
of F.cross_entropy((x @ W.T).float(), y), which materializes the logits.

Per shape: GPU time (launch queue filled ahead), wall time (do_bench median,
p20-p80), profiler kernel time, peak memory above the inputs; for fwd+bwd, % of
the copy bandwidth or of the bf16 matmul rate measured in the same run, and
ratios to compile, compile_naive, liger and cce. Writes results.csv,
results.json and summary.md to --out.

--device cpu times the wall clock only (no GPU time, no peak memory): a check
of the plumbing and of the CPU backends; pass small --shape values there.

  lmkernels bench --op rms_norm --shape 16384x4096 --shape 4096x8192
  lmkernels bench --op flce --shape BT=8192,H=4096,V=128256 --set regime=zipf
  lmkernels bench --op rms_norm --device cpu --shape 64x256 --quick
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
        short = cliargs.DTYPE_ALIASES.get(v.strip().lower().removeprefix("torch."))
        out[k.strip()] = DTYPES[short] if short in DTYPES else cliargs.key_value(item)[1]
    return out


def _set_item(text: str) -> str:
    cliargs.key_value(text)  # an argparse error unless it is key=value
    return text


def add_parser(subparsers: argparse._SubParsersAction[Any]) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench",
        help="time and peak memory of every backend of one op (CUDA)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--op", required=True, type=cliargs.op_name, help="the op, e.g. rms_norm or flce")
    p.add_argument(
        "--shape",
        action="append",
        metavar="SHAPE",
        help='"M=4096,N=8192" or "4096x8192" (dims as in the op\'s grid; repeatable); '
        "default: the op's reference shape (Llama 3 8B's sizes)",
    )
    p.add_argument(
        "--backend",
        action="extend",
        type=cliargs.backend_names_type(extra=list(PSEUDO_BACKENDS)),
        help="backend (repeatable or comma-separated); default every available one, "
        "adapters and compile_naive included",
    )
    p.add_argument("--dtype", default="bf16", type=cliargs.dtype_type())
    p.add_argument(
        "--mode",
        default="full",
        choices=[*MODES, "all"],
        help="fwd, bwd (backward alone), full (fwd+bwd, default) or all three",
    )
    p.add_argument(
        "--set",
        action="append",
        type=_set_item,
        metavar="KEY=VALUE",
        help="op options instead of the default cases, e.g. grad_accum_dtype=bf16 "
        "or regime=zipf (FLCE's logit regime: uniform, gaussian, zipf)",
    )
    p.add_argument("--device", type=cliargs.device, help="cuda (default) or cpu (wall time only)")
    p.add_argument("--out", help="report directory (default lmkernels-results/bench-<date>)")
    p.add_argument("--quick", action="store_true", help="short timings, default options only")
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
        default=540.0,
        help="seconds: shapes not started by then are recorded as skipped (default 540)",
    )
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--wide", action="store_true", help="one table with every column (wall and kernel time; > 80 columns)"
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    console = Console()
    if args.device is None:
        if not torch.cuda.is_available():
            raise LMKernelsError(
                "lmkernels bench times the kernels on a CUDA device; none is available here. "
                "--device cpu times the CPU backends' wall clock; `lmkernels validate` checks them all"
            )
        args.device = "cuda"
    spec = get_op(args.op)
    shapes = [cliargs.parse_shape(spec, s) for s in args.shape] if args.shape else [default_shape(args.op)]
    options = parse_options(args.set)
    if options:
        cliargs.check_options([spec], options)
    names, skipped = backends_for(args.op, args.backend, args.device)
    if skipped:
        console.print(f"not run here: {escape(cliargs.summarize_skipped(skipped))}")
        hint = cliargs.triton_hint(skipped.values())
        if hint:
            console.print(hint)
    if not names:
        asked = f" by {', '.join(args.backend)}" if args.backend else ""
        raise LMKernelsError(f"nothing to time: no impl of {args.op}{asked} runs on {args.device} here")
    if args.device == "cpu":
        console.print("on the CPU: wall time only (no GPU time, no peak memory)")
    modes = list(MODES) if args.mode == "all" else [args.mode]
    out = Path(args.out or f"lmkernels-results/bench-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    command = " ".join(sys.argv)

    def save_partial(
        rows: list[dict[str, Any]], meta: dict[str, Any]
    ) -> None:  # after each point: a run stopped from outside keeps its results
        write_reports(rows, meta | {"command": command, "partial": True}, out)

    rows, meta = run_bench(
        args.op,
        shapes,
        args.backend,
        DTYPES[args.dtype],
        modes,
        args.quick,
        options,
        device=args.device,
        warmup=args.warmup,
        rep=args.rep,
        console=console,
        progress=not args.no_progress,
        budget_s=args.budget,
        on_point=save_partial,
    )
    meta["command"] = command
    print_tables(rows, console, args.wide)
    paths = write_reports(rows, meta, out)
    console.print(f"wrote {len(paths)} files to {out}")
    return 0


def print_tables(rows: list[dict[str, Any]], console: Console, wide: bool = False) -> None:
    """The results: narrow tables (80 columns) and the failures' notes, or with `wide` one
    table with every column, printed past the terminal's width."""
    from rich.console import Console
    from rich.markup import escape

    if wide:
        Console(
            file=console.file,
            width=max(console.width, WIDE_COLUMNS),
            force_terminal=console.is_terminal,
            color_system=console.color_system,  # type: ignore[arg-type]  # (rich: str property, Literal argument)
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
