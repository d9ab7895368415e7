"""Tests of the maintainers' suite (lmkernels_bench); a package, so that its conftest stays its own."""
