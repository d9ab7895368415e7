"""Host time of the Triton launchers on a machine without a GPU.

Each launch is replaced by what the launch cache does before it calls the compiled kernel's
launcher: its key (`_launch.launch_key`) and the cache lookup. What is left is the launchers'
own Python (configurations, allocations, arguments), which is what a change to a launcher
moves; the compiled launcher and the GPU are not involved. Run it against two trees to A/B
them, e.g. `PYTHONPATH=OLD/src python3 scripts/launcher_host_cpu.py` against the checkout.

Prints microseconds per call (best of 5 repeats of 20000 calls, tiny bf16 tensors on the CPU).
--breakdown adds where an RMSNorm forward + backward through autograd spends its host time:
against plain torch's `x * w`, a bare autograd.Function that makes the same allocations, and
the launchers' floor (their allocations and keyed launches, none of their own logic). On the
CPU the autograd engine runs the backward in the calling thread; on a GPU it hands it to a
device thread, which adds a fixed cost per backward call that these figures leave out.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "0"  # jit functions as compiled code sees them (their params)

import torch  # noqa: E402

from lmkernels.backends.triton import _launch, _norms, rms_norm, rope  # noqa: E402
from lmkernels.backends.triton import layer_norm as layer_norm_mod  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_overhead import BareNorm  # noqa: E402


def keyed_launch(kernel, grid, *args, **kwargs):
    """The launch cache up to the launcher call: the key and the lookup."""
    state = kernel.__dict__.get("_lmk_launches")
    if state is None:
        constexprs = tuple(i for i, p in enumerate(kernel.params) if p.is_constexpr)
        state = kernel._lmk_launches = ({}, constexprs)
    state[0].get(_launch.launch_key(args, kwargs, state[1]))


def per_call_us(fn, n: int = 20000, repeats: int = 5) -> float:
    for _ in range(200):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - start) / n)
    return best * 1e6


def launcher_floor(launcher, *args):
    """A function making the launcher's allocations (as many as it makes, x's size) and its
    launches (keyed, with the arguments it passed): the launcher without its own logic."""
    launches = []

    def record(kernel, grid, *a, **kw):
        launches.append((kernel, grid, a, kw))

    for module in (rms_norm, _norms):
        module.launch = record
    outputs = launcher(*args)
    for module in (rms_norm, _norms):
        module.launch = keyed_launch
    tensors = [t for t in (outputs if isinstance(outputs, tuple) else (outputs,))]
    count = len(tensors) + (1 if len(launches) > 1 else 0)  # the partial rows between launches
    like = args[0]

    def floor():
        for _ in range(count):
            torch.empty(like.shape, dtype=like.dtype)
        for kernel, grid, a, kw in launches:
            keyed_launch(kernel, grid, *a, **kw)

    return floor


def breakdown(x, w, dy, rstd) -> dict:
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()

    def ours():
        torch.autograd.grad(rms_norm.rms_norm_triton(xg, wg, 1e-6), (xg, wg), dy)

    def bare():
        torch.autograd.grad(BareNorm.apply(xg, wg, 1e-6, 0.0, "llama")[0], (xg, wg), dy)

    def mul():
        torch.autograd.grad(xg * wg, (xg, wg), dy)

    fwd_floor = launcher_floor(rms_norm._rms_norm_fwd, x, w, 1e-6, 0.0, "llama")
    bwd_floor = launcher_floor(rms_norm._rms_norm_bwd, dy, x, w, rstd, 0.0, "llama")
    return {
        "rms_norm fwd + bwd, autograd": ours,
        "bare Function, same allocations": bare,
        "x * w fwd + bwd (plain torch)": mul,
        "forward launcher's floor": fwd_floor,
        "backward launcher's floor": bwd_floor,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--breakdown", action="store_true", help="RMSNorm's host time through autograd")
    args = p.parse_args(argv)
    for module in (rms_norm, layer_norm_mod, rope, _norms):
        module.launch = keyed_launch
    bf16 = torch.bfloat16
    x, w, b = torch.randn(16, 256, dtype=bf16), torch.randn(256, dtype=bf16), torch.randn(256, dtype=bf16)
    dy = torch.randn_like(x)
    _, rstd = rms_norm._rms_norm_fwd(x, w, 1e-6, 0.0, "llama")
    _, mean, ln_rstd = layer_norm_mod._layer_norm_fwd(x, w, b, 1e-5)
    # transformers' q and k: (B, H, T, D) views of (B, T, H, D) memory
    B, Hq, Hkv, T, D = 1, 4, 2, 16, 64
    q = torch.randn(B, T, Hq, D, dtype=bf16).transpose(1, 2)
    k = torch.randn(B, T, Hkv, D, dtype=bf16).transpose(1, 2)
    cos, sin = torch.randn(T, D, dtype=bf16), torch.randn(T, D, dtype=bf16)
    cases = {
        "rms_norm forward launcher": lambda: rms_norm._rms_norm_fwd(x, w, 1e-6, 0.0, "llama"),
        "rms_norm backward launcher": lambda: rms_norm._rms_norm_bwd(dy, x, w, rstd, 0.0, "llama"),
        "layer_norm forward launcher": lambda: layer_norm_mod._layer_norm_fwd(x, w, b, 1e-5),
        "layer_norm backward launcher": lambda: layer_norm_mod._layer_norm_bwd(dy, x, w, mean, ln_rstd, bf16),
        "rope launcher": lambda: rope._rope_rotate(q, k, cos, sin, None, False, D, False, True, True),
    }
    if args.breakdown:
        cases |= breakdown(x, w, dy, rstd)
    print(f"torch {torch.__version__}; us per call, launches keyed but not run")
    for name, fn in cases.items():
        print(f"  {name:<34} {per_call_us(fn):7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
