"""Shared pieces of the multi-process checks (distributed_checks.py runs them): a tiny Llama,
batches, SGD training, the one-process reference and the comparison.

Tolerances (fp32): losses and final parameters within 1e-5 relative of the one-process run; the
differences come from summation order only (measured ~1e-7). A check that loses a gradient
(e.g. an unsharded weight whose gradient is never reduce-scattered) is off by O(1).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

V, T, B_PER_RANK, STEPS, LR = 512, 32, 2, 3, 0.5
RTOL = 1e-5
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":  # the Triton kernels run on the interpreter; must be set before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")


def registry():
    """A dict of checks and the decorator that fills it (name: the function's without check_)."""
    checks: dict = {}

    def check(fn):
        checks[fn.__name__.removeprefix("check_")] = fn
        return fn

    return checks, check


# --- helpers -------------------------------------------------------------------------------------


def tiny(seed=0, **overrides):
    from lmkernels.convergence.models import build_model

    return build_model("llama", V, T, seed=seed, **overrides).to(DEVICE)


def global_batches(world: int):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, V, (B_PER_RANK * world, T), generator=g).to(DEVICE) for _ in range(STEPS)]


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if type(t).__name__ == "DTensor" else t


def params(model) -> dict[str, torch.Tensor]:
    return {n: full(p.detach()).float().clone() for n, p in model.named_parameters()}


def train(model, batches, rank=None, world=1):
    """SGD steps; rank=None: every rank sees the whole batch (one process, tensor parallel), else
    its slice of rows (data parallel). Returns the global mean loss of each step."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model.train()
    losses = []
    for ids in batches:
        if rank is not None:
            ids = ids.chunk(world)[rank]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach().float().clone()
        if rank is not None:  # equal token counts per rank: the mean of the means is the global mean
            dist.all_reduce(loss)
            loss /= world
        losses.append(loss.item())
    return losses


_REFERENCE = {}


def reference(world: int, **overrides):
    """One process, plain transformers, whole batch, fp32."""
    key = tuple(sorted(overrides.items()))
    if key not in _REFERENCE:
        model = tiny(**overrides)
        losses = train(model, global_batches(world))
        _REFERENCE[key] = (losses, params(model))
    return _REFERENCE[key]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def compare(losses, final, ref, rtol=RTOL) -> dict:
    ref_losses, ref_params = ref
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    param_err = max(rel(final[n], ref_params[n]) for n in ref_params)
    assert set(final) == set(ref_params), f"parameters differ: {set(final) ^ set(ref_params)}"
    assert loss_err <= rtol, f"loss off by {loss_err:.2e} relative (> {rtol}): {losses} vs {ref_losses}"
    assert param_err <= rtol, f"final parameters off by {param_err:.2e} relative (> {rtol})"
    return {"loss_rel_err": loss_err, "param_rel_err": param_err}


def patched(model, backend="eager"):
    from lmkernels.integrations import transformers as lk_hf

    return lk_hf.apply(model, backend=backend)


def fsdp_run(
    ctx, lm_head_alone=False, embed_alone=False, ckpt=None, backend="eager", model_kw=None, **shard_kw
):
    from torch.distributed.fsdp import fully_shard

    model_kw = model_kw or {}
    model = patched(tiny(**model_kw), backend)
    if ckpt is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": ckpt})
    for layer in model.model.layers:
        fully_shard(layer, **shard_kw)
    if embed_alone:
        fully_shard(model.model.embed_tokens, **shard_kw)
    if lm_head_alone:
        fully_shard(model.lm_head, **shard_kw)
    fully_shard(model, **shard_kw)
    if lm_head_alone:
        w = model.lm_head.weight
        assert type(w).__name__ == "DTensor" and w.to_local().shape[0] < V, "lm_head is not sharded"
    losses = train(model, global_batches(ctx["world"]), ctx["rank"], ctx["world"])
    return compare(losses, params(model), reference(ctx["world"], **model_kw))
