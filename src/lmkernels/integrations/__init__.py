"""Integrations with model libraries.

`lmkernels.integrations.transformers`: patch Hugging Face transformers models (Llama, Mistral,
Qwen2, Gemma, Gemma2) so their RMSNorm, rotary embedding, MLP and lm_head + loss run through
lmkernels ops. It is not imported here: transformers is an optional dependency.
"""
