"""What a plan is made of: a model's shape (what sizes its caches and weights), what a plan of `paper` is of
(`PlanConfig`: its protocol, the lengths assumed, the options that change the cost), and one stage's work
(`StagePlan`: its units, the token count of each forward they make, the most caches alive at once and the longest
sequence they hold). `plan.paper` fills them before a run, `plan.recorded` from a run's ledger.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from stagereplay.engine.limits import static_cache_len
from stagereplay.engine.model import check_cache
from stagereplay.errors import StageReplayError
from stagereplay.experiments.protocol.paper import PaperConfig
from stagereplay.records.manifest import StageSection

BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp32-compute": 4}  # a cache element at each precision
WEIGHT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp32-compute": 2}  # fp32-compute keeps 16-bit weights


@dataclass(frozen=True)
class Shape:
    """What sizes caches and weights: layers, KV heads x head dim, parameters, context."""

    layers: int
    kv_heads: int
    head_dim: int
    params: int
    context: int

    def cache_bytes(self, positions: int, precision: str) -> int:
        """K and V of every layer over `positions` positions: 2 x layers x kv_heads x head_dim x bytes each."""
        return 2 * self.layers * self.kv_heads * self.head_dim * BYTES[precision] * positions

    def weight_bytes(self, precision: str) -> int:
        return self.params * WEIGHT_BYTES[precision]


def model_shape(path: str | Path) -> Shape:
    """The shape from the model's config (no weights loaded): a folder's config.json, or a GGUF file's metadata as
    transformers maps it (`engine.gguf`). Parameters from the tensor headers (a folder's safetensors files, a GGUF
    file's tensor table: every tensor's elements, whatever type it is stored in, since our engine dequantizes them at
    load), else from the config (a Qwen2/Llama-style decoder: embeddings, attention with q/k/v biases when the config
    says so, a gated MLP, norms, an untied head unless tied)."""
    from stagereplay.engine.gguf import is_gguf
    from stagereplay.engine.limits import model_context
    from stagereplay.engine.model import check_model_dir, load_checked_config

    p = Path(path)
    if is_gguf(p):
        config, params = load_checked_config(check_model_dir(p)), _gguf_params(p)
    elif not (p / "config.json").is_file():
        raise StageReplayError(f"no config.json in {p}", "pass --model a directory holding the model's config.json, "
                                                          "or a .gguf file")
    else:
        config, params = load_checked_config(p), _safetensors_params(p)
    c = config.get_text_config()
    heads = int(c.num_attention_heads)
    head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
    kv = int(getattr(c, "num_key_value_heads", None) or heads)
    params = params or _config_params(c, heads, kv, head_dim)
    return Shape(int(c.num_hidden_layers), kv, head_dim, params, model_context(config))


def _gguf_params(path: Path) -> int:
    """Elements of every tensor in a GGUF file, from its tensor table (gguf's reader maps the file; no tensor's data
    is read)."""
    from gguf import GGUFReader

    return sum(int(t.n_elements) for t in GGUFReader(str(path)).tensors)


def _safetensors_params(path: Path) -> int:
    """Elements of every tensor in the directory's safetensors files, read from their headers only."""
    total = 0
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(size))
        total += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    return total


def _config_params(c: Any, heads: int, kv: int, head_dim: int) -> int:
    h, inter, vocab = int(c.hidden_size), int(c.intermediate_size), int(c.vocab_size)
    q, k = heads * head_dim, kv * head_dim
    bias = (q + 2 * k) if getattr(c, "attention_bias", c.model_type == "qwen2") else 0
    layer = h * q + 2 * h * k + q * h + bias + 3 * h * inter + 2 * h
    head = 0 if getattr(c, "tie_word_embeddings", False) else vocab * h
    return vocab * h + int(c.num_hidden_layers) * layer + h + head


