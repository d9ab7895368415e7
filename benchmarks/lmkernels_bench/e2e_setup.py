"""What every end-to-end benchmark shares: model presets and their construction, the patching
configurations, random token batches, the optimizer and training step, the timing loop and the
memory timeline. Used by the end-to-end benchmark (e2e.py); the distributed one (scale_worker.py)
takes its model preset and tiny sizes.

Configurations (names as on the command line):
  plain                transformers as is
  lmk[:BACKEND]        lmkernels.integrations.transformers.apply(model, backend=BACKEND) with
                       rms_norm, rope, mlp and flce; no BACKEND: automatic choice
  liger                liger_kernel's apply_liger_kernel_to_llama(model=...) (RoPE, RMSNorm,
                       SwiGLU, FLCE)
  ...-noflce           a patched one without the fused loss (the ablation)
  lmk...-nocheck       with LMKERNELS_CHECK_VALUES=0: no target range check, so no host sync
                       per loss (what the default's check costs)
  ...-1thread          the backward on the training thread: torch.autograd.
                       set_multithreading_enabled(False), where CUDA's default hands it to a
                       device thread (what that hand-over costs in the host-bound regime)
  ...+compile          then torch.compile(model) (model.compile(), batch dimension dynamic)
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

ALL_OPS = ("rms_norm", "rope", "mlp", "flce", "causal_mask")
MIN_TIMED_S = 1.5  # time at least this many seconds of steps per point (see time_steps)
MAX_STEPS = 40

LLAMA_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
# The tiny models' sizes (over a full-size preset's other fields), here and in scale_worker.py: to
# check the scripts themselves on the CPU.
TINY_SIZES = dict(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
MODELS: dict[str, dict[str, Any]] = {
    "llama-1b": LLAMA_1B,
    # The same ~1B body with a Gemma-sized vocabulary (tied, 0.5B embedding parameters): the
    # lm_head + loss take the largest share of the step, where FLCE matters most.
    "llama-1b-v256k": dict(LLAMA_1B, vocab_size=256000),
    "tiny": dict(LLAMA_1B, **TINY_SIZES, num_hidden_layers=2, max_position_embeddings=4096),
}
MODEL_TITLES = {
    "llama-1b": "Llama-3.2-1B shape (vocab 128256)",
    "llama-1b-v256k": "Llama-3.2-1B body, vocab 256000",
    "tiny": "tiny (2 layers, vocab 1000)",
}


def build_model(model_cfg: dict[str, Any], device: str, checkpointing: bool = True):
    """transformers LlamaForCausalLM, random init, bf16 parameters allocated on `device`,
    gradient checkpointing (non-reentrant), no KV cache, train mode."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**model_cfg)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # allocate the parameters in bf16 directly
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    if checkpointing:
        # transformers 5 renamed gradient checkpointing to activation checkpointing.
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    return model


# Optional suffixes of a configuration's name, in the order they are written.
SUFFIXES = ("-noflce", "-nocheck", "-1thread", "+compile")


def split_suffixes(name: str) -> tuple[str, set[str]]:
    """("lmk:triton", {"-noflce", "+compile"}) for "lmk:triton-noflce+compile": the base name and
    the SUFFIXES it ends with, each at most once and in SUFFIXES' order."""
    found = set()
    for suffix in reversed(SUFFIXES):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            found.add(suffix)
    return name, found


def parse_config(name: str) -> tuple[str, str | None, tuple[str, ...], bool]:
    """lmk:triton-noflce+compile -> ("lmk", "triton", ops without flce, compiled=True);
    lmk:triton/flce=triton_lean -> ("lmk", "triton,flce=triton_lean", all ops, False).
    "-nocheck" (lmk only) and "-1thread" are read by `patch` (value_checks, backward_threads)."""
    base, found = split_suffixes(name)
    noflce = "-noflce" in found
    kind, _, backend = base.partition(":")
    if (
        kind not in ("plain", "lmk", "liger")
        or (kind == "plain" and (backend or noflce))
        or ("-nocheck" in found and kind != "lmk")
    ):
        raise ValueError(
            f"unknown configuration {name!r}: plain, lmk[:BACKEND] or liger, then optionally "
            "-noflce (not plain), -nocheck (lmk only), -1thread and +compile"
        )
    ops = tuple(o for o in ALL_OPS if not (noflce and o == "flce"))
    # "/" stands for the "," of a backend spec ("lmk:triton/flce=triton_lean"): configurations
    # are listed comma-separated on the command line.
    return kind, backend.replace("/", ",") or None, ops, "+compile" in found


