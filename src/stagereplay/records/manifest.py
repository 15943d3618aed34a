"""The manifest: a run's frozen identity and each stage's frozen section, as models, and their part in the hash chain.

    manifest.json   Manifest: schema_version, tool, command, `config` (RunConfig: the model, data, settings, the
                    dataset and model hashes, the item ids, the stage-1 facts and the command's own options),
                    the command's `environment`, and `stages` ("<experiment>/<checkpoint>" -> its StageSection)

The models are views of the JSON the run wrote, not a second copy of it: they are read with every field the file
holds, those this version declares typed and the others (an older or newer stagereplay's, an extension's) kept as
they are, and written back with exactly the fields that were set (`Document.as_json`). A run made by an older
version, whose sections lack a field added since (`cache`, `top_p`), reads and re-binds to the same bytes. The
runtime configs (`engine.model.ModelConfig`, `experiments.core.jobs.ReplaySettings`) are built from a section, with the
defaults an older run did not record.

The ledger's first record links to the hash of the run's identity (`chain_start`), and each stage's frozen section
enters the chain as a `stage` record before that stage's first item. An edit of the configuration, the item ids, a
stage's settings or a transplant selection then breaks the chain, and `audit --verify-only` sees it without a model.

What is bound is what decides the numbers, not where the files lay: a model or data *path* is a location (the same
run made from another checkout, or merged from shards made on other machines, must bind the same identity), while
the model's config, weight, tokenizer and generation-config hashes and the dataset hash, which are bound, identify
the inputs. The audit checks that the model found at the path has those hashes.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from stagereplay.engine.model import ModelConfig
from stagereplay.records.findings import Break
from stagereplay.records.record import GENESIS, Record, diff_fields, sha256_json

UNBOUND_CONFIG = (("model", "path"), ("data", "path"), ("later_model",))
"""Locations in `config` that the chain does not bind (their files are bound by hash)."""

D = TypeVar("D", bound="Document")
S = TypeVar("S", bound="StageSection")


class Document(BaseModel):
    """A part of a run's JSON documents: frozen, typed where this version knows the field, and written back with
    exactly the fields that were set (those a reader does not declare kept as they were)."""

    model_config = ConfigDict(frozen=True, extra="allow")

    def as_json(self) -> dict[str, Any]:
        """The JSON this part holds: the fields that were set (None included), nothing else."""
        return self.model_dump(mode="json", exclude_unset=True)

    def declared(self) -> dict[str, Any]:
        """The fields this version declares, defaults filled in: what a runtime config is built from."""
        return {name: getattr(self, name) for name in type(self).model_fields}

    def extras(self) -> dict[str, Any]:
        """The fields this version does not declare, as they were read."""
        return dict(self.__pydantic_extra__ or {})

    def updated(self: D, **changes: Any) -> D:
        """A copy with `changes` set (each marked set, so `as_json` writes it)."""
        return self.model_copy(update=changes)


class ModelSection(Document):
    """The model a stage runs: what `engine.model.ModelConfig.as_dict` records."""

    path: str = Field(description="the model's folder or GGUF file where the run found it (a location: not bound)")
    precision: str = Field(description="bf16 | fp16 | fp32 | fp32-compute")
    device: str = Field("cpu", description="cpu | cuda | cuda:<i>")
    threads: int = Field(1, description="torch threads per process")
    attn_impl: str = Field("sdpa", description="the attention implementation: eager | sdpa")
    cache: str = Field("dynamic", description="dynamic | static (runs before static caches did not record it)")
    batch: int = Field(1, description="rows of a batched decode step (recorded when above 1)")
    static_len: int | None = Field(None, description="positions of each static cache, when given (recorded when set)")

    def config(self) -> ModelConfig:
        return ModelConfig(**self.declared())

    @classmethod
    def of(cls, config: ModelConfig) -> ModelSection:
        return cls.model_validate(config.as_dict())


class DecodeSection(Document):
    """How continuations are decoded (`engine.decode.DecodeConfig`)."""

    max_new_tokens: int = Field(description="suffix length limit")
    max_stage1_tokens: int | None = Field(None, description="tokens allowed to reach the boundary")
    sample: bool = Field(False, description="seeded sampling instead of greedy")
    temperature: float = Field(1.0, description="sampling temperature")
    top_k: int = Field(0, description="sample from the top k tokens only (0 = all)")
    seed: int = Field(0, description="base seed")
    top_p: float = Field(1.0, description="nucleus mass (runs before it did not record it)")


class SettingsSection(Document):
    """What every item job shares besides the item (`experiments.core.jobs.ReplaySettings`)."""

    boundary: str = Field(description="the boundary rule: marker:TEXT | regex:PATTERN | after:N")
    decode: DecodeSection = Field(description="how continuations are decoded")
    scorer: str = Field(description="last-number | exact | math | regex:PATTERN")


class DataSection(Document):
    """Where the items come from (`tasks.DataConfig.as_dict`)."""

    path: str | None = Field(None, description="the data file or folder, or hf:NAME (a location: not bound); "
                                               "null: the toy's held-out items")
    n: int | None = Field(None, description="the first n items (null: all)")
    columns: str | None = Field(None, description="TARGET=COLUMN,... (recorded when given)")
    source: str = Field("prompts", description="where the items come from (`tasks.item_sources`): prompts | "
                                               "unlabelled | rollouts | served (recorded when not prompts)")
    rollouts: bool = Field(False, description="a run made before `source` was recorded: true for a rollout file's "
                                              "(read, never written)")

    def source_name(self) -> str:
        """The source the items came from, as this run's version recorded it."""
        return "rollouts" if self.rollouts else self.source

    def as_config(self) -> dict[str, Any]:
        """The fields a `tasks.DataConfig` is made of."""
        return {"path": self.path, "n": self.n, "columns": self.columns, "source": self.source_name()}


