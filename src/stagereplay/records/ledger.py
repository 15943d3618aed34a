"""The run directory: a frozen manifest, an append-only hash-chained ledger, a lock, resume.

    RUN_DIR/manifest.json   written atomically before the first record; each experiment adds its own
                            frozen section (`stages`) before its first record and never changes it
    RUN_DIR/ledger.jsonl    one record per line, each carrying the sha256 of the previous one
    RUN_DIR/.lock           held (flock) by the one process writing the run; records its pid

The chain starts at the hash of the run's frozen identity (`records.manifest.chain_start`), so the manifest's
configuration and item ids are bound; each stage's section enters the chain as a `stage` record before its
first item, and each item's environment as an `environment` record before the first item it computed
(`records.record` has the format). A record is written whole (write, fsync). A torn last line (a kill
mid-write) is set aside and redone.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from stagereplay.errors import StageReplayError
from stagereplay.records.manifest import Manifest, StageSection, binding_problems, bound_stage, chain_start
from stagereplay.records.record import (
    GENESIS,
    SCHEMA_VERSION,
    Record,
    canonical_json,
    chain_problems,
    diff_fields,
    parse_record,
    sha256_json,
)

__all__ = ["GENESIS", "SCHEMA_VERSION", "Manifest", "Record", "Run", "StageSection", "atomic_output", "atomic_write", "canonical_json",
           "chain_problems", "diff_fields", "open_run", "parse_record", "read_ledger", "read_manifest",
           "sha256_json"]

log = logging.getLogger(__name__)
MANIFEST, LEDGER, LOCK, RESULTS = "manifest.json", "ledger.jsonl", ".lock", "results.json"


@contextlib.contextmanager
def atomic_output(target: Path) -> Iterator[Path]:
    """Yield a temporary path beside `target`; on success move it over `target` with `os.replace`.

    A reader (or a killed writer) never sees a half-written file: the old file stays until the new
    one is complete. The temporary file sits in the same directory so the rename stays atomic.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with tmp.open("rb") as fh:  # the bytes reach the disk before the name points at them
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; reports and exports are meant to be shared
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write(path: Path, data: str | bytes) -> None:
    """Write `data` to `path` through `atomic_output`: readers see the old file or the new, never half."""
    with atomic_output(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)


def read_ledger(run_dir: Path, *, strict: bool = True) -> list[Record]:
    """Every complete record, of every kind (the chain). A torn last line (no newline) is ignored here;
    `strict` also checks the chain, from the manifest's identity, and its binding to the manifest."""
    path = run_dir / LEDGER
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    complete = lines[:-1]  # the part after the last newline is either empty or torn
    records = [parse_record(line, i + 1, path) for i, line in enumerate(complete)]
    if strict:
        manifest = read_manifest(run_dir) if (run_dir / MANIFEST).exists() else None
        problems = chain_problems(records, chain_start(manifest)) or binding_problems(manifest, records)
        if problems:
            first = problems[0]
            raise StageReplayError(f"ledger {path} was modified: record {first.seq}: {first.reason}",
                                   "restore it from a copy or start a new run; `stagereplay audit --verify-only` lists every break")
    return records


def items(chain: list[Record]) -> list[Record]:
    """The item records of a chain (the outcomes), without its stage and environment records."""
    return [r for r in chain if r.kind == "item"]


def read_manifest(run_dir: Path) -> Manifest:
    """The run's manifest as its model; one line naming the problem when it is not one (unreadable, not JSON, a
    newer schema, a field of the wrong type)."""
    path = run_dir / MANIFEST
    if not path.exists():
        raise StageReplayError(f"no manifest.json in {run_dir}", "point at a run directory made by stagereplay")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise StageReplayError(f"{path} is not valid JSON", "restore the manifest from a copy") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("config", {}), dict):
        raise StageReplayError(f"{path} is not a stagereplay manifest", "restore the manifest from a copy")
    version = raw.get("schema_version", 0)
    if not isinstance(version, int):
        raise StageReplayError(f"{path} has no valid schema_version", "restore the manifest from a copy")
    if version > SCHEMA_VERSION:
        raise StageReplayError(f"{path} has manifest schema_version {version}, newer than {SCHEMA_VERSION}",
                               "upgrade stagereplay to read it")
    try:
        return Manifest.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise StageReplayError(f"{path} is not a stagereplay manifest ({where}: {first['msg']})",
                               "restore the manifest from a copy") from None


