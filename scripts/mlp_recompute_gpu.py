"""The MLP down-projection recompute (lmkernels.nn.recompute) on a GPU, without checkpointing.

For the patched Llama-3.2-1B-shape model (e2e_setup.LLAMA_1B, bf16, no activation
checkpointing): the first step's loss and every gradient with the recompute on and off (same
weights, same batch), against two runs with it on (SDPA's backward is not deterministic); then
tokens/s and peak memory of each setting, alternated (on, off, on, off) to see drift.

    python scripts/mlp_recompute_gpu.py --out OUT [--batches 2,4] [--layers 16]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import e2e_setup as es  # noqa: E402
from lmkernels.nn.recompute import ENV  # noqa: E402


def grads_of(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return float(loss), {n: p.grad.clone() for n, p in model.named_parameters()}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--batches", default="2,4")
    p.add_argument("--layers", type=int, default=16)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = es.LLAMA_1B | {"num_hidden_layers": args.layers}
    model = es.build_model(cfg, "cuda", checkpointing=False)
    es.patch(model, "lmk")
    result = {"environment": es.environment(), "config": cfg, "command": " ".join(sys.argv), "points": []}

    ids = es.make_batch(cfg["vocab_size"], 2, 1024, "cuda")
    # SDPA's backward is not deterministic on CUDA, so two runs with the recompute on give the
    # noise floor that the on-vs-off difference is read against.
    os.environ[ENV] = "1"
    loss_on, g_on = grads_of(model, ids)
    _, g_on2 = grads_of(model, ids)
    os.environ[ENV] = "0"
    loss_off, g_off = grads_of(model, ids)

    def largest(a, b):
        return max((a[n].float() - b[n].float()).abs().max().item() for n in a)

    noise, diff = largest(g_on, g_on2), largest(g_on, g_off)
    result["identical"] = {"loss_on": loss_on, "loss_off": loss_off, "max_grad_diff": diff, "noise": noise}
    print(f"loss {loss_on} vs {loss_off}; largest gradient difference {diff} (on vs on: {noise})", flush=True)
    del g_on, g_on2, g_off
    model.zero_grad(set_to_none=True)

    opt = es.make_optimizer(model)
    for batch in [int(b) for b in args.batches.split(",")]:
        ids = es.make_batch(cfg["vocab_size"], batch, 1024, "cuda")
        for setting in ("1", "0", "1", "0"):
            os.environ[ENV] = setting
            torch.cuda.empty_cache()
            r = es.time_steps(lambda ids=ids: es.train_step(model, opt, ids), "cuda", steps=6, warmup_steps=2)
            r |= {
                "batch": batch,
                "recompute": setting == "1",
                "tokens_per_s": batch * 1024 / r["step_ms"] * 1e3,
            }
            result["points"].append(r)
            print(f"b{batch} recompute={setting}: {r['step_ms']:.1f} ms  {r['peak_gib']:.2f} GiB", flush=True)
    (out / "mlp_recompute.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
