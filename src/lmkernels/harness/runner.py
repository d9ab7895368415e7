"""`lmkernels validate`: every impl x shape x dtype x option case, with a progress bar and a report."""

from __future__ import annotations

import csv
import dataclasses
import importlib
import json
import multiprocessing
import platform
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from lmkernels.harness.checks import DTYPE_NAMES, DTYPES_BY_NAME, CaseResult, TensorError, case_id, check_case
from lmkernels.harness.listing import short_op
from lmkernels.registry.core import Impl, LMKernelsError, OpSpec, get_impl, get_op, impls, ops
from lmkernels.registry.dispatch import canonical_op


@dataclasses.dataclass
class Plan:
    spec: OpSpec
    impl: Impl
    shape: dict[str, int]
    dtype: torch.dtype
    case: dict[str, Any]
    compile_backend: str | None


def not_runnable_here(impl: Impl, device: str) -> str | None:
    """Why no case of this impl can run on `device` (package missing, no such device), or None."""
    reason = impl.unavailable_reason()
    if reason:
        return reason
    if device not in impl.devices:
        return f"runs on {', '.join(impl.devices)} only"
    return None


def skipped_backends(
    op_names: Sequence[str] | None, backends: Sequence[str] | None, device: str
) -> dict[str, str]:
    """backend -> why it is left out of a run on `device` (every case would be "unsupported")."""
    specs = [get_op(canonical_op(n)) for n in op_names] if op_names else ops()
    out: dict[str, str] = {}
    for spec in specs:
        for impl in impls(spec.name):
            if backends and impl.backend not in backends:
                continue
            reason = not_runnable_here(impl, device)
            if reason:
                out.setdefault(impl.backend, reason)
    return out


def plan_cases(
    op_names: Sequence[str] | None = None,
    backends: Sequence[str] | None = None,
    dtypes: Sequence[str] | None = None,
    grid: str = "quick",
    compile_backend: str | None = None,
    compile_first_only: bool = True,
    device: str | None = None,
) -> Iterator[Plan]:
    """The cases to run, impls innermost (the fp64 reference of a case is computed once and
    shared by them). With a device, impls that cannot run there at all are left out (see
    skipped_backends).

    full: every shape x dtype x option case. quick: see quick_combos. The fullgraph compile
    check (compile_backend) runs on the first case of each impl and dtype on the full grid,
    of each impl on the quick one, or on every case without compile_first_only."""
    specs = [get_op(canonical_op(n)) for n in op_names] if op_names else ops()
    for spec in specs:
        chosen = [
            i
            for i in impls(spec.name)
            if (not backends or i.backend in backends)
            and (device is None or not not_runnable_here(i, device))
        ]
        op_dtypes = [d for d in spec.dtypes if not dtypes or DTYPE_NAMES[d] in dtypes]
        if grid == "quick":
            combos = quick_combos(spec, op_dtypes)
        else:
            combos = [(s, d, c) for d in op_dtypes for s in spec.shapes[grid] for c in spec.cases]
        seen_compile: set[tuple[str, torch.dtype | None]] = set()
        for shape, dtype, case in combos:
            for impl in chosen:
                key = (impl.backend, None if grid == "quick" else dtype)
                first = key not in seen_compile
                seen_compile.add(key)
                run_compile = compile_backend if (first or not compile_first_only) else None
                yield Plan(spec, impl, shape, dtype, case, run_compile)


def quick_combos(
    spec: OpSpec, dtypes: Sequence[torch.dtype]
) -> list[tuple[dict[str, int], torch.dtype, dict[str, Any]]]:
    """The quick grid: every option case, every dtype and every quick shape at least once, taken
    in turn (combination i: case i, dtype i, shape i, each list cycling), not their product.
    Each combination costs the compile backend a compilation (seconds on a CPU): this covers
    every code path the grid names with as few as the longest list."""
    if not dtypes:
        return []
    shapes, cases = spec.shapes["quick"], spec.cases
    n = max(len(cases), len(dtypes), len(shapes))
    return [(shapes[i % len(shapes)], dtypes[i % len(dtypes)], cases[i % len(cases)]) for i in range(n)]


