#!/usr/bin/env python3
"""Registers and spills of the norm backward kernels for Hopper (sm_90), without a GPU.

Compiles each candidate configuration of the RMSNorm / LayerNorm backward with the installed
Triton for target cuda:90 and reads the cubin's resource usage (cuobjdump): registers per
thread and stack bytes (spills). The Triton on the GPU machine may allocate differently; this
only prunes candidates that spill before a GPU run.

Usage: python3 scripts/roofline_ptxas.py [--ops rms_norm,layer_norm] [--n 5120,11008,16384]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

PTRS = {
    "rms_norm": {"dy_ptr": "*bf16", "x_ptr": "*bf16", "w_ptr": "*bf16", "rstd_ptr": "*fp32", "dx_ptr": "*bf16",
                 "dw_partial_ptr": "*fp32", "M": "i32", "N": "i32", "offset": "fp32"},
    "layer_norm": {"dy_ptr": "*bf16", "x_ptr": "*bf16", "w_ptr": "*bf16", "mean_ptr": "*fp32",
                   "rstd_ptr": "*fp32", "dx_ptr": "*bf16", "dw_partial_ptr": "*fp32",
                   "db_partial_ptr": "*fp32", "M": "i32", "N": "i32"},
}  # fmt: skip


def usage(kernel, signature, constexprs, num_warps):
    sig = dict(signature, **{k: "constexpr" for k in constexprs})
    compiled = triton.compile(
        ASTSource(kernel, sig, constexprs), target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}
    )
    from triton.backends.nvidia import compiler

    tool = os.path.join(os.path.dirname(compiler.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    regs = int(re.search(r"REG:(\d+)", out).group(1))
    stack = int(re.search(r"STACK:(\d+)", out).group(1))
    return regs, stack


def bwd_usage(op, cfg):
    from lmkernels.backends.triton import _norms, layer_norm, rms_norm

    reload_w = cfg.reload_w or cfg.path == _norms.PATH_MEM
    common = dict(
        ROWS=cfg.rows, BLOCK=cfg.block, TAIL=cfg.tail, PATH=cfg.path, RELOAD_W=reload_w, SOFT_BF16=False
    )
    if op == "rms_norm":
        const = dict(MODE=0, HAS_WEIGHT=True, ACC=cfg.apart == _norms.APART_NONE, **common)
        kernel = rms_norm._rms_norm_bwd_kernel
    else:
        acc_dw, acc_db = cfg.apart != _norms.APART_ALL, cfg.apart == _norms.APART_NONE
        const = dict(HAS_WEIGHT=True, ACC_DW=acc_dw, ACC_DB=acc_db, **common)
        kernel = layer_norm._layer_norm_bwd_kernel
    return usage(kernel, PTRS[op], const, cfg.num_warps)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default="rms_norm,layer_norm")
    ap.add_argument("--n", default="5120,11008,16384")
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from roofline_tune import bwd_name, norm_bwd_candidates

    print(f"{'op':<10} {'N':>6}  {'variant':<44} {'regs':>4} {'stack':>6}")
    for op in args.ops.split(","):
        for N in map(int, args.n.split(",")):
            from lmkernels.backends.triton import _norms

            table = _norms.bwd_config(op, N)
            for cfg in [table] + norm_bwd_candidates(N, op, new_only=True):
                try:
                    regs, stack = bwd_usage(op, cfg)
                    name = "table: " + bwd_name(cfg) if cfg is table else bwd_name(cfg)
                    print(f"{op:<10} {N:>6}  {name:<44} {regs:>4} {stack:>6}", flush=True)
                except Exception as e:  # noqa: BLE001 (reported, the others go on)
                    print(f"{op:<10} {N:>6}  {bwd_name(cfg):<44} error {type(e).__name__}: {str(e)[:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
