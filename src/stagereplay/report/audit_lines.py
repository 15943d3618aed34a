"""An audit's findings as the lines `stagereplay audit` prints: integrity first, then what was not reproduced
under other kernels, and a closing verdict that says which of the two kinds the audit found."""

from __future__ import annotations

from stagereplay.records.audit_summary import AuditSummary, Elsewhere
from stagereplay.records.findings import Finding

SHOWN_ELSEWHERE = 40
"""Units not reproduced under other kernels printed (every field of every unit moves with the bits, so there
may be thousands); audit.json holds them all. Integrity findings are printed in full."""


def finding_lines(res: AuditSummary) -> list[str]:
    """Each finding names its item (unless it is about the whole run) and the field."""
    lines = []
    findings: list[Finding] = res.findings
    for integrity, header in ((True, None), (False, "not reproduced here (other kernels):")):
        mine = [m for m in findings if m.integrity == integrity]
        if mine and header:
            lines.append(header)
        shown = mine if integrity else mine[:SHOWN_ELSEWHERE]
        for m in shown:
            item = f"{m.item_id}: " if m.item_id and m.item_id not in m.what else ""
            lines.append(f"  {item}{m.what}")
        if len(mine) > len(shown):
            lines.append(f"  ... and {len(mine) - len(shown)} more (all in audit.json)")
    return lines


def verdict_line(res: AuditSummary) -> str:
    if res.reproduced:
        return "audit: every record reproduced"
    if not res.integrity_ok:
        return "audit: integrity findings (tampering or a broken run)"
    here = res.not_reproduced_here or Elsewhere(units=0, by_precision={}, reduced_precision_only=False,
                                                fp32_token_differences=[])
    by = ", ".join(f"{n} {p}" for p, n in sorted(here.by_precision.items()))
    line = (f"audit: integrity holds; {here.units} units not reproduced under this machine's other "
            f"kernels ({by})")
    line += "; confined to bf16/fp16" if here.reduced_precision_only else ""
    suspicious = here.fp32_token_differences
    if suspicious:
        line += (f"; {len(suspicious)} fp32 units with other tokens or labels, which other kernels rarely cause: "
                 f"suspicious ({', '.join(suspicious[:3])}{', ...' if len(suspicious) > 3 else ''})")
    return line + "; re-audit on a machine with the run's kernels to tell kernels from tampering"
