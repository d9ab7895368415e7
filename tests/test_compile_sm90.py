"""The norm kernels compile for Hopper (sm_90) along every backward path, without a GPU.

The CPU interpreter runs a kernel's Python, not Triton's compiler, so a kernel that the
compiler rejects passes every interpreter test. Here each
launcher runs on CPU tensors with its kernels replaced by recorders; every launch it makes is
then compiled by `triton.compile` for sm_90 (to a cubin, ptxas included), with the arguments
and constexprs that the launcher passed. Runs in a subprocess: the kernels must be imported
without TRITON_INTERPRET, which tests/conftest.py sets for this process. This compiles with
the installed Triton only: a jit helper's `str` default for a constexpr compiles under 3.9 (CI)
and failed under 3.6 (the GPU image), which only a GPU run showed.
"""

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

_SCRIPT = r"""
import json, sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lmkernels.backends.triton import norms
from lmkernels.backends.triton.configs import tables_for

DTYPES = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.float16: "*fp16"}


class Recorder:
    def __init__(self, kernel, launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.kernel, args, kwargs))


def signature(kernel, args, kwargs):
    kwargs = dict(kwargs, SOFT_BF16=False)  # the GPU rounds in hardware
    options = {"num_warps": kwargs.pop("num_warps", 4)}
    sig, constexprs = {}, {}
    params = iter(args)
    for p in kernel.params:
        if p.is_constexpr:
            constexprs[p.name] = kwargs[p.name] if p.name in kwargs else p.default
            sig[p.name] = "constexpr"
            continue
        a = next(params)
        if a is None:  # a parameter the norm does not have: a constexpr, as Triton makes it
            constexprs[p.name] = None
            sig[p.name] = "constexpr"
        elif isinstance(a, torch.Tensor):
            sig[p.name] = DTYPES[a.dtype]
        elif isinstance(a, bool):
            sig[p.name] = "i1"
        elif isinstance(a, int):
            sig[p.name] = "i32"
        else:
            sig[p.name] = "fp32"
    return sig, constexprs, options


KERNELS = {norms: ["_norm_bwd_kernel", "_norm_col_kernel", "_sum_partials_kernel"]}


def launches(run):
    out = []
    saved = {(m, n): getattr(m, n) for m, names in KERNELS.items() for n in names}
    for (m, n), kernel in saved.items():
        setattr(m, n, Recorder(kernel, out))
    try:
        run()
    finally:
        for (m, n), kernel in saved.items():
            setattr(m, n, kernel)
    return out


def main(configs):
    torch.manual_seed(0)
    M, N = 41, 100
    x, dy = torch.randn(M, N, dtype=torch.bfloat16), torch.randn(M, N, dtype=torch.bfloat16)
    w = torch.randn(N, dtype=torch.bfloat16)
    stats = torch.ones(M)
    table = tables_for(x.device).norms
    seen, compiled = set(), 0
    for fields in configs:
        cfg = norms.BwdConfig(**fields, column=table.column, sums=table.sums)
        recorded = launches(lambda: norms.layer_norm_backward(dy, x, w, stats, stats, torch.bfloat16, cfg))
        recorded += launches(lambda: norms.rms_norm_backward(dy, x, w, stats, 0.0, "llama", cfg))
        for kernel, args, kwargs in recorded:
            # On sm_90 the launchers add PDL (programmatic dependent launch) to every launch:
            # compiled that way here.
            variants = [dict(kwargs, PDL=True)]
            if "PREFETCH" in kwargs and kwargs["PATH"] != norms.PATH_WIDE:
                # The launcher prefetches on CUDA devices only (PTX): that path is compiled here.
                variants.append(dict(kwargs, PREFETCH=True, PDL=True))
            for kw in variants:
                sig, constexprs, options = signature(kernel, args, kw)
                key = (kernel.__name__, json.dumps(sig, sort_keys=True), json.dumps(constexprs, sort_keys=True))
                if key in seen:
                    continue
                seen.add(key)
                try:
                    binary = triton.compile(ASTSource(kernel, sig, constexprs), target=GPUTarget("cuda", 90, 32),
                                            options=options)
                except Exception as e:
                    print(f"FAILED {kernel.__name__} {cfg} {kw.get('PREFETCH')}: {type(e).__name__}: {str(e)[:2000]}")
                    sys.exit(1)
                if "griddepcontrol.wait" not in binary.asm["ptx"]:
                    print(f"FAILED {kernel.__name__} {cfg}: PDL=True compiled without griddepcontrol.wait")
                    sys.exit(1)
                compiled += 1
    print(f"compiled {compiled}")


main(json.loads(sys.argv[1]))
"""


def _configs():
    """The backward configurations of tests/test_triton_norms.py's path tests, whose values the
    interpreter checks: here the same launches must compile."""
    from test_triton_norms import _PATHS, bwd_fields

    return [bwd_fields(name) for name in _PATHS]


def test_norm_backward_paths_compile_for_sm90(tmp_path):
    """Every backward path of both norms (the launches of their launchers, column kernels
    included) compiles for sm_90, with PDL as the launchers launch there."""
    pytest.importorskip("triton.backends.nvidia", reason="Triton's NVIDIA backend (ptxas) is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compiled here, not reused
    configs = _configs()
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(configs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # At least each configuration's two backward kernels (column and partial-sum kernels besides).
    assert int(result.stdout.split("compiled")[-1]) >= 2 * len(configs), result.stdout[-3000:]
