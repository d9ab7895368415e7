"""Where the host time of one small op goes on a GPU (issue 13 item 2): a layer-by-layer split.

    python scripts/host_profile.py --out DIR [--op rms_norm --op rope]

Per op (tiny bf16 inputs, so the host is all that is measured; the GPU is kept busy by a long
torch.cuda._sleep so nothing waits), microseconds per call of:
  triton_empty_launch   an empty Triton kernel with 4 tensor arguments (Triton's own launch cost)
  launcher_fwd          the op's forward launcher (allocations + launches, no autograd)
  public_fwd            lk.<op>(..., backend="triton"): dispatch + autograd wrapper + launcher
  public_fwd_bwd        forward + torch.autograd.grad
  public_fwd_bwd_design_shape   the same at the op's design shape (scripts/host_overhead.py)
  torch_mul_fwd_bwd     x * w forward + autograd.grad in plain torch (autograd's own floor)
  bare_function_fwd_bwd the same through a Python autograd.Function that launches nothing and
                        makes the norms' allocations (the floor of a Python Function)
  triton_empty_launch_direct    the empty kernel through its compiled launcher, as Triton calls it
                        after its binder, specialization and cache lookup (recorded once, replayed)
  launcher_fwd_launches_direct  the forward launcher's launches replayed the same way (no
                        allocations, no binder): what a launch cache could bring launcher_fwd to
  launcher_bwd, launcher_bwd_launches_direct   the same for the norms' backward launcher
  *_ab_cache_on / *_ab_cache_off   launcher_fwd, launcher_bwd, public_fwd and public_fwd_bwd
                        again, with the launch cache (backends/triton/_launch.py) and without
  *_1thread             public_fwd_bwd, torch_mul_fwd_bwd and bare_function_fwd_bwd with the
                        backward on the calling thread (torch.autograd.set_multithreading_enabled
                        (False)) instead of the autograd engine's device thread
  timeline_*, timeline_*_1thread   one public_fwd_bwd call split at our Python backward's
                        entry and return (medians): fwd, to_backward (the engine and its hand-off
                        to the device thread), body (our backward), from_backward (the way back),
                        on the device thread and on the calling thread
and the top functions of a cProfile of public_fwd_bwd by own time. Writes host_profile.json and
host_profile.md (device, versions, command) to --out.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_overhead import DESIGN, BareNorm, make_step, on_calling_thread, step_halves, without_launch_cache  # noqa: E402

import lmkernels as lk  # noqa: E402
from lmkernels.registry import get_op  # noqa: E402

SHAPES = {
    "rms_norm": {"M": 16, "N": 256},
    "layer_norm": {"M": 16, "N": 256},
    "rope": {"B": 1, "Hq": 4, "Hkv": 2, "T": 16, "D": 64},
    "swiglu": {"M": 16, "N": 256},
}


@triton.jit
def _empty_kernel(a, b, c, d, n, BLOCK: tl.constexpr):
    pass


# Calls per timed block: few enough that their launches fit in the CUDA launch queue (about a
# thousand entries) while the GPU sleeps, else the host blocks and the wait is counted.
CALLS = 40


def per_call_us(fn, calls: int = CALLS) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(20):
        torch.cuda._sleep(100_000_000)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def record_launches(fn) -> list:
    """The (launcher, args) of each Triton kernel launch that fn() makes, as Triton's JIT path
    calls the compiled kernel's launcher after binding and specializing the arguments."""
    from triton.compiler.compiler import CompiledKernel

    calls = []
    prop = CompiledKernel.__dict__.get("run")
    if not isinstance(prop, property):
        raise RuntimeError(f"triton {triton.__version__}: CompiledKernel.run is not a property")

    def recording(self):
        launcher = prop.fget(self)

        def record(*args):
            calls.append((launcher, args))
            return launcher(*args)

        return record

    CompiledKernel.run = property(recording)
    try:
        without_launch_cache(fn)()  # the launch cache calls launchers it holds, not the property
    finally:
        CompiledKernel.run = prop
    torch.cuda.synchronize()
    return calls


def replay(calls: list):
    def run():
        for launcher, args in calls:
            launcher(*args)

    return run


