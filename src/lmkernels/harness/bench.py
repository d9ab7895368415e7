"""`lmkernels bench`: time and peak memory of every backend, DESIGN.md's performance protocol.

For each op, shape and backend (every registered backend that is available here, the adapters
included, plus the bench-only baseline `naive_compile` for FLCE: torch.compile of
F.cross_entropy(hidden @ W.T, target), which materializes the logits) it measures

- the median time and its 20%/80% quantiles with triton.testing.do_bench (L2 flushed between
  runs; gradients set to None before each run so they are not accumulated) of the forward
  (`fwd`, inputs requiring grad, as in training), the backward alone over a retained graph
  (`bwd`) and forward+backward (`full`, the default);
- the peak memory: torch.cuda.max_memory_allocated() during one call, minus the memory
  allocated just before it (inputs present, their gradients freed);
- for `full`: GB/s over the OpSpec's minimum bytes moved and its % of the device copy
  bandwidth, TFLOP/s over the OpSpec's flops (FLCE) and its % of a bf16 8192^3 matmul, both
  reference rates measured in the same run; speedups against `compile`, `naive_compile` and
  `liger` and peak memory relative to them, where those ran.

Backends are called through their Impl.fn, after the Impl's support check: the timings are the
kernels', without the public function's input checks (which sync with the host for FLCE).
An out-of-memory error is recorded as OOM, any other error as such, never a crash. Results go
to a directory: results.csv, results.json (with the device, versions and reference rates),
summary.md and PNG plots (harness/plots.py).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import gc
import json
import math
import platform
import sys
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from lmkernels.registry.core import LMKernelsError, OpSpec, backend_names, get_op, impls
from lmkernels.registry.dispatch import canonical_op

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MODES = ("fwd", "bwd", "full")
QUANTILES = [0.5, 0.2, 0.8]
# A slow case (FLCE, ~50 ms) gets at least this many timed runs, whatever --rep says.
MIN_TIMED_RUNS = 10
BASELINES = ("compile", "naive_compile", "liger")  # the speedup/memory ratio columns

FLCE = "fused_linear_cross_entropy"

# DESIGN.md's reference shapes ("Performance protocol and the bar to beat").
DESIGN_SHAPES: dict[str, dict[str, int]] = {
    "rms_norm": {"M": 16384, "N": 4096},
    "layer_norm": {"M": 4096, "N": 16384},
    "swiglu": {"M": 8192, "N": 14336},
    "geglu": {"M": 8192, "N": 14336},
    "rope": {"B": 1, "Hq": 32, "Hkv": 8, "T": 8192, "D": 128},
    FLCE: {"BT": 8192, "H": 4096, "V": 128256},
}

_POW2 = [1024, 2048, 4096, 8192, 16384]

# Sweeps: op -> list of (swept dim, shapes). Norms over the hidden size, RoPE and the GLUs over
# the sequence (tokens), FLCE over tokens and over the vocabulary.
SWEEPS: dict[str, list[tuple[str, list[dict[str, int]]]]] = {
    "rms_norm": [("N", [{"M": 16384, "N": n} for n in _POW2])],
    "layer_norm": [("N", [{"M": 4096, "N": n} for n in _POW2])],
    "swiglu": [("M", [{"M": m, "N": 14336} for m in _POW2])],
    "geglu": [("M", [{"M": m, "N": 14336} for m in _POW2])],
    "rope": [("T", [{"B": 1, "Hq": 32, "Hkv": 8, "T": t, "D": 128} for t in _POW2])],
    FLCE: [
        ("BT", [{"BT": bt, "H": 4096, "V": 128256} for bt in [*_POW2, 32768]]),
        ("V", [{"BT": 8192, "H": 4096, "V": v} for v in (32000, 64000, 128256, 256000)]),
    ],
}


def default_cases(op: str, dtype: torch.dtype, quick: bool) -> list[dict[str, Any]]:
    """Option sets per op. FLCE runs with our default fp32 weight-gradient accumulation and
    with accumulation in the weight's dtype: what Liger does by default and all CCE can do."""
    if op == FLCE and not quick and dtype != torch.float32:
        return [{}, {"grad_accum_dtype": dtype}]
    return [{}]