def patch(model, name: str):
    """Apply configuration `name` to `model` (in place); returns the model."""
    kind, backend, ops, compiled = parse_config(name)
    if not value_checks(name):
        os.environ["LMKERNELS_CHECK_VALUES"] = "0"  # read at each call; this process runs one configuration
    if not backward_threads(name):
        import torch

        # Thread-local: the worker trains on this thread.
        torch.autograd.set_multithreading_enabled(False)
    if kind == "lmk":
        from lmkernels.integrations.transformers import apply

        apply(model, backend=backend, ops=ops)
    elif kind == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(
            rope="rope" in ops,
            rms_norm="rms_norm" in ops,
            swiglu="mlp" in ops,
            fused_linear_cross_entropy="flce" in ops,
            cross_entropy=False,
            model=model,
        )
    if compiled:
        model.compile()
    return model


def value_checks(name: str) -> bool:
    """Whether configuration `name` keeps lmkernels' value checks (all but "-nocheck" ones)."""
    return "-nocheck" not in split_suffixes(name)[1]


def backward_threads(name: str) -> bool:
    """Whether configuration `name` leaves the backward to autograd's device threads (all but
    "-1thread" ones)."""
    return "-1thread" not in split_suffixes(name)[1]


def make_optimizer(model):
    import torch

    try:
        return torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    except (RuntimeError, TypeError, ValueError):  # no fused AdamW for this device / dtype
        return torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)


def make_batch(vocab_size: int, batch: int, seq: int, device: str, seed: int = 0, dynamic: bool = False):
    """Random token ids (batch, seq); labels = the inputs (the model shifts them). dynamic: mark
    the batch dimension dynamic for torch.compile (one graph for every batch size)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, seq), generator=g).to(device)
    if dynamic:
        torch._dynamo.maybe_mark_dynamic(ids, 0)  # no error where the model specializes it
    return ids


def train_step(model, optimizer, input_ids):
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def time_steps(step, device: str, steps: int, warmup_steps: int, min_timed_s: float = MIN_TIMED_S):
    """Warmup steps, then at least `steps` timed ones (more for short steps, so that at least
    min_timed_s seconds are timed: a few 70 ms steps varied by 1.6x between runs on the H200's
    host). Returns {"step_ms", "steps", "peak_gib" (CUDA: max allocated over the timed steps:
    parameters, gradients, optimizer states, activations), "loss"}."""
    import torch

    cuda = device.startswith("cuda")
    t_step = 0.0
    for _ in range(warmup_steps):
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        t_step = time.perf_counter() - t0
    if warmup_steps:
        steps = min(MAX_STEPS, max(steps, math.ceil(min_timed_s / max(t_step, 1e-3))))
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    if cuda:
        end.record()
        torch.cuda.synchronize()
        elapsed_ms = start.elapsed_time(end)
    else:
        elapsed_ms = (time.perf_counter() - t0) * 1e3
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return {"step_ms": elapsed_ms / steps, "steps": steps, "peak_gib": peak, "loss": float(loss)}


def memory_timeline(step, device: str, max_points: int = 4000) -> dict[str, Any]:
    """Allocated memory over one call of `step` (CUDA), from the caching allocator's trace."""
    import torch

    from lmkernels_bench.timeline import allocated_timeline

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, context=None, stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    index = torch.device(device).index or 0
    events = snapshot["device_traces"][index] if snapshot.get("device_traces") else []
    return allocated_timeline(events, base, max_points)


def environment() -> dict[str, Any]:
    """Device and versions, for the reports."""
    from lmkernels.harness.bench import environment as bench_environment

    return bench_environment()