class RopeFacts(Document):
    """The model's RoPE scaling against the longest sequence the run may reach (`engine.limits.Rope`)."""

    type: str = Field(description="the RoPE type (none, default, yarn, ...)")
    original_context: int | None = Field(description="positions its frequencies were trained for, where it has one")
    length_dependent: bool = Field(description="whether its frequencies change with the sequence length")
    may_change: bool = Field(description="whether a sequence of this run may move them")


class Stage1Facts(Document):
    """What the run resolved of stage 1 before its first item (`runs.prepare`)."""

    rule: str = Field(description="the boundary rule in force")
    rule_source: str = Field(description="given | default (from the model's tokenizer)")
    match: str = Field(description="how the rule matches: token | text | count")
    budget: int = Field(description="stage-1 tokens allowed")
    budget_source: str = Field(description="given | default")
    suffix_budget: int = Field(description="--max-new-tokens")
    longest_prompt: int = Field(description="the longest prompt's tokens")
    context: int = Field(description="the positions one sequence may hold")
    rope: RopeFacts = Field(description="RoPE scaling against the longest sequence")
    context_of: str | None = Field(None, description="whose context bounds it, where a serving engine's does")

    def line(self) -> str:
        """One line for the top of a run: the boundary rule, how it matches, and the budgets in use."""
        return (f"stage 1: {self.rule} ({self.rule_source}, matched on {self.match}), budget {self.budget} tokens "
                f"({self.budget_source}), suffix budget {self.suffix_budget}, longest prompt {self.longest_prompt}, "
                f"context {self.context}, RoPE {self.rope.type}")


class EngineSection(Document):
    """A serving engine as a stage runs it: its name, its seed and its own options (flat, each engine's: the
    engine's options class reads them, `serving.engines.config_from_dict`)."""

    name: str = Field(description="the engine (serving.engines.ENGINES)")
    seed: int = Field(0, description="the engine's seed")


class StageSection(Document):
    """One stage's frozen section (`stages["<experiment>/<checkpoint>"]`): the model and settings every stage has,
    the serving engine where one runs it, and the experiment's own fields (its `Experiment.Stage` declares them)."""

    model: ModelSection = Field(description="the model the stage runs (ours; a serving stage's tokenizer and scorer)")
    settings: SettingsSection = Field(description="boundary rule, decoding and scorer")
    engine: EngineSection | None = Field(None, description="the serving engine that runs its arms (absent: ours)")
    cross: str | None = Field(None, description="a serving stage: the engine that also replays its prefixes "
                                                "(hf: ours; '' none)")
    runs_at: str | None = Field(None, description="a serving stage: what the engine's numbers are made at, as it "
                                                  "says (vLLM's dtype; a GGUF's model, size and type and the K/V "
                                                  "cache's; a server's model type); its arms are labelled with it, "
                                                  "a --cross arm with the model's precision (absent: that precision)")

    def as_stage(self, kind: type[S]) -> S:
        """This section as the experiment's own model `kind` reads it."""
        return self if isinstance(self, kind) else kind.model_validate(self.as_json())


class RunConfig(Document):
    """The run's identity: what it runs on, and how. The command's own options (a matched run's construction, a
    paper run's selection) sit beside these fields, as its options class wrote them."""

    model: ModelSection = Field(description="the primary model")
    data: DataSection = Field(description="where the items come from")
    settings: SettingsSection = Field(description="boundary rule, decoding and scorer")
    dataset_hash: str = Field(description="sha256 of the items' source")
    item_ids: list[str] = Field(description="the items, in run order")
    model_hashes: dict[str, dict[str, Any]] = Field(
        description="per checkpoint, what identifies its model (records.provenance.model_hashes)")
    stage1: Stage1Facts | None = Field(None, description="stage 1 as resolved (runs before it lack it)")
    scorer_packages: dict[str, str | None] | None = Field(None, description="the packages a scorer's labels follow")
    shard: str | None = Field(None, description="I/N: this run holds every N-th item from the I-th")
    later_model: str | None = Field(None, description="paper: the later checkpoint's location (not bound)")
    engine: EngineSection | None = Field(None, description="matched on a serving engine: the engine")
    cross: str | None = Field(None, description="matched on a serving engine: the engine replaying its prefixes")


