"""FLCE frontier benchmark: every FLCE variant against torch.compile of the naive loss, Cut
Cross-Entropy and Liger, on 13 shapes x 3 logit regimes (CUDA; `--device cpu --tiny` checks it
on the CPU). The code is lmkernels.harness.bench.frontier; `--help` has the options.

    python benchmarks/flce_frontier.py --out DIR
"""

import sys

from lmkernels.harness.bench.frontier import main

if __name__ == "__main__":
    sys.exit(main())