@dataclass(frozen=True)
class PlanConfig:
    """What a plan of `paper` is of: its protocol, the lengths it assumes before the run, and the options of the run
    that change what it costs (each as `paper` takes it; `cli: False`, the command's own groups give them)."""

    panel: ClassVar[str] = "Assumed lengths"

    n: int = field(default=200, metadata={"help": "items"})
    suffix_tokens: int | None = field(default=None, metadata={
        "help": "assumed suffix length (default: --max-new-tokens)"})
    stage1_tokens: int | None = field(default=None, metadata={
        "help": "assumed stage-1 length (default: the stage-1 budget)"})
    prompt_tokens: int | None = field(default=None, metadata={
        "help": "assumed prompt length (default: the items' as tokenized)"})
    divergent: int | None = field(default=None, metadata={
        "help": "items whose live and fresh suffixes diverge (default: all)"})
    protocol: PaperConfig = field(default_factory=PaperConfig)
    """What `paper` runs (its steps, `experiments.protocol.paper.paper_steps`)."""
    later: bool = field(default=True, metadata={
        "cli": False, "help": "whether `paper` replicates at a later checkpoint"})
    audit_sample: int | None = field(default=None, metadata={
        "help": "units per stage and part the audit re-executes (None or 0: every unit; of a run: None, what its audit "
                "did)"})
    dedup: bool = field(default=True, metadata={
        "help": "the 2x2 and the transplants carry the matched arms over (--no-dedup: count them decoding the matched "
                "arms again)"})
    workers: int = field(default=1, metadata={"cli": False, "help": "processes (calibrated together on a CPU)"})
    cache: str = field(default="dynamic", metadata={"cli": False, "help": "dynamic | static: how caches are sized"})
    max_new_tokens: int = field(default=128, metadata={"cli": False, "help": (
        "the suffix budget: every suffix's length unless `suffix_tokens` says otherwise; what a static cache is "
        "allocated for")})
    batch: int = field(default=1, metadata={"cli": False, "help": "rows of a batched step (`paper --batch C`)"})
    device: str = field(default="cpu", metadata={"cli": False, "help": (
        "where the run goes: a static cache's steps on CUDA are graphs, proven before they run")})

    def __post_init__(self) -> None:
        for name in ("n", "suffix_tokens", "stage1_tokens", "prompt_tokens", "workers", "max_new_tokens", "batch"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise StageReplayError(f"--{name.replace('_', '-')} must be at least 1, got {value}",
                                       f"pass a positive --{name.replace('_', '-')}")
        if self.audit_sample is not None and self.audit_sample < 0:
            raise StageReplayError(f"--audit-sample must be 0 or more, got {self.audit_sample}",
                                   "pass e.g. --audit-sample 20")
        check_cache(self.cache)
        if self.divergent is not None and not 0 <= self.divergent <= self.n:
            raise StageReplayError(f"--divergent must lie in 0..--n ({self.n}), got {self.divergent}",
                                   "pass the number of items expected to diverge")

    @property
    def suffix(self) -> int:
        """Every suffix's assumed length."""
        return self.suffix_tokens or self.max_new_tokens


@dataclass
class StagePlan:
    """One stage's work: units and the token count of each forward they make (a multiset)."""

    name: str
    precision: str
    units: int = 0
    sizes: Counter[int] = field(default_factory=Counter)  # tokens per forward -> forwards
    positions: int = 0  # the longest sequence a cache of this stage holds
    caches: int = 0
    rows: int = 1  # items stepping together (`--batch`): single-token steps share forwards of this many rows

    def add(self, forwards: Iterable[int], positions: int) -> None:
        self.units += 1
        self.sizes.update(forwards)
        self.positions = max(self.positions, positions)

    @property
    def forwards(self) -> int:
        """Forwards made: each prefill alone, the single-token steps `rows` to a forward (rows kept full)."""
        return sum(v for k, v in self.sizes.items() if k > 1) + self.batched_steps

    @property
    def batched_steps(self) -> int:
        """Forwards of the single-token steps: one per step at batch 1, one per `rows` steps batched."""
        return -(-self.steps // self.rows)

    @property
    def steps(self) -> int:
        """Single-token steps, one per item and position (a batched forward makes `rows` of them)."""
        return self.sizes.get(1, 0)

    @property
    def prefill_tokens(self) -> int:
        return sum(k * v for k, v in self.sizes.items() if k > 1)


def new_stage(name: str, precision: str, stage: StageSection) -> StagePlan:
    """A plan row for the manifest stage `name` (`<experiment>/<checkpoint>`, `@precision` for a per-precision
    row), holding as many caches as its experiment's items hold at once (`Experiment.peak_caches`)."""
    from stagereplay.experiments.core.registry import of_stage

    return StagePlan(name, precision, caches=of_stage(name.split("@")[0]).peak_caches(stage))


def allocate(stages: list[StagePlan], prompts: Iterable[int], max_stage1: int | None, max_new: int,
             context: int, static_len: int | None = None) -> None:
    """Size every stage's caches at the longest static allocation of items with these prompt lengths
    (`engine.limits.static_cache_len`, or `static_len` where that is more, as `LM.cache_len` allocates them)."""
    positions = max((max(static_cache_len(p, max_stage1, max_new, context), static_len or 0) for p in prompts),
                    default=0)
    for st in stages:
        st.positions = positions
