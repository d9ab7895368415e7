"""The `lmkernels` command: list, explain, validate, converge, bench, tune, compile-check, patch-report."""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from rich.console import Console

from lmkernels import cliargs
from lmkernels.cliargs import parse_shape, summarize_skipped  # noqa: F401  (used by tests and tools)
from lmkernels.harness.checks import DTYPE_NAMES, DTYPES_BY_NAME, CaseResult
from lmkernels.registry.core import LMKernelsError, get_op
from lmkernels.registry.dispatch import Explanation, explain

if TYPE_CHECKING:
    from concurrent.futures import ProcessPoolExecutor

console = Console()
VALIDATE_DTYPES = ("fp32", "bf16", "fp16")


# --- list ---------------------------------------------------------------------------------------


def cmd_list(args: argparse.Namespace) -> int:
    from lmkernels import _versions
    from lmkernels.harness.listing import render_list

    print(render_list(width=cliargs.width(), reasons=args.reasons))
    for problem in _versions.problems():
        print(cliargs.wrap(f"warning: {problem}", subsequent="  "))
    return 0


# --- explain ------------------------------------------------------------------------------------


def parse_options(items: list[tuple[str, Any]] | None) -> dict[str, Any]:
    """--set key=value pairs (parsed by cliargs.key_value)."""
    return dict(items or [])


def cmd_explain(args: argparse.Namespace) -> int:
    op = args.op
    spec = get_op(op)
    shape = parse_shape(spec, args.shape) if args.shape else spec.shapes["quick"][0]
    options = parse_options(args.set)
    cliargs.check_options([spec], options)
    dtype = DTYPES_BY_NAME[args.dtype]
    inputs = spec.make_inputs(shape, dtype, args.device, 0, **options)
    spec.check_inputs(**inputs)  # a bad option value: an error naming the option
    if args.grad:
        for name in spec.grad_inputs:
            if isinstance(inputs.get(name), torch.Tensor):
                inputs[name].requires_grad_(True)
    dims = ",".join(f"{k}={v}" for k, v in shape.items())
    opts = "".join(f", {k}={v!r}" for k, v in options.items())
    print(cliargs.wrap(f"{op} {dims}, {args.dtype}, {args.device}{opts}{', grad' if args.grad else ''}"))
    print(render_explanation(explain(op, inputs, args.backend)))
    return 0


def render_explanation(e: Explanation, columns: int | None = None) -> str:
    """An Explanation as a table that fits the terminal: long reasons wrap in their column."""
    cols = columns or cliargs.width()
    asked = (
        "auto (no backend asked for)"
        if e.requested.source == "auto"
        else (f"requested {e.requested.backend!r} by {e.requested.source}")
    )
    head = f"{asked}: " + (f"runs {e.chosen!r}" if e.chosen else f"ERROR: {e.error}")
    rows = [
        ("->" if name == e.chosen else "", name, str(prio), "; ".join(reasons) or "ok")
        for name, prio, reasons in e.rows
    ]
    lines = [
        cliargs.wrap(head, subsequent="  ", columns=cols),
        cliargs.table(("", "backend", "prio", "ok, or why not"), rows, cols),
    ]
    if e.note:
        lines.append(cliargs.wrap(f"note: {e.note}", subsequent="  ", columns=cols))
    return "\n".join(lines)


# --- validate -----------------------------------------------------------------------------------


def cmd_validate(args: argparse.Namespace) -> int:
    from lmkernels.harness import runner

    check_filters(args.op, args.backend)
    grid = "full" if args.full else "quick"
    compile_backend = None if args.compile == "none" else args.compile
    # Workers start first: they import torch and the compiler while this process plans.
    jobs = args.jobs if args.jobs is not None else default_jobs(args.device, args.op, args.backend)
    workers = runner.start_workers(jobs) if jobs > 1 else None
    try:
        return _validate(args, grid, compile_backend, jobs, workers)
    finally:
        if workers is not None:
            workers.shutdown(cancel_futures=True)