def write_manifest(run_dir: Path, manifest: Manifest) -> None:
    atomic_write(run_dir / MANIFEST, manifest.write())


class Run:
    """A run directory opened for writing by this process (see `open_run`).

    `chain` is every record in file order; `records` only the items (what experiments and reports read)."""

    def __init__(self, path: Path, manifest: Manifest, chain: list[Record]):
        self.path = path
        self.manifest = manifest
        self.chain = chain
        self.records = items(chain)
        self._keys = {r.key for r in self.records}
        self._staged = {(r.experiment, r.checkpoint) for r in chain if r.kind == "stage"}
        self._environments = {r.env for r in chain if r.kind == "environment"}

    @property
    def last_hash(self) -> str:
        return self.chain[-1].hash if self.chain else chain_start(self.manifest)

    def begin_stage(self, name: str, section: StageSection) -> StageSection:
        """Freeze one experiment's section in the manifest and the chain before its first record, or check that it
        is unchanged. Returns the section as the manifest holds it (as a later reader, the audit, reads it)."""
        written = StageSection.model_validate(section.as_json())  # normalised as JSON gives it back
        held = self.manifest.stage(name)
        if held is not None:
            differ = diff_fields(held.as_json(), written.as_json())
            if differ:
                raise StageReplayError(
                    f"{self.path} already holds a {name} run with a different configuration ({', '.join(differ)})",
                    "use the same options to resume, or a new --out",
                )
        else:
            self.manifest = self.manifest.with_stage(name, written)
            write_manifest(self.path, self.manifest)
        experiment, _, checkpoint = name.partition("/")
        if (experiment, checkpoint) not in self._staged:
            # Also after a kill between the manifest's write and this record's: the resumed run adds it.
            self._write("stage", experiment, checkpoint, "", "", bound_stage(written), "")
            self._staged.add((experiment, checkpoint))
        return self.manifest.stages[name]

    def done(self, experiment: str, checkpoint: str, item_id: str, part: str = "") -> bool:
        return (experiment, checkpoint, item_id, part) in self._keys

    def find(self, experiment: str, checkpoint: str) -> list[Record]:
        return [r for r in self.records if r.experiment == experiment and r.checkpoint == checkpoint]

    def append(self, experiment: str, checkpoint: str, item_id: str, payload: dict[str, Any], part: str = "",
               environment: dict[str, Any] | None = None) -> Record:
        """Write one item record, chained to the last; its environment (the process that computed it) goes
        in full into the chain first if this is its first record."""
        key = (experiment, checkpoint, item_id, part)
        if key in self._keys:
            raise RuntimeError(f"duplicate ledger record {key}")
        if (experiment, checkpoint) not in self._staged:
            raise RuntimeError(f"{experiment}/{checkpoint} has no stage record; call begin_stage first")
        env = sha256_json(environment) if environment is not None else ""
        if environment is not None and env not in self._environments:
            self._write("environment", "", "", "", "", environment, env)
            self._environments.add(env)
        record = self._write("item", experiment, checkpoint, item_id, part, payload, env)
        self.records.append(record)
        self._keys.add(key)
        return record

    def _write(self, kind: Literal["item", "stage", "environment"], experiment: str, checkpoint: str, item_id: str,
               part: str, payload: dict[str, Any], env: str) -> Record:
        """Make, hash and write one whole record (write, fsync), chained to the last."""
        record = Record(schema_version=SCHEMA_VERSION, seq=len(self.chain), kind=kind, experiment=experiment,
                        checkpoint=checkpoint, item_id=item_id, part=part, payload=payload, env=env,
                        prev_hash=self.last_hash, hash="")
        record = record.model_copy(update={"hash": record.computed_hash()})
        fd = os.open(self.path / LEDGER, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, record.line())
            os.fsync(fd)
        finally:
            os.close(fd)
        self.chain.append(record)
        return record

    def write_results(self, results: dict[str, Any]) -> None:
        atomic_write(self.path / RESULTS, json.dumps(results, indent=2) + "\n")


