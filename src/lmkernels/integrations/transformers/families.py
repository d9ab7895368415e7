"""Model families: which transformers model type a target is, and tiny configs of any of them.

Nothing here decides what gets patched (structure.py does, from the modules themselves); a
family is only the model type, its modeling module and classes, for class-level patching,
reports and tests.
"""

from __future__ import annotations

import dataclasses
import importlib
import types
from typing import TYPE_CHECKING, Any

from torch import nn

from lmkernels.registry import LMKernelsError

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

# The families the tests train (tests/test_integration_families.py), in the table's order.
TESTED = (
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "qwen3_next",
    "phi3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "olmo",
    "olmo2",
    "granite",
    "cohere",
    "glm",
    "smollm3",
    "gpt_neox",
    "starcoder2",
)

# Small enough for a CPU training step in milliseconds; every field is set only where the
# family's config has it. GQA (4 query heads, 2 kv heads), 2 layers, MoE with 4 experts, top 2.
TINY: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 128,
    "max_position_embeddings": 64,
    "num_local_experts": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 48,
    "shared_expert_intermediate_size": 80,
    "query_pre_attn_scalar": 16,
    "attention_dropout": 0.0,
    "hidden_dropout": 0.0,
    "residual_dropout": 0.0,
    "embedding_dropout": 0.0,
    "attn_implementation": "sdpa",
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# Non-default values where the default would hide a feature from the checks: Granite's default
# logits_scaling is 1.0 (a missing scale would pass), sliding windows shorter than the sequence.
FAMILY_TINY: dict[str, dict[str, Any]] = {
    "granite": {"logits_scaling": 4.0, "residual_multiplier": 0.5, "embedding_multiplier": 2.0},
    "mistral": {"sliding_window": 16},
    "gemma2": {"sliding_window": 16, "attn_implementation": "eager"},
    "gemma3_text": {"sliding_window": 16, "final_logit_softcapping": 30.0},
    "cohere": {"use_qk_norm": False},
    # Its default layer pattern puts the first full-attention layer fourth: in 2 layers, one
    # of each kind (gated delta net, then gated attention).
    "qwen3_next": {"layer_types": ["linear_attention", "full_attention"]},
}
# Size fields of one family that TINY does not name (shrink_config applies these too): partial
# rotary dims the default of which exceeds the tiny head (16), an MLP width by another name.
FAMILY_SIZES: dict[str, dict[str, Any]] = {
    "gptj": {"rotary_dim": 8},
    "codegen": {"rotary_dim": 8},
    "opt": {"ffn_dim": 96},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},  # one pair: 2 layers
}
# A verification model (tiny_model, the models patch_report / apply / `lmkernels patch-report`
# build) bigger than this is refused: it means the config kept sizes the tiny fields missed,
# and building it would take minutes and gigabytes for a check meant to take milliseconds.
MAX_VERIFY_PARAMS = 50_000_000


@dataclasses.dataclass(frozen=True)
class Family:
    """A transformers causal-LM model type, its modeling module and its class name prefix."""

    model_type: str
    prefix: str  # class name prefix: f"{prefix}RMSNorm", f"{prefix}ForCausalLM"
    module_name: str

    def module(self) -> types.ModuleType:
        """The family's modeling module (transformers.models.<type>.modeling_<type>)."""
        return importlib.import_module(self.module_name)

    def cls(self, suffix: str) -> type:
        """The family's class named prefix + suffix ("ForCausalLM", "RMSNorm", ...)."""
        return getattr(self.module(), f"{self.prefix}{suffix}")


def check_transformers_version(version: str | None = None) -> None:
    """Raise LMKernelsError unless `version` (default: the installed one) is in the range
    lmkernels supports (pyproject.toml's hf extra; lmkernels/_versions.py reads it): the model
    internals patched here differ in other versions."""
    from lmkernels import _versions

    if version is None:
        import transformers

        version = transformers.__version__
    _versions.check("transformers", version)


