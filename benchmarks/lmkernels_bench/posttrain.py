"""Post-training losses through the lm_head, forward + backward: lmkernels against plain PyTorch,
TRL's own head, Liger's chunked losses and verl's fused head.

    lmkernels-bench posttrain --out DIR [--data benchmarks/data] [--losses grpo,grpo-7b,dpo,jsd]
    lmkernels-bench posttrain --out DIR --impls triton,liger --budget 540
    lmkernels-bench posttrain --out DIR --tiny --device cpu     # tiny shapes: checks the script

Losses (bf16 hidden states and lm_head weights; the loss of each is the same math in every
implementation, its value recorded per row):

  grpo     8 x 2048 completion tokens, head 1536 x 151936, temperature 0.7; TRL's default GRPO
           loss (dapo, token-level clipped surrogate), the k3 KL to a reference (beta 0.04, its
           per-token log-probs precomputed as TRL does) and an entropy bonus (entropy_coef 0.01:
           the entropy's gradient through the head)
  grpo-7b  the same at 16 x 1024 tokens, head 3584 x 152064
  dpo      4 pairs x 2048 tokens, policy and reference heads 1536 x 151936 (the reference's
           forward under no_grad inside the loss), sigmoid loss, beta 0.1
  jsd      8192 tokens, student head 1536 x 151936, teacher 3584 x 151936, generalized JSD
           beta 0.5, hard / soft weights 0.5 / 0.5

Implementations (--impls):

  plain        PyTorch: the full logits (bf16 matmul), log_softmax / softmax in fp32
  trl          TRL's own fused head: trl.kernels.chunked_logprob.ChunkedLogProbFunction (GRPO,
               DPO), DistillationTrainer's _chunked_divergence_loss + the head's log-probs for
               the hard loss (JSD)
  liger        liger_kernel.chunked_loss at its defaults: LigerFusedLinearGRPOLoss (no entropy
               bonus: it has none), LigerFusedLinearDPOLoss, LigerFusedLinearJSDLoss
  verl         verl's fused head (verl.utils.kernel.linear_cross_entropy, CUDA; GRPO only)
  triton       lmkernels.losses with backend="triton"; triton_lean: backend="triton_lean"
  eager        lmkernels.losses with backend="eager" (full logits: a check of the loss values; not
               in the default list)

A peer that is not installed, a loss it does not have, a backend that refuses an option (the
Triton backends before they have temperature or the entropy's gradient) is recorded with its
reason, never dropped. Measured per row (lmkernels.harness.bench's protocol): GPU time of one
forward + backward with the launch queue filled ahead (gpu_ms), wall time (wall_ms, do_bench
median and p20 / p80), peak memory above the inputs (peak_mib); CUDA only for the first and
the last. Outputs: <out>/posttrain.json (environment + rows), <out>/posttrain.md (the table),
<out>/data.jsonl (the rows with their provenance); --data DIR appends them to DIR/<gpu>.jsonl
(part "posttrain"). --budget (s) skips what would start past it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import lmkernels
from lmkernels import losses as L
from lmkernels.harness.bench import cleanup, gpu_time_ms, is_oom, peak_memory_bytes, time_ms
from lmkernels_bench import data

LOSSES: dict[str, dict[str, Any]] = {
    "grpo": dict(kind="grpo", B=8, T=2048, H=1536, V=151936, temperature=0.7),
    "grpo-7b": dict(kind="grpo", B=16, T=1024, H=3584, V=152064, temperature=0.7),
    "dpo": dict(kind="dpo", B=4, T=2048, H=1536, V=151936),
    "jsd": dict(kind="jsd", N=8192, Hs=1536, Ht=3584, V=151936),
}
TINY: dict[str, dict[str, Any]] = {
    "grpo": dict(kind="grpo", B=2, T=8, H=32, V=96, temperature=0.7),
    "grpo-7b": dict(kind="grpo", B=2, T=4, H=48, V=100, temperature=0.7),
    "dpo": dict(kind="dpo", B=2, T=8, H=32, V=96),
    "jsd": dict(kind="jsd", N=16, Hs=32, Ht=48, V=96),
}
IMPLS = ("plain", "trl", "liger", "verl", "triton", "triton_lean", "eager")
DEFAULT_IMPLS = IMPLS[:-1]  # eager (lmkernels.losses on the eager reference: full logits) on request
GRPO: dict[str, Any] = dict(beta=0.04, entropy_coef=0.01, epsilon=0.2, loss_type="dapo")
DPO_BETA = 0.1
JSD = dict(beta=0.5, hard=0.5, soft=0.5)
PEERS = {
    "plain": "PyTorch: full logits (bf16 matmul), fp32 log_softmax",
    "trl": "TRL {trl} fused head (ChunkedLogProbFunction; DistillationTrainer's chunked divergence)",
    "liger": "liger-kernel {liger} chunked_loss at its defaults",
    "verl": "verl {verl} linear_cross_entropy (Triton)",
    "triton": "lmkernels.losses, backend triton",
    "triton_lean": "lmkernels.losses, backend triton_lean",
    "eager": "lmkernels.losses, backend eager (the reference: full logits)",
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lmkernels-bench posttrain", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="the folder of posttrain.json / .md / data.jsonl")
    p.add_argument("--data", default=None, help="append the rows to DATA/<gpu>.jsonl (e.g. benchmarks/data)")
    p.add_argument("--losses", default=",".join(LOSSES), help=f"comma-separated, of {tuple(LOSSES)}")
    p.add_argument("--impls", default=",".join(DEFAULT_IMPLS), help=f"comma-separated, of {IMPLS}")
    p.add_argument("--device", default=None, choices=("cuda", "cpu"), help="default: cuda when available")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (a check of the script, e.g. on the CPU)")
    p.add_argument("--budget", type=float, default=None, help="seconds; what would start past it is skipped")
    p.add_argument("--warmup", type=float, default=25.0, help="do_bench warm-up (ms)")
    p.add_argument("--rep", type=float, default=200.0, help="do_bench repetition time (ms)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    args.losses = [x for x in args.losses.split(",") if x]
    args.impls = [x for x in args.impls.split(",") if x]
    bad = [x for x in args.losses if x not in LOSSES] + [x for x in args.impls if x not in IMPLS]
    if bad or not args.losses or not args.impls:
        p.error(f"unknown --losses / --impls {bad or 'none given'}; losses {tuple(LOSSES)}, impls {IMPLS}")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


class Skip(Exception):
    """An implementation that cannot run this case (status, note)."""

    def __init__(self, status: str, note: str):
        super().__init__(note)
        self.status, self.note = status, note


# --- inputs -----------------------------------------------------------------------------------------


def make_inputs(case: dict[str, Any], device: str, dtype: torch.dtype, seed: int = 0) -> dict[str, Any]:
    """The case's tensors, on the CPU generator (the same values on every device): hidden states
    and weights at logits of std ~2, targets, masks (a padded tail on every other row),
    advantages, old and reference log-probs near the policy's."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype)

    out: dict[str, Any] = {}
    if case["kind"] in ("grpo", "dpo"):
        rows = case["B"] if case["kind"] == "grpo" else 2 * case["B"]
        T, H, V = case["T"], case["H"], case["V"]
        out["hidden"] = randn(rows, T, H)
        out["weight"] = randn(V, H, scale=2.0 / H**0.5)
        out["target"] = torch.randint(0, V, (rows, T), generator=g).to(device)
        mask = torch.ones(rows, T, dtype=torch.long)
        mask[::2, T - T // 8 :] = 0
        out["mask"] = mask.to(device)
        if case["kind"] == "grpo":
            out["advantages"] = torch.randn(rows, generator=g).to(device)
            out["old_logps"] = (-5.0 + 0.1 * torch.randn(rows, T, generator=g)).to(device)
            out["ref_logps"] = (-5.0 + 0.1 * torch.randn(rows, T, generator=g)).to(device)
        else:
            out["ref_hidden"] = randn(rows, T, H)
            out["ref_weight"] = randn(V, H, scale=2.0 / H**0.5)
    else:
        N, V = case["N"], case["V"]
        out["hidden"] = randn(N, case["Hs"])
        out["weight"] = randn(V, case["Hs"], scale=2.0 / case["Hs"] ** 0.5)
        out["teacher_hidden"] = randn(N, case["Ht"])
        out["teacher_weight"] = randn(V, case["Ht"], scale=2.0 / case["Ht"] ** 0.5)
        target = torch.randint(0, V, (N,), generator=g)
        target[: N // 16] = -100
        out["target"] = target.to(device)
    out["hidden"].requires_grad_(True)
    out["weight"].requires_grad_(True)
    return out


# --- the losses from per-token log-probs (shared by plain, trl, verl) -------------------------------


def grpo_from_tokens(logps, entropy, x, case) -> torch.Tensor:
    """TRL's dapo GRPO loss with the k3 reference KL and the entropy bonus (lmkernels.losses'
    grpo_loss defines the same)."""
    m = x["mask"].to(logps.dtype)
    adv = x["advantages"][:, None]
    coef_1 = torch.exp(torch.where(x["mask"].bool(), logps - x["old_logps"], 0.0))
    coef_2 = torch.clamp(coef_1, 1 - GRPO["epsilon"], 1 + GRPO["epsilon"])
    d = torch.where(x["mask"].bool(), x["ref_logps"] - logps, 0.0)
    kl = (torch.exp(d) - d - 1) * coef_1
    per_token = -torch.min(coef_1 * adv, coef_2 * adv) + GRPO["beta"] * kl
    count = m.sum().clamp(min=1.0)
    return (per_token * m).sum() / count - GRPO["entropy_coef"] * (entropy * m).sum() / count


def dpo_from_logps(chosen, rejected, ref_chosen, ref_rejected) -> torch.Tensor:
    return -F.logsigmoid(DPO_BETA * ((chosen - ref_chosen) - (rejected - ref_rejected))).mean()


def _full_logits_stats(hidden, weight, target, temperature=1.0):
    """plain: per-token log-probs and entropy from the full logits (bf16 matmul, fp32 softmax)."""
    logits = (hidden @ weight.T).float() / temperature
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, target.clamp(min=0)[..., None])[..., 0]
    entropy = -(logp.exp() * logp).sum(-1)
    return lp, entropy


def _trl_stats(hidden, weight, target, temperature=1.0, outputs=("entropy",)):
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    H = hidden.shape[-1]
    lp, entropy, *_ = ChunkedLogProbFunction.apply(
        hidden.reshape(-1, H), weight, None, target.reshape(-1).clamp(min=0), temperature,
        _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, outputs,
    )  # fmt: skip
    shape = target.shape
    return lp.view(shape), None if entropy is None else entropy.view(shape)


def _seq(lp, mask):
    return (lp * mask).sum(-1)


def _generalized_jsd_from_logits(xs, xt, beta, temperature=1.0):
    log_s = torch.log_softmax(xs.float() / temperature, -1)
    log_t = torch.log_softmax(xt.float() / temperature, -1)
    log_m = torch.logaddexp(log_s + math.log1p(-beta), log_t + math.log(beta))
    kl_t = (log_t.exp() * (log_t - log_m)).sum(-1)
    kl_s = (log_s.exp() * (log_s - log_m)).sum(-1)
    return beta * kl_t + (1 - beta) * kl_s


# --- one implementation's forward + backward ------------------------------------------------------


def loss_fn(impl: str, case: dict[str, Any], x: dict[str, Any]):
    """A closure computing the case's loss with `impl` (raises Skip where it cannot)."""
    kind = case["kind"]
    if impl in ("triton", "triton_lean", "eager"):
        return _lmkernels(impl, case, x)
    if impl == "plain":
        return _plain(case, x)
    if impl == "trl":
        try:
            import trl  # noqa: F401
        except ImportError:
            raise Skip("not installed", "trl is not installed") from None
        return _trl(case, x)
    if impl == "liger":
        try:
            from liger_kernel import chunked_loss
        except ImportError:
            raise Skip("not installed", "liger-kernel is not installed") from None
        return _liger(chunked_loss, case, x)
    if kind != "grpo":
        raise Skip("no such loss", "verl's fused head gives log-probs and entropy (RL losses) only")
    if not x["hidden"].is_cuda:
        raise Skip("needs CUDA", "verl's linear_cross_entropy is a CUDA Triton kernel")
    try:
        from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy
    except ImportError as e:
        raise Skip("not installed", f"verl: {e}"[:200]) from None

    def verl():
        lp, ent = linear_cross_entropy(
            x["hidden"], x["weight"], x["target"].clamp(min=0), float(case["temperature"]), "none"
        )
        return grpo_from_tokens(lp.view(x["target"].shape), ent.view(x["target"].shape), x, case)

    return verl


def _lmkernels(backend, case, x):
    kind = case["kind"]
    if kind == "grpo":
        return lambda: L.grpo_loss(
            x["hidden"], x["weight"], x["target"], x["advantages"], x["mask"], old_logps=x["old_logps"],
            ref_logps=x["ref_logps"], temperature=case["temperature"], beta=GRPO["beta"],
            entropy_coef=GRPO["entropy_coef"], loss_type=GRPO["loss_type"], backend=backend,
        )[0]  # fmt: skip
    if kind == "dpo":
        return lambda: L.dpo_loss(
            x["hidden"], x["weight"], x["target"], x["mask"], ref_hidden=x["ref_hidden"],
            ref_weight=x["ref_weight"], beta=DPO_BETA, backend=backend,
        )[0]  # fmt: skip
    return lambda: L.distillation_loss(
        x["hidden"], x["weight"], x["teacher_hidden"], x["teacher_weight"], x["target"], beta=JSD["beta"],
        hard_weight=JSD["hard"], soft_weight=JSD["soft"], backend=backend,
    )[0]  # fmt: skip


def _plain(case, x):
    kind = case["kind"]
    if kind == "grpo":

        def grpo():
            lp, ent = _full_logits_stats(x["hidden"], x["weight"], x["target"], case["temperature"])
            return grpo_from_tokens(lp, ent, x, case)

        return grpo
    if kind == "dpo":

        def dpo():
            m = x["mask"]
            lp, _ = _full_logits_stats(x["hidden"], x["weight"], x["target"])
            with torch.no_grad():
                ref, _ = _full_logits_stats(x["ref_hidden"], x["ref_weight"], x["target"])
            return dpo_from_logps(*_seq(lp, m).chunk(2), *_seq(ref, m).chunk(2))

        return dpo

    def jsd():
        xs = x["hidden"] @ x["weight"].T
        with torch.no_grad():
            xt = x["teacher_hidden"] @ x["teacher_weight"].T
        valid = x["target"] != -100
        soft = (_generalized_jsd_from_logits(xs, xt, JSD["beta"]) * valid).sum() / valid.sum()
        hard = F.cross_entropy(xs.float(), x["target"])
        return JSD["soft"] * soft + JSD["hard"] * hard

    return jsd


def _trl(case, x):
    kind = case["kind"]
    if kind == "grpo":

        def grpo():
            lp, ent = _trl_stats(x["hidden"], x["weight"], x["target"], case["temperature"])
            return grpo_from_tokens(lp, ent, x, case)

        return grpo
    if kind == "dpo":

        def dpo():
            m = x["mask"]
            target = torch.where(m.bool(), x["target"], 0)
            lp, _ = _trl_stats(
                x["hidden"], x["weight"], target, outputs=("entropy", "mean_logits", "is_top1")
            )
            with torch.no_grad():
                ref, _ = _trl_stats(x["ref_hidden"], x["ref_weight"], target, outputs=())
            return dpo_from_logps(*_seq(lp, m).chunk(2), *_seq(ref, m).chunk(2))

        return dpo
    try:
        from trl.trainer.distillation_trainer import _chunked_divergence_loss
    except ImportError as e:
        raise Skip(
            "not installed", f"TRL without DistillationTrainer's chunked divergence: {e}"[:200]
        ) from None

    def jsd():
        valid = x["target"] != -100
        soft, _, _ = _chunked_divergence_loss(
            x["hidden"][None], x["teacher_hidden"][None], x["weight"], x["teacher_weight"], valid[None].long(),
            JSD["beta"],
        )  # fmt: skip
        lp, _ = _trl_stats(x["hidden"], x["weight"], x["target"], outputs=())
        hard = -(lp * valid).sum() / valid.sum()
        return JSD["soft"] * soft + JSD["hard"] * hard

    return jsd


def _liger(chunked_loss, case, x):
    kind = case["kind"]
    if kind == "grpo":
        loss = chunked_loss.LigerFusedLinearGRPOLoss(
            beta=GRPO["beta"], temperature=case["temperature"], loss_type=GRPO["loss_type"]
        )
        return lambda: loss(
            x["hidden"], x["weight"], x["target"], x["mask"], x["advantages"],
            ref_per_token_logps=x["ref_logps"], old_per_token_logps=x["old_logps"],
        )[0]  # fmt: skip
    if kind == "dpo":
        loss = chunked_loss.LigerFusedLinearDPOLoss(beta=DPO_BETA)
        loss.use_ref_model = True  # the case has a reference model (its default in newer releases)
        target = torch.where(x["mask"].bool(), x["target"], -100)
        return lambda: _first(
            loss(x["weight"], x["hidden"], target, ref_input=x["ref_hidden"], ref_weight=x["ref_weight"])
        )
    loss = chunked_loss.LigerFusedLinearJSDLoss(
        weight_hard_loss=JSD["hard"], weight_soft_loss=JSD["soft"], beta=JSD["beta"]
    )
    return lambda: loss(
        x["hidden"], x["weight"], x["teacher_hidden"], x["teacher_weight"], x["target"], None, None
    )


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _refusal(impl: str, case: dict[str, Any], x: dict[str, Any]) -> str:
    """Why lmkernels' Triton backend refuses the case today ("" if it takes it): the impl's
    reasons for its options, and the entropy's gradient (the GRPO entropy bonus)."""
    if impl not in ("triton", "triton_lean"):
        return ""
    if case["kind"] == "jsd":
        names = {i.backend for i in lmkernels.impls("fused_linear_distillation")}
        return (
            ""
            if impl in names
            else f"fused_linear_distillation has no backend {impl!r} (backends: {sorted(names)})"
        )
    if case["kind"] != "grpo":
        return ""
    reasons = lmkernels.get_impl("fused_linear_cross_entropy", impl).not_supported_reasons(
        hidden=x["hidden"], weight=x["weight"], target=x["target"], temperature=case["temperature"]
    )
    return "; ".join(reasons)


def measure(impl: str, case: dict[str, Any], x: dict[str, Any], args) -> dict[str, Any]:
    """One row's measurements: the loss value, GPU / wall time of forward + backward, peak."""
    grads = [x["hidden"], x["weight"]]
    refusal = _refusal(impl, case, x)
    if refusal:
        raise Skip("unsupported", refusal)
    fn = loss_fn(impl, case, x)

    def run():
        fn().backward()

    value = fn()
    value.backward()
    row: dict[str, Any] = {"loss": float(value.detach().float())}
    wall = time_ms(run, grads, args.device, args.warmup, args.rep, min_runs=1 if args.tiny else 10)
    row["wall_ms"], row["wall_p20_ms"], row["wall_p80_ms"] = (round(w, 4) for w in wall)
    if args.device == "cuda":
        row["gpu_ms"] = round(gpu_time_ms(run, grads), 4)
        peak = peak_memory_bytes(run, grads, args.device)
        row["peak_mib"] = None if peak is None else round(peak / 2**20, 2)
    else:
        row["gpu_ms"] = row["peak_mib"] = None
    return row


def shape_name(case: dict[str, Any]) -> str:
    if case["kind"] == "jsd":
        return f"{case['N']}x{case['Hs']}/{case['Ht']}x{case['V']}"
    return f"{case['B']}x{case['T']}x{case['H']}x{case['V']}"


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for name, dist in (("trl", "trl"), ("liger", "liger-kernel"), ("verl", "verl")):
        try:
            out[name] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def run(argv=None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cases = TINY if args.tiny else LOSSES
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    start = time.monotonic()
    command = data.command_line("posttrain", argv)
    prov = data.provenance(command, f"posttrain-{time.strftime('%Y-%m-%dT%H:%M:%S')}")
    vers = _versions()
    rows = []
    for name in args.losses:
        case = cases[name]
        for impl in args.impls:
            row = {
                "part": "posttrain",
                "op": name,
                "impl": impl,
                "shape": shape_name(case),
                "dims": {k: v for k, v in case.items() if k != "kind"},
                "dtype": "bf16" if dtype == torch.bfloat16 else "fp32",
                "peer": PEERS[impl].format(**vers),
                "status": "ok",
                "note": "",
            }
            if impl == "liger" and case["kind"] == "grpo":
                row["note"] = "no entropy bonus (Liger's GRPO loss has none)"
            if args.budget is not None and time.monotonic() - start > args.budget:
                row.update(status="skipped", note=f"past the --budget of {args.budget:g} s")
                rows.append(row)
                continue
            x = None
            try:
                x = make_inputs(case, args.device, dtype)
                row.update(measure(impl, case, x, args))
            except Skip as s:
                row.update(status=s.status, note=s.note)
            except Exception as e:  # recorded, never hidden
                status = "OOM" if is_oom(e) else "error"
                row.update(status=status, note=f"{type(e).__name__}: {e}"[:300])
            finally:
                del x
                cleanup(args.device)
            print(_line(row), flush=True)
            rows.append(prov | row)
    (out / "posttrain.json").write_text(json.dumps({"command": command, "rows": rows}, indent=1, default=str))
    (out / "posttrain.md").write_text(table(rows) + "\n")
    data.append_rows(out / "data.jsonl", rows)
    if args.data:
        data.append_rows(data.data_path(Path(args.data), prov["gpu"]), rows)
    return rows


def _line(row) -> str:
    t = "-" if row.get("gpu_ms") is None else f"{row['gpu_ms']:.2f} ms GPU"
    w = "-" if row.get("wall_ms") is None else f"{row['wall_ms']:.2f} ms wall"
    return f"{row['op']:8s} {row['impl']:12s} {row['status']:12s} {t:>16s} {w:>16s} {row.get('note', '')}"


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| loss | shape | impl | status | GPU ms | wall ms | peak MiB | loss value | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    for r in rows:
        lines.append(
            f"| {r['op']} | {r['shape']} | {r['impl']} | {r['status']} | {f(r.get('gpu_ms'), '.2f')} | "
            f"{f(r.get('wall_ms'), '.2f')} | {f(r.get('peak_mib'), '.0f')} | {f(r.get('loss'), '.5g')} | "
            f"{r.get('note', '')} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