@dataclasses.dataclass
class Point:
    """One (op, shape, options) to measure, and where it belongs in the report."""

    op: str
    shape: dict[str, int]
    options: dict[str, Any]
    sweep: str  # "design" or the swept dim ("N", "T", "BT", ...)


def plan(ops: Sequence[str], grid: str, dtype: torch.dtype, quick: bool, options: dict | None) -> list[Point]:
    points = []
    for op in ops:
        cases = [options] if options is not None else default_cases(op, dtype, quick)
        for case in cases:
            if grid == "design":
                points.append(Point(op, DESIGN_SHAPES[op], case, "design"))
                continue
            for dim, shapes in SWEEPS[op]:
                if quick:  # first, middle and last size
                    shapes = (
                        shapes[::2] if len(shapes) % 2 else [shapes[0], shapes[len(shapes) // 2], shapes[-1]]
                    )
                points.extend(Point(op, s, case, dim) for s in shapes)
    return points


def options_id(options: dict[str, Any]) -> str:
    def fmt(v):
        return DTYPE_NAMES.get(v, str(v)) if isinstance(v, torch.dtype) else str(v)

    return ",".join(f"{k}={fmt(v)}" for k, v in options.items()) or "default"


# --- bench-only baselines --------------------------------------------------------------------------


class Unsupported(Exception):
    pass


_NAIVE_OK = {"hidden", "weight", "target", "ignore_index", "reduction", "grad_accum_dtype"}
_naive_compiled: Callable[..., Any] | None = None


def _is_default(v: Any) -> bool:
    """None, False or 0: an option left at its default (FLCE's defaults are all of these)."""
    return v is None or v is False or (isinstance(v, (int, float)) and v == 0)


def _naive_flce(hidden, weight, target, ignore_index=-100, reduction="mean"):
    # Plain PyTorch as people write it: the (tokens x V) logits in the input dtype.
    logits = hidden.reshape(-1, weight.shape[1]) @ weight.T
    loss = torch.nn.functional.cross_entropy(
        logits, target.reshape(-1), ignore_index=ignore_index, reduction=reduction
    )
    return loss.float()


def naive_compile_fn(inputs: dict[str, Any]) -> Callable[..., Any]:
    """torch.compile of the logits-materializing loss (DESIGN.md's torch.compile FLCE row)."""
    global _naive_compiled
    extra = [k for k, v in inputs.items() if k not in _NAIVE_OK and not _is_default(v)]
    if extra:
        raise Unsupported(f"naive_compile takes only the default loss, not {extra}")
    if _naive_compiled is None:
        _naive_compiled = torch.compile(_naive_flce)
    compiled = _naive_compiled

    def run(hidden, weight, target, ignore_index=-100, reduction="mean", **_):
        # grad_accum_dtype does not apply: dW is one matmul with fp32 accumulation.
        return compiled(hidden, weight, target, ignore_index, reduction)

    return run


PSEUDO_BACKENDS: dict[str, tuple[str, Callable[[dict[str, Any]], Callable[..., Any]]]] = {
    "naive_compile": (FLCE, naive_compile_fn),
}


def backends_for(op: str, requested: Sequence[str] | None) -> tuple[list[str], dict[str, str]]:
    """The backends to run for `op` and, for the others asked for or registered, why not."""
    names, skipped = [], {}
    registered = {i.backend: i for i in impls(op)}
    candidates = (
        list(requested)
        if requested
        else [*registered, *(b for b, (o, _) in PSEUDO_BACKENDS.items() if o == op)]
    )
    for name in candidates:
        if name in PSEUDO_BACKENDS:
            if PSEUDO_BACKENDS[name][0] == op:
                names.append(name)
            continue
        impl = registered.get(name)
        if impl is None:
            continue  # not implemented for this op: nothing to report
        reason = impl.unavailable_reason()
        if reason:
            skipped[name] = reason
        else:
            names.append(name)
    return names, skipped


def backend_fn(op: str, backend: str, inputs: dict[str, Any]) -> Callable[..., Any]:
    """The callable to time, or Unsupported with the impl's reasons."""
    if backend in PSEUDO_BACKENDS:
        return PSEUDO_BACKENDS[backend][1](inputs)
    impl = next((i for i in impls(op) if i.backend == backend), None)
    if impl is None:
        raise Unsupported(f"backend {backend!r} has no {op}")
    reasons = impl.not_supported_reasons(**inputs)
    if reasons:
        raise Unsupported("; ".join(reasons))
    return impl.fn


# --- measurement -------------------------------------------------------------------------------------


def prepare_inputs(spec: OpSpec, inputs: dict[str, Any], device: str) -> dict[str, Any]:
    """A device copy of `inputs` (made on the CPU once per shape), grad inputs requiring grad."""
    out = {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor):
            v = v.to(device, copy=True)
            if k in spec.grad_inputs and v.is_floating_point():
                v.requires_grad_(True)
        out[k] = v
    return out


def _outputs(out: Any) -> list[torch.Tensor]:
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    return [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]


def _mode_fn(fn: Callable[..., Any], inputs: dict[str, Any], mode: str) -> Callable[[], Any]:
    """The closure timed for `mode`. Upstream gradients: 1 for a scalar loss (as loss.backward()
    gives), fixed random values otherwise."""
    first = _outputs(fn(**inputs))
    grads = [torch.ones_like(o) if o.dim() == 0 else torch.randn_like(o) for o in first]
    if mode == "bwd":
        return lambda: torch.autograd.backward(first, grads, retain_graph=True)
    first.clear()  # fwd and full build their own graphs: free this one
    if mode == "fwd":
        return lambda: fn(**inputs)

    def full():
        torch.autograd.backward(_outputs(fn(**inputs)), grads)

    return full


def _zero_grads(tensors: Sequence[torch.Tensor]) -> None:
    for t in tensors:
        t.grad = None


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def peak_memory_bytes(
    run: Callable[[], Any], grad_tensors: Sequence[torch.Tensor], device: str
) -> int | None:
    """Peak allocated memory during one call above what was allocated just before it."""
    if not device.startswith("cuda"):
        return None
    _zero_grads(grad_tensors)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    _zero_grads(grad_tensors)
    return peak


def time_ms(
    run: Callable[[], Any], grad_tensors: Sequence[torch.Tensor], device: str, warmup: float, rep: float
) -> list[float]:
    """[median, p20, p80] in ms: triton's do_bench on CUDA, a perf_counter loop on the CPU."""
    _sync(device)
    t0 = time.perf_counter()
    run()
    _sync(device)
    once_ms = (time.perf_counter() - t0) * 1e3
    rep = max(rep, MIN_TIMED_RUNS * once_ms)
    if device.startswith("cuda"):
        import triton.testing

        return list(
            triton.testing.do_bench(
                run, warmup=warmup, rep=rep, grad_to_none=list(grad_tensors), quantiles=QUANTILES
            )
        )
    # CPU fallback (tests, smoke runs): the same statistics from wall-clock times.
    end = time.perf_counter() + warmup / 1e3
    while time.perf_counter() < end:
        run()
    times = []
    for _ in range(max(MIN_TIMED_RUNS, min(1000, int(rep / max(once_ms, 1e-3))))):
        _zero_grads(grad_tensors)
        t = time.perf_counter()
        run()
        times.append((time.perf_counter() - t) * 1e3)
    return torch.quantile(
        torch.tensor(times, dtype=torch.float64), torch.tensor(QUANTILES, dtype=torch.float64)
    ).tolist()


def kernel_time_ms(run: Callable[[], Any], grad_tensors: Sequence[torch.Tensor], iters: int = 5) -> float:
    """Device time of the kernels one call launches (torch.profiler, summed over kernels).

    do_bench's wall time also counts the gaps while the host is still launching; on a slow host
    (the H200 VM: ~0.3-1 ms of Python per fwd+bwd) small ops measure the host, not the GPU. In
    training the host runs ahead of the GPU behind the large matmuls, so both numbers matter:
    the wall time says what a lone call costs, the kernel time what the GPU spends.
    """
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            _zero_grads(grad_tensors)
            run()
        torch.cuda.synchronize()
    total_us = sum(e.self_device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA")
    return total_us / iters / 1e3


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def _cleanup(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _measure(op, backend, inputs, mode, warmup, rep, grad_tensors, device):
    """(peak bytes or None, [median, p20, p80] ms). Its closures, and the autograd graph they
    hold, die when it returns."""
    fn = backend_fn(op, backend, inputs)
    run = _mode_fn(fn, inputs, mode)  # its first forward also compiles / autotunes
    run()  # one more warm-up call, outside the memory measurement (e.g. bwd's first backward)
    peak = peak_memory_bytes(run, grad_tensors, device)
    times = time_ms(run, grad_tensors, device, warmup, rep)
    kernel_ms = kernel_time_ms(run, grad_tensors) if device.startswith("cuda") else None
    return peak, times, kernel_ms


def measure(
    op: str,
    backend: str,
    inputs: dict[str, Any],
    mode: str = "full",
    warmup: float = 25,
    rep: float = 100,
) -> dict[str, Any]:
    """Time and peak memory of one backend on prepared inputs (see prepare_inputs) in one mode.

    Returns a row: status ("ok", "unsupported", "OOM", "error"), ms, ms_p20, ms_p80, peak_mib
    (None on the CPU) and a note. Never raises for a backend's failure.
    """
    device = next(v.device.type for v in inputs.values() if isinstance(v, torch.Tensor))
    row: dict[str, Any] = {
        "backend": backend,
        "mode": mode,
        "status": "ok",
        "ms": None,
        "ms_p20": None,
        "ms_p80": None,
        "peak_mib": None,
        "kernel_ms": None,
        "note": "",
    }
    grad_tensors = [v for v in inputs.values() if isinstance(v, torch.Tensor) and v.requires_grad]
    try:
        peak, (row["ms"], row["ms_p20"], row["ms_p80"]), row["kernel_ms"] = _measure(
            op, backend, inputs, mode, warmup, rep, grad_tensors, device
        )
        row["peak_mib"] = None if peak is None else peak / 2**20
    except Unsupported as e:
        row.update(status="unsupported", note=str(e))
    except Exception as e:  # a backend's failure is a result, not a crash
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if _is_oom(e):
            row.update(status="OOM", note=first[:200])
        else:
            note = f"{type(e).__name__}: {first}"[:300]
            if mode == "bwd":  # name the cause: the mode, not the kernel, is what is refused
                note = (
                    "backward over a retained graph, repeated: this impl computes or overwrites its "
                    f"gradients in the forward and refuses a second backward ({note})"
                )
            row.update(status="error", note=note)
    _zero_grads(grad_tensors)
    _cleanup(device)
    return row


# --- reference rates ---------------------------------------------------------------------------------


def copy_bandwidth_gbps(device: str = "cuda", nbytes: int = 2**31) -> float:
    """Device-to-device copy of `nbytes` (bytes read + written per second, in GB/s)."""

    def measure_copy():
        src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
        dst = torch.empty_like(src)
        return time_ms(lambda: dst.copy_(src), [], device, 25, 200)[0]

    ms = measure_copy()
    _cleanup(device)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def matmul_tflops(device: str = "cuda", n: int = 8192, dtype: torch.dtype = torch.bfloat16) -> float:
    """Rate of an n^3 matmul (2 n^3 flops), the reference for FLCE's TFLOP/s."""

    def measure_matmul():
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        return time_ms(lambda: a @ b, [], device, 25, 200)[0]

    ms = measure_matmul()
    _cleanup(device)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def add_rooflines(
    rows: list[dict[str, Any]], dtype: torch.dtype, copy_gbps: float | None, mm_tflops: float | None
) -> None:
    """GB/s and TFLOP/s for `full` rows (the OpSpecs' byte and flop models are fwd+bwd)."""
    for row in rows:
        for suffix, ms in (("", row["ms"]), ("_kernel", row.get("kernel_ms"))):
            row.update({f"gbps{suffix}": None, f"pct_copy_bw{suffix}": None})
            row.update({f"tflops{suffix}": None, f"pct_matmul{suffix}": None})
            if row["mode"] != "full" or ms is None:
                continue
            spec = get_op(row["op"])
            seconds = ms * 1e-3
            if spec.bytes_moved is not None:
                gbps = spec.bytes_moved(row["dims"], dtype) / seconds / 1e9
                row[f"gbps{suffix}"] = gbps
                row[f"pct_copy_bw{suffix}"] = 100 * gbps / copy_gbps if copy_gbps else None
            if spec.flops is not None:
                tflops = spec.flops(row["dims"]) / seconds / 1e12
                row[f"tflops{suffix}"] = tflops
                row[f"pct_matmul{suffix}"] = 100 * tflops / mm_tflops if mm_tflops else None


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """speedup_vs_X = time(X) / time(row) (> 1: faster than X); mem_vs_X = peak(row) / peak(X)."""
    key = lambda r: (r["op"], r["shape"], r["options"], r["dtype"], r["mode"])
    by_key: dict[tuple, dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_key.setdefault(key(row), {})[row["backend"]] = row
    for row in rows:
        group = by_key[key(row)]
        for base in BASELINES:
            ref = group.get(base)
            ok = ref is not None and ref["ms"] and row["ms"]
            row[f"speedup_vs_{base}"] = ref["ms"] / row["ms"] if ok else None
            ok = ref is not None and ref.get("kernel_ms") and row.get("kernel_ms")
            row[f"kernel_speedup_vs_{base}"] = ref["kernel_ms"] / row["kernel_ms"] if ok else None
            ok = ref is not None and ref["peak_mib"] and row["peak_mib"] is not None
            row[f"mem_vs_{base}"] = row["peak_mib"] / ref["peak_mib"] if ok else None


def allocated_timeline(
    events: Sequence[dict[str, Any]], base_bytes: int, max_points: int = 4000
) -> dict[str, Any]:
    """Allocated memory (MiB) after each event of a CUDA caching-allocator trace
    (torch.cuda.memory._snapshot()["device_traces"][i], recorded with _record_memory_history),
    starting from base_bytes; downsampled to about max_points, keeping each bucket's maximum
    so that peaks survive. x: ms from the first event, or the event index where the trace has
    no timestamps."""
    timed = bool(events) and "time_us" in events[0]
    xs, values, allocated = [], [], base_bytes
    for i, ev in enumerate(events):
        if ev["action"] == "alloc":
            allocated += ev["size"]
        elif ev["action"] == "free_completed":
            allocated -= ev["size"]
        else:  # free_requested (not yet reusable), segment_* (reserved memory), snapshot, oom
            continue
        xs.append(ev["time_us"] / 1e3 if timed else i)
        values.append(allocated / 2**20)
    x0 = xs[0] if xs else 0
    stride = max(1, math.ceil(len(xs) / max_points))
    return {
        "x": [x - x0 for x in xs[::stride]],
        "mib": [max(values[i : i + stride]) for i in range(0, len(values), stride)],
        "x_label": "time in the step (ms)" if timed else "allocator event",
        "base_mib": base_bytes / 2**20,
    }


# --- the run -----------------------------------------------------------------------------------------


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    for dist in ("triton", "liger-kernel", "cut-cross-entropy", "lmkernels"):
        env[dist] = _version(dist)
    if torch.cuda.is_available():
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        env["memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return env


def _failed_rows(backend: str, modes: Sequence[str], status: str, note: str) -> list[dict[str, Any]]:
    empty = {"ms": None, "ms_p20": None, "ms_p80": None, "peak_mib": None, "kernel_ms": None}
    return [{"backend": backend, "mode": m, "status": status, **empty, "note": note} for m in modes]


def _measure_point(spec: OpSpec, point: Point, names, dtype, modes, device, warmup, rep, bar, task):
    """Rows of every backend and mode for one (op, shape, options); fresh inputs per backend."""
    cpu_inputs = spec.make_inputs(point.shape, dtype, "cpu", 0, **point.options)
    measured = []
    for backend in names:
        bar.update(
            task, description=f"{point.op} {spec.shape_id(point.shape)} {options_id(point.options)} {backend}"
        )
        try:
            inputs = prepare_inputs(spec, cpu_inputs, device)
        except Exception as e:  # even the inputs may not fit
            measured += _failed_rows(backend, modes, "OOM" if _is_oom(e) else "error", f"inputs: {e}"[:200])
            _cleanup(device)
            bar.advance(task, len(modes))
            continue
        for mode in modes:
            measured.append(measure(point.op, backend, inputs, mode, warmup, rep))
            bar.advance(task)
        del inputs
        _cleanup(device)
    return measured


def run_bench(
    ops: Sequence[str],
    backends: Sequence[str] | None,
    dtype: torch.dtype,
    modes: Sequence[str],
    grid: str,
    quick: bool,
    options: dict[str, Any] | None,
    device: str = "cuda",
    warmup: float | None = None,
    rep: float | None = None,
    console: Any = None,
    progress: bool = True,
    budget_s: float | None = None,
    on_point: Callable[[list[dict[str, Any]], dict[str, Any]], None] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Measure everything planned; returns (rows, meta). Points not started within budget_s
    seconds are recorded as skipped; on_point(rows, meta) runs after each point (the CLI writes
    the partial results then, so a run stopped from outside still leaves them)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = console or Console()
    deadline = time.time() + budget_s if budget_s else math.inf
    warmup = warmup if warmup is not None else (5 if quick else 25)
    rep = rep if rep is not None else (25 if quick else 100)
    meta = environment() | {
        "dtype": DTYPE_NAMES[dtype],
        "grid": grid,
        "quick": quick,
        "modes": list(modes),
        "warmup_ms": warmup,
        "rep_ms": rep,
        "min_timed_runs": MIN_TIMED_RUNS,
    }
    if device.startswith("cuda"):
        console.print("measuring the copy bandwidth and the matmul rate ...")
        meta["copy_gbps"] = copy_bandwidth_gbps(device)
        meta["matmul_tflops"] = matmul_tflops(device, dtype=torch.bfloat16)
        console.print(f"copy {meta['copy_gbps']:.0f} GB/s, bf16 matmul {meta['matmul_tflops']:.0f} TFLOP/s")

    points = plan(ops, grid, dtype, quick, options)
    per_op = {op: backends_for(op, backends) for op in ops}
    meta["not_run"] = {op: skipped for op, (_, skipped) in per_op.items() if skipped}
    total = sum(len(per_op[p.op][0]) * len(modes) for p in points)
    rows: list[dict[str, Any]] = []
    done: dict[tuple, list[dict[str, Any]]] = {}  # a shape in two sweeps is measured once
    compiled_for = None

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, disable=not progress) as bar:
        task = bar.add_task("bench", total=total)
        for point in points:
            spec = get_op(point.op)
            names = per_op[point.op][0]
            key = (point.op, spec.shape_id(point.shape), options_id(point.options))
            base = {
                "op": point.op,
                "shape": key[1],
                "dims": dict(point.shape),
                "options": key[2],
                "dtype": DTYPE_NAMES[dtype],
                "sweep": point.sweep,
                "size": point.shape.get(point.sweep),
            }
            if key not in done and time.time() > deadline:
                done[key] = [r for b in names for r in _failed_rows(b, modes, "skipped", "time budget")]
                bar.advance(task, len(names) * len(modes))
            elif key not in done:
                if key[:2] != compiled_for:  # static shapes: forget kernels compiled for other shapes
                    torch._dynamo.reset()
                    compiled_for = key[:2]
                done[key] = _measure_point(spec, point, names, dtype, modes, device, warmup, rep, bar, task)
            else:
                bar.advance(task, len(names) * len(modes))
            rows.extend(r | base for r in done[key])
            add_rooflines(rows, dtype, meta.get("copy_gbps"), meta.get("matmul_tflops"))
            add_ratios(rows)
            if on_point is not None:
                on_point(rows, meta)
    return rows, meta


# --- reports -----------------------------------------------------------------------------------------

CSV_FIELDS = [
    "op",
    "shape",
    "options",
    "dtype",
    "sweep",
    "size",
    "backend",
    "mode",
    "status",
    "ms",
    "ms_p20",
    "ms_p80",
    "peak_mib",
    "gbps",
    "pct_copy_bw",
    "tflops",
    "pct_matmul",
    "kernel_ms",
    "gbps_kernel",
    "pct_copy_bw_kernel",
    "tflops_kernel",
    "pct_matmul_kernel",
    *(f"speedup_vs_{b}" for b in BASELINES),
    *(f"kernel_speedup_vs_{b}" for b in BASELINES),
    *(f"mem_vs_{b}" for b in BASELINES),
    "note",
]


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return f"{v:.{digits}g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def _rate(row: dict[str, Any], suffix: str = "") -> str:
    if row.get(f"tflops{suffix}") is not None:
        pct = row.get(f"pct_matmul{suffix}")
        return f"{row[f'tflops{suffix}']:.1f} TFLOP/s" + (f" ({pct:.0f}% mm)" if pct is not None else "")
    if row.get(f"gbps{suffix}") is not None:
        pct = row.get(f"pct_copy_bw{suffix}")
        return f"{row[f'gbps{suffix}']:.0f} GB/s" + (f" ({pct:.0f}% copy)" if pct is not None else "")
    return "-"


def _ratios(row: dict[str, Any], prefix: str = "") -> str:
    parts = [
        f"{_fmt(row[f'{prefix}speedup_vs_{b}'])}x {b}"
        for b in BASELINES
        if row.get(f"{prefix}speedup_vs_{b}") is not None and row["backend"] != b
    ]
    return ", ".join(parts) or "-"


def _mem_ratios(row: dict[str, Any]) -> str:
    parts = [
        f"{_fmt(row[f'mem_vs_{b}'])}x {b}"
        for b in BASELINES
        if row.get(f"mem_vs_{b}") is not None and row["backend"] != b
    ]
    return ", ".join(parts) or "-"


def _status(row: dict[str, Any]) -> str:
    return "ok" if row["status"] == "ok" else f"{row['status']}: {row['note']}"


def rich_table(rows: list[dict[str, Any]]):
    from rich.table import Table

    table = Table(title="lmkernels bench")
    for col in (
        "op",
        "shape",
        "options",
        "mode",
        "backend",
        "ms (p20-p80)",
        "kernel ms",
        "peak MiB",
        "rate",
        "speedup",
        "status",
    ):
        table.add_column(col, overflow="fold")
    for r in _unique(rows):
        ms = f"{r['ms']:.3f} ({r['ms_p20']:.3f}-{r['ms_p80']:.3f})" if r["ms"] is not None else "-"
        table.add_row(
            r["op"],
            r["shape"],
            r["options"],
            r["mode"],
            r["backend"],
            ms,
            _fmt(r.get("kernel_ms"), 4),
            _fmt(r["peak_mib"], 4),
            _rate(r),
            _ratios(r),
            _status(r)[:80],
        )
    return table


def _unique(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows without the copies a shape shared by two sweeps gets."""
    seen, out = set(), []
    for r in rows:
        k = (r["op"], r["shape"], r["options"], r["backend"], r["mode"])
        if k not in seen:
            seen.add(k)
            out.append(r)
    return out


def summary_markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = ["# lmkernels bench", ""]
    for k in (
        "date",
        "device",
        "torch",
        "triton",
        "liger-kernel",
        "cut-cross-entropy",
        "cuda",
        "dtype",
        "grid",
        "quick",
        "command",
        "partial",
    ):
        if k in meta:
            lines.append(f"- {k}: {meta[k]}")
    if meta.get("copy_gbps"):
        lines.append(f"- copy bandwidth (device-to-device, read+write): {meta['copy_gbps']:.0f} GB/s")
    if meta.get("matmul_tflops"):
        lines.append(f"- bf16 matmul 8192^3: {meta['matmul_tflops']:.0f} TFLOP/s")
    lines.append("")
    lines.append(
        "Speedup vs X = time(X) / time(backend): above 1 is faster than X. "
        "Wall: triton.testing.do_bench median (includes host launch gaps); kernel: device time of "
        "the kernels per call (torch.profiler). "
        "Peak: max_memory_allocated above the inputs. Rates for fwd+bwd (mode full) only."
    )
    for op in dict.fromkeys(r["op"] for r in rows):
        op_rows = _unique([r for r in rows if r["op"] == op])
        lines += ["", f"## {op}", ""]
        lines.append(
            "| shape | options | mode | backend | wall ms (p20-p80) | wall rate | wall speedup "
            "| kernel ms | kernel rate | kernel speedup | peak MiB | peak vs | status |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in op_rows:
            ms = f"{r['ms']:.3f} ({r['ms_p20']:.3f}-{r['ms_p80']:.3f})" if r["ms"] is not None else "-"
            lines.append(
                f"| {r['shape']} | {r['options']} | {r['mode']} | {r['backend']} | {ms} | {_rate(r)} | "
                f"{_ratios(r)} | {_fmt(r.get('kernel_ms'), 4)} | {_rate(r, '_kernel')} | "
                f"{_ratios(r, 'kernel_')} | {_fmt(r['peak_mib'], 4)} | {_mem_ratios(r)} | "
                f"{_status(r).replace('|', '/')} |"
            )
    if meta.get("not_run"):
        lines += ["", "## Backends not run", ""]
        for op, skipped in meta["not_run"].items():
            for backend, reason in skipped.items():
                lines.append(f"- {op} / {backend}: {reason}")
    return "\n".join(lines) + "\n"


def write_reports(
    rows: list[dict[str, Any]], meta: dict[str, Any], out_dir: Path, plots: bool = True
) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "results.csv", out_dir / "results.json", out_dir / "summary.md"]
    with open(paths[0], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    paths[1].write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    paths[2].write_text(summary_markdown(rows, meta))
    if plots:
        from lmkernels.harness.plots import plot_bench

        paths += plot_bench(rows, out_dir)
    return paths


# --- CLI ---------------------------------------------------------------------------------------------


def _split(values: Sequence[str] | None) -> list[str] | None:
    if not values:
        return None
    return [v.strip() for item in values for v in item.split(",") if v.strip()]


def parse_options(items: Sequence[str] | None) -> dict[str, Any] | None:
    """--set key=value: Python literals, dtype names (bf16, fp32, fp16) as torch dtypes."""
    import ast

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
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--op", action="append", help="op (repeatable or comma-separated); default all")
    p.add_argument(
        "--backend",
        action="append",
        help="backend (repeatable or comma-separated); default every available one, "
        "adapters and naive_compile included",
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
        help="op options for every point instead of the default cases, e.g. grad_accum_dtype=bf16",
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
    dtype = DTYPES[args.dtype]
    modes = list(MODES) if args.mode == "all" else [args.mode]
    out = Path(args.out or f"benchmarks/results/{datetime.datetime.now():%Y%m%d-%H%M%S}")
    command = " ".join(sys.argv)

    def save_partial(rows, meta):  # after each point: a run stopped from outside keeps its results
        write_reports(rows, meta | {"command": command, "partial": True}, out, plots=False)

    rows, meta = run_bench(
        ops,
        _split(args.backend),
        dtype,
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


if __name__ == "__main__":
    sys.exit(main())
