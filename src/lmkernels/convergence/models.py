"""Tiny randomly initialized causal LMs of each supported family, built from transformers configs.

Small enough for a CPU run in seconds, but with every feature the patches touch: GQA (4 query
heads, 2 kv heads), a non-power-of-two MLP width, Qwen2's attention biases, Mistral's sliding
window, Gemma's (1 + w) norms, GeGLU and tied embeddings, Gemma2's extra norms, alternating
sliding/global layers and final-logit softcapping.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lmkernels.registry import LMKernelsError

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

FAMILIES = ("llama", "mistral", "qwen2", "gemma", "gemma2")

TINY = {
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


def _config_class(family: str) -> type[PretrainedConfig]:
    import transformers

    classes: dict[str, type[PretrainedConfig]] = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "gemma": transformers.GemmaConfig,
        "gemma2": transformers.Gemma2Config,
    }
    if family not in classes:
        raise LMKernelsError(f"family: expected one of {FAMILIES}, got {family!r}")
    return classes[family]


def tiny_config(family: str, vocab_size: int, max_positions: int, **overrides: Any) -> PretrainedConfig:
    """The transformers config of a tiny `family` model; `overrides` replace any field."""
    fields: dict[str, Any] = dict(TINY, vocab_size=vocab_size, max_position_embeddings=max_positions)
    # Gemma2 uses eager attention in transformers (softcapped attention logits); the others the
    # default SDPA. Attention is never patched, so this only has to match between runs.
    fields["attn_implementation"] = "eager" if family == "gemma2" else "sdpa"
    if family == "mistral":  # a window shorter than the sequence, so sliding attention matters
        fields["sliding_window"] = max(2, max_positions // 2)
    if family == "gemma2":
        # query scaling by head_dim as Gemma2 does; a window shorter than the sequence so the
        # sliding layers differ from the global ones; the default final softcap (30) stays.
        fields.update(query_pre_attn_scalar=TINY["head_dim"], sliding_window=max(2, max_positions // 2))
    fields.update(overrides)
    return _config_class(family)(**fields)


def build_model(
    family: str, vocab_size: int, max_positions: int, seed: int = 0, **overrides: Any
) -> PreTrainedModel:
    """A freshly initialized fp32 model on the CPU; the same seed gives the same weights."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, vocab_size, max_positions, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: PreTrainedModel = AutoModelForCausalLM.from_config(config)
    return model
