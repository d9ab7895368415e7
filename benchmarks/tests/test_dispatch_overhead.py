"""Host cost of the dispatch on the CPU, tiny tensors (target: <= 10 us per call), measured by
`lmkernels-bench dispatch-overhead` (run it for the figures against the target; it says how it
measures).

Microseconds scale with the machine (a throttled CI machine measures twice a quiet one's), so the
test bounds what does not:

- ratio: the dispatch around a no-op impl, in units of the tensor attribute reads any cached
  dispatch must do for the same inputs, measured in the same rounds (a slow machine slows both).
  On the 2-core development machine: 6.3-6.5x (rms_norm) and 4.6-4.8x (rope), quiet or loaded;
  an uncached dispatch measures 58x and 35x. Bounds: about 50% above.
- overhead: an absolute backstop at 50 us for what the ratio does not see (a host sync or a copy
  in the eager path). Under load it is the noisy figure: a CI-like run beside a compile job
  measured rope at +27.8 us with its dispatch at 5.4 us.

One retry absorbs a burst of load; a real regression fails both tries."""

from lmkernels_bench import dispatch_overhead as bench

RATIO_BOUNDS = {"rms_norm": 9.5, "rope": 7.0}
OVERHEAD_BOUND_US = 50.0


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
