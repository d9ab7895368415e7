"""FLCE rows kernel: does a second read of each fp32 logits row come from L2 instead of HBM?

    source scripts/gpu_env.sh; export TRITON_INTERPRET=0
    python3 scripts/flce_rows_probe.py --out OUT          # one GPU, about 2 minutes

`_flce_rows_kernel` reads each row of fp32 logits twice (pass 1: logsumexp; pass 2: the
gradient, written in bf16 over the row). With one program per row, every SM streams several
500 KiB rows (V = 128k) at once: far more than the 50 MB L2 holds, so pass 2 reads HBM again
and the kernel moves 10 bytes a logit where 6 would do. Variants (_flce_kernels knobs):
- programs per SM (ROWS_PROGRAMS_PER_SM; None: one program per row): fewer rows in flight;
- warps and block (ROWS_WARPS, ROWS_BLOCK): enough loads in flight with few programs;
- reverse (ROWS_REVERSE_PASS1): pass 1 ends on the row's first block, where pass 2 starts.

Part 1 times the kernel alone (GPU time of one launch, logits restored and L2 flushed before
each) and checks every variant against the default's loss, logsumexp and gradients. Part 2
times the whole op (forward + backward, harness measure) at the end-to-end benchmark's heads.
Part 3 (--ab N, alone): the default and the reversed pass 1 taking turns on the whole op, N
rounds, paired. Writes OUT/rows.json and OUT/op.json (OUT/ab.json with --ab).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from lmkernels.backends.triton import _flce_kernels as kernels
from lmkernels.harness.bench import FLCE, environment, measure, prepare_inputs
from lmkernels.harness.bench.measure import cleanup
from lmkernels.registry.core import get_op

# (programs per SM, warps, block, reverse pass 1); the first is the library's default.
VARIANTS = [
    (None, 8, 4096, False),
    (None, 8, 4096, True),
    (1, 8, 4096, False),
    (1, 8, 4096, True),
    (1, 16, 8192, False),
    (1, 16, 8192, True),
    (2, 8, 4096, True),
    (2, 16, 4096, True),
    (1, 32, 8192, True),
]
ROW_SHAPES = [(1024, 128256), (2048, 128256), (4096, 128256), (2048, 256000), (8192, 32000)]
OP_SHAPES = [(8192, 2048, 128256), (32768, 2048, 128256), (8192, 4096, 128256)]


def set_variant(v) -> str:
    kernels.ROWS_PROGRAMS_PER_SM, kernels.ROWS_WARPS, kernels.ROWS_BLOCK, kernels.ROWS_REVERSE_PASS1 = v
    per_sm, warps, block, reverse = v
    return f"{'row' if per_sm is None else f'{per_sm}/SM'} w{warps} b{block}{' rev' if reverse else ''}"


def rows_case(n_rows: int, V: int, reps: int) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    src = torch.randn(n_rows, V, device="cuda", generator=g) * 2.0
    target = torch.randint(0, V, (n_rows,), device="cuda", generator=g)
    grad = torch.full((), 1.0 / n_rows, device="cuda")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    logits = torch.empty_like(src)
    rows = kernels.Rows(target, None, None, -100, 0.0, None, 0.0, V)
    out, ref = [], None
    for v in VARIANTS:
        name = set_variant(v)
        lse = torch.empty(n_rows, device="cuda")
        loss = torch.empty(n_rows, device="cuda")
        dlogits = kernels._dlogits_view(logits, torch.bfloat16)
        times = []
        for i in range(reps + 2):
            logits.copy_(src)
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            rows.launch(logits, dlogits, slice(0, n_rows), lse, loss, grad, 0, lse_given=False)
            end.record()
            torch.cuda.synchronize()
            if i >= 2:
                times.append(start.elapsed_time(end))
        got = (loss.clone(), lse.clone(), dlogits.float().clone())
        if ref is None:
            ref = got
        err = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for a, b in zip(got, ref))
        ms = sorted(times)[len(times) // 2]
        bytes_min = n_rows * V * (4 + 2)  # read fp32 once, write bf16
        row = {"rows": n_rows, "V": V, "variant": name, "ms": ms, "rel_err_vs_default": err}
        row["tb_s_at_6B"] = bytes_min / ms / 1e9
        out.append(row)
        print(
            f"{n_rows:6d} x {V:6d}  {name:22s} {ms:7.3f} ms  {row['tb_s_at_6B']:5.2f} TB/s(6B)  err {err:.1e}",
            flush=True,
        )
    set_variant(VARIANTS[0])
    return out


def op_case(bt: int, h: int, v: int, variants) -> list[dict]:
    spec = get_op(FLCE)
    made = spec.make_inputs({"BT": bt, "H": h, "V": v}, torch.bfloat16, "cuda", 0)
    out = []
    for var in variants:
        name = set_variant(var)
        inputs = prepare_inputs(spec, made, "cuda")
        row = measure(FLCE, "triton", inputs, "full", warmup=5, rep=30, profile=False, min_runs=3, gpu_runs=5)
        row |= {"shape": f"{bt}x{h}x{v}", "variant": name}
        out.append(row)
        print(
            f"{row['shape']:20s} {name:22s} gpu {row['gpu_ms']:8.3f} ms  peak {row['peak_mib']:7.0f} MiB",
            flush=True,
        )
        del inputs
        cleanup("cuda")
    set_variant(VARIANTS[0])
    return out


def op_ab(bt: int, h: int, v: int, a, b, rounds: int) -> dict:
    """The whole op with variants a and b taking turns, `rounds` times: paired ratios a / b."""
    spec = get_op(FLCE)
    made = spec.make_inputs({"BT": bt, "H": h, "V": v}, torch.bfloat16, "cuda", 0)
    inputs = prepare_inputs(spec, made, "cuda")
    ms: dict[str, list[float]] = {}
    for r in range(rounds):
        for var in (a, b) if r % 2 == 0 else (b, a):
            name = set_variant(var)
            row = measure(
                FLCE, "triton", inputs, "full", warmup=3, rep=20, profile=False, min_runs=3, gpu_runs=3
            )
            ms.setdefault(name, []).append(row["gpu_ms"])
    set_variant(VARIANTS[0])
    (na, ta), (nb, tb) = ms.items()
    ratios = sorted(x / y for x, y in zip(ta, tb))
    out = {"shape": f"{bt}x{h}x{v}", "a": na, "b": nb, "a_ms": ta, "b_ms": tb, "a_over_b": ratios}
    print(
        f"{out['shape']:20s} {na} / {nb}: median {ratios[len(ratios) // 2]:.4f} "
        f"[{ratios[0]:.4f}-{ratios[-1]:.4f}], b faster in {sum(x > 1 for x in ratios)}/{rounds}",
        flush=True,
    )
    del inputs, made
    cleanup("cuda")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--op-variants", default="0,1,3,5", help="indices into VARIANTS for part 2")
    ap.add_argument("--ab", type=int, default=0, help="only part 3: the default against reverse, N rounds")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    meta = environment() | {"command": " ".join(["python3", *sys.argv])}
    if args.ab:
        ab = [op_ab(*shape, VARIANTS[0], VARIANTS[1], args.ab) for shape in OP_SHAPES]
        with open(os.path.join(args.out, "ab.json"), "w") as f:
            json.dump({"meta": meta, "rows": ab}, f, indent=1)
        return
    rows = [r for n, v in ROW_SHAPES for r in rows_case(n, v, args.reps)]
    with open(os.path.join(args.out, "rows.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    chosen = [VARIANTS[int(i)] for i in args.op_variants.split(",")]
    ops = [r for shape in OP_SHAPES for r in op_case(*shape, chosen)]
    with open(os.path.join(args.out, "op.json"), "w") as f:
        json.dump({"meta": meta, "rows": ops}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
