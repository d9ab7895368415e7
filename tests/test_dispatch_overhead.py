"""Host cost of the dispatch on the CPU, tiny tensors (issue 13: <= 10 us per call), measured by
benchmarks/dispatch_overhead.py (run it for the reported figures; it says how it measures):

- issue: `lk.rms_norm(x, w, backend="eager")` minus `rms_norm_reference(x, w)`, and the same for
  rope. On the 2-core development machine shared by three agents: +18..+19 us (rms_norm) and
  +22..+25 us (rope) before the per-op generated fast path, +11..+12 and +13..+14 after.
- dispatch: the public function around an impl that does nothing, minus calling that impl:
  6.8..7.4 and 9.6..10.1 us before, 4.5..4.6 and 6.3..6.5 after.

Bounds: the figures are medians of paired differences, which a loaded machine still moves by
several microseconds (more for the issue figure, whose reference side alone takes 60-170 us and
runs slower after any other work). In a full CI run on the throttled 2-core development machine
the fast path measured issue 16.3 / 20.5 us and dispatch 7.0 / 9.8 us (rms_norm / rope), so
tighter bounds fail on a slow machine with nothing wrong. The bounds therefore catch what a
test can catch reliably, a return of the uncached dispatch (issue +28 / +41 us in issue 13):
issue < 25 us, dispatch < 14 us. One retry absorbs a burst of load; a real regression fails
both tries. The figures against the 10-us target come from the benchmark, not from this test."""

import importlib.util
from pathlib import Path

ISSUE_BOUND_US = 25.0
DISPATCH_BOUND_US = 14.0

_path = Path(__file__).resolve().parents[1] / "benchmarks" / "dispatch_overhead.py"
_spec = importlib.util.spec_from_file_location("dispatch_overhead", _path)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _within_bounds(figures) -> bool:
    return all(f["issue"] < ISSUE_BOUND_US and f["dispatch"] < DISPATCH_BOUND_US for f in figures.values())


def test_dispatch_overhead_per_call_on_cpu():
    figures = bench.measure(seconds=3.0)
    print(bench.report(figures))
    if not _within_bounds(figures):
        figures = bench.measure(seconds=6.0)
        print("retry:\n" + bench.report(figures))
    assert _within_bounds(figures), figures
