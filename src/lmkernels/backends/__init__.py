"""Built-in backends: eager, compile, triton and the optional adapters (liger, cce, torch_native).

Importing this package registers nothing; `load_builtin()` does, and the top-level package hands
it to the registry as its loader, so the backends (and triton, and the compiler) are imported
when an impl is first looked up, not at `import lmkernels`.

A backend whose requirements are missing (no Triton, no GPU, package not installed) still
registers; its Impl.available() says why it cannot run, so `lmkernels list` can show it.
"""

from __future__ import annotations

import importlib
import pkgutil


def load_builtin() -> None:
    import lmkernels.ops  # noqa: F401  (registers the OpSpecs first)
    from lmkernels.backends import adapters, compile, eager  # noqa: F401  (register on import)
    from lmkernels.backends import triton as triton_backend
    from lmkernels.backends.triton import triton_importable

    if triton_importable():
        # Every module of the Triton package is imported (the op modules register on import): a
        # new op's module registers with no edit here.
        for module in pkgutil.iter_modules(triton_backend.__path__):
            if not module.name.startswith("_") and not module.ispkg:
                importlib.import_module(f"{triton_backend.__name__}.{module.name}")
    else:
        from lmkernels.backends.triton import _unavailable

        _unavailable.register_placeholders()
