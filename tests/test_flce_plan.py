"""The FLCE Triton backend's plan (flce_kernels): chunk and block sizes, the default's chunks and
the memory budget's choices. Host arithmetic only: no kernel runs here (test_triton_flce.py runs
the plans, test_triton_flce_memory.py measures their memory)."""

import pytest
import torch

pytest.importorskip("triton", reason="the Triton backend needs triton")

import lmkernels  # noqa: E402
from lmkernels.backends.triton import flce_kernels as kernels  # noqa: E402

# The frontier benchmark's lm_head shapes (tokens, hidden, vocabulary).
GRID_HEADS = [
    (8192, 4096, 128256),
    (16384, 2560, 151936),
    (32768, 2048, 128256),
    (16384, 3584, 152064),
    (16384, 3072, 128256),
    (4096, 2048, 128256),
    (4096, 2304, 256000),
    (8192, 3584, 256000),
]


def test_chunk_size_rule(monkeypatch):
    monkeypatch.delenv(kernels.CHUNK_ENV, raising=False)
    assert kernels.flce_chunk_tokens(8192, 128256) == 2048  # <= 1 GiB of fp32 logits, 128-aligned
    assert kernels.flce_chunk_tokens(65536, 32000) == 8320
    assert kernels.flce_chunk_tokens(8192, 32000) == 8192  # never more than the tokens
    assert kernels.flce_chunk_tokens(10**6, 10**7) == 128  # never below one GEMM tile
    assert kernels.flce_chunk_tokens(37, 131) == 37
    assert kernels.flce_chunk_tokens(8192, 128256, max_bytes=256 * 2**20) == 512  # a smaller cap
    monkeypatch.setenv(kernels.CHUNK_ENV, "200")
    assert kernels.flce_chunk_tokens(8192, 128256) == 200


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("CHUNK_ENV", "abc"),
        ("CHUNK_ENV", "0"),
        ("BLOCKS_ENV", "16"),
        ("BLOCKS_ENV", "16,-4"),
        ("BLOCKS_ENV", "a,b"),
    ],
)
def test_size_variables_refuse_malformed_values(monkeypatch, name, value):
    variable = getattr(kernels, name)
    monkeypatch.setenv(variable, value)
    with pytest.raises(
        lmkernels.LMKernelsError, match=f"{variable}: expected .*positive integer.*got '{value}'"
    ):
        kernels.flce_chunk_tokens(37, 131) if name == "CHUNK_ENV" else kernels.flce_blocks(
            37, 64, 131, 1 << 20, False, True
        )


def test_block_size_rule(monkeypatch):
    """The lean backward's blocks fit the budget: fp32 logits block + fp32 grad_hidden accumulator."""
    monkeypatch.delenv(kernels.BLOCKS_ENV, raising=False)
    BT, H, V = 8192, 4096, 128256
    budget = kernels.lean_budget_bytes(BT, H, V, 2)
    assert budget == int(0.08 * (V + BT) * H * 2)
    tokens, cols = kernels.flce_blocks(BT, H, V, budget, whole_tokens=False, accumulate_h=True)
    assert (tokens, cols) == (2048, 6784)  # 4 even super-chunks, 19 vocabulary blocks
    assert tokens * (H + cols) * 4 <= budget
    # grad_W rounded once: one super-chunk of every token; the accumulator alone then exceeds the
    # budget and the block shrinks to its floor.
    tokens, cols = kernels.flce_blocks(BT, H, V, budget, whole_tokens=True, accumulate_h=True)
    assert (tokens, cols) == (BT, kernels.MIN_VOCAB_BLOCK)
    # At most MAX_SUPER_CHUNKS roundings of grad_W, even past the budget.
    tokens, _ = kernels.flce_blocks(65536, 2048, 32000, 2**20, whole_tokens=False, accumulate_h=True)
    assert tokens == 65536 // kernels.MAX_SUPER_CHUNKS
    # Never more than the tokens or the vocabulary present.
    assert kernels.flce_blocks(100, 64, 300, 10**9, whole_tokens=False, accumulate_h=True) == (100, 300)


