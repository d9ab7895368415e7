#!/usr/bin/env python3
"""Registers, spills and instructions of the norm backward and RoPE kernels for Hopper (sm_90),
without a GPU.

Compiles each candidate configuration of the RMSNorm / LayerNorm backward with the installed
Triton for target cuda:90 and reads the cubin (cuobjdump): registers per thread, stack bytes
(spills), and for the norms the instructions of the loop over row tiles (the SASS between the
loop's backward branch and its target), per element of a row: loop instructions x threads /
(rows x columns). That is what a warp scheduler issues per element when the loop runs; "fits"
says whether the registers let programs_per_sm programs share an SM (65536 registers). The
Triton on the GPU machine may compile differently; this prunes candidates before a GPU run.

Usage: python3 scripts/roofline_ptxas.py [--ops rms_norm,layer_norm,rope] [--n 5120,11008,16384]
  [--family issue|hold|prefetch]  (the table and that family of roofline_tune.py instead of the
  candidates added since the pipelining run)
  (rope: the tile kernel's candidates and the position kernel's table at the --grid rope points)
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


def usage(kernel, signature, constexprs, num_warps, aligned=()):
    """(registers, stack bytes, instructions of the longest loop) of the kernel's cubin.
    aligned: arguments that the launch specializes as multiples of 16 (pointers, strides).
    Constexprs not given take their defaults (PREFETCH, PDL: off)."""
    defaults = {p.name: p.default for p in kernel.params if p.is_constexpr and p.name not in constexprs}
    constexprs = dict(constexprs, **defaults)
    sig = {p.name: "constexpr" if p.name in constexprs else signature[p.name] for p in kernel.params}
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    compiled = triton.compile(
        ASTSource(kernel, sig, constexprs, attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps},
    )
    from triton.backends.nvidia import compiler

    tool = os.path.join(os.path.dirname(compiler.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    regs = int(re.search(r"REG:(\d+)", out).group(1))
    stack = int(re.search(r"STACK:(\d+)", out).group(1))
    return regs, stack, loop_instructions(sass)


def loop_instructions(sass):
    """Instructions of the longest loop in a SASS listing: from a backward branch's target to
    the branch."""
    addrs = [int(m.group(1), 16) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+\S", sass)]
    longest = 0
    for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+[^;]*\bBRA\b[^;]*?(0x[0-9a-f]+)\s*;", sass):
        branch, target = int(m.group(1), 16), int(m.group(2), 16)
        if target < branch:
            longest = max(longest, sum(1 for a in addrs if target <= a <= branch))
    return longest


def bwd_usage(op, cfg, N=0):
    from lmkernels.backends.triton import _norms, layer_norm, rms_norm

    reload_w = cfg.reload_w or cfg.path == _norms.PATH_MEM
    common = dict(
        ROWS=cfg.rows,
        BLOCK=cfg.block,
        TAIL=cfg.tail,
        PATH=cfg.path,
        RELOAD_W=reload_w,
        NUM_STAGES=cfg.stages,
        SOFT_BF16=False,
        N_CONST=N if cfg.const_n else 0,
        RELOAD_X=cfg.reload_x and not cfg.hold_x,  # bf16 (PTRS): hold_x replaces reload_x
        HOLD_X=cfg.hold_x,
    )
    if op == "layer_norm":
        common["FMA"] = cfg.fma
    if op == "rms_norm":
        const = dict(MODE=0, HAS_WEIGHT=True, ACC=cfg.apart == _norms.APART_NONE, **common)
        kernel = rms_norm._rms_norm_bwd_kernel
    else:
        acc_dw, acc_db = cfg.apart != _norms.APART_ALL, cfg.apart == _norms.APART_NONE
        const = dict(HAS_WEIGHT=True, ACC_DW=acc_dw, ACC_DB=acc_db, **common)
        kernel = layer_norm._layer_norm_bwd_kernel
    # The launch specializes pointers and N as multiples of 16 at every grid point (all its
    # widths are): without that the loads are not vectorized and the counts are far too high.
    aligned = [n for n, t in PTRS[op].items() if t.startswith("*")] + ["N"]
    return usage(kernel, PTRS[op], const, cfg.num_warps, aligned)


def rope_usage(kernel_name, D, R, backward, constexprs, num_warps):
    from lmkernels.backends.triton import rope

    ptrs = ["q_ptr", "k_ptr", "q_out_ptr", "k_out_ptr", "cos_ptr", "sin_ptr", "pos_ptr"]
    kernel = getattr(rope, kernel_name)
    names = kernel.arg_names
    constexprs_all = {p.name for p in kernel.params if p.is_constexpr}
    sig = {n: "*bf16" if n in ptrs else "i32" for n in names if n not in constexprs_all}
    rest = D - R
    const = dict(
        BLOCK_HALF=1 << (R // 2 - 1).bit_length(), BLOCK_REST=1 << (rest - 1).bit_length() if rest else 1,
        INTERLEAVED=False, HAS_POS=False, HAS_REST=rest > 0, BACKWARD=backward, head_dim=D, half=R // 2,
        **constexprs,
    )  # fmt: skip
    # Arguments in the kernel's order (the constexprs among them). At the --grid rope points
    # (contiguous bf16 q, k; a (T, R) table) pointers, strides, T, D and R / 2 are multiples of 16.
    sig = {n: sig.get(n, "constexpr") for n in names}
    aligned = [n for n in sig if n in ptrs or n.startswith("stride") or n in ("T", "head_dim")]
    aligned += ["half"] if R % 32 == 0 else []
    return usage(kernel, sig, const, num_warps, aligned)


def rope_main():
    from roofline_candidates import ROPE_GRID
    from roofline_rope import TILE_CANDIDATES

    from lmkernels.backends.triton import rope

    print(f"{'D':>4} {'R':>4}  {'variant':<34} {'regs':>4} {'stack':>6}")
    for D, R in sorted({(s[4], s[5] or s[4]) for s in ROPE_GRID["rope"]}):
        block_h, _, _, _, warps = rope._launch_config(1 << 20, 32, 8, R, D)
        variants = [("pos table", "_rope_kernel", dict(BLOCK_H=block_h), warps)]
        for e, w, once in dict.fromkeys((e, w, once) for e, w, _, once, _ in TILE_CANDIDATES):
            block_t = max(1, e // (1 << (D - 1).bit_length()))
            name = f"2d e{e} w{w} {'once' if once else 'reload'}"
            variants.append((name, "_rope_tile_kernel", dict(BLOCK_T=block_t, TABLES_ONCE=once), w))
        for name, kernel, const, w in variants:
            try:
                regs, stack, _ = rope_usage(kernel, D, R, True, const, w)
                print(f"{D:>4} {R:>4}  {name:<34} {regs:>4} {stack:>6}", flush=True)
            except Exception as e:  # noqa: BLE001 (reported, the others go on)
                print(f"{D:>4} {R:>4}  {name:<34} error {type(e).__name__}: {str(e)[:100]}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default="rms_norm,layer_norm")
    ap.add_argument("--n", default="5120,11008,16384")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from roofline_candidates import BWD_FAMILIES, bwd_name, norm_bwd_candidates

    ap.add_argument("--family", choices=list(BWD_FAMILIES))
    args = ap.parse_args(argv)

    def candidates(N, op):
        if args.family:
            return BWD_FAMILIES[args.family][0](N, op)
        return norm_bwd_candidates(N, op, new_only=True)

    ops = args.ops.split(",")
    if "rope" in ops:
        rope_main()
        ops.remove("rope")

    print(f"{'op':<10} {'N':>6}  {'variant':<44} {'regs':>4} {'stack':>6} {'loop':>5} {'/elem':>5}")
    for op in ops:
        for N in map(int, args.n.split(",")):
            from lmkernels.backends.triton import _norms

            table = _norms.bwd_config(op, N)
            for cfg in [table] + candidates(N, op):
                try:
                    regs, stack, loop = bwd_usage(op, cfg, N)
                    name = "table: " + bwd_name(cfg) if cfg is table else bwd_name(cfg)
                    per_elem = loop * 32 * cfg.num_warps / (cfg.rows * N)
                    fits = regs * 32 * cfg.num_warps * cfg.programs_per_sm <= 65536
                    print(f"{op:<10} {N:>6}  {name:<44} {regs:>4} {stack:>6} {loop:>5} {per_elem:>5.1f}"
                          + ("" if fits else "  (does not fit)"), flush=True)  # fmt: skip
                except Exception as e:  # noqa: BLE001 (reported, the others go on)
                    print(f"{op:<10} {N:>6}  {bwd_name(cfg):<44} error {type(e).__name__}: {str(e)[:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
