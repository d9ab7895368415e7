"""DeepSpeed ZeRO-2 / ZeRO-3 on the CPU (2 gloo processes): a patched tiny Llama under
deepspeed.initialize, transformers' Trainer with a DeepSpeed config and Accelerate trains as one
process trains plain transformers (tests/distributed_checks_deepspeed.py). Skipped without
deepspeed (`pip install 'lmkernels[deepspeed]'`; DS_BUILD_OPS=0 needs no compiler)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the DeepSpeed checks train transformers models")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")
pytest.importorskip("deepspeed", reason="deepspeed is not installed: pip install 'lmkernels[deepspeed]'")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available in this torch build", allow_module_level=True)

HERE = Path(__file__).parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import distributed_checks as checks  # noqa: E402

SUITE = "deepspeed"


@pytest.fixture(scope="session")
def deepspeed_results(tmp_path_factory):
    return checks.run_world(SUITE, tmp_path_factory.mktemp("dist_ds") / "results.json")


@pytest.mark.parametrize("name", sorted(checks.SUITES[SUITE][1]))
def test_deepspeed(deepspeed_results, name):
    checks.assert_check(deepspeed_results, name, checks.SUITES[SUITE][0])