def _lock(path: Path) -> int:
    """Hold an exclusive flock on RUN_DIR/.lock; the kernel drops it when the process dies (no stale locks)."""
    fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise StageReplayError(f"run directory {path} is being written by process {holder}",
                               "wait for it to finish or use another --out") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def _before_manifest(name: str) -> bool:
    """What a run's folder may hold before its manifest: the lock, and a writer's unrenamed manifest."""
    return name == LOCK or (name.startswith(f".{MANIFEST}.") and name.endswith(".tmp"))


def _set_aside_torn_tail(path: Path) -> None:
    ledger = path / LEDGER
    if not ledger.exists():
        return
    data = ledger.read_bytes()
    cut = data.rfind(b"\n") + 1
    if cut == len(data):
        return
    torn = path / f"{LEDGER}.torn"
    with open(torn, "ab") as f:
        f.write(data[cut:] + b"\n")
    with open(ledger, "r+b") as f:
        f.truncate(cut)
        f.flush()
        os.fsync(f.fileno())
    log.warning(f"{ledger}: an incomplete last record was set aside in {torn.name} and will be redone")


@contextlib.contextmanager
def open_run(path: Path, manifest: Manifest, identity: tuple[str, ...] = ("config",), extend: bool = True
             ) -> Iterator[Run]:
    """Create or resume a run directory under a lock.

    A run of an older ledger schema opens only to be read (`extend=False`: the audit, which rewrites its
    results and report but adds no record): one chain never mixes two schemas.

    A new run gets `manifest` written atomically before anything else. An existing run is resumed only when the
    manifest's `identity` sections are equal; otherwise the differing fields are named. If this call created
    the folder and fails before writing any record, the folder is removed: no half-written run is left behind.
    """
    path = Path(path)
    created = not path.exists()
    if not created and not path.is_dir():
        raise StageReplayError(f"--out {path} exists and is not a directory", "choose another --out")
    # Before its manifest lands a run's folder holds at most the lock and the manifest's temporary file (another
    # writer may be between taking the lock and renaming the manifest into place: `_lock` below names it). Any
    # other folder with files is someone else's, refused before a lock file is left in it. The names are read
    # before the manifest is looked for, so a manifest renamed in between is seen by the second look.
    names = [] if created else [p.name for p in path.iterdir()]
    if not all(_before_manifest(name) for name in names) and not (path / MANIFEST).exists():
        raise StageReplayError(f"--out {path} exists and is not a stagereplay run", "choose an empty or new folder")
    path.mkdir(parents=True, exist_ok=True)
    fd = None
    run: Run | None = None
    try:
        fd = _lock(path)
        if (path / MANIFEST).exists():
            existing = read_manifest(path)
            mine, theirs = existing.as_json(), manifest.as_json()
            differ = [f for key in identity for f in diff_fields(mine.get(key), theirs.get(key), f"{key}.")]
            if differ:
                raise StageReplayError(f"{path} holds a run with a different configuration ({', '.join(differ)})",
                                       "use the same options to resume, or a new --out")
            version = existing.schema_version
            if extend and version < SCHEMA_VERSION:
                raise StageReplayError(f"{path} is a run of ledger schema {version}, which this stagereplay audits "
                                       "but does not extend", "start a new run with another --out")
            _set_aside_torn_tail(path)
            run = Run(path, existing, read_ledger(path))
        else:
            write_manifest(path, manifest)
            run = Run(path, manifest, [])
        yield run
    except BaseException:
        if created and (run is None or not run.records):
            shutil.rmtree(path, ignore_errors=True)
        raise
    finally:
        if fd is not None:
            os.close(fd)
