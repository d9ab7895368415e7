"""Timing and peak memory of one backend on prepared inputs (GPU time, wall time, peak memory).

- wall time: triton.testing.do_bench median and 20%/80% quantiles (L2 flushed, gradients set
  to None before each run), host launch gaps included; a perf_counter loop on the CPU;
- GPU time: device time of one call with the launch queue filled ahead: a torch.cuda._sleep
  kernel longer than the host's launch time precedes the start event, so the events time the
  kernels back to back (gpu_time_ms); the profiler's kernel sum beside it (kernel_time_ms);
- peak: torch.cuda.max_memory_allocated() during one call above what was allocated just before
  it (inputs present, their gradients freed).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lmkernels.harness.bench.backends import Unsupported, backend_fn
from lmkernels.registry.core import OpSpec

QUANTILES = [0.5, 0.2, 0.8]
# A slow case (FLCE, ~50 ms) gets at least this many timed runs, whatever `rep` says.
MIN_TIMED_RUNS = 10
MAX_GPU_RUNS = 50
# The alternating calls' common sleep covers launches up to this long (interleaved_gpu_ms): above
# the FLCE grid's own launches, below a peer's slow softcap call, whose launch a sleep could
# cover only by idling the GPU far longer before every call of its shape (docs/performance.md,
# "Method").
MAX_COVERED_LAUNCH_MS = 50.0


def prepare_inputs(spec: OpSpec, inputs: dict[str, Any], device: str) -> dict[str, Any]:
    """A fresh device copy of `inputs`, grad inputs requiring grad (a backend may overwrite its
    inputs, e.g. Liger's GLU backward: every backend gets its own copy)."""
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


def mode_fn(fn: Callable[..., Any], inputs: dict[str, Any], mode: str) -> Callable[[], Any]:
    """The closure timed for `mode`. Upstream gradients: 1 for a scalar loss (as loss.backward()
    gives), fixed random values otherwise."""
    first = _outputs(fn(**inputs))
    grads = [torch.ones_like(o) if o.dim() == 0 else torch.randn_like(o) for o in first]
    if mode == "bwd":
        return lambda: torch.autograd.backward(first, grads, retain_graph=True)
    first.clear()  # fwd and full build their own graphs: free this one
    if mode == "fwd":
        return lambda: fn(**inputs)

    def full() -> None:
        torch.autograd.backward(_outputs(fn(**inputs)), grads)

    return full


def zero_grads(tensors: Sequence[torch.Tensor]) -> None:
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
    zero_grads(grad_tensors)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    zero_grads(grad_tensors)
    return peak


def once_ms(run: Callable[[], Any], device: str) -> tuple[float, float]:
    """(wall ms of one synchronized call, host ms to launch it): the second is the time until
    run() returns, before the device finishes."""
    _sync(device)
    t0 = time.perf_counter()
    run()
    t1 = time.perf_counter()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3, (t1 - t0) * 1e3


def time_ms(
    run: Callable[[], Any],
    grad_tensors: Sequence[torch.Tensor],
    device: str,
    warmup: float,
    rep: float,
    min_runs: int = MIN_TIMED_RUNS,
) -> list[float]:
    """Wall time [median, p20, p80] in ms: triton's do_bench on CUDA (rep raised to min_runs
    calls), a perf_counter loop on the CPU."""
    one, _ = once_ms(run, device)
    rep = max(rep, min_runs * one)
    if device.startswith("cuda"):
        import triton.testing

        return list(
            triton.testing.do_bench(
                run, warmup=warmup, rep=rep, grad_to_none=list(grad_tensors), quantiles=QUANTILES
            )
        )
    end = time.perf_counter() + warmup / 1e3
    while time.perf_counter() < end:
        run()
    times = []
    for _ in range(max(min_runs, min(1000, int(rep / max(one, 1e-3))))):
        zero_grads(grad_tensors)
        t = time.perf_counter()
        run()
        times.append((time.perf_counter() - t) * 1e3)
    return torch.quantile(
        torch.tensor(times, dtype=torch.float64), torch.tensor(QUANTILES, dtype=torch.float64)
    ).tolist()


_cycles_per_ms: float | None = None


def _sleep_cycles_per_ms() -> float:
    """GPU clock cycles per ms of torch.cuda._sleep, measured once."""
    global _cycles_per_ms
    if _cycles_per_ms is None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)  # load the kernel
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        torch.cuda.synchronize()
        _cycles_per_ms = 20_000_000 / start.elapsed_time(end)
    return _cycles_per_ms


