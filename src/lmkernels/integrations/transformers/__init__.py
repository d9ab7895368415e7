"""Run Hugging Face transformers causal LMs on lmkernels ops, patched by structure and verified.

    from lmkernels.integrations import transformers as lk_hf
    model = lk_hf.from_pretrained("Qwen/Qwen3-0.6B", backend="triton")   # load + patch, one line
    lk_hf.apply(model)                            # or patch a model you built: its own modules
    lk_hf.apply("qwen3")                          # or a class / model type: every model of it
    print(lk_hf.patch_report("qwen3"))            # what would be patched, and why not the rest
    lk_hf.revert(model)                           # restores the original functions exactly
    Trainer(..., callbacks=[lk_hf.LmkernelsCallback()])   # the Trainer / TRL switch (callback.py)

Modules are recognized by what they are, not by the model type (structure.py): RMSNorm variants
(epsilon attribute, Gemma's (1 + w) offset, casting mode, per-head q/k norms), LayerNorm with or
without weight and bias, the rotary function each attention calls (neox or interleaved, partial
rotary), gated MLPs (gate/up or fused gate_up; SiLU, GELU tanh, GELU exact) also inside MoE
experts, and the causal-LM head + loss (logit scaling, final softcapping, tied weights, router
aux loss). Each replacement is checked when it is applied, on a small random fp32 input against
the module it replaces (verify.py); one that does not match is never installed.

What is replaced (`ops` chooses a subset of SUPPORTED_OPS):

- "rms_norm" / "layer_norm": the norm's forward -> `lmkernels.rms_norm` / `lmkernels.layer_norm`.
- "rope": the modeling module's `apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)` ->
  `lmkernels.rope` with the layout and rotary dims the probe found.
- "mlp": `down(act(gate(x)) * up(x))` -> `down(swiglu(gate, up))` or geglu (tanh / none).
- "flce": the causal-LM forward. In training mode with `labels`, lm_head + loss become one
  `lmkernels.fused_linear_cross_entropy` call on the final hidden states: the (tokens x vocab)
  logits are never built and the output's `logits` is None. The loss is transformers'
  ForCausalLMLoss: labels shifted left by padding with ignore_index (or `shift_labels` as given),
  mean over non-ignored tokens, or sum / `num_items_in_batch` when the Trainer passes it;
  `logits_to_keep` slices the hidden states as the original forward does. Without labels, or in
  eval mode, the original forward runs unchanged and returns logits (generation, evaluation).
- "causal_mask" (not a kernel): a base model called with no attention_mask, position_ids or
  cache (past_key_values before transformers 5.24) builds no (B, 1, T, T) causal mask, also under torch.compile, where
  transformers always builds one: SDPA runs is_causal=True with GQA instead of its masked
  kernel on repeated K/V. Every other call gets the mask transformers builds. Applied only where the base
  forward's source shows attention_mask reaching nothing but transformers' mask functions
  (masks.py); elsewhere kept with the reason.

PEFT: a PeftModel is seen through (the transformers model inside is patched; LoRA layers on MLP
projections run as PEFT defines them; lm_head as LoRA or modules_to_save is computed by the fused
loss: integrations/peft.py), so PEFT may wrap before or after apply(). TRL: the fused LM head TRL
1.x wraps around the forward runs on lmkernels' fused loss where it can (integrations/trl.py).

`strict=True` (default): apply() raises, before changing anything, if a module that looks like
one of these kinds cannot be patched correctly (a failed check, an activation with no GLU op, a
custom loss). `strict=False` patches what passed and reports the rest (`report(model)`).
Modules of kinds lmkernels has no op for (attention, a non-gated MLP) are kept and listed.

Patching a class (or a model type) verifies on a tiny model of the family and replaces functions
on its classes, for every model of the family, built before or after. Patching a model instance
sets `forward` on its own submodules only, except rope (module-level, see patching.py). A deep
copy of a patched model is patched too, without a rope hold of its own.

`backend`: None lets lmkernels' dispatch choose at each call (use_backend(), LMKERNELS_BACKEND,
auto); a name ("triton") or a spec like "triton,flce=compile" fixes it per op.
Before torch.compile(model), backend="eager,flce=triton" runs the norms, rope and GLU as
plain torch code that inductor fuses with its neighbours, while the fused loss stays the
Triton op (`lmkernels-bench e2e --sweeps compile` measures both against the default).

Known differences from the unpatched model, all in low precision only: lmkernels' RMSNorm output
has x's dtype even when the weight has another dtype; rope and GLU compute in fp32 and round
once where transformers rounds after each elementwise op; a batch whose labels are all
ignore_index gives loss 0 instead of nan.

Supported: the transformers range of lmkernels' hf extra (pyproject.toml), checked when a
model is patched (check_transformers_version).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmkernels.integrations.transformers import families  # noqa: F401  (tests patch its tables)

# The public API is api.py's: its names and its __all__.
from lmkernels.integrations.transformers.api import *  # noqa: F403
from lmkernels.integrations.transformers.api import __all__ as __all__

if TYPE_CHECKING:  # imported on first use (__getattr__ below); named here for type checkers
    from lmkernels.integrations.transformers.callback import LmkernelsCallback as LmkernelsCallback


def __getattr__(name: str) -> Any:
    # The Trainer callback imports transformers' trainer stack (seconds): loaded when first used.
    if name == "LmkernelsCallback":
        from lmkernels.integrations.transformers.callback import LmkernelsCallback

        return LmkernelsCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
