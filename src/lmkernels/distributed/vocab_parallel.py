"""Vocab-parallel fused linear cross entropy: the lm_head weight is sharded on the vocabulary.

Each rank holds rows [start, start + V_local) of the (V, H) weight and the same hidden states.
Per chunk of tokens it computes its shard's logits (fp32, chunk x V_local: the full logits never
exist anywhere) and combines per-token statistics across the group with two small all-reduces:
the max of the shards' logsumexps (MAX), then the sum of exp(shard lse - max), the target logit
(0 outside the shard that holds it) and, for label smoothing, the sum of the logits (SUM).
That gives the global logsumexp, so
the loss is the one-device loss of `lmkernels.fused_linear_cross_entropy` (same semantics, see
ops/flce.py). The gradient of the logits is

    dz_c = g_i * ((1 + 2 s lse_i) * softmax_c - (1 - e) [c == t_i] - e / V)

(times 1 - (z / softcap)^2 under a softcap, and 1 / T with a temperature T, which divides the
logits after the softcap as in the one-device op), so grad_weight is the local shard's own
gradient and grad_hidden, a partial sum over the shards, is all-reduced once.

Two modes, as the Triton FLCE has (backends/triton/flce.py):
- fast (the default): for "mean" / "sum" the forward turns each chunk's logits into dz right
  away and runs the two gradient GEMMs, so the logits GEMM runs once (6*BT*H*V_local flops, what
  an unfused lm_head + loss costs); the backward only scales by the upstream scalar (in place:
  a second backward through the same graph raises autograd's version error).
- lean (`lean=True`; `dtensor_linear_cross_entropy` picks it for backend "triton_lean"), and
  always for reduction "none" or without gradients: the forward keeps the logsumexp, the
  backward recomputes each chunk's logits (8*BT*H*V_local flops), nothing is held in between.

grad_weight accumulates over chunks in the weight's dtype (cuBLAS adds each chunk's product in
place) when there are at most MAX_LOW_PRECISION_SUMS chunks of bf16 / fp32 weights, the rounding
count the FLCE's policy allows; otherwise in fp32. The GEMMs are cuBLAS's. The elementwise work
per chunk runs in the one-device FLCE's Triton row kernel where it can (_use_triton: CUDA, no
bias, not fp16): one read for the shard's logsumexp, one read and a half-size write for dz,
written over the chunk's logits. Elsewhere torch ops do it in about three times the traffic.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from lmkernels.registry import LMKernelsError
from lmkernels.utils import check_choice, env_sizes

CHUNK_BYTES = 512 * 2**20  # fp32 logits of one chunk; the softcap's backward holds twice that
CHUNK_ENV = "LMKERNELS_FLCE_CHUNK_TOKENS"
# (ignore_index, reduction, label_smoothing, softcap, z_loss_scale)
_Opts = tuple[int, str, float, float | None, float]
MAX_LOW_PRECISION_SUMS = 8  # as the Triton FLCE's MAX_SUPER_CHUNKS
# The elementwise passes' implementation: "triton" (the FLCE's row kernel) or "torch" (ops);
# unset or empty: where _use_triton allows. Tests run the kernel on the CPU interpreter with it.
ROWS_ENV = "LMKERNELS_VOCAB_PARALLEL_ROWS"
_MM_FP32_OUT = True  # torch.mm(..., out_dtype=float32) works here (CUDA); cleared when it does not


def shard_range(vocab_size: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rows [start, end) of rank's shard under DTensor's Shard(0) (torch.chunk semantics: chunks of
    ceil(V / world), the last ones shorter or empty)."""
    chunk = -(-vocab_size // world_size)
    start = min(rank * chunk, vocab_size)
    return start, min(start + chunk, vocab_size)


def _chunk_tokens(n_tokens: int, v_local: int) -> int:
    fixed = env_sizes(CHUNK_ENV, 1)
    if fixed is not None:
        return fixed[0]
    return max(1, min(n_tokens, CHUNK_BYTES // (4 * max(v_local, 1))))


def communication(
    n_tokens: int,
    hidden_size: int,
    vocab_size: int,
    world_size: int,
    *,
    label_smoothing: bool = False,
    chunk_tokens: int | None = None,
) -> list[tuple[str, str, int]]:
    """The collectives one call of the vocab-parallel loss (forward + backward, fast or lean mode:
    the same ones) issues on its group: [(what, op, payload bytes per rank)], in order. n_tokens:
    the rows of hidden (every rank of the group holds the same ones). Per chunk of tokens, two
    all-reduces of fp32 per-token statistics; once, the all-reduce of grad_hidden in fp32 (at the
    end of the forward in fast mode, of the backward in lean mode). A ring all-reduce of b bytes
    moves 2 b (R - 1) / R bytes in and out of each rank. dtensor_linear_cross_entropy adds the
    label check (one all-reduce of 32 bytes, with value checks on) and, for a sequence-sharded
    hidden, its all-gather (n_tokens x hidden_size elements of hidden's dtype)."""
    v_chunk = -(-vocab_size // world_size)  # the largest shard sets the chunk (see _chunks)
    step = chunk_tokens or max(1, min(n_tokens, CHUNK_BYTES // (4 * v_chunk)))
    out = []
    for s in range(0, n_tokens, step):
        n = min(step, n_tokens - s)
        out.append(("max of the shards' logsumexp", "all_reduce MAX", 4 * n))
        parts = 3 if label_smoothing else 2  # sum of exp, target logit (, sum of logits)
        out.append(
            (
                "sum-exp, target logit" + (", sum of logits" if label_smoothing else ""),
                "all_reduce SUM",
                4 * parts * n,
            )
        )
    out.append(("grad_hidden (fp32)", "all_reduce SUM", 4 * n_tokens * hidden_size))
    return out


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with an fp32 result: low-precision inputs multiply on the tensor cores with fp32
    output where torch offers it (CUDA), else upcast first; never a rounded product."""
    global _MM_FP32_OUT
    if a.dtype == torch.float32:
        return a @ b
    if a.is_cuda and _MM_FP32_OUT:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError):  # an older torch / unsupported dtype: upcast instead
            _MM_FP32_OUT = False
    return a.float() @ b.float()


def _raw_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 logits of one chunk of tokens, before the softcap."""
    z = _mm_f32(h, weight.T)
    if bias is not None:
        z += bias.float()
    return z


def _logits(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, softcap: float | None
) -> torch.Tensor:
    """fp32 logits of one chunk of tokens, softcapped (the temperature not yet applied)."""
    z = _raw_logits(h, weight, bias)
    if softcap is not None:
        z = torch.tanh_(z / softcap).mul_(softcap)
    return z


def _scaled_(z: torch.Tensor, temperature: float) -> torch.Tensor:
    """The logits divided by the temperature, in place."""
    return z if temperature == 1.0 else z.div_(temperature)


class _Targets:
    """Per-token target bookkeeping for this rank's shard."""

    def __init__(
        self, target: torch.Tensor, ignore_index: int, start: int, v_local: int, smoothing: float
    ) -> None:
        self.valid = target != ignore_index
        local_t = target - start
        self.in_shard = self.valid & (local_t >= 0) & (local_t < v_local)
        self.safe_t = torch.where(self.in_shard, local_t, 0).long()[:, None]
        # -(1 - e) at each token's target column when the target is in this shard (else adds 0)
        self.onehot = torch.where(self.in_shard, -(1.0 - smoothing), 0.0)


def _local_stats_torch_(
    z: torch.Tensor, tg: _Targets, s: int, e: int, smoothing: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk's logits z (bias and softcap applied) -> exp(z - m) in place, m the row max
    over this shard. Returns (this shard's logsumexp, m, target logit (0 outside the shard),
    sum of the logits or None)."""
    n, v_local = z.shape
    if not v_local:
        none = z.new_full((n,), float("-inf"))
        return none, none, z.new_zeros(n), z.new_zeros(n) if smoothing else None
    target_z = torch.where(tg.in_shard[s:e], z.gather(1, tg.safe_t[s:e])[:, 0], 0.0)
    sum_z = z.sum(dim=1) if smoothing else None
    m = z.amax(dim=1)
    lse_local = m + torch.log(z.sub_(m[:, None]).exp_().sum(dim=1))
    return lse_local, m, target_z, sum_z


def _cap(x: torch.Tensor, softcap: float | None, temperature: float = 1.0) -> torch.Tensor:
    x = x if softcap is None else torch.tanh(x / softcap) * softcap
    return x if temperature == 1.0 else x / temperature


def _combine(
    lse_local: torch.Tensor,
    target_z: torch.Tensor,
    sum_z: torch.Tensor | None,
    group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The global logsumexp, target logit and sum of logits per token, from every shard's."""
    m = lse_local.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)  # finite: some shard has columns
    parts = [torch.exp(lse_local - m), target_z] + ([sum_z] if sum_z is not None else [])
    stats = torch.stack(parts)
    dist.all_reduce(stats, group=group)
    return m + torch.log(stats[0]), stats[1], stats[2] if sum_z is not None else None


def _dlogits(
    ez: torch.Tensor,
    inv_sum: torch.Tensor | float,
    capped: torch.Tensor | None,
    lse: torch.Tensor,
    tg: _Targets,
    s: int,
    e: int,
    g: torch.Tensor,
    opts: _Opts,
    vocab_size: int,
    low_dtype: torch.dtype | None,
) -> torch.Tensor:
    """dz of one chunk from ez = softmax / inv_sum (overwritten) and g, the per-token upstream
    gradient: in low_dtype, or fp32 if low_dtype is None. The common case (low_dtype given; no
    smoothing, softcap or z-loss) folds every per-row factor into one multiply that writes
    low_dtype directly: two fewer passes over the chunk."""
    _, _, smoothing, _, z_scale = opts
    scale = g * (1.0 + 2.0 * z_scale * lse) * inv_sum  # z-loss adds 2 s lse softmax
    onehot = tg.onehot[s:e] * g
    if low_dtype is not None and capped is None and not smoothing and not z_scale:
        if ez.shape[1]:
            # (ez + onehot / scale) * scale; scale is 0 only where g is (e.g. ignored tokens)
            fix = torch.where(scale != 0, onehot / scale, 0.0)
            ez.scatter_add_(1, tg.safe_t[s:e], fix[:, None])
        return torch.mul(ez, scale[:, None], out=torch.empty(ez.shape, dtype=low_dtype, device=ez.device))
    ez.mul_(scale[:, None])
    if ez.shape[1]:
        ez.scatter_add_(1, tg.safe_t[s:e], onehot[:, None])
    if smoothing:
        ez.sub_((g * (smoothing / vocab_size))[:, None])
    if capped is not None:
        ez.mul_(capped)
    return ez if low_dtype is None else ez.to(low_dtype)


def _softcap_slope(z: torch.Tensor, softcap: float | None) -> torch.Tensor | None:
    """d capped / d uncapped = 1 - (z / softcap)^2, from the capped logits (before they are
    overwritten)."""
    return None if softcap is None else z.div(softcap).square_().neg_().add_(1.0)


class _GradSums:
    """grad_hidden (fp32, all-reduced at the end), grad_weight and grad_bias over the chunks."""

    def __init__(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        needs: tuple[bool, ...],
        n_chunks: int,
    ) -> None:
        need_h, need_w, need_b = needs
        n, v_local = hidden.shape[0], weight.shape[0]
        low_ok = weight.dtype != torch.float16 and n_chunks <= MAX_LOW_PRECISION_SUMS
        self.w_dtype = weight.dtype if low_ok else torch.float32
        f32, device = torch.float32, hidden.device
        self.h = torch.zeros(n, hidden.shape[1], dtype=f32, device=device) if need_h else None
        self.w = torch.zeros(weight.shape, dtype=self.w_dtype, device=weight.device) if need_w else None
        self.b = torch.zeros(v_local, dtype=f32, device=device) if need_b and bias is not None else None

    def low_dtype(self, weight: torch.Tensor) -> torch.dtype | None:
        """The dtype _dlogits should return: fp32 while the bias gradient sums it (rare: an
        lm_head bias), else the weight's (the matmuls run in the inputs' dtype, like the fused
        kernels)."""
        return None if self.b is not None else weight.dtype

    def add(self, dz: torch.Tensor, hidden_c: torch.Tensor, weight: torch.Tensor, s: int, e: int) -> None:
        if self.b is not None:
            self.b += dz.sum(dim=0)
        dz_low = dz.to(weight.dtype)
        if self.h is not None:
            self.h[s:e] = _mm_f32(dz_low, weight)
        if self.w is not None:
            if self.w_dtype == torch.float32:
                self.w += _mm_f32(dz_low.T, hidden_c)
            else:
                self.w.addmm_(dz_low.T, hidden_c)

    def finish(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: dist.ProcessGroup | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        gh = None
        if self.h is not None:
            dist.all_reduce(self.h, group=group)  # each shard's vocab contributes a partial sum
            gh = self.h.to(hidden.dtype)
        gw = None if self.w is None else self.w.to(weight.dtype)
        gb = None if self.b is None or bias is None else self.b.to(bias.dtype)
        return gh, gw, gb


def _chunks(n: int, vocab_size: int, group: dist.ProcessGroup | None) -> list[tuple[int, int]]:
    """The token chunks, alike on every rank of the group: sized for the largest Shard(0) shard,
    ceil(V / R) rows. (Sized for each rank's own shard, an uneven split, e.g. V = 151665 over 4
    ranks, gave ranks different chunk counts, hence different numbers of collectives.)"""
    step = _chunk_tokens(n, -(-vocab_size // dist.get_world_size(group)))
    return [(s, min(s + step, n)) for s in range(0, n, step)]


def _use_triton(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """The FLCE's Triton row kernel does the elementwise work when it can: on CUDA (or when
    ROWS_ENV asks for it, e.g. on the CPU interpreter in tests), without a bias (its kernel
    reads a full-vocabulary bias), not in fp16 (whose dlogits need the FLCE's scaling), and not
    while torch.compile traces (torch ops are what it can trace). ROWS_ENV=triton where it
    cannot run raises; ROWS_ENV=torch always takes the torch ops."""
    choice = os.environ.get(ROWS_ENV, "").strip()
    if choice:
        check_choice(ROWS_ENV, choice, ("triton", "torch"))
    if choice == "torch":
        return False
    obstacles = [
        what
        for what, present in (
            ("a bias", bias is not None),
            ("fp16", weight.dtype == torch.float16),
            ("torch.compile tracing", torch.compiler.is_compiling()),
        )
        if present
    ]
    if not choice:  # the default: CUDA, no obstacle, Triton usable (imported only then)
        if obstacles or not weight.is_cuda:
            return False
        from lmkernels.backends.triton import triton_unavailable_reason

        return triton_unavailable_reason() is None
    from lmkernels.backends.triton import triton_devices, triton_unavailable_reason

    if weight.device.type not in triton_devices():
        obstacles.append(f"a {weight.device.type} weight")
    unavailable = triton_unavailable_reason()
    if unavailable is not None:
        obstacles.append(unavailable)
    if obstacles:  # asked for by name: never a silent fallback
        raise LMKernelsError(f"{ROWS_ENV}=triton: the row kernel cannot run here ({'; '.join(obstacles)})")
    return True


class _TritonRows:
    """The one-device FLCE's Triton row kernel (backends/triton/flce_kernels.py) on this
    shard's chunks, set up once per call."""

    def __init__(
        self,
        target: torch.Tensor,
        tg: _Targets,
        opts: _Opts,
        vocab_size: int,
        v_local: int,
        max_chunk: int,
        device: torch.device,
        temperature: float,
    ) -> None:
        from lmkernels.backends.triton import flce_kernels as kernels
        from lmkernels.backends.triton.configs import tables_for

        ignore_index, _, smoothing, softcap, z_scale = opts
        self.kernels, self.tg, self.smoothing, self.softcap = kernels, tg, smoothing, softcap
        self.temperature = temperature
        self.v_local, self.max_chunk, self.device = v_local, max_chunk, device
        # Pass 2 (dlogits): the full problem, the chunk's columns starting at the shard's first
        # vocabulary row. Pass 1 (this shard's logsumexp, forward only) is set up when first used.
        self.table = tables_for(device).flce
        self.grads = kernels.Rows(
            target, None, None, ignore_index, smoothing, softcap, z_scale, vocab_size, self.table, temperature
        )
        self.stats: Any = None

    def local_stats(
        self, z: torch.Tensor, s: int, e: int
    ) -> tuple[torch.Tensor, None, torch.Tensor, torch.Tensor | None]:
        """_local_stats_torch_'s results from raw logits z (no softcap applied; kept): one read
        of the chunk (two with label smoothing)."""
        n, cap, temp = z.shape[0], self.softcap, self.temperature
        tg = self.tg
        if self.v_local:
            target_z = torch.where(tg.in_shard[s:e], _cap(z.gather(1, tg.safe_t[s:e])[:, 0], cap, temp), 0.0)
        else:  # a shard without vocabulary rows holds no target (gather needs a column)
            target_z = z.new_zeros((n,))
        sum_z = None
        if self.smoothing:
            sum_z = z.sum(dim=1) if cap is None else torch.tanh(z / cap).sum(dim=1) * cap
            sum_z = sum_z if temp == 1.0 else sum_z / temp
        lse_local = z.new_full((n,), float("-inf"))
        if self.v_local:
            if self.stats is None:  # no target, no smoothing: only the logsumexp is wanted
                no_target = torch.full((self.max_chunk,), -1, dtype=torch.long, device=self.device)
                self.stats = self.kernels.Rows(
                    no_target, None, None, -1, 0.0, cap, 0.0, self.v_local, self.table, temp
                )
                self.scratch = torch.empty(self.max_chunk, dtype=torch.float32, device=self.device)
            self.stats.launch(z, None, slice(0, n), lse_local, self.scratch, None, 0, False)
        return lse_local, None, target_z, sum_z

    def dlogits(
        self,
        z: torch.Tensor,
        lse: torch.Tensor,
        g: torch.Tensor,
        s: int,
        e: int,
        start: int,
        low_dtype: torch.dtype,
    ) -> torch.Tensor:
        """dz of one chunk from its raw logits z: written in low_dtype over z's own memory (each
        row's values fill the first bytes of its fp32 row)."""
        dz = self.kernels._dlogits_view(z, low_dtype)
        self.grads.launch(z, dz, slice(s, e), lse, None, g, start, True)
        ready: torch.Tensor = self.kernels._gemm_ready(dz)  # contiguous on the CPU (see there)
        return ready


def _triton_rows(
    target: torch.Tensor,
    tg: _Targets,
    opts: _Opts,
    vocab_size: int,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    chunks: list[tuple[int, int]],
    temperature: float,
) -> _TritonRows | None:
    """A _TritonRows where _use_triton allows, else None (torch ops)."""
    if not _use_triton(weight, bias):
        return None
    max_chunk = max(e - s for s, e in chunks)
    return _TritonRows(target, tg, opts, vocab_size, weight.shape[0], max_chunk, weight.device, temperature)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        target: torch.Tensor,
        group: dist.ProcessGroup | None,
        start: int,
        vocab_size: int,
        opts: _Opts,
        fast: bool,
        temperature: float,
    ) -> torch.Tensor:
        ignore_index, reduction, smoothing, softcap, z_scale = opts
        n, v_local = hidden.shape[0], weight.shape[0]
        tg = _Targets(target, ignore_index, start, v_local, smoothing)
        count = tg.valid.sum()
        chunks = _chunks(n, vocab_size, group)
        triton_rows = _triton_rows(target, tg, opts, vocab_size, weight, bias, chunks, temperature)
        if fast:
            # The upstream gradient of each token's loss, with the loss's own reduction; the
            # backward multiplies by grad_out. (The torch ops take the temperature's chain
            # factor 1/T with it: dz is linear in g; the row kernel applies it itself.)
            g = 1.0 / count.clamp(min=1) if reduction == "mean" else torch.ones((), device=hidden.device)
            g_rows = torch.where(tg.valid, g, 0.0) / temperature
            sums = _GradSums(hidden, weight, bias, ctx.needs_input_grad[:3], len(chunks))
        lse = hidden.new_empty(n, dtype=torch.float32)
        loss = hidden.new_empty(n, dtype=torch.float32)
        for s, e in chunks:
            if triton_rows is not None:
                z = _raw_logits(hidden[s:e], weight, bias)  # the kernel applies the softcap
                lse_local, m, target_z, sum_z = triton_rows.local_stats(z, s, e)
            else:
                z = _logits(hidden[s:e], weight, bias, softcap)
                capped = _softcap_slope(z, softcap) if fast else None
                lse_local, m, target_z, sum_z = _local_stats_torch_(
                    _scaled_(z, temperature), tg, s, e, smoothing
                )
            lse_c, target_z, sum_z = _combine(lse_local, target_z, sum_z, group)
            loss_c = (1.0 - smoothing) * (lse_c - target_z)
            if smoothing:
                assert sum_z is not None  # (summed whenever there is smoothing)
                loss_c = loss_c + (smoothing / vocab_size) * (vocab_size * lse_c - sum_z)
            if z_scale:
                loss_c = loss_c + z_scale * lse_c.square()
            lse[s:e], loss[s:e] = lse_c, loss_c
            if fast and triton_rows is not None:
                dz = triton_rows.dlogits(z, lse, g, s, e, start, weight.dtype)
            elif fast:
                # z holds exp(z - m): the softmax is z * exp(m - lse)
                assert m is not None  # (the torch ops' row max)
                inv_sum = torch.exp(m - lse_c)
                low = sums.low_dtype(weight)
                dz = _dlogits(z, inv_sum, capped, lse_c, tg, s, e, g_rows[s:e], opts, vocab_size, low)
            if fast:
                sums.add(dz, hidden[s:e], weight, s, e)
                del dz
            del z
        loss = torch.where(tg.valid, loss, 0.0)
        ctx.fast = fast
        # The FLCE's scale_ where its kernels run: one pass, where torch's mul_ by a 0-dim CUDA tensor is slower.
        ctx.scale_ = triton_rows.kernels.scale_ if triton_rows is not None else torch.Tensor.mul_
        if fast:
            ctx.save_for_backward(*sums.finish(hidden, weight, bias, group))
        else:
            ctx.save_for_backward(hidden, weight, bias, target, lse, count)
            ctx.meta = (group, start, vocab_size, opts, temperature)
        if reduction == "none":
            return loss
        if reduction == "sum":
            return loss.sum()
        return loss.sum() / count.clamp(min=1)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.fast:
            # The gradients of the reduced loss, computed in the forward; the buffers are ours.
            grads = [None if t is None else ctx.scale_(t, grad_out) for t in ctx.saved_tensors]
            return (*grads, *[None] * 7)
        hidden, weight, bias, target, lse, count = ctx.saved_tensors
        group, start, vocab_size, opts, temperature = ctx.meta
        ignore_index, reduction, smoothing, softcap, _ = opts
        n, v_local = hidden.shape[0], weight.shape[0]
        tg = _Targets(target, ignore_index, start, v_local, smoothing)
        g = grad_out.float() / count.clamp(min=1) if reduction == "mean" else grad_out.float()
        chunks = _chunks(n, vocab_size, group)
        sums = _GradSums(hidden, weight, bias, ctx.needs_input_grad[:3], len(chunks))
        triton_rows = _triton_rows(target, tg, opts, vocab_size, weight, bias, chunks, temperature)
        # torch ops: with the temperature's chain factor (the row kernel applies it itself)
        g_rows = torch.where(tg.valid, g.expand(n), 0.0) / temperature if triton_rows is None else None
        for s, e in chunks:
            if triton_rows is not None:
                z = _raw_logits(hidden[s:e], weight, bias)
                dz = triton_rows.dlogits(z, lse, g, s, e, start, weight.dtype)
            else:
                assert g_rows is not None  # (set whenever triton_rows is None)
                z = _logits(hidden[s:e], weight, bias, softcap)
                capped = _softcap_slope(z, softcap)
                p = _scaled_(z, temperature).sub_(lse[s:e, None]).exp_()
                low = sums.low_dtype(weight)
                dz = _dlogits(p, 1.0, capped, lse[s:e], tg, s, e, g_rows[s:e], opts, vocab_size, low)
            sums.add(dz, hidden[s:e], weight, s, e)
            del z, dz
        return (*sums.finish(hidden, weight, bias, group), *[None] * 7)


def vocab_parallel_cross_entropy(
    hidden: torch.Tensor,
    weight_shard: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_size: int,
    group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    bias_shard: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    z_loss_scale: float = 0.0,
    temperature: float = 1.0,
    lean: bool = False,
) -> torch.Tensor:
    """`lmkernels.fused_linear_cross_entropy` of the full (vocab_size, H) weight, from this rank's
    rows [vocab_start, vocab_start + len(weight_shard)) of it (default: DTensor's Shard(0) split
    over `group`). hidden (..., H) and target (...) must be the same on every rank of the group.
    Returns what one device returns; gradients: the local shard's for weight_shard / bias_shard,
    the full one (all-reduced) for hidden. `temperature` divides the logits after the softcap,
    as in the one-device op. Class weights, return_lse and return_stats are not supported.
    `lean`: recompute the logits in the backward instead of computing the gradients in the
    forward (module docstring)."""
    if reduction not in ("mean", "sum", "none"):
        raise LMKernelsError(f"reduction: expected one of ('mean', 'sum', 'none'), got {reduction!r}")
    if weight_shard.dim() != 2 or hidden.shape[-1] != weight_shard.shape[1]:
        raise LMKernelsError(
            f"weight_shard: expected shape (V_local, {hidden.shape[-1]}) to match hidden's last dim, "
            f"got {tuple(weight_shard.shape)}"
        )
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise LMKernelsError(f"target: expected shape {tuple(hidden.shape[:-1])}, got {tuple(target.shape)}")
    if weight_shard.dtype != hidden.dtype:
        raise LMKernelsError(
            f"weight_shard: expected dtype {hidden.dtype} (same as hidden), got {weight_shard.dtype}"
        )
    if not 0.0 <= label_smoothing <= 1.0:
        raise LMKernelsError(f"label_smoothing: expected a number in [0, 1], got {label_smoothing}")
    if softcap is not None and not softcap > 0:
        raise LMKernelsError(f"softcap: expected None or a positive number, got {softcap}")
    if not 0.0 < temperature < float("inf"):
        raise LMKernelsError(f"temperature: expected a positive finite number, got {temperature}")
    if vocab_start is None:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        vocab_start, end = shard_range(vocab_size, world, rank)
        if end - vocab_start != weight_shard.shape[0]:
            raise LMKernelsError(
                f"weight_shard: rank {rank} of {world} should hold rows [{vocab_start}, {end}) of a "
                f"vocabulary of {vocab_size} (Shard(0) split), got {weight_shard.shape[0]} rows; "
                f"pass vocab_start for another split"
            )
    if bias_shard is not None and tuple(bias_shard.shape) != (weight_shard.shape[0],):
        raise LMKernelsError(
            f"bias_shard: expected shape ({weight_shard.shape[0]},), got {tuple(bias_shard.shape)}"
        )
    opts = (ignore_index, reduction, float(label_smoothing), softcap, float(z_loss_scale))
    h = hidden.reshape(-1, hidden.shape[-1])
    wants_grad = any(t is not None and t.requires_grad for t in (h, weight_shard, bias_shard))
    fast = not lean and reduction != "none" and torch.is_grad_enabled() and wants_grad
    loss = _VocabParallelCE.apply(
        h,
        weight_shard,
        bias_shard,
        target.reshape(-1),
        group,
        vocab_start,
        vocab_size,
        opts,
        fast,
        float(temperature),
    )
    return loss.view(target.shape) if reduction == "none" else loss
