"""The arms of an engine that saves and restores a sequence's K/V (llama.cpp): the boundary state taken from live
and from a one-shot prefill, each loaded into a cleared context and continued (`matched --engine llama.cpp`).

    live            as on any serving engine, and the sequence's K/V saved the moment the boundary token is
                    emitted (before it is fed): the cache over P[0:T-1], the pending token P[T-1]. Its fingerprint
                    is live's `cache_fp`
    state-restore   live's saved K/V loaded into the cleared context (llama-server's slot restore), P[T-1] fed as
                    a decode step, then decoded: exactly the operations live ran, so it must continue as live did
                    unless the restore itself changes something
    oneshot-restore a fresh prefill of P[0:T-1] as one batch, saved, loaded the same way and continued: the whole-
                    cache transplant of the one-shot state into live's position. Set against live, only the cache
                    differs; `cache_equal` says whether the two caches are the same bytes
    each #replica   the same from live#replica's saved state, and from a second one-shot prefill

A restore arm's `cache_fp` is the cache re-read after the load (so a restore that changed the bytes shows), and
`restored_positions` how many positions it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from stagereplay.records.payloads import Arm
from stagereplay.serving.seam import Generation, SavedState, SavesState


def restore_arms(engine: SavesState, prefix: Sequence[int], states: Sequence[SavedState | None], max_new: int,
                 arm: Callable[[str, Generation, str, int], Arm]) -> list[Arm]:
    """state-restore from each of `states` (live's, live#replica's), then oneshot-restore and its replica.
    `arm(name, generation, cache_fp, restored_positions)` builds an arm."""
    out = []
    names = ("state-restore", "state-restore#replica")
    for name, state in zip(names, states, strict=False):
        if state is not None and list(state.ids) == list(prefix[:-1]):
            g, loaded = engine.restore(state, prefix[-1], max_new)
            out.append(arm(name, g, loaded, len(state.ids)))
    for name in ("oneshot-restore", "oneshot-restore#replica"):
        g, loaded = engine.restore(engine.build_state(prefix[:-1]), prefix[-1], max_new)
        out.append(arm(name, g, loaded, len(prefix) - 1))
    return out
