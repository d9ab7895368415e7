"""torchtitan's config functions with lmkernels applied, for `--module lmkernels.integrations.torchtitan`:

    --module lmkernels.integrations.torchtitan --config llama3_debugmodel
        torchtitan.models.llama3.config_registry.llama3_debugmodel(), through apply()
    --module lmkernels.integrations.torchtitan --config my_pkg.configs.my_run
        a config function of your own (module path + function name), through apply()

A bare name is looked up in the config_registry of the torchtitan model its prefix names
(llama3_8b -> llama3, qwen3_0_6b -> qwen3), then in every torchtitan model's.
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Callable
from typing import Any

from lmkernels.integrations.torchtitan import apply


def _model_modules() -> list[str]:
    from torchtitan.models import _supported_models

    return sorted(_supported_models, key=len, reverse=True)


def _registry(module: str) -> types.ModuleType | None:
    try:
        return importlib.import_module(f"torchtitan.models.{module}.config_registry")
    except ImportError:
        return None


def find(name: str) -> Callable[..., Any] | None:
    """The torchtitan config function called `name` (see the module docstring), or None."""
    if "." in name:
        path, _, fn = name.rpartition(".")
        candidates = [f"torchtitan.models.{path}.config_registry", f"{path}.config_registry", path]
        for candidate in candidates:
            try:
                module = importlib.import_module(candidate)
            except ImportError:
                continue
            found = getattr(module, fn, None)
            if callable(found):
                return found
        return None
    models = _model_modules()
    preferred = [m for m in models if name == m or name.startswith(m + "_")][:1]
    for model in preferred + [m for m in models if m not in preferred]:
        registry = _registry(model)
        found = getattr(registry, name, None) if registry is not None else None
        if callable(found):
            return found
    return None


def __getattr__(name: str) -> Callable[..., Any]:
    if name.startswith("__"):
        raise AttributeError(name)
    fn = find(name)
    if fn is None:
        raise AttributeError(f"no torchtitan config function {name!r}")

    def config() -> Any:
        return apply(fn())

    config.__name__ = name.rpartition(".")[-1]
    config.__doc__ = (
        f"{fn.__module__}.{fn.__name__}() with lmkernels (lmkernels.integrations.torchtitan.apply)"
    )
    return config


def __dir__() -> list[str]:
    names = {"find"}
    for model in _model_modules():
        module = _registry(model)
        if module is not None:
            names.update(n for n in dir(module) if n.startswith(model) and callable(getattr(module, n)))
    return sorted(names)
