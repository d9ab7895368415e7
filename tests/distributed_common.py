"""Shared pieces of the multi-process checks (distributed_checks.py runs them): the device and
backend of this world, a tiny Llama, batches, SGD training, the one-process reference and the
comparison.

Where the checks run (set once per process by `configure`, before lmkernels is imported):
- cpu (CI): gloo, the eager backend; Triton kernels, where a check names them, on the interpreter;
- cuda: cuda:LOCAL_RANK, NCCL (gloo beside it for CPU tensors: CPU offload), the Triton backend
  (the compiled kernels); IEEE fp32 matmuls (no TF32), in the checks and in the reference alike.

Tolerances (fp32; the reference is plain transformers in fp32, one process, whole batch):
- loss of every step within 1e-5 relative, and every parameter tensor within 3e-3 of its training
  update (||p - p_ref|| / ||p_ref - p_init||): the fp32 limits of the convergence policy
  (lmkernels.convergence.compare.TOLERANCES_FP32), which any fp32 implementation of the ops
  meets; a kernel that multiplied in TF32 would not;
- backend "eager" (the ops' formulas are transformers' own, only the summation order and the
  sharding differ; measured ~1e-7): also every parameter within 1e-5 of its norm.
A check that loses a gradient (e.g. an unsharded weight whose gradient is never reduce-scattered)
is off by O(1) in both.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

import torch
import torch.distributed as dist

V, T, B_PER_RANK, STEPS, LR = 512, 32, 2, 3, 0.5
RTOL = 1e-5  # loss (every step) and, under the eager backend, parameters relative to their norm
UPDATE_RTOL = 3e-3  # parameters relative to their training update, any backend

DEVICE = torch.device("cpu")
BACKEND = "eager"


def configure(device: str, backend: str | None = None) -> None:
    """Set this process's device ("cpu" or "cuda") and the patched models' default backend
    (None: eager on the CPU, triton on CUDA). Must run before triton / lmkernels are imported."""
    global DEVICE, BACKEND
    # The checks name their backends; an LMKERNELS_BACKEND from the shell would change the rest.
    os.environ.pop("LMKERNELS_BACKEND", None)
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels on the interpreter
        DEVICE = torch.device("cpu")
    elif device == "cuda":
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            raise RuntimeError(
                "--device cuda runs the compiled Triton kernels: unset TRITON_INTERPRET "
                f"(it is {os.environ['TRITON_INTERPRET']!r})"
            )
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda: torch sees no CUDA device")
        DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(DEVICE)
        m = torch.backends.cuda.matmul
        # fp32 means fp32 on both sides of every comparison (torch >= 2.9 raises on mixing the
        # legacy flag with the new one: set the new one where it exists).
        if hasattr(m, "fp32_precision"):
            m.fp32_precision = "ieee"
        else:
            m.allow_tf32 = False
    else:
        raise ValueError(f"device: expected 'cpu' or 'cuda', got {device!r}")
    BACKEND = backend or ("eager" if device == "cpu" else "triton")


def device_mesh(shape: tuple[int, ...], names: tuple[str, ...] | None = None):
    from torch.distributed.tensor import init_device_mesh

    return init_device_mesh(DEVICE.type, shape, mesh_dim_names=names)


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


@contextlib.contextmanager
def saved_tiny(ctx, **overrides):
    """tiny(**overrides) saved with save_pretrained in a directory the ranks share (this machine);
    yields its path, removed afterwards."""
    box = [tempfile.mkdtemp(prefix="lmk-tiny-") if ctx["rank"] == 0 else None]
    dist.broadcast_object_list(box)
    path = os.path.join(box[0], "tiny-llama")
    if ctx["rank"] == 0:
        tiny(**overrides).save_pretrained(path)
    dist.barrier()
    try:
        yield path
    finally:
        dist.barrier()
        if ctx["rank"] == 0:
            shutil.rmtree(box[0], ignore_errors=True)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if type(t).__name__ == "DTensor" else t


def params(model) -> dict[str, torch.Tensor]:
    """Full fp32 copies on the CPU (CPU-offloaded and device parameters compare alike)."""
    return {n: full(p.detach()).to("cpu", torch.float32, copy=True) for n, p in model.named_parameters()}


def optimizer(model):
    """SGD on its foreach path (CUDA's default, asked for on the CPU too, so CI runs what GPUs
    run), over groups that never mix DTensors with plain tensors: the foreach ops reject such a
    mix, and tensor-parallel models hold both (transformers' tp_plan and torch's parallel styles
    leave norms and embeddings plain). See lmkernels.distributed.foreach_safe_param_groups."""
    from lmkernels.distributed import foreach_safe_param_groups

    return torch.optim.SGD(foreach_safe_param_groups(model.parameters()), lr=LR, foreach=True)


def train(model, batches, rank=None, world=1, fused_lm_head=False):
    """SGD steps; rank=None: every rank sees the whole batch (one process, tensor parallel), else
    its slice of rows (data parallel). Returns the global mean loss of each step.
    fused_lm_head: through TRL's fused LM head (model(..., fused_lm_head=True), its loss, plus
    zero times the entropy: the entropy's backward runs)."""
    opt = optimizer(model)
    model.train()
    losses = []
    for ids in batches:
        if rank is not None:
            ids = ids.chunk(world)[rank]
        if fused_lm_head:
            out = model(input_ids=ids, labels=ids, fused_lm_head=True)
            loss = out.loss + 0.0 * out.entropy.sum()
        else:
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
    """One process, plain transformers, whole batch, fp32: (losses, final params, initial params)."""
    key = tuple(sorted(overrides.items()))
    if key not in _REFERENCE:
        model = tiny(**overrides)
        init = params(model)
        losses = train(model, global_batches(world))
        _REFERENCE[key] = (losses, params(model), init)
    return _REFERENCE[key]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def errors(losses, final, ref) -> dict:
    """The worst relative errors against the reference: loss, parameters vs their norm and vs
    their training update (with the tensor where it is worst)."""
    ref_losses, ref_params, init = ref
    assert set(final) == set(ref_params), f"parameters differ: {set(final) ^ set(ref_params)}"
    update = {n: rel(final[n] - init[n], ref_params[n] - init[n]) for n in ref_params}
    worst = max(update, key=update.get)
    return {
        "loss_rel_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
        "param_rel_err": max(rel(final[n], ref_params[n]) for n in ref_params),
        "param_update_rel_err": update[worst],
        "worst_update_param": worst,
    }


