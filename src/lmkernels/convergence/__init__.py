"""Short-run convergence: does a model trained on lmkernels ops train like plain transformers?

Tiny models of each supported family (`models`), real text tokenized offline (`data`), a few
dozen AdamW steps plain and patched with the same init and batches (`train`), every step's
loss, the eval loss, the eval log-probs and the final parameters compared under per-dtype
tolerances (`compare`, which documents them), shown as a table, JSON and PNG (`report`), from
`lmkernels converge` (`cli`).

    from lmkernels.convergence import run_convergence
    report = run_convergence("compile", families=("llama",), steps=30)
    assert report.passed

Needs the `hf` extra (transformers, tokenizers, matplotlib).
"""

from lmkernels.convergence.compare import TOLERANCES_FP32, Report, run_convergence
from lmkernels.convergence.train import Patch, TrainConfig, train_run

__all__ = ["TOLERANCES_FP32", "Patch", "Report", "TrainConfig", "run_convergence", "train_run"]
