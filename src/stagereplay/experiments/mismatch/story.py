"""One mismatch item's story (`stagereplay show RUN ITEM`): where along the response each side parts from the
rollout, and by how much.

Per side (every arm of the item's records but the rollout itself: its replica, our engine's incremental and
prefill scores, the trainer at each precision, the transplant's continuations), against the rollout's
log-probabilities on the same tokens:

    first differs    the first response token whose log-probability differs from the rollout's in its bits
                     (`never`: every one is the same bits)
    max |log-ratio|  the largest |log pi_side - log pi_rollout| over the response (nats), and the response token
                     where it is

Positions are response tokens, counted from 0 (the first token after the prompt); a side that starts later (a
transplant's continuation) is held against the rollout's tokens from where it starts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stagereplay.experiments.mismatch.payloads import MismatchPayload, ScoredArm
from stagereplay.records import arrays


@dataclass(frozen=True)
class Parting:
    """One side against the rollout, on the tokens both scored."""

    side: str
    first: int | None
    """The first response token whose log-probability differs in bits (None: none does)."""
    max_abs: float
    """The largest |log-ratio| (0.0: none differs)."""
    at: int | None
    """The response token where it is (None: none differs)."""


def parting(rollout: ScoredArm, side: ScoredArm) -> Parting:
    """Where `side` parts from `rollout`, in response tokens counted from the rollout's first."""
    a, b = arrays.decode(rollout.logprobs), arrays.decode(side.logprobs)
    offset = side.start - rollout.start
    a = a[offset:offset + len(b)]
    b = b[:len(a)]
    differs = np.flatnonzero(a.view(np.uint32) != b.view(np.uint32))
    if not differs.size:
        return Parting(side.name, None, 0.0, None)
    gap = np.abs(b.astype(np.float64) - a.astype(np.float64))
    worst = int(np.argmax(gap))
    return Parting(side.name, offset + int(differs[0]), float(gap[worst]), offset + worst)


def story_lines(payloads: list[MismatchPayload], where: str) -> list[str]:
    """The story of one item's records (its rollout part first, then each trainer part) at one checkpoint."""
    main = next((p for p in payloads if p.response_ids is not None), None)
    rollout = next((a for p in payloads for a in p.arms if a.name == "rollout"), None)
    if main is None or rollout is None:
        return [f"{where}: no rollout recorded for this item"]
    prompt, response = len(main.prompt_ids or []), len(main.response_ids or [])
    head = f"{where}: prompt {prompt} tokens, response {response} tokens ({main.source} rollout"
    lines = [head + (f", stopped at {main.stop})" if main.stop else ")"),
             "Each side against the rollout (response tokens from 0; log-ratio in nats):",
             f"  {'side':<28} {'first differs':>13} {'max |log-ratio|':>15} {'at':>6}"]
    for p in payloads:
        for arm in p.arms:
            if arm is rollout:
                continue
            part = parting(rollout, arm)
            first = "never" if part.first is None else str(part.first)
            at = "-" if part.at is None else str(part.at)
            lines.append(f"  {part.side:<28} {first:>13} {part.max_abs:>15.3g} {at:>6}")
    if main.transplant is not None:
        moved = main.transplant
        outcomes = ", ".join(f"{d}: follows the {o.outcome}" for d, o in moved.directions.items())
        control = ", ".join(f"{d}: {o.outcome}" for d, o in moved.control.items())
        lines.append(f"K/V transplant at position {moved.at}: {outcomes} (control, no layer moved: {control})")
    return lines
