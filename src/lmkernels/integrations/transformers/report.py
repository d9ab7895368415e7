"""What apply() patched and what it kept, and why: plain-text tables that fit 80 columns."""

from __future__ import annotations

import dataclasses

from lmkernels.integrations.transformers.structure import FAILED, KEPT, PATCHED, Finding

WIDTH = 80


@dataclasses.dataclass
class PatchReport:
    model: str  # e.g. "Qwen3ForCausalLM (qwen3)"
    backend: str | None
    findings: list[Finding]

    def by_status(self, status: str) -> list[Finding]:
        return [f for f in self.findings if f.status == status]

    @property
    def patched(self) -> list[Finding]:
        return self.by_status(PATCHED)

    @property
    def kept(self) -> list[Finding]:
        return self.by_status(KEPT)

    @property
    def failed(self) -> list[Finding]:
        return self.by_status(FAILED)

    def patched_ops(self) -> list[str]:
        return sorted({f.op for f in self.patched})

    def summary(self) -> dict[str, list[str]]:
        """{"patched": ["rms_norm: Qwen3RMSNorm x5", ...], "kept": [...], "failed": [...]} (tests, docs)."""
        out: dict[str, list[str]] = {PATCHED: [], KEPT: [], FAILED: []}
        for f in self.findings:
            out[f.status].append(f"{f.op}: {f.what}" + (f" x{f.count}" if f.count > 1 else ""))
        return out

    def brief(self) -> str:
        """One line: what is patched, what is kept and why (for a log)."""

        def count(f):
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
