"""The harness: correctness checks (checks.py), the validation runner and reports (runner.py,
report.py), performance and memory measurement (the bench/ package) and plots (plots.py)."""

from lmkernels.harness.checks import CaseResult, TensorError, check_case

__all__ = ["CaseResult", "TensorError", "check_case"]
