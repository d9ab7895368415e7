"""The run: reference rates, then every planned point x backend x mode, with a progress bar,
a time budget and partial results after each point."""

from __future__ import annotations

import datetime
import math
import platform
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import TYPE_CHECKING, Any

import torch

from lmkernels.harness.bench.backends import backends_for
from lmkernels.harness.bench.measure import (
    MIN_TIMED_RUNS,
    cleanup,
    empty_row,
    is_oom,
    measure,
    prepare_inputs,
)
from lmkernels.harness.bench.plan import DTYPE_NAMES, Point, options_id, plan
from lmkernels.harness.bench.roofline import add_ratios, add_rooflines, copy_bandwidth_gbps, matmul_tflops
from lmkernels.registry.core import OpSpec, get_op

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """Date, device and the versions of everything measured."""
    env: dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    for dist in ("triton", "transformers", "liger-kernel", "cut-cross-entropy", "lmkernels"):
        env[dist] = _version(dist)
    if torch.cuda.is_available():
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        env["memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return env


def reference_rates(device: str, console: Any = None) -> dict[str, float]:
    """Copy bandwidth and bf16 matmul rate, measured now (empty off CUDA)."""
    if not device.startswith("cuda"):
        return {}
    if console is not None:
        console.print("measuring the copy bandwidth and the matmul rate ...")
    rates = {"copy_gbps": copy_bandwidth_gbps(device), "matmul_tflops": matmul_tflops(device)}
    if console is not None:
        console.print(f"copy {rates['copy_gbps']:.0f} GB/s, bf16 matmul {rates['matmul_tflops']:.0f} TFLOP/s")
    return rates


def _failed_rows(backend: str, modes: Sequence[str], status: str, note: str) -> list[dict[str, Any]]:
    return [empty_row(backend, m, status, note) for m in modes]


def _measure_point(
    spec: OpSpec,
    point: Point,
    names: Sequence[str],
    dtype: torch.dtype,
    modes: Sequence[str],
    device: str,
    warmup: float,
    rep: float,
    bar: Progress,
    task: TaskID,
) -> list[dict[str, Any]]:
    """Rows of every backend and mode for one (op, shape, options); fresh inputs per backend."""
    made = spec.make_inputs(point.shape, dtype, device, 0, **point.options)
    measured: list[dict[str, Any]] = []
    for backend in names:
        desc = f"{point.op} {spec.shape_id(point.shape)} {options_id(point.options)} {backend}"
        bar.update(task, description=desc)
        try:
            inputs = prepare_inputs(spec, made, device)
        except Exception as e:  # even the inputs may not fit
            measured += _failed_rows(backend, modes, "OOM" if is_oom(e) else "error", f"inputs: {e}"[:200])
            cleanup(device)
            bar.advance(task, len(modes))
            continue
        for mode in modes:
            measured.append(measure(point.op, backend, inputs, mode, warmup, rep))
            bar.advance(task)
        del inputs
        cleanup(device)
    return measured


def run_bench(
    op: str,
    shapes: Sequence[dict[str, int]] | None,
    backends: Sequence[str] | None,
    dtype: torch.dtype,
    modes: Sequence[str],
    quick: bool = False,
    options: dict[str, Any] | None = None,
    device: str = "cuda",
    warmup: float | None = None,
    rep: float | None = None,
    console: Any = None,
    progress: bool = True,
    budget_s: float | None = None,
    on_point: Callable[[list[dict[str, Any]], dict[str, Any]], None] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Measure every backend of `op` at `shapes` (default: plan.default_shape) on `device`;
    returns (rows, meta). Points not started within budget_s seconds are recorded as skipped;
    on_point(rows, meta) runs after each point (the CLI writes the partial results then, so a
    run stopped from outside still leaves them)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = console or Console()
    deadline = time.time() + budget_s if budget_s else math.inf
    warmup = warmup if warmup is not None else (5 if quick else 25)
    rep = rep if rep is not None else (25 if quick else 100)
    meta = environment() | {
        "op": op,
        "dtype": DTYPE_NAMES[dtype],
        "bench_device": device,
        "quick": quick,
        "modes": list(modes),
        "warmup_ms": warmup,
        "rep_ms": rep,
        "min_timed_runs": MIN_TIMED_RUNS,
    }
    meta |= reference_rates(device, console)
    spec = get_op(op)
    points = plan(op, shapes, dtype, quick, options)
    names, skipped = backends_for(op, backends, device)
    meta["not_run"] = {op: skipped} if skipped else {}
    rows: list[dict[str, Any]] = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, disable=not progress) as bar:
        task = bar.add_task("bench", total=len(points) * len(names) * len(modes))
        compiled_for = None
        for point in points:
            shape_id = spec.shape_id(point.shape)
            base = {
                "op": op,
                "shape": shape_id,
                "dims": dict(point.shape),
                "options": options_id(point.options),
                "dtype": DTYPE_NAMES[dtype],
            }
            if time.time() > deadline:
                measured = [r for b in names for r in _failed_rows(b, modes, "skipped", "time budget")]
                bar.advance(task, len(names) * len(modes))
            else:
                if shape_id != compiled_for:  # static shapes: forget kernels compiled for other shapes
                    torch._dynamo.reset()
                    compiled_for = shape_id
                measured = _measure_point(spec, point, names, dtype, modes, device, warmup, rep, bar, task)
            rows.extend(r | base for r in measured)
            add_rooflines(rows, dtype, meta.get("copy_gbps"), meta.get("matmul_tflops"))
            add_ratios(rows)
            if on_point is not None:
                on_point(rows, meta)
    return rows, meta
