"""Host cost of the dispatch on the CPU, tiny tensors (issue 13: <= 10 us per call).

Two figures per op (rms_norm, rope), both in microseconds per call:
- issue: the public function with backend="eager" minus the bare eager reference, the
  definition of the issue (`lk.rms_norm(x, w, backend="eager")` - `rms_norm_reference(x, w)`);
- dispatch: the public function around an impl that does nothing, minus calling that impl
  directly: the dispatch alone, without the reference's own time and its noise.

The machine this runs on is shared and noisy, so each figure is a paired measurement: a short
window (`--calls` calls) of one side, then one of the other, round after round for
`--seconds`; the figure is the median of the per-round differences (the fastest windows are
printed for scale). One torch thread, as a tiny op should run.

    python benchmarks/dispatch_overhead.py [--seconds 20] [--calls 100]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

import lmkernels as lk
from lmkernels.ops.rms_norm import rms_norm_reference
from lmkernels.ops.rope import rope_reference
from lmkernels.registry import register, unregister

NOOP = "dispatch_noop"  # registered for the measurement only


def _nothing(**inputs):
    return None


def candidates(noop: str = NOOP) -> dict[str, Callable[[], object]]:
    x, w = torch.randn(4, 8), torch.randn(8)
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 1, 4, 8)
    cos, sin = torch.randn(4, 8), torch.randn(4, 8)
    rms_kw = {"x": x, "weight": w, "eps": 1e-6, "offset": 0.0, "casting_mode": "llama"}
    rope_kw = {"q": q, "k": k, "cos": cos, "sin": sin, "position_ids": None, "layout": "neox"}
    return {
        "rms_norm eager": lambda: lk.rms_norm(x, w, backend="eager"),
        "rms_norm reference": lambda: rms_norm_reference(x, w),
        "rms_norm noop": lambda: lk.rms_norm(x, w, backend=noop),
        "rms_norm noop direct": lambda: _nothing(**rms_kw),
        "rope eager": lambda: lk.rope(q, k, cos, sin, backend="eager"),
        "rope reference": lambda: rope_reference(q, k, cos, sin),
        "rope noop": lambda: lk.rope(q, k, cos, sin, backend=noop),
        "rope noop direct": lambda: _nothing(**rope_kw, rotary_dim=None),
    }


def _window(fn: Callable[[], object], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def paired_times(
    pairs: dict[str, tuple[Callable[[], object], Callable[[], object]]], seconds: float, calls: int
) -> dict[str, dict[str, float]]:
    """Per pair (a, b): a window of a then a window of b, round after round for `seconds`, in
    alternating order. Returns the median of the per-round differences a - b (a slow drift of
    the machine's load cancels out within a round, a spike moves the median little) and the
    fastest window of each, in us per call."""
    for a, b in pairs.values():
        for _ in range(200):
            a(), b()
    gc.collect()
    diffs: dict[str, list[float]] = {name: [] for name in pairs}
    best = {name: [float("inf"), float("inf")] for name in pairs}
    deadline = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < deadline:
        for name, (a, b) in pairs.items():
            if n % 2:
                tb, ta = _window(b, calls), _window(a, calls)
            else:
                ta, tb = _window(a, calls), _window(b, calls)
            diffs[name].append(ta - tb)
            best[name] = [min(best[name][0], ta), min(best[name][1], tb)]
        n += 1
    return {
        name: {"diff": statistics.median(d), "a": best[name][0], "b": best[name][1], "rounds": len(d)}
        for name, d in diffs.items()
    }


def measure(seconds: float = 20.0, calls: int = 100) -> dict[str, dict[str, float]]:
    """{op: {"issue": us, "dispatch": us, "eager": us, "reference": us}} per call."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    register("rms_norm", NOOP, _nothing)
    register("rope", NOOP, _nothing)
    try:
        fns = candidates()
        pairs = {
            f"{op} {kind}": (fns[f"{op} {a}"], fns[f"{op} {b}"])
            for op in ("rms_norm", "rope")
            for kind, a, b in (("issue", "eager", "reference"), ("dispatch", "noop", "noop direct"))
        }
        timed = paired_times(pairs, seconds, calls)
    finally:
        unregister("rms_norm", NOOP)
        unregister("rope", NOOP)
        torch.set_num_threads(threads)
    return {
        op: {
            "issue": timed[f"{op} issue"]["diff"],
            "dispatch": timed[f"{op} dispatch"]["diff"],
            "eager": timed[f"{op} issue"]["a"],
            "reference": timed[f"{op} issue"]["b"],
            "rounds": timed[f"{op} issue"]["rounds"],
        }
        for op in ("rms_norm", "rope")
    }


def report(figures: dict[str, dict[str, float]]) -> str:
    lines = [f"{'op':<9} {'eager':>8} {'reference':>10} {'issue':>7} {'dispatch':>9}   (us per call)"]
    for op, f in figures.items():
        lines.append(
            f"{op:<9} {f['eager']:>8.1f} {f['reference']:>10.1f} {f['issue']:>+7.1f} {f['dispatch']:>9.1f}"
        )
    lines.append("issue = eager backend - bare reference; dispatch = around a no-op impl;")
    lines.append("medians of paired differences; eager, reference: fastest windows")
    return "\n".join(lines)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=20.0, help="time budget of the measurement")
    p.add_argument("--calls", type=int, default=100, help="calls per timed window")
    args = p.parse_args(argv)
    print(
        f"torch {torch.__version__}, python {platform.python_version()}, {_cpu_name()}, {os.cpu_count()} cores"
    )
    print(f"measuring for {args.seconds:.0f} s ...", flush=True)
    print(report(measure(args.seconds, args.calls)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
