"""Distributed training on the CPU: FSDP2 wrappings, DDP, tensor/sequence parallel, pipeline
parallel and the vocab-parallel FLCE, in one world of 2 gloo processes (tests/distributed_checks.py
holds the checks and their tolerances; each is one test here, the world starts once per session).
The DeepSpeed and 2-D (4 processes) suites have their own files: test_distributed_deepspeed.py,
test_distributed_2d.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the distributed checks train transformers models")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available in this torch build", allow_module_level=True)

HERE = Path(__file__).parent
if str(HERE) not in sys.path:  # the check modules import each other by name
    sys.path.insert(0, str(HERE))
import distributed_checks as checks  # noqa: E402

SUITE = "main"


@pytest.fixture(scope="session")
def world_results(tmp_path_factory):
    return checks.run_world(SUITE, tmp_path_factory.mktemp("dist") / "results.json")


@pytest.mark.parametrize("name", sorted(checks.SUITES[SUITE][1]))
def test_distributed(world_results, name):
    checks.assert_check(world_results, name, checks.SUITES[SUITE][0])
