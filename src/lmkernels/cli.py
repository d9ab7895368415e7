"""The `lmkernels` command: list, explain, validate, converge, bench."""

from __future__ import annotations

import argparse
import ast
import datetime
import importlib
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from lmkernels.harness.checks import DTYPE_NAMES, DTYPES_BY_NAME
from lmkernels.registry.core import LMKernelsError, get_op
from lmkernels.registry.dispatch import canonical_op, explain

console = Console()


# --- list ---------------------------------------------------------------------------------------


def cmd_list(args: argparse.Namespace) -> int:
    from lmkernels.harness.listing import render_list

    print(render_list(width=80, reasons=args.reasons))
    return 0


# --- explain ------------------------------------------------------------------------------------


def parse_shape(spec_name: str, text: str) -> dict[str, int]:
    """ "M=4096,N=8192" or "4096x8192" (dims in the order of the op's shape grid)."""
    spec = get_op(spec_name)
    dims = list(spec.shapes["quick"][0])
    if "=" in text:
        shape = {}
        for part in text.split(","):
            k, _, v = part.partition("=")
            shape[k.strip()] = int(v)
        missing = [d for d in dims if d not in shape]
        if missing:
            raise LMKernelsError(f"--shape: {spec_name} needs dims {dims}, missing {missing}")
        return {d: shape[d] for d in dims}
    values = [int(v) for v in text.lower().split("x")]
    if len(values) != len(dims):
        raise LMKernelsError(f"--shape: {spec_name} takes {len(dims)} dims {'x'.join(dims)}, got {text!r}")
    return dict(zip(dims, values))


def parse_options(items: list[str] | None) -> dict[str, Any]:
    """--set key=value pairs; values are Python literals when they parse as such."""
    out: dict[str, Any] = {}
    for item in items or []:
        k, sep, v = item.partition("=")
        if not sep:
            raise LMKernelsError(f"--set: expected key=value, got {item!r}")
        try:
            out[k] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            out[k] = v
    return out


def cmd_explain(args: argparse.Namespace) -> int:
    op = canonical_op(args.op)
    spec = get_op(op)
    shape = parse_shape(op, args.shape) if args.shape else spec.shapes["quick"][0]
    dtype = DTYPES_BY_NAME[args.dtype]
    inputs = spec.make_inputs(shape, dtype, args.device, 0, **parse_options(args.set))
    if args.grad:
        for name in spec.grad_inputs:
            if isinstance(inputs.get(name), torch.Tensor):
                inputs[name].requires_grad_(True)
    print(f"shape {shape}, dtype {args.dtype}, device {args.device}")
    print(explain(op, inputs, args.backend))
    return 0


# --- validate -----------------------------------------------------------------------------------


def cmd_validate(args: argparse.Namespace) -> int:
    from lmkernels.harness import runner

    if args.device == "cuda" and not torch.cuda.is_available():
        console.print("[red]--device cuda: no CUDA device is available[/]")
        return 2
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


def _validate(args, grid: str, compile_backend: str | None, jobs: int, workers) -> int:
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
        console.print(f"not run here: {summarize_skipped(skipped)}", soft_wrap=False)
    if not plans:
        console.print("[red]nothing to validate for these filters[/]")
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

    def checkpoint(so_far):
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


def default_jobs(device: str, op_filter, backend_filter) -> int:
    """Two worker processes on a CPU with 2+ cores (a CPU run mostly waits on the C++ compiler
    of the compile backend); one for a run narrowed to some ops and backends, too small to
    pay for starting them (seconds), and on a GPU."""
    if device != "cpu" or (op_filter and backend_filter):
        return 1
    return min(2, os.cpu_count() or 1)


def summarize_skipped(skipped: dict[str, str]) -> str:
    """One line for the backends a run leaves out: "liger, cce (not installed); torch_native
    (cuda only)", reasons cut to their gist (the report's meta keeps them whole)."""
    by_reason: dict[str, list[str]] = {}
    for backend, reason in skipped.items():
        short = reason.split(" (")[0]
        if short.endswith(" is not installed"):
            short = "not installed"
        elif short.startswith("runs on ") and short.endswith(" only"):
            short = short.removeprefix("runs on ")
        by_reason.setdefault(short, []).append(backend)
    return "; ".join(f"{', '.join(bs)} ({why})" for why, bs in by_reason.items())


# --- main ---------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lmkernels", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    lst = sub.add_parser("list", help="which backend can run each op here")
    lst.add_argument("--reasons", action="store_true", help="say why each 'no' is a no")
    lst.set_defaults(func=cmd_list)

    e = sub.add_parser("explain", help="which impl would run for given inputs, and why not the others")
    e.add_argument("op")
    e.add_argument("--shape", help='"M=4096,N=8192" or "4096x8192" (dims as in the op\'s grid)')
    e.add_argument("--dtype", default="bf16", choices=list(DTYPES_BY_NAME))
    e.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    e.add_argument("--backend", help="as if backend= were passed")
    e.add_argument("--set", action="append", help="op option key=value, e.g. casting_mode=gemma")
    e.add_argument("--grad", action="store_true", help="inputs require grad")
    e.set_defaults(func=cmd_explain)

    v = sub.add_parser("validate", help="check every impl's values and gradients against fp64")
    v.add_argument("--op", action="append", help="op name (repeatable); default all")
    v.add_argument("--backend", action="append", help="backend (repeatable); default all")
    v.add_argument("--dtype", action="append", help="fp32, bf16, fp16 (repeatable); default all")
    v.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
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
    v.add_argument("--jobs", type=int, help="worker processes (default: 2 on a CPU with 2+ cores, else 1)")
    v.add_argument("--out", help="report directory")
    v.add_argument("--no-progress", action="store_true")
    v.set_defaults(func=cmd_validate)

    for module in (
        "lmkernels.convergence.cli",
        "lmkernels.harness.bench.cli",
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
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except LMKernelsError as e:
        console.print(f"[red]error:[/] {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["main", "build_parser", "DTYPE_NAMES"]
