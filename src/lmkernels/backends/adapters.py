"""Adapters for external libraries (Liger Kernel, Cut Cross-Entropy, torch native), registered
as ordinary backends when their package is importable. Filled in by the performance work."""
