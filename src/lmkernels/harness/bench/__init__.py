"""`lmkernels bench`: time and peak memory of every registered backend of one op at the shapes the
user gives (GPU time with the launch queue filled ahead, wall time, peak memory above the inputs,
rates against the copy bandwidth and the matmul rate measured in the same run).

One job per module:

- plan.py      the points of a run: the op's shapes (the user's, else its reference shape), options
- backends.py  which backends run (registered impls, peer adapters, compile_naive) and what is timed
- measure.py   GPU time (queue filled ahead; alternating calls), wall time (do_bench), kernel
               time, peak memory
- roofline.py  copy bandwidth and matmul rate measured in the run, rooflines, ratios to baselines
- run.py       the loop over shapes x backends x modes, budget, progress, environment
- report.py    CSV, JSON, markdown summary, tables for the terminal
- cli.py       `lmkernels bench`

These are the measurement protocol's public functions: the maintainers' suites (peer comparisons,
end to end, distributed, the documents' tables) are a package of their own, built on them.
"""

from lmkernels.harness.bench.backends import (
    PSEUDO_BACKENDS,
    Unsupported,
    backend_fn,
    backends_for,
    naive_flce,
)
from lmkernels.harness.bench.cli import parse_options
from lmkernels.harness.bench.measure import (
    MAX_COVERED_LAUNCH_MS,
    MIN_TIMED_RUNS,
    QUANTILES,
    cleanup,
    empty_row,
    gpu_time_ms,
    grad_tensors_of,
    interleaved_gpu_ms,
    is_oom,
    kernel_time_ms,
    measure,
    mode_fn,
    peak_memory_bytes,
    prepare_inputs,
    time_ms,
    timed_call,
)
from lmkernels.harness.bench.plan import (
    DESIGN_SHAPES,
    DTYPE_NAMES,
    DTYPES,
    FLCE,
    MODES,
    Point,
    default_shape,
    options_id,
    plan,
)
from lmkernels.harness.bench.report import (
    CSV_FIELDS,
    rich_table,
    summary_markdown,
    write_reports,
    write_tables,
)
from lmkernels.harness.bench.roofline import (
    BASELINES,
    add_ratios,
    add_rooflines,
    copy_bandwidth_gbps,
    matmul_tflops,
)
from lmkernels.harness.bench.run import environment, reference_rates, run_bench

__all__ = [
    "BASELINES",
    "CSV_FIELDS",
    "DESIGN_SHAPES",
    "DTYPES",
    "DTYPE_NAMES",
    "FLCE",
    "MAX_COVERED_LAUNCH_MS",
    "MIN_TIMED_RUNS",
    "MODES",
    "PSEUDO_BACKENDS",
    "QUANTILES",
    "Point",
    "Unsupported",
    "add_ratios",
    "add_rooflines",
    "backend_fn",
    "backends_for",
    "cleanup",
    "copy_bandwidth_gbps",
    "default_shape",
    "empty_row",
    "environment",
    "gpu_time_ms",
    "grad_tensors_of",
    "interleaved_gpu_ms",
    "is_oom",
    "kernel_time_ms",
    "matmul_tflops",
    "measure",
    "mode_fn",
    "naive_flce",
    "options_id",
    "parse_options",
    "peak_memory_bytes",
    "plan",
    "prepare_inputs",
    "reference_rates",
    "rich_table",
    "run_bench",
    "summary_markdown",
    "time_ms",
    "timed_call",
    "write_reports",
    "write_tables",
]
