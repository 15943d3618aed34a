"""Whether a serving engine built an arm's state the way the arm's construction says, from what the engine
reported of the request. A server decides for itself what it reuses: a slot restore that the server could not use
(a sliding-window model's cache, say) is continued from a fresh prefill, and a prefix-cache request may find only
the prompt's blocks. Such an arm is not what its name says, and the report counts it apart.

    live, oneshot     nothing taken from a cache: `num_cached_tokens` is 0
    prefix-cache      positions past the prompt taken from the cache, which live's decoding wrote
                      (`num_cached_tokens` > the prompt's length)
    slot-restore      every position before the pending token taken from the restored slot
                      (`num_cached_tokens` = boundary - 1)
    under load        also: other requests were in flight when it was sent (`load.in_flight_at_send` > 0)

An engine that does not report cached positions (an OpenAI-style server without prompt-token details) leaves it
unknown (None), as does an arm whose state the engine does not report on.
"""

from __future__ import annotations

from stagereplay.records.payloads import Arm

COUNTED = ("live", "oneshot", "prefix-cache", "slot-restore")
"""The constructions whose taking place an engine's counts show."""


def took_place(arm: Arm, prompt_len: int, boundary: int) -> bool | None:
    """Whether the arm's construction took place, as its engine reported the request (module docstring)."""
    cached, construction = arm.num_cached_tokens, arm.construction
    if cached is None or construction not in COUNTED:
        return None
    if arm.load is not None and not arm.load.in_flight_at_send:
        return False
    if construction in ("live", "oneshot"):
        return bool(cached == 0)
    if construction == "prefix-cache":
        return bool(cached > prompt_len)
    return bool(cached >= boundary - 1)
