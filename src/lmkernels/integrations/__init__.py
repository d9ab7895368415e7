"""Integrations with model libraries.

`lmkernels.integrations.transformers`: patch Hugging Face transformers causal LMs (any family
built from RMSNorm / LayerNorm, rotary embedding, gated MLPs and an nn.Linear head; recognized by
structure and verified at apply time) so those run through lmkernels ops. It is not imported here: transformers is an optional dependency.
"""
