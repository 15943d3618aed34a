"""The smallest run of an experiment on the embedded toy, as its own command makes it: what the test of every reading
command (`tests/test_every_command.py`) makes of each registered experiment, an installed extension's included
(`Experiment.smallest_run`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class SmallRun:
    """The options of an experiment's command that make the smallest run the toy allows, and the run it extends."""

    options: tuple[str, ...] = field(default=(), metadata={"help": "its command's options (no run directory, no "
                                                                    "--out)"})
    extends: str | None = field(default=None, metadata={
        "help": "the experiment whose smallest run its stage is added to; None: its command makes the run"})

    def command_line(self, command: str, run: Path) -> list[str]:
        """Its command line after `stagereplay`: a run made in `run` (`--out`), or a stage added to the run there."""
        if self.extends is None:
            return [command, *self.options, "--out", str(run)]
        return [command, str(run), *self.options]
