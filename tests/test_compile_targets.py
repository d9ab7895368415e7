"""Every production launch of every Triton op compiles for every GPU target we claim, within the
target's limits, without a GPU (lmkernels.harness.targets, `lmkernels compile-check`).

The CPU interpreter runs a kernel's Python, not Triton's compiler: a kernel the compiler rejects
for sm_80, or a launch asking for more shared memory than a 99 KiB part has, passes every
interpreter test. Here each op's Triton impl runs forward and backward on CPU tensors as it
would on the target (its tables, PDL and the L2 prefetch on sm_90+, pipeline stages fitted to its
shared memory), its launches recorded and compiled by `triton.compile` for the target (ptxas, or
Triton's AMD backend), and each kernel's shared memory, threads and registers checked against
the target's limits. Runs in a subprocess: the kernels must be imported without TRITON_INTERPRET,
which tests/conftest.py sets for this process. It compiles with the installed Triton only (a jit
helper's `str` constexpr default compiled under 3.9 and failed under 3.6, which a GPU run showed).

CI compiles the "ci" scope (every table entry and backward path, bf16, the norms in fp32 too,
default options: ~150 specializations per target); `lmkernels compile-check --target all --scope
full` compiles every option set and dtype (~2,500 per target).
"""

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

from lmkernels.backends.triton.configs.targets import CHECKED, TARGETS  # noqa: E402
from lmkernels.harness.targets import compile_failures  # noqa: E402