def compare(losses, final, ref, backend=None) -> dict:
    """Assert the tolerances of this module's docstring for a run with `backend`."""
    err = errors(losses, final, ref)
    backend = backend or BACKEND
    assert err["loss_rel_err"] <= RTOL, (
        f"loss off by {err['loss_rel_err']:.2e} relative (> {RTOL}): {losses} vs {ref[0]}"
    )
    assert err["param_update_rel_err"] <= UPDATE_RTOL, (
        f"{err['worst_update_param']} off by {err['param_update_rel_err']:.2e} of its training "
        f"update (> {UPDATE_RTOL})"
    )
    if backend == "eager":
        assert err["param_rel_err"] <= RTOL, (
            f"final parameters off by {err['param_rel_err']:.2e} relative (> {RTOL})"
        )
    return {"backend": backend, **err}


def patched(model, backend=None):
    from lmkernels.integrations import transformers as lk_hf

    return lk_hf.apply(model, backend=backend or BACKEND)


def fsdp_run(
    ctx,
    lm_head_alone=False,
    embed_alone=False,
    ckpt=None,
    backend=None,
    model_kw=None,
    trl_outputs=None,
    **shard_kw,
):
    """trl_outputs: TRL's fused LM head with these outputs added to the patched model (before the
    sharding, as TRL's trainers do), trained through it (lmkernels runs it: checked)."""
    from torch.distributed.fsdp import fully_shard

    model_kw = model_kw or {}
    backend = backend or BACKEND
    model = patched(tiny(**model_kw), backend)
    if trl_outputs is not None:
        from trl.trainer.utils import add_fused_lm_head

        vars(model)[patching_record()].hints["entropy_grad"] = "entropy" in trl_outputs
        add_fused_lm_head(model, outputs=trl_outputs)
    if ckpt is not None:
        # transformers 5 renamed gradient checkpointing to activation checkpointing
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": ckpt})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": ckpt})
    # The mesh on DEVICE: FSDP2's default mesh is on the GPU whenever torch sees one, so CPU
    # ranks on a one-GPU machine would each claim cuda:rank.
    shard_kw.setdefault("mesh", device_mesh((ctx["world"],)))
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
    losses = train(model, global_batches(ctx["world"]), ctx["rank"], ctx["world"], trl_outputs is not None)
    out = compare(losses, params(model), reference(ctx["world"], **model_kw), backend)
    if trl_outputs is not None:
        decision = vars(model)[patching_record()].trl_decision
        assert decision is not None and decision.ours, decision and decision.message
        out["trl_head"] = decision.message
    return out


def patching_record() -> str:
    from lmkernels.integrations.transformers import patching

    return patching.RECORD
