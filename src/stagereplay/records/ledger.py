"""The run directory: a frozen manifest, an append-only hash-chained ledger, a lock, resume.

    RUN_DIR/manifest.json   written atomically before the first record; each experiment adds its own
                            frozen section (`stages`) before its first record and never changes it
    RUN_DIR/ledger.jsonl    one record per line, each carrying the sha256 of the previous one
    RUN_DIR/.lock           held (flock) by the one process writing the run; records its pid

A record is written whole (write, flush, fsync). A torn last line (a kill mid-write) is set aside and redone.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from stagereplay.errors import StageReplayError

SCHEMA_VERSION = 1
GENESIS = "0" * 64
MANIFEST, LEDGER, LOCK, RESULTS = "manifest.json", "ledger.jsonl", ".lock", "results.json"


class Record(BaseModel):
    """One ledger line: the outcome of one experiment on one item (and part, e.g. a precision)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: int = Field(SCHEMA_VERSION, description="ledger record format version")
    seq: int = Field(description="0-based position in the ledger")
    experiment: str = Field(description="matched | precision_2x2 | bridge | transplant")
    checkpoint: str = Field(description="which model of the run: primary, later, ...")
    item_id: str = Field(description="the item this record is about")
    part: str = Field("", description="sub-unit of the item for experiments that split it (e.g. a precision)")
    payload: dict[str, Any] = Field(description="token IDs, fingerprints, labels: experiment-specific")
    prev_hash: str = Field(description="hash of the previous record (GENESIS for the first)")
    hash: str = Field("", description="sha256 of this record's canonical JSON without this field")

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.experiment, self.checkpoint, self.item_id, self.part)

    def computed_hash(self) -> str:
        return sha256_json(self.model_dump(exclude={"hash"}))


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(canonical_json(obj)).hexdigest()


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


def parse_record(line: str, lineno: int, path: Path) -> Record:
    """Parse one ledger line, refusing newer schema versions by name."""
    try:
        raw = json.loads(line)
    except json.JSONDecodeError:
        raise StageReplayError(f"{path} line {lineno} is not valid JSON",
                               "run `stagereplay audit --verify-only` on the run to see the damage") from None
    version = raw.get("schema_version") if isinstance(raw, dict) else None
    if isinstance(version, int) and version > SCHEMA_VERSION:
        raise StageReplayError(
            f"{path} line {lineno} has ledger schema_version {version}, newer than this stagereplay's {SCHEMA_VERSION}",
            "upgrade stagereplay to read it",
        )
    try:
        return Record.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise StageReplayError(f"{path} line {lineno} is not a valid ledger record ({where}: {first['msg']})",
                               "restore the ledger from a copy or start a new run") from None


def chain_problems(records: list[Record]) -> list[dict[str, Any]]:
    """Every break in the hash chain or sequence, as {seq, reason}: empty means intact."""
    problems: list[dict[str, Any]] = []
    prev = GENESIS
    for i, r in enumerate(records):
        if r.seq != i:
            problems.append({"seq": i, "reason": f"seq is {r.seq}, expected {i}"})
        if r.prev_hash != prev:
            problems.append({"seq": i, "reason": f"prev_hash does not match record {i - 1}"})
        if r.computed_hash() != r.hash:
            problems.append({"seq": i, "reason": "content does not match its hash"})
        prev = r.hash
    return problems


def read_ledger(run_dir: Path, *, strict: bool = True) -> list[Record]:
    """All complete records. A torn last line (no newline) is ignored here; `strict` also checks the chain."""
    path = run_dir / LEDGER
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    complete = lines[:-1]  # the part after the last newline is either empty or torn
    records = [parse_record(line, i + 1, path) for i, line in enumerate(complete)]
    if strict:
        problems = chain_problems(records)
        if problems:
            first = problems[0]
            raise StageReplayError(f"ledger {path} was modified: record {first['seq']}: {first['reason']}",
                                   "restore it from a copy or start a new run; `stagereplay audit --verify-only` lists every break")
    return records


def read_manifest(run_dir: Path) -> dict[str, Any]:
    path = run_dir / MANIFEST
    if not path.exists():
        raise StageReplayError(f"no manifest.json in {run_dir}", "point at a run directory made by stagereplay")
    try:
        manifest: dict[str, Any] = json.loads(path.read_text())
    except json.JSONDecodeError:
        raise StageReplayError(f"{path} is not valid JSON", "restore the manifest from a copy") from None
    version = manifest.get("schema_version", 0)
    if version > SCHEMA_VERSION:
        raise StageReplayError(f"{path} has manifest schema_version {version}, newer than {SCHEMA_VERSION}",
                               "upgrade stagereplay to read it")
    return manifest