def _validate(
    args: argparse.Namespace,
    grid: str,
    compile_backend: str | None,
    jobs: int,
    workers: ProcessPoolExecutor | None,
) -> int:
    from lmkernels.harness import runner

    plans = list(
        runner.plan_cases(
            args.op,
            args.backend,
            runner.parse_dtypes(args.dtype),
            grid,
            compile_backend,
            compile_first_only=not args.compile_all,
            device=args.device,
        )
    )
    skipped = runner.skipped_backends(args.op, args.backend, args.device)
    ran = sorted({p.impl.backend for p in plans})
    console.print(
        f"validating on {args.device}: {', '.join(ran) or 'nothing'} ({len(plans)} cases, "
        f"{jobs} process{'es' if jobs > 1 else ''})"
    )
    if skipped:
        console.print(f"not run here: {summarize_skipped(skipped)}")
        hint = cliargs.triton_hint(skipped.values())
        if hint:
            console.print(hint)
    if not plans:
        console.print("[red]nothing to validate: every backend selected is unavailable here[/]")
        return 2
    if grid == "quick":
        console.print(
            "quick grid: per op and backend, values and gradients of every option set, dtype "
            "and quick shape at least once (not their product); fullgraph compile check "
            f"({compile_backend or 'off'}) once per backend"
        )
    for line in runner.coverage_lines(plans):
        console.print(f"  {line}")
    meta = runner.environment() | {
        "grid": grid,
        "command": " ".join(sys.argv),
        "compile_backend": compile_backend,
        "not_run_here": skipped,
    }
    out = Path(args.out or f"lmkernels-results/validate-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    last_write = [time.monotonic()]

    def checkpoint(so_far: Sequence[CaseResult]) -> None:
        # Rewrite the reports every 30 s: a run stopped by a time limit keeps what it checked.
        if time.monotonic() - last_write[0] > 30:
            runner.write_reports(so_far, out, meta | {"partial": f"{len(so_far)} of {len(plans)} cases"})
            last_write[0] = time.monotonic()

    results = runner.run_validation(plans, args.device, console, not args.no_progress, checkpoint, workers)
    console.print(runner.summary_table(results))
    for line in runner.failure_lines(results):
        console.print(f"[red]FAIL[/] {line}")
    paths = runner.write_reports(results, out, meta)
    n_bad = sum(r.status in ("fail", "error") for r in results)
    n_pass = sum(r.status == "pass" for r in results)
    n_uns = sum(r.status == "unsupported" for r in results)
    console.print(f"{n_pass} passed, {n_bad} failed, {n_uns} unsupported; reports: {paths['md'].parent}")
    return 1 if n_bad else 0


def default_jobs(device: str, op_filter: Sequence[str] | None, backend_filter: Sequence[str] | None) -> int:
    """Two worker processes on a CPU with 2+ cores (a CPU run mostly waits on the C++ compiler
    of the compile backend); one for a run narrowed to some ops and backends, too small to
    pay for starting them (seconds), and on a GPU."""
    if device != "cpu" or (op_filter and backend_filter):
        return 1
    return min(2, os.cpu_count() or 1)


def check_filters(op_filter: list[str] | None, backend_filter: list[str] | None) -> None:
    """Raise LMKernelsError when no selected backend implements a selected op (`validate --op
    rope --backend cce`): the run would check nothing."""
    from lmkernels.registry.core import impls, ops

    if not backend_filter:
        return
    op_names = op_filter or [s.name for s in ops()]
    if not any(i.backend in backend_filter for op in op_names for i in impls(op)):
        raise LMKernelsError(
            f"--backend: no impl of {', '.join(op_names)} by {', '.join(backend_filter)} "
            "(lmkernels list shows which backend implements which op)"
        )


# --- main ---------------------------------------------------------------------------------------


def _version_line() -> str:
    """lmkernels' version and those of what it runs on."""
    import lmkernels

    parts = [f"lmkernels {lmkernels.__version__}", f"torch {torch.__version__}"]
    try:
        import triton

        parts.append(f"triton {triton.__version__}")
    except ImportError:
        parts.append("no triton")
    return ", ".join(parts)


def build_parser() -> argparse.ArgumentParser:
    p = cliargs.Parser(prog="lmkernels", description=__doc__)
    p.add_argument("--version", action="version", version=_version_line())
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    lst = sub.add_parser("list", help="which backend can run each op here")
    lst.add_argument("--reasons", action="store_true", help="say why each 'no' is a no")
    lst.set_defaults(func=cmd_list)

    e = sub.add_parser("explain", help="which impl would run for given inputs, and why not the others")
    e.add_argument("op", type=cliargs.op_name, help="op name, e.g. rms_norm or flce")
    e.add_argument("--shape", help='"M=4096,N=8192" or "4096x8192" (dims as in the op\'s grid)')
    e.add_argument("--dtype", default="bf16", type=cliargs.dtype_type("fp32", "bf16", "fp16", "fp64"))
    e.add_argument(
        "--device",
        type=cliargs.device,
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu or cuda (default: cuda if available)",
    )
    e.add_argument("--backend", type=cliargs.backend_name, help="as if backend= were passed")
    e.add_argument(
        "--set",
        action="append",
        type=cliargs.key_value,
        metavar="KEY=VALUE",
        help="op option (repeatable), e.g. casting_mode=gemma",
    )
    e.add_argument("--grad", action="store_true", help="inputs require grad")
    e.set_defaults(func=cmd_explain)

    v = sub.add_parser("validate", help="check every impl's values and gradients against fp64")
    v.add_argument(
        "--op", action="extend", type=cliargs.op_names, help="op (repeatable or comma-separated); default all"
    )
    v.add_argument(
        "--backend",
        action="extend",
        type=cliargs.backend_names_type(),
        help="backend (repeatable or comma-separated); default all",
    )
    v.add_argument(
        "--dtype",
        action="extend",
        type=cliargs.dtype_list,
        help="fp32, bf16, fp16 (repeatable or comma-separated); default all",
    )
    v.add_argument("--device", default="cpu", type=cliargs.device, help="cpu (default) or cuda")
    g = v.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="small shapes (default)")
    g.add_argument("--full", action="store_true", help="the full grid, up to the benchmark sizes")
    v.add_argument(
        "--compile",
        default="aot_eager",
        choices=["none", "eager", "aot_eager", "inductor"],
        help="torch.compile backend of the fullgraph check (default aot_eager)",
    )
    v.add_argument(
        "--compile-all", action="store_true", help="compile-check every case, not one per impl/dtype"
    )
    v.add_argument(
        "--jobs",
        type=cliargs.positive_int,
        help="worker processes (default: 2 on a CPU with 2+ cores, else 1)",
    )
    v.add_argument("--out", help="report directory (default lmkernels-results/validate-<date>)")
    v.add_argument("--no-progress", action="store_true")
    v.set_defaults(func=cmd_validate)

    for module in (
        "lmkernels.convergence.cli",
        "lmkernels.harness.bench.cli",
        "lmkernels.harness.tune.cli",
        "lmkernels.harness.targets",
        "lmkernels.integrations.transformers.cli",
    ):
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            if exc.name != module:
                raise
            continue
        mod.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    return cliargs.invoke(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["main", "build_parser", "DTYPE_NAMES"]