def launcher_fwd(op: str, inputs: dict):
    from lmkernels.backends.triton import layer_norm, rms_norm, rope

    if op == "rms_norm":
        return lambda: rms_norm._rms_norm_fwd(inputs["x"], inputs["weight"], 1e-6, 0.0, "llama")
    if op == "layer_norm":
        return lambda: layer_norm._layer_norm_fwd(inputs["x"], inputs["weight"], inputs["bias"], 1e-5)
    if op == "rope":
        q, k, cos, sin = (inputs[n] for n in ("q", "k", "cos", "sin"))
        return lambda: rope._rope_rotate(q, k, cos, sin, None, False, q.shape[-1], False, False, False)
    return None


def launcher_bwd(op: str, inputs: dict):
    from lmkernels.backends.triton import layer_norm, rms_norm

    x, w = inputs["x"].detach(), inputs["weight"].detach()
    dy = torch.randn_like(x)
    if op == "rms_norm":
        _, rstd = rms_norm._rms_norm_fwd(x, w, 1e-6, 0.0, "llama")
        return lambda: rms_norm._rms_norm_bwd(dy, x, w, rstd, 0.0, "llama")
    if op == "layer_norm":
        _, mean, rstd = layer_norm._layer_norm_fwd(x, w, inputs["bias"], 1e-5)
        return lambda: layer_norm._layer_norm_bwd(dy, x, w, mean, rstd, inputs["bias"].dtype)
    return None


def time_launcher(result: dict, name: str, make) -> object:
    """result[name]: the host time per call of the launcher call that make() returns (None: the
    op has none), then its launches recorded and replayed (name_launches, name_launches_direct).
    Returns the call, or None where there is none or the script cannot time it (name_error)."""
    try:
        fn = make()
        if fn is not None:
            result[name] = per_call_us(fn)
            launches = record_launches(fn)
            result[name + "_launches"] = float(len(launches))
            result[name + "_launches_direct"] = per_call_us(replay(launches))
        return fn
    except Exception as e:  # a launcher signature this script does not know: say so
        result[name + "_error"] = repr(e)
        return None


