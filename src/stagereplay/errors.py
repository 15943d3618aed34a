"""One exception type for every bad input: the CLI prints its message on one line and exits non-zero."""

from __future__ import annotations


class StageReplayError(Exception):
    """A problem the user can fix. The message names the problem and the fix, in one line."""

    exit_code = 2

    def __init__(self, problem: str, fix: str | None = None) -> None:
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem}; {fix}" if fix else problem)