def diff_fields(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted names of the fields whose values differ between two JSON-like objects."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for k in sorted(set(old) | set(new)):
            out += diff_fields(old.get(k), new.get(k), f"{prefix}{k}.")
        return out
    return [] if old == new else [prefix.rstrip(".")]


class Run:
    """A run directory opened for writing by this process (see `open_run`)."""

    def __init__(self, path: Path, manifest: dict[str, Any], records: list[Record]):
        self.path = path
        self.manifest = manifest
        self.records = records
        self._keys = {r.key for r in records}

    @property
    def last_hash(self) -> str:
        return self.records[-1].hash if self.records else GENESIS

    def begin_stage(self, name: str, config: dict[str, Any]) -> None:
        """Freeze one experiment's configuration in the manifest before its first record, or check it is unchanged."""
        stages = self.manifest.setdefault("stages", {})
        config = json.loads(json.dumps(config))  # normalise tuples etc. to what JSON will give back
        if name in stages:
            differ = diff_fields(stages[name], config)
            if differ:
                raise StageReplayError(
                    f"{self.path} already holds a {name} run with a different configuration ({', '.join(differ)})",
                    "use the same options to resume, or a new --out",
                )
            return
        stages[name] = config
        atomic_write(self.path / MANIFEST, json.dumps(self.manifest, indent=2) + "\n")

    def done(self, experiment: str, checkpoint: str, item_id: str, part: str = "") -> bool:
        return (experiment, checkpoint, item_id, part) in self._keys

    def find(self, experiment: str, checkpoint: str) -> list[Record]:
        return [r for r in self.records if r.experiment == experiment and r.checkpoint == checkpoint]

    def append(self, experiment: str, checkpoint: str, item_id: str, payload: dict[str, Any], part: str = "") -> Record:
        """Write one whole record (write, flush, fsync), chained to the last."""
        key = (experiment, checkpoint, item_id, part)
        if key in self._keys:
            raise RuntimeError(f"duplicate ledger record {key}")
        record = Record(schema_version=SCHEMA_VERSION, seq=len(self.records), experiment=experiment,
                        checkpoint=checkpoint, item_id=item_id, part=part, payload=payload,
                        prev_hash=self.last_hash, hash="")
        record = record.model_copy(update={"hash": record.computed_hash()})
        line = canonical_json(record.model_dump()) + b"\n"
        fd = os.open(self.path / LEDGER, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        self.records.append(record)
        self._keys.add(key)
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
    warnings.warn(f"{ledger}: an incomplete last record was set aside in {torn.name} and will be redone",
                  stacklevel=2)


@contextlib.contextmanager
def open_run(path: Path, manifest: dict[str, Any], identity: tuple[str, ...] = ("config",)) -> Iterator[Run]:
    """Create or resume a run directory under a lock.

    A new run gets `manifest` written atomically before anything else. An existing run is resumed only when the
    manifest's `identity` sections are equal; otherwise the differing fields are named. If this call created
    the folder and fails before writing any record, the folder is removed: no half-written run is left behind.
    """
    path = Path(path)
    created = not path.exists()
    if not created and not path.is_dir():
        raise StageReplayError(f"--out {path} exists and is not a directory", "choose another --out")
    if not created and any(p.name != LOCK for p in path.iterdir()) and not (path / MANIFEST).exists():
        raise StageReplayError(f"--out {path} exists and is not a stagereplay run", "choose an empty or new folder")
    path.mkdir(parents=True, exist_ok=True)
    fd = None
    run: Run | None = None
    try:
        fd = _lock(path)
        if (path / MANIFEST).exists():
            existing = read_manifest(path)
            differ = [f for key in identity for f in diff_fields(existing.get(key), manifest.get(key), f"{key}.")]
            if differ:
                raise StageReplayError(f"{path} holds a run with a different configuration ({', '.join(differ)})",
                                       "use the same options to resume, or a new --out")
            _set_aside_torn_tail(path)
            run = Run(path, existing, read_ledger(path))
        else:
            atomic_write(path / MANIFEST, json.dumps(manifest, indent=2) + "\n")
            run = Run(path, manifest, [])
        yield run
    except BaseException:
        if created and (run is None or not run.records):
            shutil.rmtree(path, ignore_errors=True)
        raise
    finally:
        if fd is not None:
            os.close(fd)