def gpu_time_ms(
    run: Callable[[], Any], grad_tensors: Sequence[torch.Tensor], rep: float = 100, runs: int | None = None
) -> float:
    """Median device time of one call with the launch queue filled ahead (CUDA).

    Before each call: the L2 is flushed, then a _sleep kernel longer than the host needs to
    launch the call holds the stream, so that by the time the start event runs every kernel of
    the call is queued behind it: the events measure the device, not the host. An impl that
    syncs with the host inside the call cannot be queued ahead; its GPU time includes the wait.
    runs: how many calls (default: rep ms worth, 3 to MAX_GPU_RUNS).
    """
    cache = _l2_flush_buffer()
    zero_grads(grad_tensors)
    wall, host = once_ms(run, "cuda")  # after the caller's warm-up calls
    cycles = _sleep_cycles(host)
    n = runs or max(3, min(MAX_GPU_RUNS, int(rep / max(wall, 1e-3))))
    times = [_queued_call_ms(run, grad_tensors, cache, cycles) for _ in range(n)]
    zero_grads(grad_tensors)
    return statistics.median(times)


def interleaved_gpu_ms(
    runs: dict[str, tuple[Callable[[], Any], Sequence[torch.Tensor]]], calls: int
) -> tuple[dict[str, float], float, set[str]]:
    """(median device time of one call per name, the sleep before each call in ms, the names
    whose calls wait for the GPU on the host), measured as gpu_time_ms does but with the names'
    calls alternating: each pass calls every name once, every other pass in reverse order, every
    call behind the same sleep. Where a case holds the GPU at its power limit, a call's time
    depends on the load and the idle before it; alternating gives every name the same ones.

    The sleep covers the slowest launch among the calls that do not wait for the GPU and launch
    within MAX_COVERED_LAUNCH_MS: a call that waits (a read of a device value back to the host)
    idles the GPU whatever the sleep, and a sleep long enough for its whole call, or for one
    very slow launch, would rest the GPU before every call for longer than most calls run. The
    names returned as waiting include those slow launchers: their device time includes host time.
    runs: name -> (the call, the tensors whose gradients it sets)."""
    cache = _l2_flush_buffer()
    hosts = {}
    for name, (run, grad_tensors) in runs.items():
        zero_grads(grad_tensors)
        run()  # warm: the host sample below must not include a first call's costs
        zero_grads(grad_tensors)
        hosts[name] = once_ms(run, "cuda")[1]
        zero_grads(grad_tensors)
    # Behind a sleep much longer than any call's host time, a call that returns before the sleep
    # ends launched without waiting; its host time then is its launch time.
    detect = int(_sleep_cycles_per_ms() * (2 * max(hosts.values()) + 20))
    launches = {name: _launch_ms(*runs[name], detect) for name in runs}
    waits = {name for name, ms in launches.items() if ms is None or ms > MAX_COVERED_LAUNCH_MS}
    covered = (ms for ms in launches.values() if ms is not None and ms <= MAX_COVERED_LAUNCH_MS)
    cycles = _sleep_cycles(max(covered, default=0.0))
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(calls):
        for name in names if i % 2 == 0 else names[::-1]:
            times[name].append(_queued_call_ms(*runs[name], cache, cycles))
    return {name: statistics.median(t) for name, t in times.items()}, cycles / _sleep_cycles_per_ms(), waits


def _launch_ms(run: Callable[[], Any], grad_tensors: Sequence[torch.Tensor], cycles: int) -> float | None:
    """Host ms to launch run() with the GPU asleep for `cycles` ahead of it, or None where the
    call waited for the GPU on the host (the sleep had ended by the time it returned)."""
    zero_grads(grad_tensors)
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles)
    slept = torch.cuda.Event()
    slept.record()
    t0 = time.perf_counter()
    run()
    host_ms = (time.perf_counter() - t0) * 1e3
    waited = slept.query()
    torch.cuda.synchronize()
    zero_grads(grad_tensors)
    return None if waited else host_ms


def _l2_flush_buffer() -> torch.Tensor:
    return torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")


def _sleep_cycles(host_ms: float) -> int:
    """A sleep longer than the host needs to launch a call that takes host_ms to launch."""
    return int(_sleep_cycles_per_ms() * (1.5 * host_ms + 0.2))