def _env(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compiled here, not reused
    env["TRITON_DEFAULT_FP_FUSION"] = env.get("TRITON_DEFAULT_FP_FUSION", "1")
    return env


def _run_script(tmp_path, script, *args):
    """A compiling script in a subprocess (no interpreter); its last line of output, as JSON."""
    cmd = [sys.executable, "-c", script, *args]
    result = subprocess.run(cmd, env=_env(tmp_path), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """The compile check of every checked target, CI scope (one subprocess, 2 compiling workers)."""
    tmp = tmp_path_factory.mktemp("compile-check")
    out = tmp / "reports.json"
    cmd = [
        sys.executable,
        "-m",
        "lmkernels",
        "compile-check",
        "--target",
        "all",
        "--jobs",
        "2",
        "--json",
        str(out),
    ]
    result = subprocess.run(cmd, env=_env(tmp), capture_output=True, text=True, timeout=1500)
    log = result.stdout + result.stderr[-3000:]
    assert out.exists(), log[-9000:]
    return {r["target"]: r for r in json.loads(out.read_text())}, log


KERNELS = {
    "_norm_fwd_kernel", "_norm_bwd_kernel", "_norm_col_kernel", "_sum_partials_kernel", "_rope_kernel",
    "_rope_tile_kernel", "_glu_fwd_kernel", "_glu_bwd_kernel", "_flce_rows_kernel", "_scale_kernel",
    "_distill_rows_kernel",
}  # fmt: skip


OP_KERNELS = {"rope": {"_rope_kernel", "_rope_tile_kernel"}}


@pytest.mark.parametrize("name", CHECKED)
def test_every_launch_compiles_within_the_targets_limits(reports, name):
    by_target, log = reports
    if name not in by_target:
        reason = next(
            (line for line in log.splitlines() if line.startswith(f"{name}: not checked")), log[-500:]
        )
        pytest.skip(reason)  # e.g. Triton's AMD backend missing: said, not hidden
    report = by_target[name]
    assert not report["case_errors"], report["case_errors"]
    bad = [r for r in report["results"] if not r["ok"]]
    assert not bad, "\n".join(
        f"{r['kernel']} [{r['config']}] ({r['origin']}): {r['error'] or r['problems']}" for r in bad
    )
    results = report["results"]
    # Every kernel of every op reached, but those of an op the installed Triton cannot compile
    # for the target (said in the log: test_what_the_installed_triton_cannot_compile_is_said).
    unchecked = set().union(*(OP_KERNELS[op] for op in compile_failures(TARGETS[name])))
    assert {r["kernel"] for r in results} == KERNELS - unchecked
    assert len(results) >= 100
    t = TARGETS[name]
    assert max(r["shared"] for r in results) <= t.shared_per_block
    assert all(r["registers"] and r["threads"] <= t.max_threads_per_block for r in results)
    # PDL where the target has it, and only there (each such kernel waits first: checked above).
    assert any(r["pdl"] for r in results) == t.sm90_ptx
    # The tables each target launches from: Hopper's measured ones on sm_90 only.
    assert report["tables"] == ("hopper" if name == "sm_90" else f"generic {name}")


def test_what_the_installed_triton_cannot_compile_is_said(reports):
    """An op the installed Triton is known to fail on for a target (Triton < 3.8 on AMD: the RoPE
    kernel) is named in the check's output and refused by the op there; from 3.8 on, AMD's RoPE
    launches are compiled like any other."""
    from lmkernels.backends.triton.rope import amd_compile_failure

    assert amd_compile_failure("3.7.1") and amd_compile_failure("3.6.0+rocm7.1")
    assert amd_compile_failure("3.8.0") is None and amd_compile_failure("3.9.0") is None
    by_target, log = reports
    if "gfx942" not in by_target:
        pytest.skip("Triton's AMD backend is not installed")
    kernels = {r["kernel"] for r in by_target["gfx942"]["results"]}
    if amd_compile_failure(triton.__version__):
        assert f"gfx942: rope not checked: {amd_compile_failure(triton.__version__)}" in log
        assert not kernels & OP_KERNELS["rope"]
    else:
        assert OP_KERNELS["rope"] <= kernels


_PATHS_SCRIPT = r"""
import json, sys
import torch
import lmkernels
from lmkernels.backends import load_builtin
from lmkernels.backends.triton import norms
from lmkernels.backends.triton.configs import targets, tables_for
from lmkernels.harness.targets import _worker_init, compile_launch, recording

load_builtin()
_worker_init()
t = targets.TARGETS["sm_90"]
torch.manual_seed(0)
M, N = 41, 100
x, dy = torch.randn(M, N, dtype=torch.bfloat16), torch.randn(M, N, dtype=torch.bfloat16)
w, stats = torch.randn(N, dtype=torch.bfloat16), torch.ones(M)
launches = {}
with recording(t) as recorder:
    table = tables_for(x.device).norms
    for fields in json.loads(sys.argv[1]):
        for prefetch in (False, True):
            cfg = norms.BwdConfig(**fields, prefetch=prefetch and fields["path"] != norms.PATH_WIDE,
                                  column=table.column, sums=table.sums)
            norms.layer_norm_backward(dy, x, w, stats, stats, torch.bfloat16, cfg)
            norms.rms_norm_backward(dy, x, w, stats, 0.0, "llama", cfg)
    for launch in recorder.launches:
        launches.setdefault(launch.key, launch)
failed = []
for launch in launches.values():
    out = compile_launch(t.name, launch)
    if out.get("error") or out.get("pdl") is False:
        failed.append(f"{launch.name} [{launch.describe()}]: {out.get('error') or 'no griddepcontrol.wait'}")
print(json.dumps({"compiled": len(launches), "failed": failed}))
"""


def test_interpreter_checked_backward_paths_compile_for_sm90(tmp_path):
    """The backward configurations of tests/test_triton_norms.py's path tests (whose values the
    interpreter checks, beyond what the tables select) compile for sm_90, with PDL and the L2
    prefetch as the launchers launch there."""
    pytest.importorskip("triton.backends.nvidia", reason="Triton's NVIDIA backend (ptxas) is not installed")
    from test_triton_norms import _PATHS, bwd_fields

    configs = [bwd_fields(name) for name in _PATHS]
    out = _run_script(tmp_path, _PATHS_SCRIPT, json.dumps(configs))
    assert not out["failed"], out["failed"]
    assert out["compiled"] >= 2 * len(configs)


_SCALED_LOGITS_SCRIPT = r"""
import json
import torch
from lmkernels.backends import load_builtin
from lmkernels.backends.triton.configs import targets
from lmkernels.harness.targets import Case, _worker_init, _kernel, recording, run_case
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

load_builtin()
_worker_init()
t = targets.TARGETS["sm_90"]
out = {}
for name, options in (("plain", ()), ("softcap", (("softcap", 30.0),)), ("temperature", (("temperature", 0.7),))):
    case = Case("fused_linear_cross_entropy", "triton", torch.float32, (1, 1, 1),
                options + (("z_loss_scale", 1e-4),))
    with recording(t) as recorder:
        run_case(case)
    fused = []
    for launch in recorder.launches:
        if launch.name == "_flce_rows_kernel":
            src = ASTSource(_kernel(launch.kernel), launch.signature, launch.constexprs, launch.attrs)
            target = GPUTarget(t.backend, t.arch, t.warp_size)
            compiled = triton.compile(src, target=target, options=launch.options)
            fused.append(compiled.asm["ptx"].count("fma.rn.f32"))
    out[name] = fused
print(json.dumps(out))
"""


def test_scaled_logits_are_rounded_once_for_every_use(tmp_path):
    """With a softcap or a temperature, every launch of FLCE's row kernel compiles without fused
    multiply-adds: fused, the scaled logit's product goes unrounded into z - max and lse - z_t
    while the max keeps it rounded, and with one class (a loss that is the z-loss alone) the
    cross-entropy is not 0 (tests/property_regressions.py). Without either the launches keep
    their fused multiply-adds."""
    pytest.importorskip("triton.backends.nvidia", reason="Triton's NVIDIA backend (ptxas) is not installed")
    out = _run_script(tmp_path, _SCALED_LOGITS_SCRIPT)
    for name in ("softcap", "temperature"):
        assert out[name] and not any(out[name]), out
    assert out["plain"] and all(out["plain"]), out
