"""Memory of the Triton FLCE (lmkernels/backends/triton/flce.py): what a training step
allocates (counted on the CPU under the profiler) and the peak above the inputs over forward +
backward against the plan's own accounting (CUDA), for the default, the lean mode and memory
budgets. Values are tests/test_triton_flce.py's."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import gc  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="the Triton backend needs triton")

import lmkernels  # noqa: E402
from flce_common import BACKEND, DEVICE, fix_sizes, make, mode, small_chunks  # noqa: E402, F401
from lmkernels.backends.triton import flce_kernels as kernels  # noqa: E402
from lmkernels.backends.triton import triton_unavailable_reason  # noqa: E402

if triton_unavailable_reason() is not None:
    pytest.skip(triton_unavailable_reason(), allow_module_level=True)


def _profile_step(inputs):
    """One eager forward + backward under the profiler: (the bytes of each allocation, the bytes
    still allocated afterwards, the names of the recorded calls).

    Not a TorchDispatchMode: under one, calls go to the custom op (_common.traced), and the
    point is the eager path. Each allocation is attributed to the innermost op (an empty /
    empty_strided), so an event's self memory is one allocation; frees land on enclosing events.
    """
    # Earlier tests' garbage collected now, not by the collection inside the profile (its frees
    # would count against this step's remaining bytes).
    gc.collect()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if DEVICE == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        loss = lmkernels.fused_linear_cross_entropy(**inputs, backend=BACKEND["name"])
        loss.sum().backward()
        del loss
        # Triton's CPU interpreter keeps the storages of a launch's arguments in a reference
        # cycle (a recursive closure in GridExecutor._init_args_hst) until the next collection.
        gc.collect()
    events = prof.events()
    usage = [e.self_device_memory_usage if DEVICE == "cuda" else e.self_cpu_memory_usage for e in events]
    return [u for u in usage if u > 0], sum(usage), {e.name for e in events}


@pytest.mark.skipif(
    DEVICE == "cuda",
    reason="torch.profiler does not attribute CUDA caching-allocator allocations to op events "
    "(torch 2.11 on the H200: every count 0); test_peak_memory_cuda covers the CUDA peak",
)
@pytest.mark.parametrize("reduction", ["mean", "none"])  # grads in the forward / recomputed
@pytest.mark.parametrize(
    ("dtype", "accum"),
    [
        (torch.float32, None),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, None),
    ],
    ids=["fp32", "bf16-lean", "bf16-fp32-accum", "bf16-default"],
)
def test_allocations_per_step(dtype, accum, reduction, mode):
    """A training step allocates grad_W and grad_hidden once each and nothing else of their
    size (no zero-filled gradients for the unused outputs, no copy into .grad), everything but
    those two is freed by the end (the fp32 accumulator included), and the eager call never
    goes through the custom op."""
    BT, H, V = 37, 64, 131  # V*H*2, V*H*4, BT*H*2, BT*H*4 bytes: no other allocation has these
    inputs = make({"BT": BT, "H": H, "V": V}, dtype, {"reduction": reduction, "grad_accum_dtype": accum})
    hidden = inputs["hidden"].requires_grad_(True)
    weight = inputs["weight"].requires_grad_(True)
    allocations, remaining, names = _profile_step(inputs)
    size = dtype.itemsize
    counts = {n: allocations.count(n) for n in (V * H * size, BT * H * size, V * H * 4)}
    expected = {V * H * size: 1, BT * H * size: 1}
    if dtype != torch.float32:
        # fp32 V x H: the fast mode's grad_W accumulator (fp32 accumulation asked for, gradients
        # computed in the forward; the default sums these few chunks in bf16) and, without
        # fp32-output GEMMs for 16-bit inputs (CPU), one weight upcast per loop with fp32 logits
        # (the forward's, and the recomputing backward's; the default's forward has bf16 logits).
        # The lean backward never holds a V x H accumulator: grad_W rows are written block by block.
        in_forward = mode == "fast" and reduction == "mean"
        bf16_logits = in_forward and accum in (None, torch.bfloat16) and dtype == torch.bfloat16
        upcasts = 0 if kernels._cuda_fp32_out(hidden) or bf16_logits else (1 if in_forward else 2)
        expected[V * H * 4] = (accum == torch.float32 and in_forward) + upcasts
    assert counts == expected
    assert remaining == (V * H + BT * H) * size  # hidden.grad and weight.grad
    assert weight.grad.shape == (V, H) and hidden.grad.shape == (BT, H)
    assert "FlceTritonFunction" in names
    assert not any(n.startswith("lmkernels::") for n in names), sorted(n for n in names if "::" in n)


@pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="peak GPU memory needs a CUDA device and compiled kernels (TRITON_INTERPRET=0)",
)
@pytest.mark.parametrize("accum", [torch.bfloat16, None, torch.float32], ids=["bf16", "default", "fp32"])
def test_peak_memory_cuda(monkeypatch, accum, mode):
    """Peak memory above the inputs over forward + backward follows the documented formulas.

    lean: grad_W + grad_hidden + the backward's fp32 logits block and grad_hidden accumulator
    (flce_blocks' sizes), the forward never above that. fast: the forward holds the gradients,
    a chunk of logits (bf16 ones when grad_W is summed in bf16, fp32 with fp32 accumulation) and
    (fp32 accumulation) the V x H accumulator plus its conversion; the backward of a "mean" loss
    allocates nothing.
    """
    fix_sizes(monkeypatch, None, None)
    BT, H, V = 8192, 1024, 128256
    inputs = make({"BT": BT, "H": H, "V": V}, torch.bfloat16, {"grad_accum_dtype": accum})
    hidden = inputs["hidden"].requires_grad_(True)
    weight = inputs["weight"].requires_grad_(True)
    lmkernels.fused_linear_cross_entropy(**inputs, backend=BACKEND["name"]).backward()  # warm-up, autotune
    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = lmkernels.fused_linear_cross_entropy(**inputs, backend=BACKEND["name"])
    torch.cuda.synchronize()
    before_backward = torch.cuda.memory_allocated()
    peak_forward = torch.cuda.max_memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    torch.cuda.synchronize()
    peak_backward = torch.cuda.max_memory_allocated() - base
    grad_h, grad_w = BT * H * 2, V * H * 2
    slack = 8 * 2**20  # loss, lse, scales, cuBLAS workspace
    if mode == "lean":
        budget = kernels.lean_budget_bytes(BT, H, V, 2)
        whole = accum == torch.float32
        tokens, cols = kernels.flce_blocks(BT, H, V, budget, whole_tokens=whole, accumulate_h=True)
        expected = grad_h + grad_w + tokens * (H + cols) * 4
        assert peak_forward <= expected + slack, f"forward peak {peak_forward / 2**20:.0f} MiB"
        assert peak_backward <= expected + slack, f"backward peak {peak_backward / 2**20:.0f} MiB"
        if not whole:  # the budget holds: 8% above the gradients
            assert max(peak_forward, peak_backward) <= (grad_h + grad_w) * 1.08 + slack
    else:
        chunk = kernels.bf16_logits_chunk(BT, V, torch.bfloat16, 2)
        if accum == torch.float32 or chunk is None:
            # the fp32 accumulator, then the conversion's result next to it
            logits = kernels.flce_chunk_tokens(BT, V) * V * 4
            expected = grad_h + 2 * grad_w + max(logits, grad_w)
        else:  # 8 chunks of bf16 logits, summed in bf16 straight into grad_W
            expected = grad_h + grad_w + chunk * V * 2
        assert peak_forward < BT * V * 4  # below the fp32 logits that eager materializes
        assert peak_forward <= expected + slack, f"forward peak {peak_forward / 2**20:.0f} MiB"
        assert peak_backward - (before_backward - base) <= 2**20, "the fast backward allocated"


@pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="peak GPU memory needs a CUDA device and compiled kernels (TRITON_INTERPRET=0)",
)
@pytest.mark.parametrize("budget", [0.0, 0.15, 0.4, 1.0])
def test_budget_peak_memory_cuda(monkeypatch, budget):
    """A memory budget's peak above the inputs over forward + backward stays within what its
    plan holds beyond the gradients (fast_extra_bytes, or the lean mode's blocks), and within
    the budget wherever the plan is not at a block floor. At 16384 x 2560 x 151936 the budgets
    run the lean mode at its block floor (0) and within the budget (0.15), 16 smaller bf16
    chunks (0.4) and the default (1.0)."""
    fix_sizes(monkeypatch, None, None)
    BT, H, V = 16384, 2560, 151936
    p = kernels.plan(BT, H, V, 2, torch.bfloat16, None, False, budget, True, True)
    grads = (BT + V) * H * 2
    if p.lean:
        tokens, cols = kernels.flce_blocks(
            BT, H, V, p.block_bytes, whole_tokens=p.accum_fp32, accumulate_h=True
        )
        extra = tokens * (H + cols) * 4
    else:
        extra = kernels.fast_extra_bytes(p, BT, H, V, True, torch.bfloat16)
    inputs = make({"BT": BT, "H": H, "V": V}, torch.bfloat16, {"memory_budget": budget})
    hidden = inputs["hidden"].requires_grad_(True)
    weight = inputs["weight"].requires_grad_(True)
    lmkernels.fused_linear_cross_entropy(**inputs, backend="triton").backward()  # warm-up, autotune
    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    lmkernels.fused_linear_cross_entropy(**inputs, backend="triton").backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    slack = 8 * 2**20  # loss, lse, scales, cuBLAS workspace
    assert peak <= grads + extra + slack, f"peak {peak / 2**20:.0f} MiB, plan {(grads + extra) / 2**20:.0f}"
    if extra <= budget * grads:
        assert peak <= grads * (1 + budget) + slack, f"peak {peak / 2**20:.0f} MiB over the budget"