def profile_op(op: str) -> dict:
    spec = get_op(op)
    shape = SHAPES[op]
    inputs = spec.make_inputs(shape, torch.bfloat16, "cuda", 0)
    a = torch.empty(64, device="cuda")
    result = {"shape": shape}
    empty = lambda: _empty_kernel[(1,)](a, a, a, a, 64, BLOCK=64)  # noqa: E731
    result["triton_empty_launch"] = per_call_us(empty)
    try:
        result["triton_empty_launch_direct"] = per_call_us(replay(record_launches(empty)))
    except Exception as e:  # a Triton whose compiled kernels this script cannot record: say so
        result["direct_error"] = repr(e)
    launcher = time_launcher(result, "launcher_fwd", lambda: launcher_fwd(op, inputs))
    backward = time_launcher(result, "launcher_bwd", lambda: launcher_bwd(op, inputs))
    public = getattr(lk, op)
    plain = {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    result["public_fwd"] = per_call_us(lambda: public(**plain, backend="triton"))
    step = make_step(op, "triton", shape, torch.bfloat16)
    result["public_fwd_bwd"] = per_call_us(step)
    x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
    result["torch_mul_fwd_bwd"] = per_call_us(lambda: torch.autograd.grad([x * w], [x, w], [g]))
    bare = lambda: torch.autograd.grad([BareNorm.apply(x, w, 1e-6, 0.0, "llama")[0]], [x, w], [g])  # noqa: E731
    result["bare_function_fwd_bwd"] = per_call_us(bare)
    design = make_step(op, "triton", DESIGN[op], torch.bfloat16)
    result["public_fwd_bwd_design_shape"] = per_call_us(design)
    # The same with the launch cache (backends/triton/_launch.py) on, then off.
    timed = {"launcher_fwd": launcher, "launcher_bwd": backward,
             "public_fwd": lambda: public(**plain, backend="triton"), "public_fwd_bwd": step}  # fmt: skip
    for name, fn in timed.items():
        if fn is not None:
            on, off = per_call_us(fn), per_call_us(without_launch_cache(fn))
            result[name + "_ab_cache_on"], result[name + "_ab_cache_off"] = on, off
    # The autograd engine's device thread against the calling thread.
    result["public_fwd_bwd_1thread"] = per_call_us(on_calling_thread(step))
    result["torch_mul_fwd_bwd_1thread"] = per_call_us(
        on_calling_thread(lambda: torch.autograd.grad([x * w], [x, w], [g]))
    )
    result["bare_function_fwd_bwd_1thread"] = per_call_us(on_calling_thread(bare))
    for one_thread, suffix in ((False, ""), (True, "_1thread")):
        for phase, us in backward_timeline(op, one_thread).items():
            result[f"timeline_{phase}{suffix}"] = us
    result["cprofile_top"] = profile_top(step, blocks=10, lines=22)
    return result


def backward_timeline(op: str, one_thread: bool) -> dict:
    """Where one forward + torch.autograd.grad of the op (public function, SHAPES) spends its
    host time, medians over 10 blocks of CALLS calls with the GPU kept busy (microseconds):
    fwd (the public call), to_backward (autograd.grad called -> the op's Python backward
    entered: the engine, and on CUDA its hand-off to the device thread), body (inside our
    backward), from_backward (our backward returned -> autograd.grad returned)."""
    from lmkernels.backends.triton import layer_norm, rms_norm, rope

    function = {"rms_norm": rms_norm._RMSNormFunction, "layer_norm": layer_norm._LayerNormFunction,
                "rope": rope._RopeFunction}.get(op)  # fmt: skip
    if function is None:
        return {}
    forward, backward = step_halves(op, "triton", SHAPES[op], torch.bfloat16)
    original = function.__dict__["backward"]
    inner = original.__func__
    marks = {}

    def timed(ctx, *grads):
        marks["entry"] = time.perf_counter()
        try:
            return inner(ctx, *grads)
        finally:
            marks["exit"] = time.perf_counter()

    phases = {"fwd": [], "to_backward": [], "body": [], "from_backward": []}

    def call():
        t0 = time.perf_counter()
        res = forward()
        t1 = time.perf_counter()
        backward(res)
        t2 = time.perf_counter()
        return t1 - t0, marks["entry"] - t1, marks["exit"] - marks["entry"], t2 - marks["exit"]

    function.backward = staticmethod(timed)
    try:
        with torch.autograd.set_multithreading_enabled(not one_thread):
            call()
            torch.cuda.synchronize()
            for _ in range(10):
                torch.cuda._sleep(100_000_000)
                for _ in range(CALLS):
                    for name, dt in zip(phases, call()):
                        phases[name].append(dt * 1e6)
                torch.cuda.synchronize()
    finally:
        function.backward = original
    return {name: statistics.median(ts) for name, ts in phases.items()}


def profile_top(step, blocks: int, lines: int) -> str:
    """cProfile of `blocks` x CALLS calls of step, each block issued while a sleep kernel keeps
    the GPU busy: the top `lines` functions by own time."""
    prof = cProfile.Profile()
    for _ in range(blocks):
        torch.cuda._sleep(100_000_000)
        prof.enable()
        for _ in range(CALLS):
            step()
        prof.disable()
        torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(lines)
    return buf.getvalue()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--op", action="append", choices=sorted(SHAPES))
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for op in args.op or ["rms_norm", "rope"]:
        results[op] = profile_op(op)
        nums = {k: round(v, 1) for k, v in results[op].items() if isinstance(v, float)}
        print(op, nums, flush=True)
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    (out / "host_profile.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    md = [f"# Host time per call, us ({meta['device']})", "", f"`{meta['command']}`", ""]
    md += [f"torch {meta['torch']}, triton {meta['triton']}", ""]
    for op, r in results.items():
        md += [f"## {op} {r['shape']}", ""]
        md += [f"- {k}: {v:.1f}" for k, v in r.items() if isinstance(v, float)]
        md += ["", "```", r["cprofile_top"].strip(), "```", ""]
    (out / "host_profile.md").write_text("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
