"""Distributed benchmark: every wrapping (FSDP2, FSDP2 + lm_head alone, TP, FSDP2 x TP through
transformers or torch's styles, DeepSpeed ZeRO-2/3, pipeline parallel) on 1, 2 and 4 GPUs, plain
vs lmkernels vs Liger. It launches torchrun itself, once per run. The code is
lmkernels.harness.bench.scale; `--help` has the options.

    python benchmarks/dist_scale.py --out DIR --gpus 1,2,4
    python benchmarks/dist_scale.py --out DIR --tiny --gpus 2 --modes pp   # the CPU (gloo) check
"""

import sys

from lmkernels.harness.bench.scale import main

if __name__ == "__main__":
    sys.exit(main())
