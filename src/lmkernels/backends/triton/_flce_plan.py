"""Fused linear cross entropy, Triton backend: the memory-budget policy. Which mode a call runs
in (fast or lean, grad_W summed in fp32 or in its own dtype) and how large the forward's token
chunks and the recomputing backward's blocks are, from the shapes, the options and the budget
(flce.py's docstring has the design). Plain host arithmetic: the loops in _flce_kernels.py ask
it for their sizes, flce.py for the plan of a call.

Two environment variables fix the sizes (tests, tuning): LMKERNELS_FLCE_CHUNK_TOKENS the tokens
per forward chunk, LMKERNELS_FLCE_BLOCKS="TOKENS,COLUMNS" the recomputing backward's super-chunk
tokens and vocabulary block.
"""

import dataclasses

import torch

from lmkernels.backends.triton._common import cdiv
from lmkernels.utils import env_sizes

# Token chunks of run_chunks: at most CHUNK_BYTES of logits (fp32, or bf16 in the default fast
# mode for bf16 inputs), or the lean budget below when that is smaller; CHUNK_ENV overrides it.
CHUNK_BYTES = 1 << 30
CHUNK_ENV = "LMKERNELS_FLCE_CHUNK_TOKENS"
BLOCKS_ENV = "LMKERNELS_FLCE_BLOCKS"
# Memory the lean mode may use beyond the gradients it returns, as a fraction of their bytes
# (grad_W + grad_hidden): the recomputed logits block plus the fp32 grad_hidden accumulator.
LEAN_EXTRA_FRACTION = 0.08
# Smallest blocks the budget may shrink to: below these the GEMMs lose their efficiency. Blocks
# of 512 vocabulary columns (memory_budget=0) measured 1.4-13.5x the lean default's time for
# 1.5-7% less peak (H100, H200, 8 lm_head shapes), while the lean default's blocks (3200 columns
# at 4096 x 2048 x 128256, 6784 at 8192 x 4096 x 128256) ran at 1.21-1.57x torch.compile's time.
# The floor of 2048 columns is not yet measured on the GPU.
MIN_SUPER_CHUNK = 256
MIN_VOCAB_BLOCK = 2048
# grad_W rows summed over super-chunks in the weight's dtype round once per super-chunk: at most
# this many (measured on the CPU, bf16, 2048 tokens: grad_W error 1.2x eager's with one
# super-chunk, 1.7x with 4, 2.2x with 8, 2.9x with 16; the policy allows 3x).
MAX_SUPER_CHUNKS = 8
MIN_FAST_CHUNK_TOKENS = 1024  # see fast_weight_dtype_chunk
# The default's bf16 chunks on long batches (see bf16_logits_chunk): where 8 chunks would pass
# LONG_CHUNK_TOKENS tokens each, up to LONG_MAX_CHUNKS chunks of at least LONG_CHUNK_TOKENS.
LONG_CHUNK_TOKENS = 2048
LONG_MAX_CHUNKS = 16


def _round_down(x: int, multiple: int) -> int:
    return x // multiple * multiple


