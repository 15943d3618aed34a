"""`stagereplay plan`: what a `paper` run costs, before it runs, from the model's config alone.

Per stage: the items, the forwards (prefill forwards and their tokens, single-token decode steps) counted by
each experiment's own `forwards(...)` (the list its item function makes, built from engine.forwards, which
`LM.construct` also runs from), the most K/V caches alive at once and their size at the longest sequence, the
weights resident, and with rates (given, or measured by `rates.calibrate` on the real model) the wall time.

Before a run the lengths are assumptions: every prompt as tokenized (or `prompt_tokens`), stage 1 of
`stage1_tokens` (default: the stage-1 budget), every suffix of `suffix_tokens` (default: `--max-new-tokens`),
and `divergent` items whose live and fresh suffixes differ (default: all; it sizes the transplant selections
and the carried-over 2x2 arm's diagnostic decode). After a run (`plan_run`) every length is the measured one.

A dynamic cache holds what was fed so far, so its size is that of the longest sequence. A static cache
(`--cache static`) is allocated whole before the first token, for prompt + stage-1 budget + max new tokens - 1
positions (`LM.cache_len`), and is priced at that length whatever the suffixes turn out to be.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from stagereplay.engine.forwards import Lengths, continuation_forwards
from stagereplay.engine.limits import static_cache_len
from stagereplay.engine.model import check_cache
from stagereplay.errors import StageReplayError
from stagereplay.execution.kernels import check_kernels, choose, follow_run, pin
from stagereplay.experiments.rates import Rates, calibrate
from stagereplay.records.ledger import Record, items, read_ledger, read_manifest

PEAK_CACHES = {"matched": 4, "bridge": 3, "precision_2x2": 3, "transplant": 4, "resample": 4}
"""The most boundary/continuation caches an item holds at once (each item function's docstring says which)."""

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
    """The shape from config.json (no weights loaded); parameters from the safetensors headers when the
    directory has weights, else from the config (a Qwen2/Llama-style decoder: embeddings, attention with
    q/k/v biases when the config says so, a gated MLP, norms, an untied head unless tied)."""
    from stagereplay.engine.limits import model_context
    from stagereplay.engine.model import load_checked_config

    p = Path(path)
    if not (p / "config.json").is_file():
        raise StageReplayError(f"no config.json in {p}", "pass --model a directory holding the model's config.json")
    config = load_checked_config(p)
    c = config.get_text_config()
    heads = int(c.num_attention_heads)
    head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
    kv = int(getattr(c, "num_key_value_heads", None) or heads)
    params = _safetensors_params(p) or _config_params(c, heads, kv, head_dim)
    return Shape(int(c.num_hidden_layers), kv, head_dim, params, model_context(config))


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
    """The cost-relevant options of `paper`, and the lengths a plan assumes before a run."""

    n: int = field(default=200, metadata={"help": "items"})
    suffix_tokens: int = field(default=128, metadata={"help": "every suffix's length (default --max-new-tokens)"})
    stage1_tokens: int | None = field(default=None, metadata={"help": "stage-1 length (default: the budget)"})
    prompt_tokens: int | None = field(default=None, metadata={"help": "prompt length when the items are unknown"})
    divergent: int | None = field(default=None, metadata={"help": "items whose suffixes diverge (default: all)"})
    bridge_rows: int = 12
    select: str = "first:24"
    sweep: bool = False
    later: bool = True
    constructions: tuple[str, ...] = ("incremental", "oneshot")
    precisions: tuple[str, ...] = ("bf16", "fp32")
    audit_sample: int | None = field(default=None, metadata={"help": "units per stage the audit re-executes "
                                                                      "(None or 0: every unit)"})
    dedup: bool = field(default=True, metadata={"help": "the 2x2 and the transplants carry the matched arms over "
                                                        "(False: they decode them again)"})
    workers: int = 1
    resample: int = field(default=0, metadata={"help": "K sampled draws per state (0: no resample stage)"})
    resample_items: int = field(default=50, metadata={"help": "items the resample stage draws on"})
    cache: str = field(default="dynamic", metadata={"help": "dynamic | static: how caches are sized"})
    max_new_tokens: int | None = field(default=None, metadata={
        "help": "the suffix budget a static cache is allocated for (at least suffix_tokens)"})
    batch: int = field(default=1, metadata={"help": "rows of a batched step (`paper --batch C`)"})

    def __post_init__(self) -> None:
        for name in ("n", "suffix_tokens", "stage1_tokens", "prompt_tokens", "bridge_rows", "workers",
                     "resample_items", "batch"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise StageReplayError(f"--{name.replace('_', '-')} must be at least 1, got {value}",
                                       f"pass a positive --{name.replace('_', '-')}")
        if self.audit_sample is not None and self.audit_sample < 0:
            raise StageReplayError(f"--audit-sample must be 0 or more, got {self.audit_sample}",
                                   "pass e.g. --audit-sample 20")
        if self.resample < 0:
            raise StageReplayError(f"--resample must be 0 or more, got {self.resample}", "pass e.g. --resample 32")
        check_cache(self.cache)
        if self.divergent is not None and not 0 <= self.divergent <= self.n:
            raise StageReplayError(f"--divergent must lie in 0..--n ({self.n}), got {self.divergent}",
                                   "pass the number of items expected to diverge")


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


def _experiment(name: str) -> str:
    return name.split("/")[0]


def _new(name: str, precision: str, constructions: Sequence[str] = ()) -> StagePlan:
    caches = len(constructions) + 1 if _experiment(name) == "precision_2x2" else PEAK_CACHES[_experiment(name)]
    return StagePlan(name, precision, caches=caches)


def plan_paper(cfg: PlanConfig, shape: Shape, prompts: Sequence[int], budget: int) -> list[StagePlan]:
    """The stages of `paper` with assumed lengths: `prompts` are the items' prompt lengths (`cfg.n` of them)."""
    from stagereplay.experiments import bridge, matched, precision_2x2, resample, transplant
    from stagereplay.experiments.transplant import TransplantConfig, parse_selection

    s1, n = cfg.stage1_tokens or budget, cfg.suffix_tokens
    divergent = cfg.n if cfg.divergent is None else cfg.divergent
    units = [Lengths(p, s1, n) for p in prompts]
    end = max(prompts) + s1 + n
    stages: list[StagePlan] = []

    def stage(name: str, precision: str, todo: Sequence[tuple[Lengths, list[int]]]) -> None:
        st = _new(name, precision, cfg.constructions)
        for lengths, fw in todo:
            st.add(fw, lengths.prefix + n)
        stages.append(st)

    def transplants(checkpoint: str, rule: str) -> None:
        kind, k, _ = parse_selection(rule)
        t = TransplantConfig(select=rule, sweep=cfg.sweep and checkpoint == "primary")
        chosen = units[: divergent if kind == "all" else min(k, divergent)]
        carried = (("live", 0), (t.construction, 0)) if cfg.dedup else ()  # own suffixes: the matched run's
        stage(f"transplant/{checkpoint}", "bf16", [(u, transplant.forwards(replace(u, looks=carried), t, shape.layers))
                                                   for u in chosen])

    def replay(i: int) -> list[int]:
        # The diagnostics decode the first-run arm of a divergent pair again to its first divergent step d
        # (d + 1 steps, d < the suffix): a bound of one suffix per divergent item, for the live/fresh pair of
        # matched and the incremental/oneshot pair of the bf16 2x2; fp32 arms are assumed not to diverge.
        return continuation_forwards(n) if i < divergent else []

    stage("matched/primary", "bf16", [(u, matched.forwards(u) + replay(i)) for i, u in enumerate(units)])
    stage("bridge/primary", "bf16", [(u, bridge.forwards(u)) for u in units[: cfg.bridge_rows]])
    transplants("primary", cfg.select)
    for p in cfg.precisions:
        # At the run's precision the matched arms are carried over (`precision_2x2.reused_arms`): each decoded only
        # to the first divergence, at most all of it where the arms diverge, its first step where they do not; a
        # pair is replayed only where one of its arms is decoded in full.
        cs = cfg.constructions
        carried = [c for c in cs if cfg.dedup and p == "bf16" and c in ("oneshot", *precision_2x2.CARRIED_FROM)]
        pairs = sum(1 for i, a in enumerate(cs) for b in cs[i + 1 :] if not (a in carried and b in carried))
        todo = [(u, precision_2x2.forwards(Lengths(u.prompt, s1, n, looks=tuple((c, n if i < divergent else 1)
                                                                               for c in carried)), cs, p)
                 + (replay(i) * pairs if p == "bf16" else []))
                for i, u in enumerate(units)]
        stage(f"precision_2x2/primary@{p}", p, todo)
    if cfg.resample:
        for p in cfg.precisions:  # `paper --resample K` draws at bf16 (live) and fp32 (incremental stands in)
            source = "live" if p == "bf16" else "incremental"
            stage(f"resample/primary@{p}", p, [(u, resample.forwards(u, cfg.resample, "oneshot", source))
                                                for u in units[: cfg.resample_items]])
    if cfg.later:
        stage("matched/later", "bf16", [(u, matched.forwards(u) + replay(i)) for i, u in enumerate(units)])
        transplants("later", "all-divergent")
    stages += audit_stages(stages, cfg.audit_sample or None)
    stages += proof_stages(cfg, max(prompts), end, shape.context)
    for st in stages:
        st.positions = min(st.positions, end)
    return stages


def proof_stages(cfg: PlanConfig, prompt: int, reach: int, context: int) -> list[StagePlan]:
    """Before a process's first captured step on a model it proves that step equal to the eager one
    (engine.proof): one prefill, then two single-token steps per position up to the reach, rounded up as
    `LM.prove` rounds it; once per model setting (checkpoint, precision) and worker. One row per precision.
    A static cache's CPU steps and fp32-compute's are eager: nothing to prove; batched steps are not captured
    (their check, `LM.prove_batch`, costs a few dozen forwards, not counted)."""
    from stagereplay.engine.proof import proof_reach

    if cfg.cache != "dynamic" or cfg.batch > 1:
        return []
    settings = {("primary", "bf16"), *(("primary", p) for p in cfg.precisions)}
    if cfg.later:
        settings.add(("later", "bf16"))
    target = proof_reach(reach, 0, context)
    out: dict[str, StagePlan] = {}
    for _, precision in sorted(settings):
        if precision == "fp32-compute":
            continue
        row = out.setdefault(precision, StagePlan(f"proof@{precision}", precision, caches=2))
        for _ in range(cfg.workers):
            row.add([prompt, *[1] * (2 * (target - prompt))], target)
    return list(out.values())


def audit_stages(stages: list[StagePlan], sample: int | None) -> list[StagePlan]:
    """Before a run: the audit re-executes every unit of every stage, or `sample` units per stage (a 2x2's two
    precisions are one stage), scaled from the stage's mean unit; one row per precision."""
    units: Counter[str] = Counter()
    for s in stages:
        units[s.name.split("@")[0]] += s.units
    out: dict[str, StagePlan] = {}
    for s in stages:
        audit = out.setdefault(s.precision, StagePlan(f"audit@{s.precision}", s.precision))
        total = units[s.name.split("@")[0]]
        share = 1.0 if sample is None or total == 0 else min(sample, total) / total
        audit.units += round(s.units * share)
        for k, v in s.sizes.items():
            audit.sizes[k] += round(v * share)
        audit.positions = max(audit.positions, s.positions)
        audit.caches = max(audit.caches, s.caches)
    return list(out.values())


def allocate(stages: list[StagePlan], prompts: Iterable[int], max_stage1: int | None, max_new: int,
             context: int) -> None:
    """Size every stage's caches at the longest static allocation of items with these prompt lengths
    (`engine.limits.static_cache_len`, as `LM.cache_len` allocates them)."""
    positions = max((static_cache_len(p, max_stage1, max_new, context) for p in prompts), default=0)
    for st in stages:
        st.positions = positions


def lengths_of(payload: dict[str, Any]) -> Lengths:
    """A record's measured lengths: prompt, stage 1, each arm's suffix (a no_boundary record: generated)."""
    prompt = len(payload.get("prompt_ids") or [])
    if payload.get("status") != "ok":
        return Lengths(prompt, None, 0, generated=len(payload.get("generated_ids") or []))
    arms = tuple((a["name"], len(a["suffix_ids"])) for a in payload.get("arms", []))
    return Lengths(prompt, payload["boundary"] - prompt, 0, arms)


def grid_lengths(payload: dict[str, Any]) -> Lengths:
    """A 2x2 record's lengths, with the steps each arm it carried over from matched was decoded again for its
    diagnostics (`precision_2x2.diagnostic_steps`: against every other arm's suffix, as `grid_item` runs it)."""
    from stagereplay.experiments.precision_2x2 import diagnostic_steps

    n = lengths_of(payload)
    arms = payload.get("arms", [])
    looks = tuple((str(a["construction"]), diagnostic_steps(a["suffix_ids"], [tuple(o["suffix_ids"]) for o in arms
                                                                             if o is not a]))
                  for a in arms if a.get("same_as"))
    return Lengths(n.prompt, n.stage1, 0, n.arms, looks=looks)


def plan_run(run_dir: Path, audit_sample: int | None = None, audited: bool = True) -> list[StagePlan]:
    """The stages of a run as it ran: every unit's forwards from its record's measured lengths; then its audit,
    re-executing the units the audit picks (`audit.sample_units`: the run's own sample, from its audit.json,
    unless `audit_sample` is given; 0 or none recorded: every unit)."""
    from stagereplay.experiments.audit import AuditConfig, sample_units

    manifest = read_manifest(run_dir)
    stages_cfg = manifest.get("stages", {})
    plans: dict[str, StagePlan] = {}
    units: dict[str, list[Record]] = {}  # per stage, as the audit groups them, in ledger order
    made: dict[int, tuple[str, list[int], int]] = {}  # record seq -> (row, forwards, longest sequence)
    prompts: list[int] = []
    for r in items(read_ledger(run_dir)):
        prompts.append(len(r.payload.get("prompt_ids") or []))
        name = f"{r.experiment}/{r.checkpoint}"
        stage = stages_cfg.get(name)
        if stage is None:
            continue  # not a declared stage: the audit re-executes none of it, and verify names it
        counted = unit_forwards(r, stage)
        if counted is None:
            continue
        row, fw, longest = counted
        precision = r.part or stage["model"]["precision"]
        plan = plans.setdefault(row, _new(row, precision, stage.get("constructions", ())))
        plan.add(fw, longest)
        units.setdefault(name, []).append(r)
        made[r.seq] = counted
    out = list(plans.values())
    config = manifest["config"]
    if run_cache(manifest) == "static":  # every cache is allocated whole: priced at the longest allocation
        from stagereplay.engine.limits import model_context
        from stagereplay.engine.model import load_checked_config

        decode = config["settings"]["decode"]
        allocate(out, prompts, decode.get("max_stage1_tokens"), decode["max_new_tokens"],
                 model_context(load_checked_config(Path(config["model"]["path"]))))
    if not audited:
        return out
    if audit_sample is None:
        recorded: dict[str, Any] = {}
        if (run_dir / "audit.json").exists():
            recorded = json.loads((run_dir / "audit.json").read_text()).get("sample") or {}
        audit_sample, seed = recorded.get("per_stage"), recorded.get("seed", 0)
    else:
        seed = 0
    chosen = sample_units(units, AuditConfig(audit_sample or None, seed))
    audits: dict[str, StagePlan] = {}
    for r in (r for rs in chosen.values() for r in rs):
        row, fw, longest = made[r.seq]
        st = plans[row]
        audit = audits.setdefault(st.precision, StagePlan(f"audit@{st.precision}", st.precision))
        audit.add(fw, longest)
        audit.caches = max(audit.caches, st.caches)
    return out + list(audits.values())


def run_cache(manifest: dict[str, Any]) -> str:
    """The cache kind a run ran on (a run from before `--cache` ran on a dynamic cache)."""
    return str(manifest["config"]["model"].get("cache", "dynamic"))


def unit_forwards(r: Record, stage: dict[str, Any]) -> tuple[str, list[int], int] | None:
    """(its plan row, the forwards its item function made, its longest sequence) for one item record, from its
    measured lengths; None for a unit whose lengths are not recorded (a transplant whose prefix was not
    reproduced)."""
    from stagereplay.experiments import bridge, matched, precision_2x2, resample, transplant
    from stagereplay.experiments.transplant import TransplantConfig

    name, p, n = f"{r.experiment}/{r.checkpoint}", r.payload, lengths_of(r.payload)
    if r.experiment == "matched":
        fw = matched.forwards(n, stage["construction"])
    elif r.experiment == "bridge":
        fw = bridge.forwards(n)
    elif r.experiment == "transplant":
        if p.get("status") != "ok":
            return None
        suffix = stage["settings"]["decode"]["max_new_tokens"]  # sweep continuations are not recorded
        carried = tuple((a["name"], 0) for a in p.get("arms", []) if a.get("same_as"))  # own suffixes not decoded
        fw = transplant.forwards(Lengths(n.prompt, n.stage1, suffix, n.arms, looks=carried),
                                 TransplantConfig(**stage["config"]), _layers(stage))
    elif r.experiment == "precision_2x2":
        fw = precision_2x2.forwards(grid_lengths(p), tuple(stage["constructions"]), r.part)
        name = f"{name}@{r.part}"
    elif r.experiment == "resample":
        if p.get("status") != "ok":
            return None  # live generation no longer reached the prefix: how far it went is not recorded
        source = dict(resample.job_extra(stage, r.part, None))["live_source"]
        fw = resample.forwards(n, stage["config"]["k"], stage["config"]["construction"], source)
        name = f"{name}@{r.part}"
    else:
        raise StageReplayError(f"plan does not count {r.experiment} stages yet", "plan a run without them")
    if p.get("status") == "ok" and r.experiment in ("matched", "bridge", "precision_2x2"):
        fw = fw + replay_forwards(p)
    return name, fw, n.prefix + max((length for _, length in n.arms), default=n.generated)


def replay_forwards(p: dict[str, Any]) -> list[int]:
    """The single-token forwards the diagnostics make replaying an arm to its pair's first divergent step d
    (experiments.diagnose, engine.steps.replay_logits): d + 1 for each (arm, d) with d >= 1 inside both arms'
    steps, for the arm of the pair that ran first (the other watched its suffix and kept its own logits there).
    Arms run in the record's order, except the arms carried over from matched (`same_as`), which run last,
    decode only as far as their diagnostics read and watch every other arm's suffix (never replayed)."""
    arms = p.get("arms", [])
    carried = {a["name"] for a in arms if "same_as" in a}
    order = [a["name"] for a in arms if a["name"] not in carried] + [a["name"] for a in arms if a["name"] in carried]
    steps = {a["name"]: len(a.get("suffix_ids") or []) for a in arms}
    out: list[int] = []
    seen: set[tuple[str, int]] = set()
    for c in p.get("comparisons", []):
        a, b, d = c.get("a"), c.get("b"), c.get("first_divergence")
        if a not in steps or b not in steps or not d or d >= steps[a] or d >= steps[b]:
            continue
        first = a if order.index(a) < order.index(b) else b
        if first not in carried and (first, d) not in seen:
            seen.add((first, d))
            out += [1] * (d + 1)
    return out


def _layers(stage: dict[str, Any]) -> int:
    from stagereplay.engine.model import load_checked_config

    return int(load_checked_config(Path(stage["model"]["path"])).get_text_config().num_hidden_layers)


def render(stages: list[StagePlan], shape: Shape, rates: Rates | None, workers: int = 1) -> str:
    """A table, one row per stage, then the totals."""
    head = (f"{'stage':28} {'prec':>5} {'items':>6} {'forwards':>10} {'prefill tok':>12} {'steps':>10} "
            f"{'caches':>7} {'cache MiB':>10} {'weights MiB':>12}" + (f" {'hours':>8}" if rates else ""))
    lines = [head]
    total = 0.0
    for s in stages:  # caches: the most alive at once (per item, times the items stepping together); cache MiB:
        # one of them at the stage's longest sequence
        size = shape.cache_bytes(s.positions, s.precision) / 2**20
        row = (f"{s.name:28} {s.precision:>5} {s.units:>6} {s.forwards:>10} {s.prefill_tokens:>12} {s.steps:>10} "
               f"{s.caches * s.rows:>7} {size:>10.1f} {shape.weight_bytes(s.precision) / 2**20:>12.1f}")
        if rates:
            hours = rates.wall(s, workers) / 3600
            total += hours
            row += f" {hours:>8.3f}"
        lines.append(row)
    forwards = sum(s.forwards for s in stages)
    lines.append(f"total: {forwards} forwards, {sum(s.prefill_tokens for s in stages)} prefill tokens, "
                 f"{sum(s.steps for s in stages)} decode steps"
                 + (f", {total:.3f} hours ({total * 3600:.0f} s; rates {rates.source})" if rates else ""))
    return "\n".join(lines)


def prompt_lengths(model: str, data: str | None, n: int, prompt_tokens: int | None) -> list[int]:
    """The prompt lengths of the first `n` items as the model's tokenizer makes them (the toy task's without
    `data`), or `prompt_tokens` for each when given (a directory holding only config.json has no tokenizer)."""
    if prompt_tokens is not None:
        return [prompt_tokens] * n
    from stagereplay.engine.model import load_config_and_tokenizer
    from stagereplay.tasks import DataConfig, load_items

    if not any((Path(model) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise StageReplayError(f"no tokenizer in {model} to measure the prompts with", "pass --prompt-tokens N")
    _, tokenizer = load_config_and_tokenizer(model)
    found = load_items(DataConfig(path=str(Path(data).resolve()) if data else None, n=n), tokenizer)[0]
    return [len(i.prompt_ids) for i in found]


def plan(cfg: PlanConfig, model: str | None = None, data: str | None = None, run: Path | None = None,
         max_stage1_tokens: int | None = None, rates: Rates | None = None, calibrate_on: dict[str, Any] | None = None,
         kernels: str = "auto") -> str:
    """The plan's table: of `run` as it ran (its measured lengths), else of `paper` on `model` with `cfg`'s
    lengths. `calibrate_on` (device, threads) measures the rates on the real model instead of `rates`, on the
    kernels the run would use (`kernels`, chosen before torch loads) or those `run` recorded."""
    from stagereplay.engine.limits import STAGE1_BUDGET, check_budgets

    check_kernels(kernels)
    if run is not None:
        if not (run / "manifest.json").exists():
            raise StageReplayError(f"no run in {run} (manifest.json missing)", "pass a run directory, or no RUN")
        manifest = read_manifest(run)
        if calibrate_on is not None:
            follow_run(manifest)
        model = manifest["config"]["model"]["path"]
    elif calibrate_on is not None:
        pin(choose(kernels, toy=model is None, device=calibrate_on["device"]))
    if model is None:
        from stagereplay.toy import toy_checkpoint

        model = str(toy_checkpoint("primary"))
    shape = model_shape(model)
    if run is not None:
        stages = plan_run(run, cfg.audit_sample)
        cache = run_cache(manifest)
    else:
        prompts = prompt_lengths(model, data, cfg.n, cfg.prompt_tokens)
        budget = check_budgets(max(prompts), max_stage1_tokens, cfg.suffix_tokens, shape.context, STAGE1_BUDGET)
        stages = plan_paper(cfg, shape, prompts, budget)
        cache = cfg.cache
        if cache == "static":
            max_new = max(cfg.max_new_tokens or 0, cfg.suffix_tokens)  # no suffix outgrows its budget
            allocate(stages, prompts, max_stage1_tokens, max_new, shape.context)
    batch = cfg.batch if run is None else int(manifest["config"]["model"].get("batch", 1))
    for st in stages:
        st.rows = 1 if st.name.startswith("proof@") else batch  # a proof steps one item at a time
    if calibrate_on is not None:
        together = cfg.workers if calibrate_on["device"] == "cpu" else 1  # workers on a CPU share it
        rates = calibrate(model, sorted({s.precision for s in stages}), **calibrate_on, cache=cache,
                          together=together, batch=batch)
    header = (f"model {Path(model).name}: {shape.layers} layers, {shape.kv_heads} KV heads of {shape.head_dim}, "
              f"{shape.params / 1e9:.3f}B parameters; a cache holds "
              f"{shape.cache_bytes(1, 'bf16') / 1024:.0f} KiB per position in bf16")
    if run is None:
        s1 = cfg.stage1_tokens or budget
        header += (f"\nassumed: {cfg.n} items, prompts {min(prompts)}-{max(prompts)} tokens, stage 1 {s1}, suffix "
                   f"{cfg.suffix_tokens}, divergent {cfg.n if cfg.divergent is None else cfg.divergent}; "
                   f"2x2 and transplants {'carry the matched arms over' if cfg.dedup else 'recompute every arm'}; audit "
                   + (f"of {cfg.audit_sample} units per stage" if cfg.audit_sample else "of every unit"))
    else:
        header += f"\nmeasured: the lengths recorded in {run}"
    if batch > 1:
        header += (f"\n--batch {batch}: single-token steps {batch} to a forward (rows kept full), each prefill alone; "
                   f"caches alive: {batch} items' at once")
    if cache == "static":
        header += ("\nstatic caches: each allocated for prompt + stage-1 budget + max new tokens - 1 positions, "
                   f"{stages[0].positions if stages else 0} at the longest prompt")
    return header + "\n" + render(stages, shape, rates, cfg.workers)
