"""Third-party backends: packages expose a callable in the entry-point group
``lmkernels.backends``; it is called once, after the built-in backends, and calls register()."""

from __future__ import annotations

import warnings
from importlib.metadata import entry_points

GROUP = "lmkernels.backends"


def load_entry_points() -> list[str]:
    """Call every `lmkernels.backends` entry point (a broken one warns); returns their names."""
    loaded = []
    for ep in entry_points(group=GROUP):
        try:
            hook = ep.load()
            hook()
            loaded.append(ep.name)
        except Exception as e:  # a broken plugin must not take the library down
            warnings.warn(f"lmkernels: backend plugin {ep.name!r} failed to load: {e}", stacklevel=2)
    return loaded
