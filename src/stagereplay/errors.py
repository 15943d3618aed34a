"""One exception type for every bad input, and the exit codes every command shares: the CLI prints a bad input's
message on one line and exits `REFUSED`."""

from __future__ import annotations

OK = 0
"""Success; a check's verdict is consistent (attest), reproduced (audit), faithful."""
FLAGGED = 1
"""A check's verdict accuses: attest's served run is not the claimed model; audit found tampering or a broken run."""
REFUSED = 2
"""Bad input, refused before anything was written: one line naming the problem and the fix."""
INCONCLUSIVE = 3
"""A check that could not decide: attest's null cannot support the stated level; audit's records hold but were not
reproduced under this machine's kernels. Never read as consistent, never as flagged."""
FAILED = 4
"""Anything else went wrong (a bug, a crash, a killed worker): never a verdict."""


class StageReplayError(Exception):
    """A problem the user can fix. The message names the problem and the fix, in one line."""

    exit_code = REFUSED

    def __init__(self, problem: str, fix: str | None = None) -> None:
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem}; {fix}" if fix else problem)