class Manifest(Document):
    """manifest.json."""

    schema_version: int = Field(description="ledger schema this run's records follow")
    tool: str = Field("stagereplay", description="the tool that made the run")
    tool_version: str | None = Field(None, description="its version")
    created: str | None = Field(None, description="when the run was made (UTC, ISO 8601)")
    command: str | None = Field(None, description="the command that made the run")
    config: RunConfig = Field(description="the run's identity")
    environment: dict[str, Any] = Field(default_factory=dict, description=(
        "the command's process: machine, packages, kernels, determinism (records.provenance.environment: facts read "
        "off the machine)"))
    stages: dict[str, StageSection] = Field(default_factory=dict, description="each stage's frozen section")
    merged_from: list[str] | None = Field(None, description="a merged run: the shard folders it was made from")
    shard_environments: dict[str, list[str]] | None = Field(
        None, description="a merged run: per shard, the environments its records were computed in")

    def stage(self, name: str) -> StageSection | None:
        return self.stages.get(name)

    def with_stage(self, name: str, section: StageSection) -> Manifest:
        return self.updated(stages={**self.stages, name: section})

    def write(self) -> str:
        """manifest.json's text."""
        return json.dumps(self.as_json(), indent=2) + "\n"


# -- the binding -------------------------------------------------------------------------------------------------


def _drop(obj: dict[str, Any], path: tuple[str, ...]) -> None:
    *parents, last = path
    for key in parents:
        child = obj.get(key)
        obj = child if isinstance(child, dict) else {}
    obj.pop(last, None)


def bound_config(config: RunConfig | dict[str, Any]) -> dict[str, Any]:
    """The configuration as the chain binds it: everything but the locations of its files."""
    out: dict[str, Any] = json.loads(json.dumps(config.as_json() if isinstance(config, RunConfig) else config))
    for path in UNBOUND_CONFIG:
        _drop(out, path)
    return out


def bound_stage(stage: StageSection) -> dict[str, Any]:
    """A stage's frozen section as the chain binds it (its model path is a location; the run binds its hashes)."""
    out = stage.as_json()
    _drop(out, ("model", "path"))
    return out


def bound_identity(manifest: Manifest) -> dict[str, Any]:
    return {"schema_version": manifest.schema_version, "command": manifest.command,
            "config": bound_config(manifest.config)}


def binds(manifest: Manifest | None) -> bool:
    """Schema 1 runs predate the binding: their chain starts at 64 zeros and they have no stage records."""
    return manifest is not None and manifest.schema_version >= 2


def chain_start(manifest: Manifest | None) -> str:
    """The `prev_hash` of the first record: the hash of the run's frozen identity (GENESIS for schema 1, or where
    there is no manifest)."""
    return sha256_json(bound_identity(manifest)) if manifest is not None and binds(manifest) else GENESIS


def stage_name(record: Record) -> str:
    return f"{record.experiment}/{record.checkpoint}"


def binding_problems(manifest: Manifest | None, chain: list[Record]) -> list[Break]:
    """Where the manifest and the chain disagree: the identity (checked by the first record's
    link), the stages (each declared stage has one stage record, equal to its section, before its items) and
    the environments (each item names one recorded before it, whose hash is its content)."""
    if manifest is None or not binds(manifest):
        return []
    problems: list[Break] = []
    if chain and chain[0].prev_hash != chain_start(manifest):
        problems.append(Break(seq=0, reason="the manifest's configuration or item ids are not the ones the ledger "
                                            "was made under (prev_hash of the first record)"))
    declared = manifest.stages
    staged: dict[str, Record] = {}
    environments: set[str] = set()
    for r in chain:
        name = stage_name(r)
        if r.kind == "stage":
            if name in staged:
                problems.append(Break(seq=r.seq, reason=f"stage {name} is recorded twice"))
            elif name not in declared:
                problems.append(Break(seq=r.seq, reason=f"stage {name} is not declared in the manifest"))
            elif r.payload != bound_stage(declared[name]):
                fields = diff_fields(r.payload, bound_stage(declared[name]))
                problems.append(Break(seq=r.seq, reason=f"the manifest's stage {name} differs from the one the "
                                                        f"ledger was made under ({', '.join(fields)})"))
            staged[name] = r
        elif r.kind == "environment":
            if r.env != sha256_json(r.payload):
                problems.append(Break(seq=r.seq, reason="environment record does not match its hash"))
            elif r.env in environments:
                problems.append(Break(seq=r.seq, reason="environment recorded twice"))
            environments.add(r.env)
        else:
            if name not in staged:
                problems.append(Break(seq=r.seq, reason=f"item {r.item_id} comes before its stage {name} record"))
            if r.env not in environments:
                problems.append(Break(seq=r.seq, reason=f"item {r.item_id} names an environment not recorded "
                                                        "before it"))
    for name in declared:
        if name not in staged:
            problems.append(Break(seq=len(chain), reason=f"stage {name} of the manifest has no stage record"))
    return problems
