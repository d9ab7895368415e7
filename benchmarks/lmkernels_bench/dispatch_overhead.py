"""Host cost of the dispatch on the CPU, tiny tensors (the target: <= 10 us per call).

Figures per op (rms_norm, rope), in microseconds per call:
- overhead: the public function with backend="eager" minus the bare eager reference, the
  figure the target is about (`lk.rms_norm(x, w, backend="eager")` - `rms_norm_reference(x, w)`);
- dispatch: the public function around an impl that does nothing, minus calling that impl
  directly: the dispatch alone, without the reference's time and its noise;
- reads: reading each input tensor's class, shape, dtype, device and requires_grad inline in a
  function of the op's signature, minus calling that function with no body: what any cached
  dispatch must pay to know the signature. dispatch / reads is the ratio the test bounds: it
  moves little with the machine's speed, where the microseconds move with it.

The overhead exceeds dispatch: right after the reference's kernels the dispatch runs with cold
caches (and evicts some of the reference's), which a no-op impl does not show.

The machine this runs on may be shared and noisy, so each figure is a paired measurement: a
short window (`--calls` calls) of one side, then one of the other, round after round for
`--seconds`; the figure is the median of the per-round differences (the reference's fastest
window is printed for scale). One torch thread, as a tiny op should run.

    lmkernels-bench dispatch-overhead [--seconds 20] [--calls 100]
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

TARGET_US = 10.0
NOOP = "dispatch_noop"  # registered for the measurement only


def _rms_reads(x, weight=None, eps=1e-6, offset=0.0, casting_mode="llama", *, backend=None):
    return (
        (x.__class__, x.shape, x.dtype, x.device, x.requires_grad),
        (weight.__class__, weight.shape, weight.dtype, weight.device, weight.requires_grad),
    )


def _rms_noop(x, weight=None, eps=1e-6, offset=0.0, casting_mode="llama", *, backend=None):
    return None


def _rope_reads(q, k, cos, sin, position_ids=None, layout="neox", rotary_dim=None, *, backend=None):
    return (
        (q.__class__, q.shape, q.dtype, q.device, q.requires_grad),
        (k.__class__, k.shape, k.dtype, k.device, k.requires_grad),
        (cos.__class__, cos.shape, cos.dtype, cos.device, cos.requires_grad),
        (sin.__class__, sin.shape, sin.dtype, sin.device, sin.requires_grad),
    )


def _rope_noop(q, k, cos, sin, position_ids=None, layout="neox", rotary_dim=None, *, backend=None):
    return None


def candidates(noop: str = NOOP) -> dict[str, Callable[[], object]]:
    x, w = torch.randn(4, 8), torch.randn(8)
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 1, 4, 8)
    cos, sin = torch.randn(4, 8), torch.randn(4, 8)
    return {
        "rms_norm eager": lambda: lk.rms_norm(x, w, backend="eager"),
        "rms_norm reference": lambda: rms_norm_reference(x, w),
        "rms_norm noop": lambda: lk.rms_norm(x, w, backend=noop),
        "rms_norm noop direct": lambda: _rms_noop(x, w, 1e-6, 0.0, "llama"),
        "rms_norm reads": lambda: _rms_reads(x, w, backend=noop),
        "rms_norm empty": lambda: _rms_noop(x, w, backend=noop),
        "rope eager": lambda: lk.rope(q, k, cos, sin, backend="eager"),
        "rope reference": lambda: rope_reference(q, k, cos, sin),
        "rope noop": lambda: lk.rope(q, k, cos, sin, backend=noop),
        "rope noop direct": lambda: _rope_noop(q, k, cos, sin, None, "neox", None),
        "rope reads": lambda: _rope_reads(q, k, cos, sin, backend=noop),
        "rope empty": lambda: _rope_noop(q, k, cos, sin, backend=noop),
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
    """{op: {"overhead", "dispatch", "reads", "ratio", "reference", "rounds"}}, us per call."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    register("rms_norm", NOOP, _rms_noop)
    register("rope", NOOP, _rope_noop)
    kinds = (
        ("overhead", "eager", "reference"),
        ("dispatch", "noop", "noop direct"),
        ("reads", "reads", "empty"),
    )
    try:
        fns = candidates()
        pairs = {
            f"{op} {kind}": (fns[f"{op} {a}"], fns[f"{op} {b}"])
            for op in ("rms_norm", "rope")
            for kind, a, b in kinds
        }
        timed = paired_times(pairs, seconds, calls)
    finally:
        unregister("rms_norm", NOOP)
        unregister("rope", NOOP)
        torch.set_num_threads(threads)
    figures = {}
    for op in ("rms_norm", "rope"):
        f = {kind: timed[f"{op} {kind}"]["diff"] for kind, _, _ in kinds}
        f["ratio"] = f["dispatch"] / max(f["reads"], 1e-3)
        f["reference"] = timed[f"{op} overhead"]["b"]
        f["rounds"] = timed[f"{op} overhead"]["rounds"]
        figures[op] = f
    return figures


def report(figures: dict[str, dict[str, float]], target: float = TARGET_US) -> str:
    met = f"<={target:g}us"
    lines = [
        f"{'op':<9} {'reference':>9} {'overhead':>9} {met:>7}   {'dispatch':>8} {'reads':>6} {'ratio':>6}"
    ]
    for op, f in figures.items():
        verdict = "yes" if f["overhead"] <= target else "NO"
        lines.append(
            f"{op:<9} {f['reference']:>9.1f} {f['overhead']:>+9.1f} {verdict:>7}"
            f"   {f['dispatch']:>8.1f} {f['reads']:>6.1f} {f['ratio']:>5.1f}x"
        )
    lines += [
        f"us per call; overhead = eager backend - bare reference (target <= {target:.0f} us);",
        "dispatch = around a no-op impl; reads = the tensor attribute reads a cached",
        "dispatch needs; ratio = dispatch / reads. Medians of paired differences over",
        f"{min(f['rounds'] for f in figures.values())} rounds; reference: its fastest window.",
    ]
    return "\n".join(lines)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lmkernels-bench dispatch-overhead", description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=20.0, help="time budget of the measurement")
    p.add_argument("--calls", type=int, default=100, help="calls per timed window")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    print(
        f"torch {torch.__version__}, python {platform.python_version()}, {_cpu_name()}, {os.cpu_count()} cores"
    )
    print(f"measuring for {args.seconds:.0f} s ...", flush=True)
    print(report(measure(args.seconds, args.calls)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
