"""FLCE fast mode: GPU time and peak memory per token-chunk size, beside torch.compile of the
naive loss, and where the time goes (kernel-time breakdown of one call per variant).

    source scripts/gpu_env.sh; export TRITON_INTERPRET=0
    python3 scripts/flce_chunk_probe.py --out OUT            # one GPU, about 3 minutes

The fast mode's chunk size decides how often grad_W is read and rewritten (once per chunk, in
bf16) and how tall the GEMMs are; each chunk holds its fp32 logits (tokens x V x 4 bytes).
Variants: "default" (the table's policy), "chunk N" (N tokens per chunk, forced through
_flce_kernels.CHUNK_TOKENS; grad_W still summed in bf16 when there are at most 8 chunks) and
compile_naive. Bf16, Gaussian logits (ops/flce.make_inputs), forward + backward.
Writes OUT/results.json (rows) and OUT/profile.txt (the breakdowns).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from lmkernels.backends.triton import _flce_kernels as kernels
from lmkernels.harness.bench import FLCE, backend_fn, environment, measure, mode_fn, prepare_inputs
from lmkernels.harness.bench.measure import cleanup
from lmkernels.registry.core import get_op

# (BT, H, V): the Llama-3.2-1B head of the end-to-end benchmark at batch 8 and 32 first.
SHAPES = [
    (8192, 2048, 128256),
    (32768, 2048, 128256),
    (8192, 4096, 128256),
    (2048, 8192, 128256),
    (1024, 4096, 128256),
    (4096, 2560, 151936),
    (2048, 3584, 256000),
    (16384, 2048, 65536),
]
CHUNKS = (1024, 2048, 4096, 8192)


def variants(bt):
    out = [("default", "triton", None)]
    out += [(f"chunk {c}", "triton", c) for c in CHUNKS if c <= bt]
    return out + [("compile_naive", "compile_naive", None)]


def breakdown(fn, steps=3):
    """Kernel time per call by kernel family (ms)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    fams: dict[str, float] = {}
    for e in prof.key_averages():
        t = e.device_time_total / 1e3 / steps
        if t <= 0:
            continue
        name = e.key.lower()
        fam = (
            "gemm"
            if any(s in name for s in ("gemm", "sm90", "cutlass", "nvjet", "matmul"))
            else "flce rows"
            if "flce_rows" in name
            else "other"
        )
        fams[fam] = fams.get(fam, 0.0) + t
        fams[f"  {e.key[:70]}"] = t
    return fams


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", type=int, default=len(SHAPES), help="only the first N shapes")
    ap.add_argument("--profile-shapes", type=int, default=1, help="breakdown for the first N shapes")
    ap.add_argument("--variants", help="comma-separated subset: default, compile_naive, 'chunk N'")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    spec = get_op(FLCE)
    rows, prof_lines = [], []
    for i, (bt, h, v) in enumerate(SHAPES[: args.shapes]):
        made = spec.make_inputs({"BT": bt, "H": h, "V": v}, torch.bfloat16, "cuda", 0)
        flops = 6 * bt * h * v
        for name, backend, chunk in variants(bt):
            if args.variants and name not in args.variants.split(","):
                continue
            kernels.CHUNK_TOKENS = chunk
            inputs = prepare_inputs(spec, made, "cuda")
            row = measure(
                FLCE, backend, inputs, "full", warmup=5, rep=40, profile=False, min_runs=3, gpu_runs=5
            )
            row |= {"shape": f"{bt}x{h}x{v}", "variant": name, "tflops": flops / row["gpu_ms"] / 1e9}
            if i < args.profile_shapes and row["status"] == "ok":
                fams = breakdown(mode_fn(backend_fn(FLCE, backend, inputs), inputs, "full"))
                row["breakdown"] = {k: t for k, t in fams.items() if not k.startswith(" ")}
                prof_lines.append(f"## {bt}x{h}x{v} {name}")
                prof_lines += [f"{k:74s} {t:9.3f}" for k, t in sorted(fams.items(), key=lambda kv: -kv[1])]
            rows.append(row)
            print(
                f"{row['shape']:20s} {name:14s} {row['status']:4s} gpu {row['gpu_ms']:8.3f} ms "
                f"{row['tflops']:6.0f} TF/s  peak {row['peak_mib']:7.0f} MiB  "
                + " ".join(f"{k} {t:.2f}" for k, t in row.get("breakdown", {}).items()),
                flush=True,
            )
            del inputs
            cleanup("cuda")
        kernels.CHUNK_TOKENS = None
        del made
        cleanup("cuda")
    meta = environment() | {"command": " ".join(["python3", *sys.argv])}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
    with open(os.path.join(args.out, "profile.txt"), "w") as f:
        f.write("\n".join(prof_lines) + "\n")


if __name__ == "__main__":
    main()
