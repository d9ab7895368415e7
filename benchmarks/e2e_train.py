"""End-to-end training benchmark: tokens/s and peak memory per configuration (CUDA; `--device cpu
--tiny` checks it on the CPU). The code is lmkernels.harness.bench.e2e; `--help` has the options.

    python benchmarks/e2e_train.py --out DIR --sweeps batch --batches 8,16,32,64 \\
        --interleave --rounds 3 --configs plain,lmk,liger
"""

import sys

from lmkernels.harness.bench.e2e import main

if __name__ == "__main__":
    sys.exit(main())
