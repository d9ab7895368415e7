"""The Triton backend: one public module per op (kernels, launchers, torch.library registration,
autograd, registration in the lmkernels registry), each imported by
lmkernels.backends.load_builtin, which finds them by name (every module here not starting with
"_"; shared helpers are private modules); this file holds only what they share about the
environment (it imports none of them).

Triton is optional: without it (or without a GPU and TRITON_INTERPRET=1) the impls still
register and report why they cannot run. On CPU they run only under TRITON_INTERPRET=1 and only
when asked for explicitly; `auto` picks them on CUDA.
"""

from __future__ import annotations

import os


def interpreting() -> bool:
    """Whether Triton runs kernels on its CPU interpreter (TRITON_INTERPRET=1), not compiled."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_unavailable_reason() -> str | None:
    try:
        import triton  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return f"triton is not importable ({e.__class__.__name__}: {e})"
    import torch

    if interpreting():  # on the CPU, also where a GPU is
        if _version(triton.__version__) < (3, 7):
            # Seen with triton 3.6: its interpreter fails on the row loops of the norm, rope and
            # FLCE kernels ("only 0-dimensional arrays can be converted to Python scalars"); the
            # same kernels compile and pass on the GPU with 3.6.
            return (
                f"the CPU interpreter of triton {triton.__version__} cannot run these kernels (needs >= 3.7)"
            )
    elif not torch.cuda.is_available():
        return "no CUDA device (set TRITON_INTERPRET=1 to run the kernels on the CPU interpreter)"
    return None


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("+")[0].split(".")[:2] if p.isdigit())


def triton_devices() -> tuple[str, ...]:
    return ("cuda", "cpu") if interpreting() else ("cuda",)


def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True