def _chunk_rows(nbytes: int, V: int) -> int:
    """Tokens of fp32 logits that fit nbytes, a multiple of 128 (cuBLAS tile height), below 2^31
    logits per chunk (0 or less: none fit)."""
    return _round_down(min(nbytes // (4 * V), 2**31 // V), 128)


def _chunk_override() -> int:
    """Tokens per forward chunk fixed by the environment (0: not fixed)."""
    fixed = env_sizes(CHUNK_ENV, 1)
    return fixed[0] if fixed else 0


def lean_budget_bytes(BT: int, H: int, V: int, itemsize: int) -> int:
    """Bytes the lean mode may use beyond its gradients (LEAN_EXTRA_FRACTION of them)."""
    return int(LEAN_EXTRA_FRACTION * (V + BT) * H * itemsize)


def flce_chunk_tokens(BT: int, V: int, max_bytes: int | None = None, logit_bytes: int = 4) -> int:
    """Tokens per run_chunks chunk: CHUNK_BYTES (or max_bytes, if smaller) of logits of
    logit_bytes each, rounded down to a multiple of 128 (cuBLAS tile height), at least 128, at
    most BT."""
    override = _chunk_override()
    if override > 0:
        rows = override
    else:
        budget = CHUNK_BYTES if max_bytes is None else min(CHUNK_BYTES, max_bytes)
        rows = max(128, _round_down(budget // (logit_bytes * V), 128))
    return max(1, min(rows, BT))


def fast_weight_dtype_chunk(BT: int, V: int, logit_bytes: int = 4) -> int | None:
    """The fast mode's default (grad_accum_dtype=None) grad_W accumulation: in the weight's own
    dtype over at most MAX_SUPER_CHUNKS token chunks (the rounding count the policy allows, as
    in the lean mode), when chunks of cdiv(BT, MAX_SUPER_CHUNKS) tokens, but at least
    MIN_FAST_CHUNK_TOKENS (smaller chunks re-read and re-write grad_W too often: 1.8x slower
    at 1024 tokens x 4096 x 128k with 128-token chunks), fit CHUNK_BYTES of logits (of
    logit_bytes each). Returns those chunks' tokens (a multiple of 128), or None.

    Against an fp32 V x H accumulator this saves 4*V*H bytes (plus the conversion's copy) and
    holds a smaller logits chunk: about the memory of Liger's chunked loss, at the same speed
    (the bf16 read-modify-write of grad_W per chunk moves half the fp32 one's bytes)."""
    override = _chunk_override()
    if override > 0:
        return override if cdiv(BT, override) <= MAX_SUPER_CHUNKS else None
    return _even_chunks(BT, V, logit_bytes, MAX_SUPER_CHUNKS, MIN_FAST_CHUNK_TOKENS)


def _even_chunks(BT: int, V: int, logit_bytes: int, chunks: int, min_tokens: int) -> int | None:
    """Tokens per chunk for `chunks` even chunks of BT, rounded up to 128, at least min_tokens,
    where such a chunk's logits fit CHUNK_BYTES; else None."""
    tokens = max(cdiv(cdiv(BT, chunks), 128) * 128, min_tokens)
    return tokens if tokens * V * logit_bytes <= CHUNK_BYTES else None


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one FLCE call runs. lean: the forward keeps only the logsumexp and the backward
    recomputes the logits (else the forward computes every gradient: the fast mode). accum_fp32:
    grad_W summed in fp32 (rounded once), else in its own dtype over at most MAX_SUPER_CHUNKS
    chunks. chunk_bytes: the forward's logits chunk, at most (0: CHUNK_BYTES). block_bytes:
    what the recomputing backward may hold beyond the gradients (logits block + fp32 grad_hidden
    accumulator). fp32_logits: the forward's chunks hold fp32 logits, else bf16 ones, rounded as
    the model's own lm_head rounds them (see bf16_logits_chunk)."""

    lean: bool
    accum_fp32: bool
    chunk_bytes: int
    block_bytes: int
    fp32_logits: bool = True


def bf16_logits_chunk(BT: int, V: int, weight_dtype: torch.dtype, itemsize: int) -> int | None:
    """The default fast mode's chunks for bf16 inputs: bf16 logits (as the model's lm_head and
    the eager reference round them: loss error equal to eager's, gradient errors 1.03-1.06x
    eager's, measured at 2048 tokens of six grid heads) in fast_weight_dtype_chunk's chunks of
    at most CHUNK_BYTES of bf16, grad_W summed in bf16. Against fp32 logits chunks the GEMM
    writes and the kernel reads half the bytes, and twice the tokens fit a chunk. Measured on
    the 8 grid heads against the largest fp32 chunks within 2x the gradients' bytes, in the same
    runs (H100, H200): 0.85-1.02x the time at 0.51-0.82x the peak; at 32k tokens, where no such
    chunks fit and the lean mode ran, 0.70-0.73x the time at the same peak (benchmarks/data,
    part flce).

    Long batches get more chunks: where 8 would pass LONG_CHUNK_TOKENS tokens each, up to
    LONG_MAX_CHUNKS of at least LONG_CHUNK_TOKENS. The grad_W update's GEMM (inner dimension:
    the chunk's tokens) keeps its rate down to 2048 tokens. Measured at 32768 x 2048 x 128256
    (H100, one run; GPU ms / peak MiB / grad_W error against an fp32 reference, x eager bf16's):
    8 chunks 79.7 / 1632 / 1.62x, 16 chunks 80.0 / 1131 / 1.88x, 32 chunks 85.3 / 881 / 2.14x
    (Liger's default chunking, 32 chunks: 80.4 / 881 / 2.14x). Returns the chunk's tokens, or
    None."""
    if weight_dtype != torch.bfloat16 or itemsize != 2:
        return None
    if _chunk_override() > 0 or cdiv(BT, MAX_SUPER_CHUNKS) <= LONG_CHUNK_TOKENS:
        return fast_weight_dtype_chunk(BT, V, logit_bytes=2)
    return _even_chunks(BT, V, 2, LONG_MAX_CHUNKS, LONG_CHUNK_TOKENS)


def bf16_budget_chunk(
    BT: int, V: int, weight_dtype: torch.dtype, itemsize: int, max_bytes: int
) -> int | None:
    """The default's bf16 chunks made smaller for a budget below its own: one size per head, the
    smallest the rules allow: even chunks of at least MIN_FAST_CHUNK_TOKENS tokens (smaller ones
    re-read grad_W too often), at most LONG_MAX_CHUNKS of them (the most bf16 sums of grad_W
    the accuracy policy allows), smaller than the default's, within max_bytes of bf16 logits.
    Returns the chunk's tokens, or None."""
    default = bf16_logits_chunk(BT, V, weight_dtype, itemsize)
    if default is None:
        return None
    tokens = max(cdiv(cdiv(BT, LONG_MAX_CHUNKS), 128) * 128, MIN_FAST_CHUNK_TOKENS)
    fits = tokens < min(default, BT) and tokens * V * 2 <= min(max_bytes, CHUNK_BYTES)
    return tokens if fits else None


def plan(
    BT: int,
    H: int,
    V: int,
    itemsize: int,
    weight_dtype: torch.dtype,
    grad_accum_dtype: torch.dtype | None,
    lean_default: bool,
    memory_budget: float | None,
    grads_now: bool,
    need_weight: bool,
) -> Plan:
    """The mode and sizes of one call (flce.py's docstring). grads_now: a reduced loss whose
    gradients are wanted (the fast mode can compute them in the forward).

    memory_budget None: the backend's own default (triton: the fast mode with chunks of up to
    CHUNK_BYTES; triton_lean: LEAN_EXTRA_FRACTION of the gradients). A number f: at most about
    f x the gradients' bytes (grad_hidden + grad_W) beyond them: the triton default where it
    fits (fast_extra_bytes), else its bf16 chunks made smaller (bf16_budget_chunk), else the
    fast mode's largest fp32 chunks that fit, else the lean mode within it. The block floors of
    flce_blocks (accuracy and GEMM efficiency) win over a budget below them.
    """
    grad_bytes = (BT + V) * H * itemsize
    fp32_ok = grad_accum_dtype in (None, torch.float32)
    own_ok = _sums_in_own_dtype(weight_dtype, grad_accum_dtype)
    if memory_budget is None and not lean_default:
        return _fast_default(BT, V, itemsize, weight_dtype, grad_accum_dtype, grads_now, need_weight)
    extra = int((LEAN_EXTRA_FRACTION if memory_budget is None else memory_budget) * grad_bytes)
    if memory_budget is not None and grads_now:
        # The default wherever it fits: no plan measured faster (fp32 chunks within 2x the
        # gradients 1.00-1.11x its time on the grid heads, H100 and H200).
        fast = _fast_default(BT, V, itemsize, weight_dtype, grad_accum_dtype, grads_now, need_weight)
        if fast_extra_bytes(fast, BT, H, V, need_weight, weight_dtype) <= extra:
            return fast
        # Else the default's bf16 chunks, smaller.
        if need_weight and grad_accum_dtype in (None, weight_dtype):
            tokens = bf16_budget_chunk(BT, V, weight_dtype, itemsize, extra)
            if tokens is not None:
                return Plan(False, False, tokens * V * 2, extra, fp32_logits=False)
        # Else a chunk of fp32 logits (at most CHUNK_BYTES, run_chunks' cap), and grad_W summed
        # in its own dtype over at most MAX_SUPER_CHUNKS chunks, or else in an fp32 accumulator
        # that the budget pays for too.
        rows = _chunk_rows(min(extra, CHUNK_BYTES), V)
        summed = own_ok and (rows >= BT or cdiv(BT, max(rows, 1)) <= MAX_SUPER_CHUNKS)
        if rows > 0 and (not need_weight or summed):
            return Plan(False, False, rows * V * 4, extra)
        # (chunks of fewer tokens than MIN_FAST_CHUNK_TOKENS would read and write the fp32
        # accumulator so often that the recomputing backward is faster)
        acc_loop, acc_end = _fp32_accumulator_extra(V, H, weight_dtype)
        rows = _chunk_rows(min(extra - acc_loop, CHUNK_BYTES), V)
        if rows >= min(BT, MIN_FAST_CHUNK_TOKENS) and acc_end <= extra and need_weight and fp32_ok:
            return Plan(False, True, rows * V * 4, extra)
    return Plan(True, grad_accum_dtype == torch.float32, grad_bytes + extra, extra)


def _fast_default(
    BT: int,
    V: int,
    itemsize: int,
    weight_dtype: torch.dtype,
    grad_accum_dtype: torch.dtype | None,
    grads_now: bool,
    need_weight: bool,
) -> Plan:
    """The triton backend's default plan (memory_budget None): the fast mode, its chunks as
    flce.py's docstring says."""
    own_ok = _sums_in_own_dtype(weight_dtype, grad_accum_dtype)
    if grads_now and need_weight and grad_accum_dtype in (None, weight_dtype):
        tokens = bf16_logits_chunk(BT, V, weight_dtype, itemsize)
        if tokens is not None:
            return Plan(False, False, tokens * V * 2, CHUNK_BYTES, fp32_logits=False)
    tokens = fast_weight_dtype_chunk(BT, V) if need_weight else None
    accum = grad_accum_dtype == torch.float32 or (grad_accum_dtype is None and (not own_ok or tokens is None))
    chunk = tokens * V * 4 if grads_now and need_weight and not accum and tokens is not None else 0
    return Plan(False, accum, chunk, CHUNK_BYTES)


def _sums_in_own_dtype(weight_dtype: torch.dtype, grad_accum_dtype: torch.dtype | None) -> bool:
    """Whether grad_W may be summed over chunks in the weight's own dtype: asked for, or the
    default for every dtype but fp16 (whose sums keep an fp32 accumulator)."""
    return grad_accum_dtype == weight_dtype or (grad_accum_dtype is None and weight_dtype != torch.float16)


def _fp32_accumulator_extra(V: int, H: int, weight_dtype: torch.dtype) -> tuple[int, int]:
    """Bytes an fp32 grad_W accumulator holds beyond grad_W (V x H in the weight's dtype): during
    the chunks (in grad_W's place) and at the end (its conversion, both alive)."""
    if weight_dtype == torch.float32:
        return 0, 0  # the accumulator is grad_W
    return V * H * (4 - weight_dtype.itemsize), V * H * 4


def fast_extra_bytes(p: Plan, BT: int, H: int, V: int, need_weight: bool, weight_dtype: torch.dtype) -> int:
    """What a fast-mode plan holds beyond the gradients: its largest logits chunk (as run_chunks
    sizes it) beside an fp32 grad_W accumulator's extra bytes, or the accumulator at its end."""
    logit_bytes = 4 if p.fp32_logits else 2
    chunk = flce_chunk_tokens(BT, V, p.chunk_bytes or None, logit_bytes) * V * logit_bytes
    if not (p.accum_fp32 and need_weight):
        return chunk
    acc_loop, acc_end = _fp32_accumulator_extra(V, H, weight_dtype)
    return max(chunk + acc_loop, acc_end)


def flce_blocks(
    BT: int, H: int, V: int, budget: int, whole_tokens: bool, accumulate_h: bool
) -> tuple[int, int]:
    """(tokens per super-chunk, vocabulary columns per block) of run_blocks within `budget` bytes.

    The budget pays for the fp32 logits block (super-chunk x block x 4) and, with accumulate_h,
    the super-chunk's fp32 grad_hidden accumulator (super-chunk x H x 4). whole_tokens: one
    super-chunk of all BT tokens (grad_W rounded once: each block written once); otherwise the
    super-chunks split the tokens evenly, with half the budget for the accumulator, and at
    most MAX_SUPER_CHUNKS of them (accuracy wins over the budget there).
    """
    fixed = env_sizes(BLOCKS_ENV, 2)
    if fixed is not None:
        return (BT if whole_tokens else min(fixed[0], BT)), min(fixed[1], V)
    acc_per_token = 4 * H if accumulate_h else 0
    if whole_tokens or BT <= MIN_SUPER_CHUNK:
        tokens = BT
    else:
        tokens = max(MIN_SUPER_CHUNK, _round_down(budget // 2 // max(acc_per_token, 1), 128))
        tokens = min(max(tokens, cdiv(BT, MAX_SUPER_CHUNKS)), BT)
        n = cdiv(BT, tokens)
        tokens = min(BT, cdiv(cdiv(BT, n), 128) * 128)  # even super-chunks
    left = budget - tokens * acc_per_token
    cols = _round_down(max(left, 0) // (4 * max(tokens, 1)), 128)
    return max(1, tokens), max(1, min(V, max(MIN_VOCAB_BLOCK, cols)))