def _queued_call_ms(
    run: Callable[[], Any], grad_tensors: Sequence[torch.Tensor], cache: torch.Tensor, cycles: int
) -> float:
    """The device time of one call queued behind a sleep of `cycles` (gpu_time_ms)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    zero_grads(grad_tensors)
    cache.zero_()
    torch.cuda._sleep(cycles)
    start.record()
    run()
    end.record()
    # Wait before the next sleep: queued sleeps would otherwise pile up ahead of the host.
    end.synchronize()
    zero_grads(grad_tensors)  # no call's gradients outlive it (alternating: every name's would)
    return start.elapsed_time(end)


def kernel_time_ms(run: Callable[[], Any], grad_tensors: Sequence[torch.Tensor], iters: int = 5) -> float:
    """Device time of the kernels one call launches (torch.profiler, summed over kernels)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            zero_grads(grad_tensors)
            run()
        torch.cuda.synchronize()
    total_us = sum(e.self_device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA")
    return total_us / iters / 1e3


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def cleanup(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def empty_row(backend: str, mode: str, status: str = "ok", note: str = "") -> dict[str, Any]:
    row = dict.fromkeys(("ms", "ms_p20", "ms_p80", "gpu_ms", "kernel_ms", "peak_mib"))
    return {"backend": backend, "mode": mode, "status": status, **row, "note": note}


def timed_call(op: str, backend: str, inputs: dict[str, Any], mode: str) -> Callable[[], Any]:
    """The call measure times: the backend's function in `mode` on the inputs (raises
    Unsupported where the backend cannot take them)."""
    return mode_fn(backend_fn(op, backend, inputs), inputs, mode)


def grad_tensors_of(inputs: dict[str, Any]) -> list[torch.Tensor]:
    """The inputs whose gradients a timed call sets (cleared between calls)."""
    return [v for v in inputs.values() if isinstance(v, torch.Tensor) and v.requires_grad]


def _measure(
    op: str,
    backend: str,
    inputs: dict[str, Any],
    mode: str,
    warmup: float,
    rep: float,
    grad_tensors: list[torch.Tensor],
    device: str,
    row: dict[str, Any],
    profile: bool,
    min_runs: int,
    gpu_runs: int | None,
) -> None:
    """Fills row; its closures, and the autograd graph they hold, die when it returns."""
    run = timed_call(op, backend, inputs, mode)  # its first forward also compiles / autotunes
    run()  # one more warm-up call, outside the memory measurement (e.g. bwd's first backward)
    peak = peak_memory_bytes(run, grad_tensors, device)
    row["peak_mib"] = None if peak is None else peak / 2**20
    row["ms"], row["ms_p20"], row["ms_p80"] = time_ms(run, grad_tensors, device, warmup, rep, min_runs)
    if device.startswith("cuda"):
        row["gpu_ms"] = gpu_time_ms(run, grad_tensors, rep, gpu_runs)
        if profile:
            row["kernel_ms"] = kernel_time_ms(run, grad_tensors)


def measure(
    op: str,
    backend: str,
    inputs: dict[str, Any],
    mode: str = "full",
    warmup: float = 25,
    rep: float = 100,
    profile: bool = True,
    min_runs: int = MIN_TIMED_RUNS,
    gpu_runs: int | None = None,
) -> dict[str, Any]:
    """Time and peak memory of one backend on prepared inputs (see prepare_inputs) in one mode.

    Returns a row: status ("ok", "unsupported", "OOM", "error"), ms, ms_p20, ms_p80 (wall),
    gpu_ms (queue filled ahead), kernel_ms (profiler; profile=False skips it), peak_mib (None on
    the CPU, as the GPU times) and a note. min_runs: at least that many wall-timed calls;
    gpu_runs: that many GPU-timed calls (default from rep). Never raises for a backend's failure.
    """
    device = next(v.device.type for v in inputs.values() if isinstance(v, torch.Tensor))
    row = empty_row(backend, mode)
    grad_tensors = grad_tensors_of(inputs)
    try:
        _measure(
            op, backend, inputs, mode, warmup, rep, grad_tensors, device, row, profile, min_runs, gpu_runs
        )
    except Unsupported as e:
        row.update(empty_row(backend, mode, "unsupported", str(e)))
    except Exception as e:  # a backend's failure is a result, not a crash
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if is_oom(e):
            row.update(empty_row(backend, mode, "OOM", first[:200]))
        else:
            note = f"{type(e).__name__}: {first}"[:300]
            if mode == "bwd":  # name the cause: the mode, not the kernel, is what is refused
                note = (
                    "backward over a retained graph, repeated: this impl computes or overwrites its "
                    f"gradients in the forward and refuses a second backward ({note})"
                )
            row.update(empty_row(backend, mode, "error", note))
    zero_grads(grad_tensors)
    cleanup(device)
    return row
