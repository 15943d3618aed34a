"""One run as `compare` reads it (`RunSide`): its folder, manifest and chain, what an experiment's comparison of two
runs is made from (`Experiment.compare_runs`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stagereplay.records.ledger import Record
from stagereplay.records.manifest import Manifest


@dataclass(frozen=True)
class RunSide:
    """One run as `compare` reads it: its folder, manifest and whole chain (items, stage and environment records)."""

    path: Path
    manifest: Manifest
    chain: list[Record]

    def matched(self, checkpoint: str, experiment: str) -> list[Record]:
        """Its item records of `experiment` at `checkpoint`, in ledger order."""
        return [r for r in self.chain
                if r.kind == "item" and r.experiment == experiment and r.checkpoint == checkpoint]

    def checkpoints(self, experiment: str) -> list[str]:
        return sorted({r.checkpoint for r in self.chain if r.kind == "item" and r.experiment == experiment})

    def environment(self, checkpoint: str, experiment: str) -> dict[str, Any]:
        """The environment of the process that computed its first record of `experiment` at `checkpoint` (the
        manifest's where none is named), with the serving engine's identity from the manifest (only it records
        that)."""
        envs = {r.env: r.payload for r in self.chain if r.kind == "environment"}
        first = next((envs[r.env] for r in self.matched(checkpoint, experiment) if r.env in envs), None)
        manifest_env = self.manifest.environment
        env = dict(first if first is not None else manifest_env)
        if "engine" in manifest_env:
            env["engine"] = manifest_env["engine"]
        return env
