"""The harness: correctness checks (checks.py), the validation runner and its reports
(runner.py), the properties every backend must hold on any valid input (properties.py),
`lmkernels list` (listing.py), the per-op benchmark (bench/) and the launch-configuration
tuner (tune/)."""

from lmkernels.harness.checks import CaseResult, TensorError, check_case

__all__ = ["CaseResult", "TensorError", "check_case"]
