"""The test suite on a GPU machine, and the Triton kernels under compute-sanitizer.

    lmkernels-bench gpu-tests suite GROUP --out DIR       # pytest, kernels compiled
    lmkernels-bench gpu-tests memcheck GROUP --out DIR    # the same under compute-sanitizer

Groups are pytest selections sized to finish in one 10-minute call (see GROUPS). `suite` runs
a group with TRITON_INTERPRET=0. `memcheck` runs it under `compute-sanitizer --tool memcheck`
(or `--tool racecheck` with --racecheck, for the kernels with reductions, shared memory or
barriers) with PyTorch's caching allocator off (PYTORCH_NO_CUDA_MEMORY_CACHING=1), so that
each tensor is its own allocation and a read past its end is an out-of-bounds access the tool
sees, not a read of the next tensor in the same block. Each run appends one JSON line to
DIR/gpu_tests.jsonl: the group, tool, errors counted from the tool's summary, pytest's
summary, seconds, device, versions and commit; the full log goes to DIR/<group>-<tool>.log.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from lmkernels_bench.data import checkout, commit

# name -> pytest arguments. "kernels" is every Triton kernel forward and backward over the
# quick grid (tails, odd sizes) in fp32/bf16/fp16, random shapes and layouts (the property
# tests), the unchecked out-of-range positions and targets, and the edge semantics.
GROUPS = {
    "kernels": [
        "tests/test_correctness.py",
        "tests/test_properties.py",
        "tests/test_error_inputs.py",
        "tests/test_edge_semantics.py",
        "-k",
        "triton",
    ],
    "large": ["tests/test_triton_norms.py", "tests/test_triton_rope_glu.py", "-k", "2_31"],
    "racecheck": [
        "tests/test_correctness.py",
        "-k",
        "triton and (rms_norm or layer_norm or fused_linear) and not fp16",
    ],
    "triton-files": [
        "tests/test_triton_norms.py",
        "tests/test_triton_flce.py",
        "tests/test_triton_flce_memory.py",
        "tests/test_triton_rope_glu.py",
        "tests/test_triton_glu_inplace.py",
        "tests/test_pdl.py",
        "tests/test_cuda_graph_step.py",
        "tests/test_launch.py",
    ],
    # The features beside the kernels: the distillation op, torch.func, FLCE's plans and mean
    # logits, the per-GPU tables. (The offline compile check, test_compile_targets, is CI's: it
    # compiles for other GPUs, which this one adds nothing to.)
    "triton-features": [
        "tests/test_distill.py",
        "tests/test_transforms.py",
        "tests/test_flce_plan.py",
        "tests/test_flce_mean_logits.py",
        "tests/test_gpu_targets.py",
    ],
    "posttrain": [
        "tests/test_losses.py",
        "tests/test_integration_trl_posttrain.py",
        "tests/test_integration_verl.py",
    ],
    "integration": [
        "tests/test_integration_transformers.py",
        "tests/test_integration_families.py",
        "tests/test_integration_compile.py",
        "tests/test_integration_ecosystem.py",
    ],
    # The property tests' long profile (500 random examples per op x Triton backend): longer
    # than one call, so the suite runs it in shards (-k), which the report sums.
    "properties-long": ["tests/test_properties.py", "-k", "triton"],
}
GROUP_ENV = {"properties-long": {"LMKERNELS_HYPOTHESIS_PROFILE": "long"}}

SANITIZER_SUMMARY = re.compile(r"(ERROR SUMMARY|RACECHECK SUMMARY): .*?(\d+) (?:errors?|hazards? displayed)")


def find_sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for base in sorted(Path("/usr/local").glob("cuda*/bin/compute-sanitizer"), reverse=True):
        return str(base)
    return None


def sanitizer_errors(log: str) -> int | None:
    """Errors reported by compute-sanitizer's summary lines (one per process), or None if the
    log has none (the tool did not run to its end)."""
    counts = [int(m.group(2)) for m in SANITIZER_SUMMARY.finditer(log)]
    return sum(counts) if counts else None


def pytest_summary(log: str) -> str:
    lines = [ln for ln in log.splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
    return lines[-1].strip("= ") if lines else "no pytest summary"


def environment() -> dict[str, str]:
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        import torch
        import triton

        info.update(torch=torch.__version__, triton=triton.__version__)
        if torch.cuda.is_available():
            info["device"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    info["commit"] = commit(checkout()) or "unknown"  # $LMKERNELS_COMMIT on a copy of the tree
    return info


def run(group: str, out: Path, tool: str | None, timeout: float, select: str | None = None) -> dict:
    tests = [a for a in GROUPS[group] if a.startswith("tests/")]
    pytest_args = [*tests, "-k", select] if select else GROUPS[group]
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", *pytest_args]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONUNBUFFERED="1", **GROUP_ENV.get(group, {}))
    root = checkout()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root / "src"), env.get("PYTHONPATH")]))
    if tool is not None:
        sanitizer = find_sanitizer()
        if sanitizer is None:
            raise SystemExit("compute-sanitizer: not found on PATH or under /usr/local/cuda*/bin")
        env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
        args = [sanitizer, "--tool", tool, "--print-limit", "100", *args]
    name = f"{group}-{tool or 'suite'}" + (f"-{abs(hash(select)) % 10000}" if select else "")
    start = time.perf_counter()
    print(f"{name}: {' '.join(pytest_args)}", flush=True)
    code: int | str
    try:
        proc = subprocess.run(args, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        log, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        log = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
        code = "timeout"
    seconds = time.perf_counter() - start
    (out / f"{name}.log").write_text(log)
    record = {
        "group": group,
        "select": select,
        "tool": tool or "none",
        "pytest": pytest_summary(log),
        "exit": code,
        "seconds": round(seconds, 1),
        **environment(),
    }
    if tool is not None:
        record["sanitizer_errors"] = sanitizer_errors(log)
    with open(out / "gpu_tests.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps(record), flush=True)
    return record


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lmkernels-bench gpu-tests", description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("suite", "memcheck"))
    p.add_argument("group", choices=sorted(GROUPS))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--racecheck", action="store_true", help="racecheck instead of memcheck")
    p.add_argument("--timeout", type=float, default=560.0, help="seconds before the run is stopped")
    p.add_argument("-k", dest="select", help="a pytest -k expression instead of the group's own")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    tool = None if args.mode == "suite" else ("racecheck" if args.racecheck else "memcheck")
    record = run(args.group, args.out, tool, args.timeout, args.select)
    clean = record["exit"] == 0 and (tool is None or record["sanitizer_errors"] == 0)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