def causal_lm_types() -> dict[str, str]:
    """model_type -> causal-LM class name, for every causal LM of the installed transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def causal_lm_class(model_type: str) -> type[PreTrainedModel]:
    """The causal-LM class of `model_type` in the installed transformers (LMKernelsError if none)."""
    import transformers

    names = causal_lm_types()
    if model_type not in names:
        raise LMKernelsError(
            f"model_or_class: model type {model_type!r} has no causal LM in transformers "
            f"{transformers.__version__} (known causal-LM types include {sorted(names)[:8]}...)"
        )
    cls: type[PreTrainedModel] = getattr(transformers, names[model_type])
    return cls


def family(model_type: str) -> Family:
    """The Family of `model_type` (its causal-LM class's prefix and modeling module)."""
    cls = causal_lm_class(model_type)
    return Family(model_type, cls.__name__.removesuffix("ForCausalLM"), cls.__module__)


class _Families(dict):
    """FAMILIES[model_type] -> Family for any causal-LM model type (built on first use)."""

    def __missing__(self, model_type: str) -> Family:
        self[model_type] = value = family(model_type)
        return value


FAMILIES: dict[str, Family] = _Families()


def model_type_of(target: Any) -> str:
    """The model type of a model instance, a model class, or a model_type string."""
    if isinstance(target, str):
        causal_lm_class(target)  # raises for an unknown type
        return target
    if isinstance(target, nn.Module):
        model_type = getattr(getattr(target, "config", None), "model_type", None)
        if model_type is None:
            raise LMKernelsError(f"model_or_class: {type(target).__name__} has no config.model_type")
        return model_type
    if isinstance(target, type) and issubclass(target, nn.Module):
        config_class = getattr(target, "config_class", None)
        model_type = getattr(config_class, "model_type", None)
        if not model_type:
            raise LMKernelsError(f"model_or_class: {target.__name__} has no config_class.model_type")
        return model_type
    raise LMKernelsError(
        f"model_or_class: expected a transformers model, model class or model type string, "
        f"got {type(target).__name__}"
    )


def _field_names(config_class: type, defaults: dict[str, Any]) -> dict[str, str]:
    """name -> the name `defaults` (a config's to_dict(), which holds the stored names) uses for
    it, through the class's attribute_map in both directions: gpt2 stores hidden_size as n_embd
    (attribute_map {"hidden_size": "n_embd"}), so TINY's hidden_size must be passed as n_embd."""
    amap = dict(getattr(config_class, "attribute_map", None) or {})
    names = {}
    for canonical, stored in amap.items():
        for a, b in ((canonical, stored), (stored, canonical)):
            if a not in defaults and b in defaults:
                names[a] = b
    return names


def tiny_fields(config_class: type, defaults: dict[str, Any], *extra: dict[str, Any]) -> dict[str, Any]:
    """The TINY fields a config of `config_class` has, then every field of each `extra` dict,
    keyed by the names its to_dict() `defaults` use: a later field replaces an earlier one
    whatever name (canonical or stored) each gives."""
    names = _field_names(config_class, defaults)
    fields: dict[str, Any] = {}
    for key, value in TINY.items():
        name = names.get(key, key)
        if name in defaults or key == "attn_implementation":
            fields[name] = value
    for more in extra:
        for key, value in more.items():
            fields[names.get(key, key)] = value
    return fields


def tiny_config(model_type: str, **overrides: Any) -> PretrainedConfig:
    """A tiny transformers config of `model_type` ("llama", ...): 2 layers, hidden size 64, 4 query
    and 2 key-value heads, a vocabulary of 128 (TINY, plus the family's own fields where a default
    would hide a feature). `overrides` replace any field."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    defaults = AutoConfig.for_model(model_type).to_dict()
    family_fields = FAMILY_SIZES.get(model_type, {}) | FAMILY_TINY.get(model_type, {})
    if not getattr(causal_lm_class(model_type), "_supports_sdpa", True):
        family_fields = {"attn_implementation": "eager"} | family_fields  # bloom, mpt, gpt_neo...
    fields = tiny_fields(CONFIG_MAPPING[model_type], defaults, family_fields, overrides)
    config: PretrainedConfig = AutoConfig.for_model(model_type, **fields)
    return config


def shrink_config(config: PretrainedConfig) -> PretrainedConfig:
    """`config` (of any size, e.g. a checkpoint's) with the TINY sizes it has, in place; the
    vocabulary, special tokens and attention implementation are kept, and so are the feature
    values FAMILY_TINY sets for the tests. For a verification model of the same structure."""
    keep = ("attn_implementation", "vocab_size", "pad_token_id", "bos_token_id", "eos_token_id")
    defaults = config.to_dict()
    sizes = FAMILY_SIZES.get(getattr(config, "model_type", ""), {})
    for name, value in tiny_fields(type(config), defaults, sizes).items():
        if name not in keep and defaults.get(name) is not None:
            setattr(config, name, value)
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types)[: config.num_hidden_layers]
    return config


def parameter_count(config: PretrainedConfig) -> int:
    """The parameters a causal LM of `config` has, counted on the meta device (nothing is
    allocated)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def check_verification_size(config: PretrainedConfig, limit: int = MAX_VERIFY_PARAMS) -> None:
    """Raise LMKernelsError if a model of `config` has more than `limit` parameters."""
    n = parameter_count(config)
    if n > limit:
        name = type(config).__name__
        raise LMKernelsError(
            f"config: a verification model of {name} ({getattr(config, 'model_type', '?')}) would have "
            f"{_millions(n)} parameters, over the {_millions(limit)} limit for one: sizes the tiny "
            "fields do not name (a nested text_config, say) were not shrunk; patch a model instance"
        )


def _millions(n: int) -> str:
    return f"{n / 1e6:,.0f}M" if n >= 10e6 else f"{n / 1e6:.3g}M"


def tiny_model(model_type: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """A freshly initialized fp32 causal LM of `model_type` on the CPU, built from
    tiny_config(model_type, **overrides); the same seed gives the same weights. Refuses
    (LMKernelsError) a config over MAX_VERIFY_PARAMS parameters."""
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, **overrides)
    check_verification_size(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: PreTrainedModel = AutoModelForCausalLM.from_config(config)
        return model
