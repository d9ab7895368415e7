"""The bench: time and peak memory of every backend (GPU time with the launch queue filled ahead,
wall time, peak memory above the inputs, rates against the copy bandwidth and matmul rate).

One job per module:

- plan.py      shape grids (design shapes, sweeps), option sets, the points of a run
- backends.py  which backends run (registered impls, peer adapters, compile_naive) and what is timed
- measure.py   GPU time (queue filled ahead), wall time (do_bench), kernel time, peak memory
- roofline.py  copy bandwidth and matmul rate measured in the run, rooflines, ratios to baselines
- timeline.py  allocated memory over time from an allocator trace (e2e benchmark)
- run.py       the loop over points x backends x modes, budget, progress, environment
- report.py    CSV, JSON, markdown summary, rich table, plots
- cli.py       `lmkernels bench`

The benchmarks beyond one op, each runnable alone (`python -m lmkernels.harness.bench.e2e`, or
benchmarks/*.py in a checkout):

- frontier.py, frontier_report.py   FLCE against every peer, 8 lm_head shapes x 3 logit regimes
- e2e.py, e2e_setup.py, e2e_report.py  end-to-end training, configurations taking turns
- scale.py, scale_worker.py        every distributed wrapping on 1-4 GPUs (launches torchrun)
- families.py                      bf16 training of the patched families against plain

And the suites behind the README and the docs:

- data.py      the data files: one JSON row per measurement, one file per GPU kind
- suite.py     `--suite readme|validation --part ...`: runs a part; the suites' table of parts
- grids.py     the shapes the parts measure
- parts.py     a part (Part) and the context it runs in (Context: its rows, budget, provenance)
- parts_perf.py, parts_validation.py  the parts: ops, flce, e2e, dist; grid, converge, families, ...
- tables.py    `--report`: the table registry, the README and docs blocks, the report's files
- tables_common.py, tables_perf.py, tables_validation.py, tables_plots.py  what the tables
               share, the tables, the plots
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
    MIN_TIMED_RUNS,
    QUANTILES,
    gpu_time_ms,
    is_oom,
    kernel_time_ms,
    measure,
    mode_fn,
    peak_memory_bytes,
    prepare_inputs,
    time_ms,
)
from lmkernels.harness.bench.plan import (
    DESIGN_SHAPES,
    DTYPE_NAMES,
    DTYPES,
    FLCE,
    MODES,
    SWEEPS,
    Point,
    options_id,
    plan,
)
from lmkernels.harness.bench.report import CSV_FIELDS, rich_table, summary_markdown, write_reports
from lmkernels.harness.bench.roofline import (
    BASELINES,
    add_ratios,
    add_rooflines,
    copy_bandwidth_gbps,
    matmul_tflops,
)
from lmkernels.harness.bench.run import environment, reference_rates, run_bench
from lmkernels.harness.bench.timeline import allocated_timeline

__all__ = [
    "BASELINES",
    "CSV_FIELDS",
    "DESIGN_SHAPES",
    "DTYPES",
    "DTYPE_NAMES",
    "FLCE",
    "MIN_TIMED_RUNS",
    "MODES",
    "PSEUDO_BACKENDS",
    "QUANTILES",
    "SWEEPS",
    "Point",
    "Unsupported",
    "add_ratios",
    "add_rooflines",
    "allocated_timeline",
    "backend_fn",
    "backends_for",
    "copy_bandwidth_gbps",
    "environment",
    "gpu_time_ms",
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
    "write_reports",
]
