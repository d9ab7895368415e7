"""Host overhead per op on a GPU: GPU time vs wall time, ours vs the peers (issue 13 item 2).

For each op at the design shapes (and the Llama-3.2-1B batch-1 shapes, the host-bound regime),
forward + backward in bf16, per backend:
- gpu_ms: device time of one step, the sum of its kernels (torch.profiler, CUDA activity);
- wall_ms: triton.testing.do_bench median (host included: when launching a step takes longer
  than running it, wall > gpu);
- host_ms: host time to issue one step with the GPU never waiting (perf_counter around a block
  of calls while a torch.cuda._sleep keeps the queue full); the best of --host-blocks blocks,
  the backends of an op taking turns block by block, so that the host's drift during the run
  (the same code measured 0.27 and 0.47 ms in one earlier run) falls on all of them alike;
  host_ms_median: the median of those blocks (the best flatters a noisy host);
- with --wall-repeats R: wall_ms is the median of R do_bench runs, the backends taking turns.
Ours runs through the public function (`lk.rms_norm(..., backend="triton")`, dispatch included,
what a user pays); the peers through their own functions (the registered adapters, no dispatch).
Targets: wall <= 1.1x gpu at the design shapes; host time per op <= Liger's.
Backend "triton-no-cache": ours with the launch cache off (backends/triton/_launch.py: every
launch through Triton's own binding), an A/B within the run. A backend name ending in "-1thread"
(e.g. triton-1thread, liger-1thread): the same with the backward on the calling thread
(torch.autograd.set_multithreading_enabled(False)); its host ratio is against liger-1thread.
Backend "torch-native" (norms only): torch.nn.functional.rms_norm / layer_norm, torch's fused
CUDA kernels with a C++ backward: the host cost of an op with no Python in it, for scale.
LMKERNELS_CHECK_VALUES=0 (the production setting): FLCE's target range check syncs with the
host on every call, which would stall the launch queue this script measures.

    python scripts/host_overhead.py --out benchmarks/results/host-overhead
    python scripts/host_overhead.py --op rms_norm --op rope --shapes small --out /tmp/ho

--chain K: each step calls the op K times in a row (each call's outputs feeding the next, see
CHAINED) and runs one backward through all of them, as a model does; the times are per op
(divided by K). One backward per op charges the autograd engine's fixed cost per backward
call (plain torch's x * w forward + backward: 99-127 us on the H200 hosts) to every op.

Writes host_overhead.json and host_overhead.md (device, versions, command) to --out.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import lmkernels as lk
from lmkernels.registry import get_impl, get_op, impls

DESIGN = {
    "rms_norm": {"M": 16384, "N": 4096},
    "layer_norm": {"M": 4096, "N": 16384},
    "rope": {"B": 1, "Hq": 32, "Hkv": 8, "T": 8192, "D": 128},
    "swiglu": {"M": 8192, "N": 14336},
    "geglu": {"M": 8192, "N": 14336},
    "fused_linear_cross_entropy": {"BT": 8192, "H": 4096, "V": 128256},
}
# Llama-3.2-1B at batch 1 x 1024 tokens: hidden 2048, MLP 8192, 32/8 heads of 64.
SMALL = {
    "rms_norm": {"M": 1024, "N": 2048},
    "layer_norm": {"M": 1024, "N": 2048},
    "rope": {"B": 1, "Hq": 32, "Hkv": 8, "T": 1024, "D": 64},
    "swiglu": {"M": 1024, "N": 8192},
    "geglu": {"M": 1024, "N": 8192},
    "fused_linear_cross_entropy": {"BT": 1024, "H": 2048, "V": 128256},
}
SHAPE_SETS = {"design": DESIGN, "small": SMALL}
PUBLIC = {
    "rms_norm": lk.rms_norm,
    "layer_norm": lk.layer_norm,
    "rope": lk.rope,
    "swiglu": lk.swiglu,
    "geglu": lk.geglu,
    "fused_linear_cross_entropy": lk.fused_linear_cross_entropy,
}


class BareNorm(torch.autograd.Function):
    """An RMSNorm-shaped autograd.Function that launches nothing and allocates what the Triton
    one does: y and rstd forward; dx, dw and fp32 partial rows backward. Its forward + backward
    is the floor of any op written as a Python Function (host_profile.py, launcher_host_cpu.py)."""

    @staticmethod
    def forward(ctx, x, w, eps, offset, mode):
        y, r = torch.empty_like(x), torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        ctx.mark_non_differentiable(r)
        ctx.save_for_backward(x, w, r)
        ctx.set_materialize_grads(False)
        return y, r

    @staticmethod
    def backward(ctx, dy, _):
        x, w, _r = ctx.saved_tensors
        torch.empty((3, x.shape[1]), dtype=torch.float32, device=x.device)
        return torch.empty_like(x), torch.empty_like(w), None, None, None


NO_CACHE = "triton-no-cache"
ONE_THREAD = "-1thread"  # a suffix: the backward on the calling thread (below)
# torch's own fused norms (one C++ autograd node, no Python in the backward): what the engine
# and torch's dispatcher cost an op that has no Python at all, at the same shapes.
NATIVE = "torch-native"
NATIVE_FNS = {
    "rms_norm": lambda x, weight: torch.nn.functional.rms_norm(x, weight.shape, weight, 1e-6),
    "layer_norm": lambda x, weight, bias: torch.nn.functional.layer_norm(x, weight.shape, weight, bias, 1e-5),
}


def without_launch_cache(step):
    from lmkernels.backends.triton import _launch

    def run():
        saved = _launch._ENABLED
        _launch._ENABLED = False
        try:
            step()
        finally:
            _launch._ENABLED = saved

    return run


# --chain: the inputs each call's outputs feed into the next call (the GLUs' output as the next
# gate, the up projection kept); the FLCE gives a scalar and is not chained.
CHAINED = {
    "rms_norm": ("x",),
    "layer_norm": ("x",),
    "rope": ("q", "k"),
    "swiglu": ("gate",),
    "geglu": ("gate",),
}


def chained(fn, op: str, k: int):
    """fn applied k times in a row, each call's outputs as the next call's CHAINED inputs: one
    backward through k ops, as in a model, instead of one per op."""
    if k == 1 or op not in CHAINED:
        return fn

    def run(**inputs):
        out = fn(**inputs)
        for _ in range(k - 1):
            outs = out if isinstance(out, tuple) else (out,)
            out = fn(**(inputs | dict(zip(CHAINED[op], outs))))
        return out

    return run


def base_backend(name: str) -> str:
    """The registered backend behind a variant's name (triton-no-cache, liger-1thread, ...);
    torch-native stands for itself (no registered backend)."""
    return name.removesuffix(ONE_THREAD).replace(NO_CACHE, "triton")


def runs_here(op: str, backend: str) -> bool:
    if base_backend(backend) == NATIVE:
        return op in NATIVE_FNS
    return any(i.backend == base_backend(backend) for i in impls(op))


def unavailable_reason(op: str, backend: str) -> str | None:
    """Why `backend` (a variant name) cannot run `op` here; None where it can."""
    if base_backend(backend) == NATIVE:
        return None  # torch itself
    return get_impl(op, base_backend(backend)).unavailable_reason()


def on_calling_thread(step):
    """step with the backward run on the calling thread: on CUDA the autograd engine otherwise
    hands it to a device thread (torch.autograd.set_multithreading_enabled)."""

    def run():
        with torch.autograd.set_multithreading_enabled(False):
            step()

    return run


def make_step(op: str, backend: str, shape: dict, dtype: torch.dtype, chain: int = 1):
    """A function running one forward + backward of `backend` on fresh inputs of `shape` (with
    chain > 1: `chain` calls in a row, then one backward through all of them)."""
    if backend == NO_CACHE:
        return without_launch_cache(make_step(op, "triton", shape, dtype, chain))
    if backend.endswith(ONE_THREAD):
        return on_calling_thread(make_step(op, backend.removesuffix(ONE_THREAD), shape, dtype, chain))
    forward, backward = step_halves(op, backend, shape, dtype, chain)
    return lambda: backward(forward())


def step_halves(op: str, backend: str, shape: dict, dtype: torch.dtype, chain: int = 1):
    """make_step's step as (forward, backward): forward() calls the op and returns its outputs
    as a tuple, backward(outputs) takes torch.autograd.grad of them (host_profile.py times the
    two apart). backend: a registered one or torch-native, no variant suffix."""
    spec = get_op(op)
    inputs = spec.make_inputs(shape, dtype, "cuda", 0)
    names = [n for n in spec.grad_inputs if isinstance(inputs.get(n), torch.Tensor)]
    for n in names:
        inputs[n].requires_grad_(True)
    wrt = [inputs[n] for n in names]
    if backend == NATIVE:
        fn = NATIVE_FNS[op]
    elif get_impl(op, backend).external:
        fn = get_impl(op, backend).fn  # the peer's own call, without our dispatch
    else:
        fn = functools.partial(PUBLIC[op], backend=backend)
    fn = chained(fn, op, chain)
    out = fn(**inputs)
    outs = out if isinstance(out, tuple) else (out,)
    upstream = [torch.randn_like(o) if o.requires_grad else None for o in outs]
    pairs = [(i, g) for i, g in enumerate(upstream) if g is not None]
    grads = [g for _, g in pairs]

    def forward():
        res = fn(**inputs)
        return res if isinstance(res, tuple) else (res,)

    def backward(res):
        torch.autograd.grad([res[i] for i, _ in pairs], wrt, grads, allow_unused=True)

    return forward, backward


def gpu_ms(step, iters: int = 10) -> float:
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    total_us = 0.0
    for evt in prof.key_averages():
        total_us += getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0.0)
    return total_us / iters / 1e3


def wall_ms(step) -> float:
    import triton.testing

    return float(triton.testing.do_bench(step, warmup=25, rep=200, return_mode="median"))


def host_ms(steps: dict, blocks: int, calls: int = 20) -> dict:
    """Host time to issue one step of each backend while the GPU is kept busy (so launches never
    wait): (the best, the median) of `blocks` blocks of `calls` steps, the backends taking
    turns. The best is what the code costs on a quiet host; the median what a run sees."""
    for step in steps.values():
        step()
    torch.cuda.synchronize()
    times = {name: [] for name in steps}
    for _ in range(blocks):
        for name, step in steps.items():
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU cycles ahead of the launches
            t0 = time.perf_counter()
            for _ in range(calls):
                step()
            times[name].append((time.perf_counter() - t0) / calls * 1e3)
            torch.cuda.synchronize()
    return {name: (min(ts), statistics.median(ts)) for name, ts in times.items()}


def environment() -> dict:
    env = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "lmkernels": lk.__version__,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "LMKERNELS_CHECK_VALUES": os.environ.get("LMKERNELS_CHECK_VALUES"),
    }
    for dist in ("triton", "liger-kernel", "transformers"):
        try:
            from importlib.metadata import version

            env[dist] = version(dist)
        except Exception:
            env[dist] = None
    return env


def to_markdown(rows: list[dict], env: dict) -> str:
    lines = ["# Host overhead per op (fwd + bwd, bf16)", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += [
        "",
        "| op | shape | backend | gpu ms | wall ms | wall/gpu | host ms | host median | host / liger host |",
    ]
    lines += ["|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['op']} | {r['shape']} | {r['backend']} | error: {r['error'][:80]} | | | | | |"
            )
            continue
        ratio = f"{r['host_vs_liger']:.2f}" if r.get("host_vs_liger") is not None else "-"
        ws = r.get("wall_ms_rounds", [])
        wall = f"{r['wall_ms']:.3f}" + (f" [{min(ws):.3f}-{max(ws):.3f}]" if len(ws) > 1 else "")
        lines.append(
            f"| {r['op']} | {r['shape']} | {r['backend']} | {r['gpu_ms']:.3f} | {wall} | "
            f"{r['wall_over_gpu']:.2f} | {r['host_ms']:.3f} | {r.get('host_ms_median', float('nan')):.3f} | {ratio} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for host_overhead.json and .md")
    p.add_argument("--op", action="append", help="op (repeatable); default all")
    p.add_argument(
        "--backend",
        action="append",
        help=f"default: triton, compile, liger; also {NO_CACHE}, {NATIVE} (norms); -1thread suffix",
    )
    p.add_argument("--shapes", default="design,small", help="design, small or both (comma-separated)")
    p.add_argument("--host-blocks", type=int, default=20, help="timed blocks per backend for host_ms")
    p.add_argument("--wall-repeats", type=int, default=1, help="rounds of wall timings (median kept)")
    p.add_argument("--chain", type=int, default=1, help="K calls per step, one backward (times per op: / K)")
    args = p.parse_args(argv)
    os.environ.setdefault("LMKERNELS_CHECK_VALUES", "0")
    if not torch.cuda.is_available():
        print("host_overhead.py needs a CUDA device", file=sys.stderr)
        return 2
    ops = args.op or list(DESIGN)
    wanted = args.backend or ["triton", "compile", "liger"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env, rows = environment(), []
    if args.chain > 1:
        env["chain"] = f"{args.chain} calls per step, one backward; times per op (FLCE: one call)"
    sets = [s.strip() for s in args.shapes.split(",") if s.strip()]
    plan = [(s, op) for s in sets for op in ops]
    for n, (set_name, op) in enumerate(plan, 1):
        shape = SHAPE_SETS[set_name][op]
        label = "x".join(map(str, shape.values()))
        print(f"[{n}/{len(plan)}] {op} {label}", flush=True)
        steps, op_rows = {}, {}
        chain = args.chain if op in CHAINED else 1
        for backend in [b for b in wanted if runs_here(op, b)]:
            row = op_rows[backend] = {"op": op, "shape_set": set_name, "shape": label, "backend": backend}
            row["chain"] = chain
            reason = unavailable_reason(op, backend)
            if reason:
                row["error"] = f"not available: {reason}"
                continue
            try:
                steps[backend] = make_step(op, backend, shape, torch.bfloat16, chain)
                row["gpu_ms"] = gpu_ms(steps[backend]) / chain
            except Exception as e:  # one failing backend must not lose the others' numbers
                row["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
                steps.pop(backend, None)
        # Wall time: the backends take turns, --wall-repeats rounds (the host drifts in a run).
        walls = {b: [] for b in steps}
        for _ in range(args.wall_repeats):
            for backend in list(walls):
                try:
                    walls[backend].append(wall_ms(steps[backend]) / chain)
                except Exception as e:  # noqa: BLE001 (recorded; the other backends go on)
                    op_rows[backend]["error"] = f"wall timing: {type(e).__name__}: {e}".splitlines()[0]
                    del walls[backend], steps[backend]
        for backend, ws in walls.items():
            row = op_rows[backend]
            row.update(wall_ms=statistics.median(ws), wall_ms_rounds=ws)
            row["wall_over_gpu"] = row["wall_ms"] / row["gpu_ms"]
        # A step of several ms (FLCE) would outlast the sleep ahead of it: fewer calls per block.
        long_step = any(r.get("gpu_ms", 0.0) > 1.0 for r in op_rows.values())
        try:
            for backend, (best, median) in host_ms(
                steps, args.host_blocks, calls=3 if long_step else 20
            ).items():
                op_rows[backend].update(host_ms=best / chain, host_ms_median=median / chain)
        except Exception as e:  # noqa: BLE001 (recorded; the other ops go on)
            for backend in steps:
                op_rows[backend]["error"] = f"host timing: {type(e).__name__}: {e}".splitlines()[0]
        del steps
        torch.cuda.empty_cache()
        for row in op_rows.values():
            rows.append(row)
            print(
                f"    {json.dumps({k: v for k, v in row.items() if k not in ('op', 'shape', 'shape_set')})}"
            )
    liger = {
        (r["op"], r["shape"], r["backend"].endswith(ONE_THREAD)): r.get("host_ms")
        for r in rows
        if base_backend(r["backend"]) == "liger"
    }
    for r in rows:
        base = liger.get((r["op"], r["shape"], r["backend"].endswith(ONE_THREAD)))
        r["host_vs_liger"] = r["host_ms"] / base if base and "host_ms" in r else None
    (out / "host_overhead.json").write_text(json.dumps({"meta": env, "rows": rows}, indent=1))
    (out / "host_overhead.md").write_text(to_markdown(rows, env))
    print(f"wrote {out / 'host_overhead.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
