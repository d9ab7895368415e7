"""Where one training step of the e2e model spends its GPU time, per configuration (CUDA).

    python scripts/profile_e2e.py [--configs lmk,liger] [--model llama-1b] [--batch 16] [--seq 1024]

Builds the model of benchmarks/e2e_train.py (benchmarks/e2e_setup.py: the same presets,
configurations and training step) per configuration, each in a fresh process as the benchmark does, runs two warmup steps, profiles one step and prints the kernels with the most
device time, grouped into op families, so that two configurations can be compared line by line.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

# Kernel-name patterns -> family, first match wins (names of cuBLAS, flash attention, Triton
# kernels of lmkernels and Liger, inductor and ATen elementwise kernels).
FAMILIES = [
    ("gemm", r"gemm|cutlass|sm90_xmma|nvjet|cublas"),
    ("attention", r"flash|fmha|attention|sdpa"),
    ("flce", r"flce|cross_entropy|_cross_entropy|logsumexp"),
    ("rms_norm", r"rms"),
    ("rope", r"rope|rotary"),
    ("glu", r"glu|swiglu|silu"),
    ("optimizer", r"adam|multi_tensor"),
    ("copy/cast", r"copy|cast|convert|to_copy|cat|fill"),
    ("elementwise", r"elementwise|vectorized|reduce"),
]


def family(name: str) -> str:
    low = name.lower()
    for fam, pattern in FAMILIES:
        if re.search(pattern, low):
            return fam
    return "other"


def worker(config: str, model_name: str, batch: int, seq: int, top: int) -> dict:
    import torch

    import e2e_setup as setup

    model_cfg = setup.MODELS[model_name]
    model = setup.patch(setup.build_model(model_cfg, "cuda"), config)
    optimizer = setup.make_optimizer(model)
    compiled = setup.parse_config(config)[3]
    ids = setup.make_batch(model_cfg["vocab_size"], batch, seq, "cuda", dynamic=compiled)
    train_step = setup.train_step
    for _ in range(2):
        train_step(model, optimizer, ids)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        train_step(model, optimizer, ids)
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            kernels[evt.name] = kernels.get(evt.name, 0.0) + evt.device_time / 1e3
    families: dict[str, float] = {}
    for name, ms in kernels.items():
        families[family(name)] = families.get(family(name), 0.0) + ms
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1])[:top]
    return {
        "config": config,
        "model": model_name,
        "total_ms": sum(kernels.values()),
        "families": families,
        "top": ranked,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="lmk,liger")
    p.add_argument("--model", default="llama-1b", help="e2e_setup.MODELS preset (llama-1b, llama-1b-v256k)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.model, args.batch, args.seq, args.top)))
        return 0
    results = []
    for config in args.configs.split(","):
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            config,
            "--model",
            args.model,
            "--batch",
            str(args.batch),
            "--seq",
            str(args.seq),
        ]
        cmd += ["--top", str(args.top)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            print(f"{config}: failed\n{out.stderr[-3000:]}")
            continue
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    for r in results:
        print(
            f"\n== {r['config']} ({r['model']}): {r['total_ms']:.1f} ms of kernels in one step "
            f"(batch {args.batch}, seq {args.seq})"
        )
        for fam, ms in sorted(r["families"].items(), key=lambda kv: -kv[1]):
            print(f"  {fam:12s} {ms:8.2f} ms")
        for name, ms in r["top"]:
            print(f"    {ms:8.2f}  {name[:110]}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
