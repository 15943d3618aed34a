"""An audit's findings as the lines `stagereplay audit` prints: integrity first, then what was not reproduced
under other kernels; what it re-executed (every record, or how many of them); and a closing verdict that says which
of the two kinds the audit found, or how much it reproduced, or that it checked nothing."""

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


def re_executed(res: AuditSummary) -> int | None:
    """Records the audit re-executed: its sample's, else every record (None: the model-free check alone, or an older
    audit.json that did not count them)."""
    if res.verify_only:
        return None
    return res.sample.re_executed if res.sample is not None else res.records


def count_line(res: AuditSummary) -> str:
    """What the re-execution reproduced, and of how many records."""
    if re_executed(res) == 0:
        return "re-executed no record: no trajectory or comparison was checked"
    t, c = res.trajectories, res.comparisons
    line = (f"trajectories reproduced {t.k}/{t.n}, comparisons reproduced {c.k}/{c.n}" if t and c
            else "trajectories and comparisons not counted")
    s = res.sample
    if s is not None:
        return (f"{line} (re-executed {s.re_executed} of {s.of} records: a seeded sample of {s.per_stage} per stage "
                f"and part, seed {s.seed})")
    return line if res.records is None else f"{line} (re-executed all {res.records} records)"


def verify_line(res: AuditSummary) -> str:
    """The model-free check's verdict (`audit --verify-only`)."""
    if not res.chain_ok:
        return "ledger damaged"
    if not res.reproduced:
        return "ledger intact, but its claims, summary or completeness fail"
    if res.records == 0:
        return "ledger intact, but it holds no record: nothing verified"
    return "ledger intact, bound and complete" + (f": {res.records} records verified" if res.records else "")


def verdict_line(res: AuditSummary) -> str:
    if res.reproduced:
        done = re_executed(res)
        if done == 0:
            return ("audit: re-executed nothing (the run declares no unit to re-execute), so nothing was reproduced; "
                    "its ledger verified without the model")
        if res.sample is not None and done is not None and done < res.sample.of:
            rest = res.sample.of - done
            return (f"audit: {done} of {res.sample.of} records re-executed, all reproduced; the other {rest} "
                    "verified without the model")
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
