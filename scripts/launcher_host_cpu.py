"""Host time of the Triton launchers on a machine without a GPU.

Each launch is replaced by what the launch cache does before it calls the compiled kernel's
launcher: its key (`_launch.launch_key`) and the cache lookup. What is left is the launchers'
own Python (configurations, allocations, arguments), which is what a change to a launcher
moves; the compiled launcher and the GPU are not involved. Run it against two trees to A/B
them, e.g. `PYTHONPATH=OLD/src python3 scripts/launcher_host_cpu.py` against the checkout.

Prints microseconds per call (best of 5 repeats of 20000 calls, tiny bf16 tensors on the CPU).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ["TRITON_INTERPRET"] = "0"  # jit functions as compiled code sees them (their params)

import torch  # noqa: E402

from lmkernels.backends.triton import _launch, _norms, rms_norm, rope  # noqa: E402
from lmkernels.backends.triton import layer_norm as layer_norm_mod  # noqa: E402


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


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
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
    print(f"torch {torch.__version__}; us per call, launches keyed but not run")
    for name, fn in cases.items():
        print(f"  {name:<30} {per_call_us(fn):7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