def test_fast_mode_default_accumulation(monkeypatch):
    """The fast mode's default sums grad_W in bf16 over at most MAX_SUPER_CHUNKS chunks where they
    fit CHUNK_BYTES of logits, else keeps the fp32 accumulator (and always for fp16 weights)."""
    monkeypatch.delenv(kernels.CHUNK_ENV, raising=False)
    assert kernels.fast_weight_dtype_chunk(8192, 128256) == 1024  # 8 chunks of 501 MiB
    assert kernels.fast_weight_dtype_chunk(2048, 128256) == 1024  # never below 1024 tokens
    assert kernels.fast_weight_dtype_chunk(16384, 128256) == 2048  # 8 chunks of 1002 MiB
    assert kernels.fast_weight_dtype_chunk(32768, 128256) is None  # 8 chunks would be 2004 MiB each
    assert kernels.fast_weight_dtype_chunk(37, 131) == 1024  # one chunk
    monkeypatch.setenv(kernels.CHUNK_ENV, "16")
    assert kernels.fast_weight_dtype_chunk(37, 131) == 16  # 3 chunks
    assert kernels.fast_weight_dtype_chunk(16 * 9, 131) is None  # 9 chunks

    def accum(BT, dtype=torch.bfloat16, lean=False):
        return kernels.plan(BT, 64, 131, 2, dtype, None, lean, None, True, True).accum_fp32

    assert not accum(37)
    assert accum(37, torch.float16)
    assert accum(16 * 9)
    assert not accum(16 * 9, lean=True)  # lean: its own super-chunk rule


def test_fast_mode_default_chunks(monkeypatch):
    """The default fast mode's plan: bf16 inputs get 8 chunks of bf16 logits (grad_W summed in
    bf16) wherever 8 chunks of BT / 8 tokens fit CHUNK_BYTES of bf16, on long batches up to 16
    (test_long_batch_chunks); past that, 8 chunks of fp32 logits within CHUNK_BYTES summed in
    the weight's dtype, else CHUNK_BYTES chunks into the fp32 accumulator. fp16, or an
    asked-for fp32 accumulation, keep fp32 logits."""
    monkeypatch.delenv(kernels.CHUNK_ENV, raising=False)

    def default(BT, H, V, dtype=torch.bfloat16, accum=None, grads_now=True):
        return kernels.plan(BT, H, V, 2, dtype, accum, False, None, grads_now, True)

    # The measured heads, 4k-32k tokens: 8 chunks, or at 32k tokens 16 (of 2048 tokens).
    for BT, H, V, chunks in [
        (32768, 2048, 128256, 16),
        (16384, 2560, 151936, 8),
        (16384, 3584, 152064, 8),
        (8192, 4096, 128256, 8),
    ]:
        plan = default(BT, H, V)
        assert not plan.fp32_logits and not plan.accum_fp32 and not plan.lean
        assert plan.chunk_bytes == BT // chunks * V * 2 <= kernels.CHUNK_BYTES
    assert default(4096, 2304, 256000).chunk_bytes == kernels.MIN_FAST_CHUNK_TOKENS * 256000 * 2
    assert default(8192, 4096, 128256, accum=torch.bfloat16) == default(8192, 4096, 128256)  # asked for
    # fp16, an fp32 accumulation asked for, a forward without gradients: fp32 logits.
    assert default(16384, 2560, 151936, torch.float16).fp32_logits
    assert default(16384, 2560, 151936, torch.float16).accum_fp32
    assert default(16384, 2560, 151936, accum=torch.float32).fp32_logits
    assert default(8192, 4096, 128256, grads_now=False).fp32_logits
    # Past bf16 chunks (16 of 4096 tokens pass CHUNK_BYTES), and past fp32 chunks (8 of them
    # would pass CHUNK_BYTES too): the fp32 accumulator.
    BT, H, V = 65536, 8192, 256000
    assert kernels.bf16_logits_chunk(BT, V, torch.bfloat16, 2) is None
    assert default(BT, H, V).accum_fp32 and default(BT, H, V).chunk_bytes == 0
    assert default(131072, 2048, 128256).accum_fp32


