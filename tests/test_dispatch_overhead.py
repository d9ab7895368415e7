"""Host cost of the dispatch on the CPU, tiny tensors (issue 13: <= 10 us per call), measured by
benchmarks/dispatch_overhead.py (run it for the reported figures; it says how it measures).

What this test bounds, and why not the 10 us directly: microseconds scale with the machine. On
the 2-core development machine shared by three agents the overhead (`lk.rms_norm(x, w,
backend="eager")` minus `rms_norm_reference(x, w)`) measured +7.6..+9.1 us (rms_norm) and
+8.4..+10.0 us (rope) with the flat-key fast path, +11..+14 with the one before and +28 / +41
uncached (issue 13); a throttled CI run of the previous fast path measured 16-20 us with nothing
wrong. So:

- ratio: the dispatch around a no-op impl, in units of the tensor attribute reads any cached
  dispatch must do for the same inputs (measured in the same rounds, so a slow machine slows
  both): 1.6x (rms_norm) and 1.2x (rope) in every run so far, loaded or not; 3.0x and 2.1x with
  the previous fast path; far more uncached. Bounds: about 35% above today's, below the previous
  fast path's (rms_norm has fewer reads, so its fixed costs weigh more).
- overhead: an absolute backstop at 25 us that even a throttled machine passes, and that a
  return of the uncached dispatch fails.

One retry absorbs a burst of load; a real regression fails both tries. The figures against the
10 us target come from the benchmark, not from this test."""

import importlib.util
from pathlib import Path

RATIO_BOUNDS = {"rms_norm": 2.2, "rope": 1.7}
OVERHEAD_BOUND_US = 25.0

_path = Path(__file__).resolve().parents[1] / "benchmarks" / "dispatch_overhead.py"
_spec = importlib.util.spec_from_file_location("dispatch_overhead", _path)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _within_bounds(figures) -> bool:
    return all(
        f["ratio"] < RATIO_BOUNDS[op] and f["overhead"] < OVERHEAD_BOUND_US for op, f in figures.items()
    )


def test_dispatch_overhead_per_call_on_cpu():
    figures = bench.measure(seconds=3.0)
    print(bench.report(figures))
    if not _within_bounds(figures):
        figures = bench.measure(seconds=6.0)
        print("retry:\n" + bench.report(figures))
    assert _within_bounds(figures), figures
