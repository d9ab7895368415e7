"""One line for users: load (or build) a transformers causal LM and return it patched."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def from_pretrained(
    name_or_path: str,
    backend: str | None = None,
    strict: bool = True,
    ops: Iterable[str] | None = None,
    **kwargs: Any,
):
    """`AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)`, patched by apply().

    Patch before wrapping the model (PEFT, FSDP, torch.compile): apply() recognizes the plain
    transformers modules. `strict=False` patches what passes its checks and keeps the rest
    (see `lmkernels.integrations.transformers.report(model)`)."""
    from transformers import AutoModelForCausalLM

    from lmkernels.integrations import transformers as lk_hf

    model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    return lk_hf.apply(model, backend=backend, strict=strict, ops=ops or lk_hf.SUPPORTED_OPS)


def from_config(
    config,
    backend: str | None = None,
    strict: bool = True,
    ops: Iterable[str] | None = None,
    **kwargs: Any,
):
    """`AutoModelForCausalLM.from_config(config, **kwargs)` (random weights), patched by apply()."""
    from transformers import AutoModelForCausalLM

    from lmkernels.integrations import transformers as lk_hf

    model = AutoModelForCausalLM.from_config(config, **kwargs)
    return lk_hf.apply(model, backend=backend, strict=strict, ops=ops or lk_hf.SUPPORTED_OPS)