def test_long_batch_chunks(monkeypatch):
    """Long bf16 batches: where 8 chunks would pass LONG_CHUNK_TOKENS tokens each, up to 16
    chunks of at least that many tokens (rounded up to 128), within CHUNK_BYTES of bf16 logits;
    shorter batches keep 8 chunks of at least MIN_FAST_CHUNK_TOKENS; a fixed chunk size keeps the
    8-chunk limit."""
    monkeypatch.delenv(kernels.CHUNK_ENV, raising=False)

    def tokens(BT, V=128256):
        return kernels.bf16_logits_chunk(BT, V, torch.bfloat16, 2)

    assert kernels.LONG_CHUNK_TOKENS == 2048 and kernels.LONG_MAX_CHUNKS == 16
    assert tokens(16384) == 2048  # 8 chunks of 2048: unchanged
    assert tokens(16512) == 2048  # 8 would be 2064 each: 9 chunks of 2048
    assert tokens(20000) == 2048  # 10 chunks
    assert tokens(32768) == 2048  # 16 chunks
    assert tokens(40000) == 2560  # 16 chunks, 2500 rounded up to 128
    assert tokens(65536) == 4096  # 16 chunks of 1002 MiB
    assert tokens(65536 + 128 * 16) is None  # 16 chunks would pass CHUNK_BYTES
    assert tokens(4096, 256000) == 1024
    monkeypatch.setenv(kernels.CHUNK_ENV, "2048")
    assert tokens(16384) == 2048 and tokens(32768) is None  # 16 fixed chunks: not the default's


def test_memory_budget_plans(monkeypatch):
    """memory_budget: the default wherever it fits f x the gradients' bytes beside them, else its
    bf16 chunks made smaller (16 of at least 1024 tokens), else the fast mode's largest fp32
    chunks that fit, else the lean mode within the budget."""
    monkeypatch.delenv(kernels.CHUNK_ENV, raising=False)
    BT, H, V = 16384, 2560, 151936
    grads = (BT + V) * H * 2

    def plan(budget, accum=None, dtype=torch.bfloat16, grads_now=True, weight=True):
        return kernels.plan(BT, H, V, 2, dtype, accum, False, budget, grads_now, weight)

    default = plan(None)
    need = kernels.fast_extra_bytes(default, BT, H, V, True, torch.bfloat16)
    assert need == 2048 * V * 2  # 8 chunks of 2048 tokens of bf16 logits: 0.72x the gradients
    smallest = 1024 * V * 2  # 16 chunks of 1024 tokens: 0.36x
    for f in (0.0, 0.05, smallest / grads - 0.01):  # below the smallest bf16 chunks: lean
        p = plan(f)
        assert p.lean and p.block_bytes == int(f * grads) and p.chunk_bytes == grads + p.block_bytes
    for f in (smallest / grads, 0.5, need / grads - 0.01):  # between: 16 chunks of 1024 tokens
        p = plan(f)
        assert not p.lean and not p.fp32_logits and not p.accum_fp32
        assert p.chunk_bytes == smallest
    for f in (need / grads, 1.0, 2.0, 10.0):  # the default from its own need up
        assert plan(f) == default
    # An fp32 accumulator asked for: in grad_W's place during the chunks (2 more bytes per
    # element) beside a chunk, and both at the end (4 bytes per element).
    p = plan(2.0, accum=torch.float32)
    assert not p.lean and p.accum_fp32 and p.fp32_logits
    assert 0 < p.chunk_bytes <= int(2.0 * grads) - V * H * 2 and V * H * 4 <= 2.0 * grads
    assert kernels.fast_extra_bytes(p, BT, H, V, True, torch.bfloat16) <= 2.0 * grads
    assert plan(1.0, accum=torch.bfloat16) == default  # summing in bf16 asked for: the default's
    p = plan(0.2, weight=False)  # a frozen lm_head: any chunk that fits (here 256 tokens)
    assert not p.lean and 0 < p.chunk_bytes <= int(0.2 * grads)
    assert plan(0.1, grads_now=False).lean  # "none" or no gradients: the recomputing backward
    # The lean backend without a budget: LEAN_EXTRA_FRACTION of the gradients; with one, the
    # budget decides.
    lean = kernels.plan(BT, H, V, 2, torch.bfloat16, None, True, None, True, True)
    assert lean.lean and lean.block_bytes == int(kernels.LEAN_EXTRA_FRACTION * grads)
    assert kernels.plan(BT, H, V, 2, torch.bfloat16, None, True, 1.0, True, True) == default
    # fp16 weights: the default (an fp32 accumulator beside a 1 GiB chunk of fp32 logits) needs
    # 2.08x the gradients; below that a smaller chunk beside the accumulator.
    default16 = plan(None, dtype=torch.float16)
    need16 = kernels.fast_extra_bytes(default16, BT, H, V, True, torch.float16)
    assert need16 == kernels.flce_chunk_tokens(BT, V) * V * 4 + V * H * 2
    assert plan(need16 / grads + 1e-9, dtype=torch.float16) == default16
    p16 = plan(2.0, dtype=torch.float16)
    assert not p16.lean and p16.accum_fp32 and 0 < p16.chunk_bytes < kernels.CHUNK_BYTES
    assert kernels.fast_extra_bytes(p16, BT, H, V, True, torch.float16) <= 2.0 * grads


