"""bf16 GPU convergence of the structurally patched families (issue 10's validation run).

    python scripts/families_gpu.py --out validation/h200-families            # default set
    python scripts/families_gpu.py --out /tmp/f --families qwen3 glm --steps 10

For each family: a small random model (tiny_model with hidden 256, 4 layers, vocab from the
shipped Tiny Shakespeare BPE), trained plain in fp32 (the reference), plain in bf16 (the
baseline) and patched in bf16 with --backend, same init and batches; verdict by the convergence
policy's bf16 rule (lmkernels.convergence.compare: err(patched) <= 2 x err(plain bf16) + floor,
both against fp32). Writes summary.md and results.json (device, versions, command) under --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

DEFAULT = (
    "llama",
    "qwen3",
    "qwen3_moe",
    "mixtral",
    "phi3",
    "gemma3_text",
    "olmo2",
    "cohere",
    "glm",
    "gpt_neox",
)
SIZE = {
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "head_dim": 64,
    "moe_intermediate_size": 256,
}


# The options, data and models of this script and of families_stepcheck.py, so that the step
# check trains exactly what the validation run trains.


def parser(description: str, steps: int) -> argparse.ArgumentParser:
    """The options both scripts take; `steps`: the default of --steps."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", required=True)
    p.add_argument("--families", nargs="+", default=list(DEFAULT))
    p.add_argument("--backend", default="triton")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    return p


def prepare_run(args):
    """The device, the output folder (made here) and the training batches, the same for every
    family."""
    from lmkernels.convergence import data

    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    batches = data.make_batches(args.steps, args.batch_size, args.seq_len, 2, seed=0)
    return device, out, batches


def family_model(model_type: str, batches, seq_len: int):
    """The family's small random model (SIZE, the batches' vocabulary), on the CPU in fp32."""
    from lmkernels.integrations import transformers as lk_hf

    overrides = dict(SIZE, vocab_size=batches.vocab_size, max_position_embeddings=seq_len)
    return lk_hf.tiny_model(model_type, seed=0, **overrides)


def main(argv=None) -> int:
    args = parser(__doc__.splitlines()[0], steps=30).parse_args(argv)

    import transformers

    import lmkernels
    from lmkernels.convergence.compare import compare
    from lmkernels.convergence.train import Patch, TrainConfig, train_run
    from lmkernels.integrations import transformers as lk_hf

    device, out, batches = prepare_run(args)
    results, rows = [], []
    for model_type in args.families:
        start = time.perf_counter()
        base = family_model(model_type, batches, args.seq_len)
        report = lk_hf.patch_report(base.to(device), backend=args.backend)
        base = base.cpu()
        init = {n: p.detach().float().clone() for n, p in base.named_parameters()}
        cfg = TrainConfig(
            family=model_type,
            steps=args.steps,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            dtype="bf16",
            device=device,
            vocab_size=batches.vocab_size,
        )
        reference = train_run(base, batches, cfg, dtype="fp32", label=f"{model_type} fp32", progress=True)
        baseline = train_run(base, batches, cfg, label=f"{model_type} bf16", progress=True)
        patched = train_run(
            base,
            batches,
            cfg,
            patch=Patch(args.backend, lk_hf.SUPPORTED_OPS),
            label=f"{model_type} lmk",
            progress=True,
        )
        checks = compare(patched, baseline, init, cfg.topk, reference)
        passed = all(c.passed for c in checks)
        results.append(
            {
                "family": model_type,
                "patched": report.summary()["patched"],
                "kept": report.summary()["kept"],
                "failed": report.summary()["failed"],
                "passed": passed,
                "checks": [vars(c) for c in checks],
                "losses": {"fp32": reference.losses, "bf16": baseline.losses, "patched": patched.losses},
                "seconds": time.perf_counter() - start,
            }
        )
        worst = ", ".join(f"{c.metric} {c.value:.3g}/{c.limit:.3g}" for c in checks)
        rows.append(
            f"| {model_type} | {'pass' if passed else 'FAIL'} | {', '.join(report.patched_ops())} | {worst} |"
        )
        print(rows[-1], flush=True)
    meta = {
        "command": " ".join([sys.executable, *sys.argv]),
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "lmkernels": lmkernels.__version__ if hasattr(lmkernels, "__version__") else "?",
        "backend": args.backend,
        "steps": args.steps,
        "batch": [args.batch_size, args.seq_len],
    }
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    lines = [f"# Families, bf16 convergence on {meta['device']}", "", f"`{meta['command']}`", ""]
    lines += [f"torch {meta['torch']}, transformers {meta['transformers']}, backend {args.backend}", ""]
    lines += ["| family | verdict | patched ops | error / limit per metric |", "|---|---|---|---|", *rows]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out}/summary.md")
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
