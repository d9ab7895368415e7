"""FLCE on one GPU: lmkernels' lean and fast modes against torch.compile of the naive loss, Cut
Cross-Entropy and Liger, GPU time (launch queue filled ahead) and peak memory above the inputs,
plus the lean mode's memory budget swept at the design shape.

    python scripts/flce_modes_gpu.py --out DIR [--quick]

Writes DIR/flce_modes.json and DIR/flce_modes.md (device, versions, command) and prints the table.
Peers run as their users run them: CCE's default call (its own filter_eps default), Liger's
default FusedLinearCrossEntropyLoss. Inputs: the FLCE OpSpec's make_inputs (Gaussian logits,
std ~2, 10% ignored targets) unless the OpSpec offers `regime` (then each regime is run).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import lmkernels as lk
from lmkernels.backends.triton import _flce_kernels as kernels
from lmkernels.ops.flce import SPEC

SHAPES = [
    (8192, 4096, 128256),  # the design shape (Llama-3-8B head)
    (1024, 4096, 128256),
    (4096, 2048, 128256),
    (16384, 4096, 128256),
    (32768, 2560, 151936),
    (8192, 3584, 256000),
    (8192, 8192, 32000),
    (65536, 2048, 32000),
]
QUICK_SHAPES = SHAPES[:3]


def sync():
    torch.cuda.synchronize()


def gpu_ms(fn, reps: int) -> tuple[float, float]:
    """(GPU time, wall time) medians in ms. GPU time: a sleep kernel fills the queue ahead so
    the events time the device, not the host's launch latency."""
    fn()
    sync()
    gpu, wall = [], []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(40_000_000)  # ~20 ms of device time queued before the start event
        start.record()
        fn()
        end.record()
        sync()
        gpu.append(start.elapsed_time(end))
        t0 = time.perf_counter()
        fn()
        sync()
        wall.append((time.perf_counter() - t0) * 1e3)
    gpu.sort()
    wall.sort()
    return gpu[len(gpu) // 2], wall[len(wall) // 2]


def peak_mib(fn) -> float:
    sync()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    sync()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def make_step(name, inputs):
    x = inputs["hidden"].detach().requires_grad_(True)
    w = inputs["weight"].detach().requires_grad_(True)
    y = inputs["target"]
    softcap = inputs.get("softcap")

    def clear():
        x.grad = w.grad = None

    if name.startswith("lmk"):
        _, mode, accum = name.split(":")
        accum_dtype = None if accum == "fp32acc" else x.dtype

        backend = {"lean": "triton_lean", "fast": "triton"}[mode]

        def step():
            clear()
            loss = lk.fused_linear_cross_entropy(
                x, w, y, softcap=softcap, grad_accum_dtype=accum_dtype, backend=backend
            )
            loss.backward()

    elif name == "compile_naive":

        def naive(x, w, y):
            logits = (x @ w.T).float()
            if softcap is not None:
                logits = softcap * torch.tanh(logits / softcap)
            return F.cross_entropy(logits, y, ignore_index=-100)

        compiled = torch.compile(naive)

        def step():
            clear()
            compiled(x, w, y).backward()

    elif name.startswith("cce"):
        from cut_cross_entropy import linear_cross_entropy

        kwargs = {} if name == "cce" else {"filter_eps": None}

        def step():
            clear()
            linear_cross_entropy(x, w, y, softcap=softcap, **kwargs).backward()

    elif name == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        loss_fn = LigerFusedLinearCrossEntropyLoss(softcap=softcap)

        def step():
            clear()
            loss_fn(w, x, y).backward()

    else:
        raise ValueError(name)
    return step, clear


def versions():
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("triton", "transformers", "liger_kernel", "cut_cross_entropy"):
        try:
            m = __import__(mod)
            out[mod] = getattr(m, "__version__", "?")
        except Exception as e:  # noqa: BLE001
            out[mod] = f"missing ({type(e).__name__})"
    try:
        from importlib.metadata import version

        out["liger_kernel"] = version("liger-kernel")
        out["cut_cross_entropy"] = version("cut-cross-entropy")
    except Exception:  # noqa: BLE001
        pass
    return out


def ceilings():
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms, _ = gpu_ms(lambda: dst.copy_(src), 10)
    copy_tbs = 2 * n / ms / 1e9
    m = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms, _ = gpu_ms(lambda: m @ m, 10)
    mm_tflops = 2 * 8192**3 / ms / 1e9
    return copy_tbs, mm_tflops


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    copy_tbs, mm_tflops = ceilings()
    print(f"device {torch.cuda.get_device_name()}: copy {copy_tbs:.2f} TB/s, bf16 mm {mm_tflops:.0f} TFLOP/s")
    regimes = [None]
    if "regime" in inspect.signature(SPEC.make_inputs).parameters:
        regimes = ["uniform", "gaussian", "zipf"]
    names = ["lmk:lean:bf16acc", "lmk:lean:fp32acc", "lmk:fast:bf16acc", "lmk:fast:fp32acc", "compile_naive"]
    for peer in ("cce", "cce_exact", "liger"):
        try:
            __import__(
                {"cce": "cut_cross_entropy", "cce_exact": "cut_cross_entropy", "liger": "liger_kernel"}[peer]
            )
            names.append(peer)
        except ImportError as e:
            print(f"{peer}: not installed ({e})")
    rows = []
    shapes = QUICK_SHAPES if args.quick else SHAPES
    for BT, H, V in shapes:
        for softcap in (None, 30.0) if (BT, H, V) == SHAPES[0] else (None,):
            for regime in regimes:
                opts = {"ignore_fraction": 0.05}
                if regime is not None:
                    opts["regime"] = regime
                if softcap is not None:
                    opts["softcap"] = softcap
                inputs = SPEC.make_inputs({"BT": BT, "H": H, "V": V}, torch.bfloat16, "cuda", 0, **opts)
                for name in names:
                    row = {
                        "BT": BT,
                        "H": H,
                        "V": V,
                        "softcap": softcap,
                        "regime": regime or "gaussian",
                        "impl": name,
                    }
                    try:
                        step, clear = make_step(name, inputs)
                        step()
                        clear()
                        row["peak_mib"] = peak_mib(step)
                        clear()
                        row["gpu_ms"], row["wall_ms"] = gpu_ms(step, args.reps)
                        clear()
                        row["tflops"] = 6 * BT * H * V / row["gpu_ms"] / 1e9
                    except Exception as e:  # noqa: BLE001 (OOM or a peer's refusal: recorded)
                        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                    torch.cuda.empty_cache()
                    rows.append(row)
                    msg = (
                        row.get("error")
                        or f"{row['gpu_ms']:8.2f} ms gpu {row['wall_ms']:8.2f} wall {row['peak_mib']:8.0f} MiB"
                    )
                    print(
                        f"BT={BT:6d} H={H} V={V:6d} sc={softcap} {row['regime']:8s} {name:18s} {msg}",
                        flush=True,
                    )
                del inputs
                torch.cuda.empty_cache()
    # Lean budget sweep at the design shape (bf16 accumulation).
    sweep = []
    BT, H, V = SHAPES[0]
    inputs = SPEC.make_inputs({"BT": BT, "H": H, "V": V}, torch.bfloat16, "cuda", 0, ignore_fraction=0.05)
    for frac in (0.02, 0.04, 0.08, 0.16, 0.32, 0.64):
        kernels.LEAN_EXTRA_FRACTION = frac
        step, clear = make_step("lmk:lean:bf16acc", inputs)
        step()
        clear()
        r = {
            "fraction": frac,
            "blocks": kernels.flce_blocks(BT, H, V, kernels.lean_budget_bytes(BT, H, V, 2), False, True),
        }
        r["peak_mib"] = peak_mib(step)
        clear()
        r["gpu_ms"], r["wall_ms"] = gpu_ms(step, args.reps)
        clear()
        sweep.append(r)
        print(
            f"lean fraction {frac}: blocks {r['blocks']} {r['gpu_ms']:.2f} ms {r['peak_mib']:.0f} MiB",
            flush=True,
        )
    kernels.LEAN_EXTRA_FRACTION = 0.08
    meta = {
        "device": torch.cuda.get_device_name(),
        "versions": versions(),
        "copy_TBps": copy_tbs,
        "bf16_mm_TFLOPs": mm_tflops,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "env": {k: v for k, v in os.environ.items() if k.startswith("LMKERNELS_")},
    }
    (out / "flce_modes.json").write_text(
        json.dumps({"meta": meta, "rows": rows, "lean_sweep": sweep}, indent=1)
    )
    lines = [f"# FLCE modes vs peers ({meta['device']}, {meta['date']})", "", f"`{meta['command']}`", ""]
    lines.append(f"versions: {meta['versions']}; copy {copy_tbs:.2f} TB/s, bf16 mm {mm_tflops:.0f} TFLOP/s")
    lines += [
        "",
        "| BT | H | V | softcap | regime | impl | GPU ms | wall ms | peak MiB | x compile | x CCE mem |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        key = (r["BT"], r["H"], r["V"], r["softcap"], r["regime"])
        same = {x["impl"]: x for x in rows if (x["BT"], x["H"], x["V"], x["softcap"], x["regime"]) == key}
        if "error" in r:
            lines.append(
                f"| {r['BT']} | {r['H']} | {r['V']} | {r['softcap']} | {r['regime']} | {r['impl']} | {r['error']} | | | | |"
            )
            continue
        comp = same.get("compile_naive", {}).get("gpu_ms")
        cce = same.get("cce", {}).get("peak_mib")
        xc = f"{r['gpu_ms'] / comp:.2f}" if comp else ""
        xm = f"{r['peak_mib'] / cce:.2f}" if cce else ""
        lines.append(
            f"| {r['BT']} | {r['H']} | {r['V']} | {r['softcap']} | {r['regime']} | {r['impl']} | {r['gpu_ms']:.2f} | {r['wall_ms']:.2f} | {r['peak_mib']:.0f} | {xc} | {xm} |"
        )
    lines += [
        "",
        "lean budget sweep (design shape, bf16 accumulation):",
        "",
        "| fraction | blocks | GPU ms | peak MiB |",
        "|---|---|---|---|",
    ]
    lines += [f"| {r['fraction']} | {r['blocks']} | {r['gpu_ms']:.2f} | {r['peak_mib']:.0f} |" for r in sweep]
    (out / "flce_modes.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-40:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
