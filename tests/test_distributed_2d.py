"""FSDP2 x tensor parallel on a 2-D mesh, dp 2 x tp 2, on the CPU (4 gloo processes): torch's
parallel styles with sequence-parallel norms and the vocab-parallel FLCE, and transformers' own
DistributedConfig(tp_size=2, fsdp_size=2) (tests/distributed_checks_2d.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the distributed checks train transformers models")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available in this torch build", allow_module_level=True)

HERE = Path(__file__).parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import distributed_checks as checks  # noqa: E402

SUITE = "2d"


@pytest.fixture(scope="session")
def results_2d(tmp_path_factory):
    return checks.run_world(SUITE, tmp_path_factory.mktemp("dist_2d") / "results.json")


@pytest.mark.parametrize("name", sorted(checks.SUITES[SUITE][1]))
def test_2d(results_2d, name):
    checks.assert_check(results_2d, name, checks.SUITES[SUITE][0])
