"""`lmkernels tune`: time candidate launch configurations of the Triton kernels on this GPU and
suggest the entries of its generation's config tables (backends/triton/configs)."""
