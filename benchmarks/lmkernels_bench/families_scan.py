"""Patch every causal-LM model type of the installed transformers and compare one training step.

For each type in transformers' causal-LM auto mapping: build a tiny random model
(lmkernels.integrations.transformers.tiny_model), patch a copy with `apply(strict=False)` on the
eager backend, run one forward + backward of both on the same random tokens (same RNG seed, so
dropout draws the same masks) and compare the loss and every parameter's gradient.

    lmkernels-bench families-scan --out OUT                 # every type
    lmkernels-bench families-scan --out OUT --shard 1/2     # every other type (run 0/2 beside)
    lmkernels-bench families-scan --out OUT --types dory,qwen3_next

Statuses: ok; MISMATCH (loss or a gradient differs, or a parameter has a gradient on one side
only); not-tiny (the tiny config leaves the family large: its size fields have other names);
build-fail / step-fail (plain transformers fails too, or the patched step raises: the detail
says which); none-patched; timeout. A gradient's error is |g' - g| / max(|g|, 1e-4 max|g|): a
gradient that is zero in exact arithmetic (a key projection's bias) is compared at the scale of
the model's others, not at its own rounding noise.
"""

from __future__ import annotations

import argparse
import copy
import json
import signal
import sys
from pathlib import Path

import torch

LOSS_TOL, GRAD_TOL, MAX_PARAMS, SECONDS = 1e-5, 1e-4, 30e6, 120


class _Timeout(Exception):
    pass


def _alarm(*_):
    raise _Timeout


def _step(model, ids):
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def scan_one(model_type: str) -> tuple[str, str]:
    from transformers import AutoModelForCausalLM

    from lmkernels.integrations import transformers as lk_hf
    from lmkernels.integrations.transformers import tiny_config

    try:
        with torch.device("meta"):
            n = sum(p.numel() for p in AutoModelForCausalLM.from_config(tiny_config(model_type)).parameters())
        if n > MAX_PARAMS:
            return "not-tiny", f"{n / 1e6:.0f}M parameters"
        plain = lk_hf.tiny_model(model_type, seed=0)
    except Exception as e:
        return "build-fail", f"{type(e).__name__}: {str(e)[:160]}"
    patched = lk_hf.apply(copy.deepcopy(plain), backend="eager", strict=False)
    report = lk_hf.report(patched)
    ops = sorted(report.patched_ops()) if report is not None else []
    if not ops:
        return "none-patched", ""
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    try:
        loss, grads = _step(plain, ids)
    except Exception as e:
        return "build-fail", f"plain step: {type(e).__name__}: {str(e)[:160]}"
    try:
        p_loss, p_grads = _step(patched, ids)
    except Exception as e:
        return "step-fail", f"{','.join(ops)}: {type(e).__name__}: {str(e)[:160]}"
    loss_err = (abs(p_loss - loss) / abs(loss).clamp_min(1e-30)).item()
    one_side = sorted(set(grads) ^ set(p_grads))
    scale = 1e-4 * max(g.norm().item() for g in grads.values())
    grad_err = max(
        ((p_grads[n] - g).norm().item() / max(g.norm().item(), scale))
        for n, g in grads.items()
        if n in p_grads
    )
    detail = f"{','.join(ops)}; loss {loss_err:.1e}, grad {grad_err:.1e}"
    if one_side:
        return "MISMATCH", f"{detail}; a gradient on one side only: {', '.join(one_side[:3])}"
    return ("ok" if loss_err <= LOSS_TOL and grad_err <= GRAD_TOL else "MISMATCH"), detail


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lmkernels-bench families-scan", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="folder for scan.json and scan.md")
    p.add_argument("--types", help="comma-separated model types (default: every causal-LM type)")
    p.add_argument("--shard", default="0/1", help="I/N: every N-th type from the I-th")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    torch.set_num_threads(1)
    types = args.types.split(",") if args.types else sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    i, n = map(int, args.shard.split("/"))
    types = types[i::n]
    args.out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGALRM, _alarm)
    rows = {}
    for k, model_type in enumerate(types, 1):
        signal.alarm(SECONDS)
        try:
            rows[model_type] = scan_one(model_type)
        except _Timeout:
            rows[model_type] = ("timeout", f"over {SECONDS} s")
        finally:
            signal.alarm(0)
        print(
            f"[{k}/{len(types)}] {model_type:22} {rows[model_type][0]:12} {rows[model_type][1][:34]}",
            flush=True,
        )
    tag = "" if n == 1 else f"-{i}of{n}"
    meta = {"transformers": transformers.__version__, "torch": torch.__version__, "shard": args.shard}
    (args.out / f"scan{tag}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"transformers {meta['transformers']}, torch {meta['torch']}, shard {args.shard}", ""]
    lines += ["| model type | status | detail |", "|---|---|---|"]
    lines += [f"| `{t}` | {s} | {d.replace('|', '/')} |" for t, (s, d) in rows.items()]
    (args.out / f"scan{tag}.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
