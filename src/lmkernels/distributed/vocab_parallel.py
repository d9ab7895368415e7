"""Vocab-parallel fused linear cross entropy: the lm_head weight is sharded on the vocabulary.

Each rank holds rows [start, start + V_local) of the (V, H) weight and the same hidden states.
Per chunk of tokens it computes its shard's logits (fp32, chunk x V_local: the full logits never
exist anywhere), and from them per-token statistics: the shard's max and sum of exp, the target
logit when the target falls in the shard, and the sum of the logits (label smoothing). Two
all-reduces over the group combine them into the global logsumexp and target logit, so the loss
is the one-device loss of `lmkernels.fused_linear_cross_entropy` (same semantics, see
ops/flce.py). The backward recomputes each chunk's logits and forms

    dz_c = g_i * ((1 + 2 s lse_i) * softmax_c - (1 - e) [c == t_i] - e / V)

(times 1 - (z / softcap)^2 under a softcap), so grad_weight is the local shard's own gradient and
grad_hidden, a partial sum over the shards, is all-reduced once.

Plain torch ops chunked over tokens (not the Triton FLCE kernels, which are being rewritten):
the matmuls dominate and run in cuBLAS; the elementwise passes over a chunk are a few extra reads
of chunk x V_local floats.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from lmkernels.registry import LMKernelsError

CHUNK_BYTES = 512 * 2**20  # fp32 logits of one chunk; the backward holds about twice that
CHUNK_ENV = "LMKERNELS_FLCE_CHUNK_TOKENS"
_MM_FP32_OUT = True  # torch.mm(..., out_dtype=float32) works here (CUDA); cleared when it does not


def shard_range(vocab_size: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rows [start, end) of rank's shard under DTensor's Shard(0) (torch.chunk semantics: chunks of
    ceil(V / world), the last ones shorter or empty)."""
    chunk = -(-vocab_size // world_size)
    start = min(rank * chunk, vocab_size)
    return start, min(start + chunk, vocab_size)


def _chunk_tokens(n_tokens: int, v_local: int) -> int:
    override = int(os.environ.get(CHUNK_ENV, "0") or 0)
    if override > 0:
        return override
    return max(1, min(n_tokens, CHUNK_BYTES // (4 * max(v_local, 1))))


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


def _logits(h: torch.Tensor, weight: torch.Tensor, bias, softcap) -> torch.Tensor:
    """fp32 logits of one chunk of tokens."""
    z = _mm_f32(h, weight.T)
    if bias is not None:
        z += bias.float()
    if softcap is not None:
        z = torch.tanh_(z / softcap).mul_(softcap)
    return z


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, group, start, vocab_size, opts):
        ignore_index, reduction, smoothing, softcap, z_scale = opts
        n, v_local = hidden.shape[0], weight.shape[0]
        valid = target != ignore_index
        local_t = target - start
        in_shard = valid & (local_t >= 0) & (local_t < v_local)
        safe_t = torch.where(in_shard, local_t, 0).long()
        # Per token: shard max, shard sum exp(z - shard max), target logit (0 outside), sum of z.
        m = hidden.new_empty(n, dtype=torch.float32)
        stats = hidden.new_zeros(3, n, dtype=torch.float32)
        step = _chunk_tokens(n, v_local)
        for s in range(0, n, step):
            e = min(s + step, n)
            z = _logits(hidden[s:e], weight, bias, softcap)
            m[s:e] = z.amax(dim=1) if v_local else float("-inf")
            stats[1, s:e] = z.gather(1, safe_t[s:e, None])[:, 0] if v_local else 0.0
            if smoothing:
                stats[2, s:e] = z.sum(dim=1)
            stats[0, s:e] = z.sub_(m[s:e, None]).exp_().sum(dim=1)
            del z
        stats[1] = torch.where(in_shard, stats[1], 0.0)
        m_global = m.clone()
        dist.all_reduce(m_global, op=dist.ReduceOp.MAX, group=group)
        # An empty shard has m = -inf and sum 0: exp(-inf - M) * 0 = 0, no nan.
        scale = torch.exp(m - m_global)
        stats[0] = torch.where(stats[0] > 0, stats[0] * scale, 0.0)
        dist.all_reduce(stats, group=group)
        lse = m_global + torch.log(stats[0])
        loss = (1.0 - smoothing) * (lse - stats[1])
        if smoothing:
            loss = loss + (smoothing / vocab_size) * (vocab_size * lse - stats[2])
        if z_scale:
            loss = loss + z_scale * lse.square()
        loss = torch.where(valid, loss, 0.0)
        count = valid.sum()
        ctx.save_for_backward(hidden, weight, bias, target, lse, count)
        ctx.meta = (group, start, vocab_size, opts)
        if reduction == "none":
            return loss
        if reduction == "sum":
            return loss.sum()
        return loss.sum() / count.clamp(min=1)

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, target, lse, count = ctx.saved_tensors
        group, start, vocab_size, (ignore_index, reduction, smoothing, softcap, z_scale) = ctx.meta
        n, v_local = hidden.shape[0], weight.shape[0]
        valid = target != ignore_index
        if reduction == "mean":
            g = grad_out.float() / count.clamp(min=1)
        else:
            g = grad_out.float()
        g = torch.where(valid, g.expand(n), 0.0)
        local_t = target - start
        # -(1 - e) at each token's target column when the target is in this shard (else adds 0)
        in_shard = valid & (local_t >= 0) & (local_t < v_local)
        onehot = torch.where(in_shard, -(1.0 - smoothing), 0.0)
        safe_t = torch.where(in_shard, local_t, 0).long()[:, None]
        p_scale = 1.0 + 2.0 * z_scale * lse  # z-loss adds 2 s lse softmax
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = (
            torch.zeros(n, hidden.shape[1], dtype=torch.float32, device=hidden.device) if need_h else None
        )
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(v_local, dtype=torch.float32, device=weight.device) if need_b else None
        step = _chunk_tokens(n, v_local)
        for s in range(0, n, step):
            e = min(s + step, n)
            z = _logits(hidden[s:e], weight, bias, softcap)
            capped = z.div(softcap).square_().neg_().add_(1.0) if softcap is not None else None
            dz = z.sub_(lse[s:e, None]).exp_().mul_(p_scale[s:e, None])
            if v_local:
                dz.scatter_add_(1, safe_t[s:e], onehot[s:e, None])
            if smoothing:
                dz -= smoothing / vocab_size
            dz.mul_(g[s:e, None])
            if capped is not None:
                dz.mul_(capped)
                del capped
            if need_b:
                grad_b += dz.sum(dim=0)
            dz_low = dz.to(weight.dtype)  # the matmuls run in the inputs' dtype, like the fused kernels
            del dz
            if need_h:
                grad_h[s:e] = dz_low @ weight
            if need_w:
                grad_w += _mm_f32(dz_low.T, hidden[s:e])
        if need_h:
            dist.all_reduce(grad_h, group=group)  # each shard's vocab contributes a partial sum
            grad_h = grad_h.to(hidden.dtype)
        return (
            grad_h,
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            None,
            None,
            None,
            None,
            None,
        )


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
) -> torch.Tensor:
    """`lmkernels.fused_linear_cross_entropy` of the full (vocab_size, H) weight, from this rank's
    rows [vocab_start, vocab_start + len(weight_shard)) of it (default: DTensor's Shard(0) split
    over `group`). hidden (..., H) and target (...) must be the same on every rank of the group.
    Returns what one device returns; gradients: the local shard's for weight_shard / bias_shard,
    the full one (all-reduced) for hidden. Class weights and return_lse are not supported."""
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
    loss = _VocabParallelCE.apply(
        h, weight_shard, bias_shard, target.reshape(-1), group, vocab_start, vocab_size, opts
    )
    return loss.view(target.shape) if reduction == "none" else loss
