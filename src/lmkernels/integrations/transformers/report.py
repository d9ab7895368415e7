"""What apply() patched and what it kept, and why: plain-text tables that fit 80 columns."""

from __future__ import annotations

import dataclasses

from lmkernels.integrations.transformers.structure import FAILED, KEPT, PATCHED, Finding

WIDTH = 80


@dataclasses.dataclass
class PatchReport:
    """What apply() patched on a model (or would: patch_report()), what it kept and why.

    `print(report.format())` shows it as a table; `patched_ops()` lists the ops patched;
    `findings` holds every Finding (op, what, paths, status "patched" / "kept" / "failed",
    detail), also by status: `patched`, `kept`, `failed`."""

    model: str  # e.g. "Qwen3ForCausalLM (qwen3)"
    backend: str | None
    findings: list[Finding]

    def by_status(self, status: str) -> list[Finding]:
        """The findings of one status: "patched", "kept" or "failed"."""
        return [f for f in self.findings if f.status == status]

    @property
    def patched(self) -> list[Finding]:
        """The findings whose replacement passed its check and is installed."""
        return self.by_status(PATCHED)

    @property
    def kept(self) -> list[Finding]:
        """Modules of kinds lmkernels has no op for (kept as they are; not an error)."""
        return self.by_status(KEPT)

    @property
    def failed(self) -> list[Finding]:
        """Modules that look patchable but cannot be patched correctly (strict apply raises)."""
        return self.by_status(FAILED)

    def patched_ops(self) -> list[str]:
        """The `ops` names patched ("rms_norm", "rope", "mlp", "flce", ...), sorted."""
        return sorted({f.op for f in self.patched})

    def summary(self) -> dict[str, list[str]]:
        """{"patched": ["rms_norm: Qwen3RMSNorm x5", ...], "kept": [...], "failed": [...]} (tests, docs)."""
        out: dict[str, list[str]] = {PATCHED: [], KEPT: [], FAILED: []}
        for f in self.findings:
            out[f.status].append(f"{f.op}: {f.what}" + (f" x{f.count}" if f.count > 1 else ""))
        return out

    def brief(self) -> str:
        """One line: what is patched, what is kept and why (for a log)."""

        def count(f: Finding) -> str:
            return f" x{f.count}" if f.count > 1 else ""

        patched = ", ".join(f"{f.op}{count(f)}" for f in self.patched) or "nothing"
        line = f"{self.model}, backend {self.backend or 'auto'}: patched {patched}"
        kept = self.kept + self.failed
        if kept:
            line += "; kept " + ", ".join(f"{f.op} {f.what}{count(f)} ({f.detail})" for f in kept)
        return line

    def format(self, width: int = WIDTH) -> str:
        """The report as a table per status (op, module, why) that fits `width` columns."""
        from lmkernels.cliargs import table

        lines = [f"lmkernels patch report: {self.model}, backend {self.backend or 'auto'}"]
        for status, title in (
            (PATCHED, "patched"),
            (KEPT, "kept (no lmkernels op)"),
            (FAILED, "kept (could not be patched; strict=True raises)"),
        ):
            group = self.by_status(status)
            if not group:
                continue
            rows = [(f.op, f.what + (f" x{f.count}" if f.count > 1 else ""), f.detail) for f in group]
            lines += [
                "",
                f"{title}:",
                table(("op", "module", "how" if status == PATCHED else "why"), rows, width),
            ]
        if not self.findings:
            lines.append("  nothing lmkernels can patch was found")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()
