"""Reference rates measured in the same run (device copy bandwidth, bf16 matmul rate), rooflines
(memory-bound ops: the OpSpec's minimum bytes over the copy bandwidth; FLCE: 6*BT*H*V flops
over the matmul rate) and the ratios to the baselines."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from lmkernels.harness.bench.measure import cleanup, time_ms
from lmkernels.registry.core import get_op

BASELINES = ("compile", "compile_naive", "liger", "cce")  # the speedup/memory ratio columns
TIMES = (("", "ms"), ("_gpu", "gpu_ms"), ("_kernel", "kernel_ms"))  # column suffix, row key


def copy_bandwidth_gbps(device: str = "cuda", nbytes: int = 2**31) -> float:
    """Device-to-device copy of `nbytes` (bytes read + written per second, in GB/s)."""

    def measure_copy() -> float:  # its buffers are freed when it returns
        src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
        dst = torch.empty_like(src)
        return time_ms(lambda: dst.copy_(src), [], device, 25, 200)[0]

    ms = measure_copy()
    cleanup(device)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def matmul_tflops(device: str = "cuda", n: int = 8192, dtype: torch.dtype = torch.bfloat16) -> float:
    """Rate of an n^3 matmul (2 n^3 flops), the reference for FLCE's TFLOP/s."""

    def measure_matmul() -> float:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        return time_ms(lambda: a @ b, [], device, 25, 200)[0]

    ms = measure_matmul()
    cleanup(device)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def add_rooflines(
    rows: list[dict[str, Any]], dtype: torch.dtype, copy_gbps: float | None, mm_tflops: float | None
) -> None:
    """GB/s and TFLOP/s of every time of `full` rows (the OpSpecs' byte and flop models are
    fwd+bwd), and their % of the reference rates."""
    for row in rows:
        for suffix, key in TIMES:
            ms = row.get(key)
            row.update({f"gbps{suffix}": None, f"pct_copy_bw{suffix}": None})
            row.update({f"tflops{suffix}": None, f"pct_matmul{suffix}": None})
            if row["mode"] != "full" or ms is None:
                continue
            spec = get_op(row["op"])
            seconds = ms * 1e-3
            if spec.bytes_moved is not None:
                gbps = spec.bytes_moved(row["dims"], dtype) / seconds / 1e9
                row[f"gbps{suffix}"] = gbps
                row[f"pct_copy_bw{suffix}"] = 100 * gbps / copy_gbps if copy_gbps else None
            if spec.flops is not None:
                tflops = spec.flops(row["dims"]) / seconds / 1e12
                row[f"tflops{suffix}"] = tflops
                row[f"pct_matmul{suffix}"] = 100 * tflops / mm_tflops if mm_tflops else None


def add_ratios(
    rows: list[dict[str, Any]],
    key: Callable[[dict[str, Any]], Hashable] | None = None,
    baselines: Sequence[str] = BASELINES,
) -> None:
    """speedup_vs_X = time(X) / time(row) (> 1: faster than X), per time (wall, _gpu, _kernel);
    mem_vs_X = peak(row) / peak(X). Rows compare within the same key (default: op, shape,
    options, dtype, mode)."""
    key = key or (lambda r: (r["op"], r["shape"], r["options"], r["dtype"], r["mode"]))
    by_key: dict[Hashable, dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_key.setdefault(key(row), {})[row["backend"]] = row
    for row in rows:
        group = by_key[key(row)]
        for base in baselines:
            ref = group.get(base) or {}  # (no row of that backend: no ratios)
            for suffix, t in TIMES:
                prefix = suffix.lstrip("_") + "_" if suffix else ""
                ok = ref.get(t) and row.get(t)
                row[f"{prefix}speedup_vs_{base}"] = ref[t] / row[t] if ok else None
            ok = ref.get("peak_mib") and row["peak_mib"] is not None
            row[f"mem_vs_{base}"] = row["peak_mib"] / ref["peak_mib"] if ok else None