def test_memory_budget_never_slower_when_larger(monkeypatch):
    """Across the grid heads (bf16), a larger budget never runs a slower plan: the lean mode, then
    the smaller bf16 chunks (one size), then the default, each from the budget that fits it on."""
    monkeypatch.delenv(kernels.CHUNK_ENV, raising=False)
    for BT, H, V in GRID_HEADS:
        default = kernels.plan(BT, H, V, 2, torch.bfloat16, None, False, None, True, True)
        plans = [
            kernels.plan(BT, H, V, 2, torch.bfloat16, None, False, f / 20, True, True) for f in range(41)
        ]
        first = next(i for i, p in enumerate(plans) if p == default)
        assert all(p == default for p in plans[first:])
        smaller = [i for i, p in enumerate(plans[:first]) if not p.lean]
        assert all(p.lean for p in plans[: smaller[0] if smaller else first])
        assert smaller == list(range(smaller[0], first)) if smaller else True  # one run of them
        assert all(not plans[i].fp32_logits and plans[i].chunk_bytes < default.chunk_bytes for i in smaller)
        assert len({plans[i].chunk_bytes for i in smaller}) <= 1  # one size


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"]
)
def test_planned_chunks_are_the_chunks_that_run(monkeypatch, dtype):
    """A fast plan's chunk is what run_chunks takes (flce_chunk_tokens caps chunks at CHUNK_BYTES),
    so its count of grad_W sums in 16 bits is the one the plan checked: at most LONG_MAX_CHUNKS,
    on the grid heads, long batches and wide vocabularies, at every budget."""
    monkeypatch.delenv(kernels.CHUNK_ENV, raising=False)
    shapes = [*GRID_HEADS, (65536, 8192, 256000), (16384, 2048, 300000), (131072, 4096, 128256)]
    shapes += [(65536, 1024, 151936), (131072, 3584, 151936), (65536, 2048, 256000)]
    for BT, H, V in shapes:
        for budget in (None, 0.05, 0.3, 0.75, 1.0, 1.25, 1.6, 2.0, 2.8, 4.0, 10.0):
            p = kernels.plan(BT, H, V, dtype.itemsize, dtype, None, False, budget, True, True)
            if p.lean:
                continue
            logit_bytes = 4 if p.fp32_logits else 2
            tokens = kernels.flce_chunk_tokens(BT, V, p.chunk_bytes or None, logit_bytes)
            if p.chunk_bytes:
                assert tokens == min(BT, p.chunk_bytes // (V * logit_bytes)), (BT, H, V, budget)
            if not p.accum_fp32 and dtype != torch.float32:
                assert kernels.cdiv(BT, tokens) <= kernels.LONG_MAX_CHUNKS, (BT, H, V, budget)
            if budget is not None:
                assert (
                    kernels.fast_extra_bytes(p, BT, H, V, True, dtype)
                    <= budget * (BT + V) * H * dtype.itemsize
                )


# The plans of a budget, in the order of their time (GPU frontier data, docs/performance.md):
# the default, its bf16 chunks made smaller, fp32 chunks summed in bf16, fp32 chunks into an
# fp32 accumulator, the recomputing (lean) mode.
RANKS = ("default", "smaller bf16 chunks", "fp32 chunks", "fp32 accumulator", "lean")


def _rank(p, default):
    if p == default:
        return 0
    if p.lean:
        return 4
    if not p.fp32_logits:
        return 1
    return 3 if p.accum_fp32 else 2


def _fits(rank, BT, H, V, extra, default):
    """Whether some plan of this rank that the accuracy rules allow fits `extra` bytes, by
    trying every chunk size (a multiple of 128 tokens), not by asking the plan."""
    cap = min(extra, kernels.CHUNK_BYTES)
    sizes = [t for t in range(128, BT + 128, 128)]
    if rank == 0:
        return kernels.fast_extra_bytes(default, BT, H, V, True, torch.bfloat16) <= extra
    if rank == 1:
        most = default.chunk_bytes // (2 * V)
        return any(
            kernels.MIN_FAST_CHUNK_TOKENS <= t < min(most, BT)
            and kernels.cdiv(BT, t) <= kernels.LONG_MAX_CHUNKS
            and t * V * 2 <= cap
            for t in sizes
        )
    if rank == 2:
        return any(
            t * V * 4 <= cap and (t >= BT or kernels.cdiv(BT, t) <= kernels.MAX_SUPER_CHUNKS) for t in sizes
        )
    if rank == 3:
        loop, end = V * H * 2, V * H * 4
        return end <= extra and any(
            t >= min(BT, kernels.MIN_FAST_CHUNK_TOKENS)
            and t * V * 4 <= min(extra - loop, kernels.CHUNK_BYTES)
            for t in sizes
        )
    return True


@pytest.mark.parametrize(
    "head",
    [*GRID_HEADS, (12288, 3072, 128256), (12288, 2048, 151936), (6144, 4096, 128256), (24576, 4096, 128256)],
    ids=lambda h: "x".join(map(str, h)),
)
def test_every_budget_runs_the_fastest_plan_that_fits(monkeypatch, head):
    """bf16, gradients in the forward: at every budget the plan is of the fastest kind that fits
    it (no faster kind of plan fits, found by trying every chunk size), it fits unless it is the
    lean mode at its floor, and a larger budget never gets a slower kind."""
    monkeypatch.delenv(kernels.CHUNK_ENV, raising=False)
    BT, H, V = head
    grads = (BT + V) * H * 2
    default = kernels.plan(BT, H, V, 2, torch.bfloat16, None, False, None, True, True)
    previous = len(RANKS)
    for f in [i / 40 for i in range(81)]:
        p = kernels.plan(BT, H, V, 2, torch.bfloat16, None, False, f, True, True)
        rank, extra = _rank(p, default), int(f * grads)
        faster = [RANKS[r] for r in range(rank) if _fits(r, BT, H, V, extra, default)]
        assert not faster, f"budget {f}: {RANKS[rank]} runs where {faster[0]} fits"
        if not p.lean:
            assert kernels.fast_extra_bytes(p, BT, H, V, True, torch.bfloat16) <= extra
        assert rank <= previous, f"budget {f}: {RANKS[rank]} after {RANKS[previous]} at a smaller budget"
        previous = rank
