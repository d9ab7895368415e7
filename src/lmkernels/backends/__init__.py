"""Built-in backends. Importing this registers eager, compile, triton and the optional adapters.

A backend whose requirements are missing (no Triton, no GPU, package not installed) still
registers; its Impl.available() says why it cannot run, so `lmkernels list` can show it.
"""

import lmkernels.ops  # noqa: F401  (registers the OpSpecs first)
from lmkernels.backends import adapters as _adapters  # noqa: F401
from lmkernels.backends import compile as _compile  # noqa: F401
from lmkernels.backends import eager as _eager  # noqa: F401
from lmkernels.backends import triton as _triton  # noqa: F401