def coverage_lines(plans: Sequence[Plan]) -> list[str]:
    """One line per op: how many cases per backend, the dtypes, option sets and shapes covered."""
    by_op: dict[str, list[Plan]] = {}
    for p in plans:
        by_op.setdefault(p.spec.name, []).append(p)
    lines = []
    for op, ps in by_op.items():
        spec = ps[0].spec
        backends = list(dict.fromkeys(p.impl.backend for p in ps))
        dtypes = list(dict.fromkeys(DTYPE_NAMES[p.dtype] for p in ps))
        n_cases = len({case_id(p.case) for p in ps})
        n_shapes = len({spec.shape_id(p.shape) for p in ps})
        lines.append(
            f"{short_op(op)}: {len(ps) // len(backends)} cases per backend; "
            f"{' '.join(dtypes)}; {n_cases}/{len(spec.cases)} options; {n_shapes} shapes"
        )
    return lines


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": "cpu",
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:
        env["triton"] = None
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return env


def run_validation(
    plans: Sequence[Plan],
    device: str,
    console: Console | None = None,
    progress: bool = True,
    on_result: Callable[[list[CaseResult]], None] | None = None,
    workers: ProcessPoolExecutor | None = None,
) -> list[CaseResult]:
    """Run the plans, in the worker processes of start_workers() if given (a CPU run is mostly
    the compile backend waiting on the C++ compiler), else in this process; on_result(results
    so far) after each case (e.g. to rewrite the reports, so a run stopped by a time limit keeps
    what it checked). Results come back in the order of the plans."""
    console = console or Console()
    _fail_on_recompile_limit()
    columns = [
        TextColumn("[bold]validate"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[current]}"),
    ]
    done: dict[int, CaseResult] = {}
    with Progress(*columns, console=console, disable=not progress, transient=False) as bar:
        task = bar.add_task("validate", total=len(plans), current="")

        def record(i: int, result: CaseResult) -> None:
            done[i] = result
            bar.update(task, advance=1, current=result.test_id[:40])
            if on_result is not None:
                on_result([done[k] for k in sorted(done)])

        if workers is None:
            for i, plan in enumerate(plans):
                record(i, _run_plan(plan, device))
        else:
            futures = {workers.submit(_run_in_worker, _portable(p), device): i for i, p in enumerate(plans)}
            for future in as_completed(futures):
                record(futures[future], future.result())
    return [done[i] for i in range(len(plans))]


def start_workers(jobs: int) -> ProcessPoolExecutor:
    """`jobs` worker processes for run_validation, started now: they import torch, the backends
    and the compiler while the caller plans (shut them down with .shutdown())."""
    # spawn, not fork: a forked child inherits torch's thread pools and locks mid-use.
    pool = ProcessPoolExecutor(
        jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_start_worker
    )
    for _ in range(jobs):
        pool.submit(int)  # processes start on the first submissions
    return pool


def _start_worker() -> None:
    from torch._inductor import config as inductor_config

    torch.set_num_threads(1)  # tiny cases, and the workers share the cores
    inductor_config.compile_threads = 1  # the workers are the parallelism: no compile pools
    _fail_on_recompile_limit()
    impls()  # load the backends now, while the parent plans
    importlib.import_module("torch._inductor.compile_fx")  # the compiler's imports (seconds)


def _fail_on_recompile_limit() -> None:
    # A compile backend that hit dynamo's recompile limit would silently run eagerly: make it
    # an error the check reports instead.
    torch._dynamo.config.fail_on_recompile_limit_hit = True


def _run_plan(plan: Plan, device: str) -> CaseResult:
    return check_case(
        plan.spec,
        plan.impl,
        plan.shape,
        plan.dtype,
        plan.case,
        device=device,
        compile_backend=plan.compile_backend,
    )


def _portable(plan: Plan) -> tuple:
    """A plan by names (OpSpecs and impls hold functions a worker process looks up itself)."""
    return (plan.spec.name, plan.impl.backend, plan.shape, plan.dtype, plan.case, plan.compile_backend)


def _run_in_worker(portable: tuple, device: str) -> CaseResult:
    op, backend, shape, dtype, case, compile_backend = portable
    spec = get_op(op)
    try:
        impl = get_impl(op, backend)
    except LMKernelsError as e:
        reason = f"{e} in a worker process (registered at run time? use --jobs 1)"
        return CaseResult(
            op, backend, spec.shape_id(shape), DTYPE_NAMES[dtype], case_id(case), device, "error", reason
        )
    return _run_plan(Plan(spec, impl, shape, dtype, case, compile_backend), device)


STATUS_STYLE = {"pass": "green", "fail": "bold red", "error": "bold red", "unsupported": "yellow"}


