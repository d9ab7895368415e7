"""Distributed training on the CPU: FSDP2 wrappings, DDP, tensor/sequence parallel and the
vocab-parallel FLCE, in one world of 2 gloo processes (tests/distributed_checks.py holds the
checks and their tolerances; each is one test here, the world starts once per session)."""

from __future__ import annotations

import json
import os
import subprocess
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


@pytest.fixture(scope="session")
def world_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist") / "results.json"
    env = dict(os.environ)
    src = str(HERE.parent / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # a world of our own, even when pytest itself runs under torchrun
    proc = subprocess.run(
        [sys.executable, str(HERE / "distributed_checks.py"), "--device", "cpu", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode != 0 or not out.exists():
        pytest.fail(f"the 2-process world failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())["checks"]


@pytest.mark.parametrize("name", sorted(checks.CHECKS))
def test_distributed(world_results, name):
    per_rank = world_results[name]
    assert len(per_rank) == 2
    for rank, result in enumerate(per_rank):
        assert result["ok"], f"rank {rank}: {result['error']}\n{result['trace']}"
    skipped = {result.get("skipped") for result in per_rank}
    if skipped != {None}:
        pytest.skip(f"not run here: {' / '.join(sorted(map(str, skipped)))}")
