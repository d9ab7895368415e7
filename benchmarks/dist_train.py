"""Distributed training benchmark on 2 GPUs: FSDP2 and tensor parallel, plain vs lmkernels vs
Liger (it launches torchrun itself; `--tiny` checks it on the CPU with gloo). The code is
lmkernels.harness.bench.dist; `--help` has the options.

    python benchmarks/dist_train.py --out DIR --modes fsdp,fsdp_lm_head,tp --configs plain,lmk,liger
"""

import sys

from lmkernels.harness.bench.dist import check_config, main, slug  # noqa: F401  (tests import them here)

if __name__ == "__main__":
    sys.exit(main())
