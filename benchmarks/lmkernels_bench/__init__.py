"""The maintainers' suite of lmkernels: the measurements the README and the docs cite, run from a
checkout (`lmkernels-bench COMMAND`, cli.py), on lmkernels' public API only.

- suite.py, parts.py, parts_perf.py, parts_validation.py, grids.py: `lmkernels-bench suite`: the
  parts behind the documents' tables, appended as rows to one data file per GPU kind (data.py:
  their format and provenance);
- tables.py, tables_common.py, tables_perf.py, tables_validation.py, tables_plots.py, plots.py:
  `lmkernels-bench report`: the documents' marked tables, the plots, the validation reports;
- the benchmarks, each a command: frontier.py + frontier_report.py (FLCE against every peer),
  e2e.py + e2e_setup.py + e2e_report.py + timeline.py (end-to-end training), scale.py +
  scale_worker.py + scale_titan.py (distributed), compare_trees.py, trl_head.py, families.py,
  families_scan.py, families_table.py, gpu_tests.py, dispatch_overhead.py.

The timings themselves (GPU time with the launch queue filled ahead, peak memory, rooflines) are
lmkernels' own (lmkernels.harness.bench), the protocol `lmkernels bench` measures users' shapes
with.
"""
