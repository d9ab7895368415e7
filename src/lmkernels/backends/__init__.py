"""Built-in backends: eager, compile, triton and the optional adapters (liger, cce, torch_native).

Importing this package registers nothing; `load_builtin()` does, and the top-level package hands
it to the registry as its loader, so the backends (and triton, and the compiler) are imported
when an impl is first looked up, not at `import lmkernels`.

A backend whose requirements are missing (no Triton, no GPU, package not installed) still
registers; its Impl.available() says why it cannot run, so `lmkernels list` can show it.
"""

from __future__ import annotations


def load_builtin() -> None:
    import lmkernels.ops  # noqa: F401  (registers the OpSpecs first)
    from lmkernels.backends import adapters, compile, eager  # noqa: F401  (register on import)
    from lmkernels.backends.triton import triton_importable

    if triton_importable():
        from lmkernels.backends.triton import flce, glu, norms, rope  # noqa: F401
    else:
        from lmkernels.backends.triton import _unavailable

        _unavailable.register_placeholders()