def summary_table(results: Sequence[CaseResult], failures_only: bool = False) -> Table:
    """One row per op x backend x dtype: counts, worst error ratio; then one row per failure."""
    # Short names and cells: it reads at 80 columns; failures are listed in full after it.
    table = Table(title="lmkernels validate", show_lines=False)
    for col in ("op", "backend", "dtype", "pass", "fail", "unsup.", "err/allowed", "compile"):
        table.add_column(col, justify="right" if col in ("pass", "fail", "unsup.", "err/allowed") else "left")
    groups: dict[tuple[str, str, str], list[CaseResult]] = {}
    for r in results:
        groups.setdefault((r.op, r.backend, r.dtype), []).append(r)
    for (op, backend, dtype), rs in groups.items():
        n_pass = sum(r.status == "pass" for r in rs)
        n_fail = sum(r.status in ("fail", "error") for r in rs)
        n_uns = sum(r.status == "unsupported" for r in rs)
        worst = max((r.worst_ratio for r in rs if r.status != "unsupported"), default=0.0)
        compiled = [r.compile_status for r in rs if r.compile_status != "not run"]
        comp = (
            "-"
            if not compiled
            else ("pass" if all(c == "pass" for c in compiled) else compiled[0].split(":")[0][:12])
        )
        if failures_only and not n_fail:
            continue
        style = "red" if n_fail else ("yellow" if n_uns and not n_pass else "green")
        table.add_row(
            short_op(op),
            backend,
            dtype,
            str(n_pass),
            str(n_fail),
            str(n_uns),
            f"{worst:.2f}",
            comp,
            style=style,
        )
    return table


def failure_lines(results: Sequence[CaseResult]) -> list[str]:
    return [
        f"{r.test_id}: {r.status}: {r.reason.splitlines()[0] if r.reason else ''}"
        for r in results
        if r.status in ("fail", "error")
    ]


def write_reports(results: Sequence[CaseResult], out_dir: Path, meta: dict[str, Any]) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out_dir / "validation.json",
        "csv": out_dir / "validation.csv",
        "md": out_dir / "validation.md",
    }
    paths["json"].write_text(json.dumps({"meta": meta, "results": [r.to_dict() for r in results]}, indent=1))
    with paths["csv"].open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "test_id",
                "op",
                "backend",
                "shape",
                "dtype",
                "case",
                "device",
                "status",
                "tensor",
                "rel_err_impl",
                "rel_err_eager",
                "allowed",
                "max_abs_err",
                "compile",
                "seconds",
                "reason",
            ]
        )
        for r in results:
            rows: Sequence[TensorError | None] = r.errors or [None]
            for e in rows:
                w.writerow(
                    [
                        r.test_id,
                        r.op,
                        r.backend,
                        r.shape,
                        r.dtype,
                        r.case,
                        r.device,
                        r.status,
                        e.name if e else "",
                        f"{e.impl:.3e}" if e else "",
                        f"{e.eager:.3e}" if e else "",
                        f"{e.allowed:.3e}" if e else "",
                        f"{e.max_abs:.3e}" if e else "",
                        r.compile_status,
                        f"{r.seconds:.2f}",
                        r.reason.splitlines()[0] if r.reason else "",
                    ]
                )
    lines = ["# lmkernels validation report", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    n = {s: sum(r.status == s for r in results) for s in ("pass", "fail", "error", "unsupported")}
    lines += [
        "",
        f"**{n['pass']} passed, {n['fail'] + n['error']} failed, {n['unsupported']} unsupported**",
        "",
    ]
    lines += [
        "| case | status | worst err/allowed | tensors: rel err impl / eager | compile |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        errs = ", ".join(f"{e.name} {e.impl:.2e}/{e.eager:.2e}" for e in r.errors)
        extra = r.reason.splitlines()[0][:120] if r.status != "pass" and r.reason else ""
        lines.append(
            f"| {r.test_id} | {r.status} {extra} | {r.worst_ratio:.2f} | {errs} | {r.compile_status} |"
        )
    paths["md"].write_text("\n".join(lines) + "\n")
    return paths


def parse_dtypes(names: Sequence[str] | None) -> list[str] | None:
    if not names:
        return None
    for n in names:
        if n not in DTYPES_BY_NAME:
            raise ValueError(f"--dtype: expected one of fp32, bf16, fp16, got {n!r}")
    return list(names)
