"""The report of the distributed benchmark (dist.py): the markdown summary (tokens/s/GPU, ratios to plain and
Liger, peak memory, loss differences) and the loss-curve plot."""

from __future__ import annotations

from pathlib import Path

MODES = ("fsdp", "fsdp_lm_head", "tp")


def summary(rows: list[dict], env: dict) -> str:
    lines = [
        f"# Distributed training, {env.get('gpus', 2)} x {env['device']}",
        "",
        f"`{env['command']}`",
        "",
    ]
    lines += ["| mode | config | tokens/s/GPU | vs plain | vs liger | peak GiB | final loss | status |"]
    lines += ["|---|---|---|---|---|---|---|---|"]
    by = {(r["mode"], r["config"]): r for r in rows}
    for r in rows:

        def ratio(base, r=r):
            b = by.get((r["mode"], base), {})
            if r.get("tokens_per_s_per_gpu") and b.get("tokens_per_s_per_gpu"):
                return f"{r['tokens_per_s_per_gpu'] / b['tokens_per_s_per_gpu']:.2f}x"
            return "-"

        tps = f"{r['tokens_per_s_per_gpu']:,.0f}" if r.get("tokens_per_s_per_gpu") else "-"
        peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") else "-"
        final = f"{r['losses'][-1]:.4f}" if r.get("losses") else "-"
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('error', '')[:80]}"
        lines.append(
            f"| {r['mode']} | {r['config']} | {tps} | {ratio('plain')} | {ratio('liger')} | {peak} | {final} | {status} |"
        )
    lines += ["", "Largest loss difference to plain per step (same batches, same init):", ""]
    for r in rows:
        base = by.get((r["mode"], "plain"), {})
        if r["config"] != "plain" and r.get("losses") and base.get("losses"):
            diff = max(abs(a - b) for a, b in zip(r["losses"], base["losses"]))
            lines.append(f"- {r['mode']} {r['config']}: {diff:.2e}")
    versions = ", ".join(f"{k} {env[k]}" for k in ("torch", "transformers", "triton", "liger-kernel"))
    return "\n".join([*lines, "", versions, ""])


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in MODES if any(r["mode"] == m and r.get("losses") for r in rows)] or ["none"]
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 3.6), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        for r in rows:
            if r["mode"] == mode and r.get("losses"):
                tps = r.get("tokens_per_s_per_gpu", 0)
                label = f"{r['config']} ({tps:,.0f} tok/s/GPU, {r.get('peak_gib', 0):.1f} GiB)"
                ax.plot(range(len(r["losses"])), r["losses"], label=label, marker=".")
        ax.set(title=mode, xlabel="step", ylabel="loss")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
