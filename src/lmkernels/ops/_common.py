"""What the op files share: the dispatch call of their public functions (check inputs, pick the
impl, call it; see registry.fastpath) and the random input helpers of their make_inputs."""

from __future__ import annotations

import torch

from lmkernels.registry.core import Tolerance
from lmkernels.registry.fastpath import dispatch, op_function
from lmkernels.utils import checked_values, data_checks_enabled, fail

__all__ = [
    "NORM_WIDTHS",
    "ROW_COUNTS",
    "WIDTHS",
    "check_class_indices",
    "dispatch",
    "generator",
    "op_function",
    "randn",
    "upcast",
]

# Sizes the property-based tests draw from (OpSpec.sample): empty, one, primes, powers of two
# and others. WIDTHS, for a last dim, adds wide rows up to past 2^16 (drawn with few rows).
ROW_COUNTS = (0, 1, 2, 3, 5, 7, 8, 13, 16, 31, 37, 64, 97, 128, 257)
WIDTHS = (1, 2, 3, 5, 7, 8, 13, 16, 31, 64, 96, 97, 128, 257, 1000, 1024, 4099, 8192, 65537)
# A norm's row of 1 or 2 elements normalizes to about +-1 whatever its values: its gradient is
# rounding noise, which no error bound can judge. The norms draw their widths from these.
NORM_WIDTHS = WIDTHS[2:]
WIDE = 4096  # past this width a sample takes at most 3 rows


def upcast(t: torch.Tensor) -> torch.Tensor:
    """t in the references' compute dtype: fp32, or fp64 for fp64 inputs (the harness's ground
    truth and its double-backward checks run the references in fp64)."""
    return t if t.dtype == torch.float64 else t.float()


def randn(shape, dtype: torch.dtype, device, generator: torch.Generator, scale: float = 1.0):
    """Random normal values drawn in fp32 on the CPU (same values on every device), then cast."""
    t = torch.randn(shape, generator=generator, dtype=torch.float32) * scale
    return t.to(device=device, dtype=dtype)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def check_class_indices(target: torch.Tensor, V: int, ignore_index: int) -> None:
    """Targets in [0, V) or ignore_index, for an op's check_values: one host sync (skipped with
    LMKERNELS_CHECK_VALUES=0, where every backend gives a nan loss for an out-of-range target,
    never an out-of-bounds read). Under vmap every batch element is checked at once."""
    if data_checks_enabled() and target.numel():
        target = checked_values(target)
        bad = (target != ignore_index) & ((target < 0) | (target >= V))
        if bool(bad.any()):
            first = target[bad][0].item()
            fail(
                f"target: expected class indices in [0, {V}) or ignore_index={ignore_index}, "
                f"found {first} ({int(bad.sum())} out of range)"
            )


# The policy's tolerances of the ops that project onto a vocabulary and reduce over it (fused
# linear cross entropy, fused linear distillation): the same sums in both.
# fp32: the logits matmul sums H products, so a different blocking of that sum moves
# the result by more ulps than an elementwise op; 4x eager's error still catches any
# real bug (those are O(1) relative).
# bf16/fp16: eager (what a model gets) rounds the logits and d loss / d logits to the
# input dtype; a fused kernel may keep the logits in fp32 but must round d loss / d logits
# too before the tensor-core GEMMs (Liger and CCE do the same): the same roundings in
# other places, whose errors differ by a factor that class weights and label smoothing
# (terms of uneven size, sums that nearly cancel) can push past 2x. A wrong gradient
# formula is O(1) off.
# fp16 bound: a mean loss over 8192 tokens has gradients ~1e-4, at the edge of fp16's
# normal range, so eager fp16 itself lands at 5e-3 there (fp16 training needs a loss
# scale); the bound only has to exclude garbage.
VOCAB_TOLERANCES = {
    torch.float32: Tolerance(factor=4.0, floor=1e-5, bound=1e-4),
    torch.bfloat16: Tolerance(factor=3.0, floor=1e-3, bound=2e-2),
    torch.float16: Tolerance(factor=3.0, floor=2e-4, bound=2e-2),
}
