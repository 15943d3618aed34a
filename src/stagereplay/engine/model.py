"""Loading a causal LM and its tokenizer at a chosen precision, device and thread count, deterministically."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

from stagereplay.errors import StageReplayError

if TYPE_CHECKING:
    import torch

PRECISIONS: tuple[str, ...] = ("bf16", "fp16", "fp32", "fp32-compute")
ATTN_IMPLS: tuple[str, ...] = ("eager", "sdpa")
AUTO = "auto"
"""`--attn-impl auto` (the default): the attention transformers picks for the model, resolved before a run starts
(`resolve_attn_impl`) and recorded as what it resolved to."""
CACHES: tuple[str, ...] = ("dynamic", "static")


class RecordedModel(TypedDict):
    """A `ModelConfig` as records keep it (`ModelConfig.as_dict`)."""

    path: str
    precision: str
    device: str
    threads: int
    attn_impl: str
    cache: str
    batch: NotRequired[int]  # only when above 1
    static_len: NotRequired[int]  # only when set


class DeterminismSettings(TypedDict):
    """What `set_determinism` set, as it reads back."""

    threads: int
    deterministic_algorithms: bool
    cublas_workspace_config: str | None  # cuBLAS's workspace, set for deterministic GEMMs on a GPU
    allow_tf32: bool


class Placement(TypedDict, total=False):
    """`from_pretrained` arguments that load straight onto a device (empty: load to the host, then move)."""

    device_map: str


@dataclass(frozen=True)
class ModelConfig:
    """Everything that decides which numbers a forward pass produces."""

    path: str = field(metadata={"help": "local directory with config.json, weights and tokenizer"})
    precision: str = field(default="bf16", metadata={"help": "bf16 | fp16 | fp32 | fp32-compute"})
    device: str = field(default="cpu", metadata={"help": "cpu | cuda | cuda:<i>"})
    threads: int = field(default=1, metadata={"help": "torch intra-op threads, fixed and recorded"})
    attn_impl: str = field(default="sdpa", metadata={"help": "eager | sdpa"})
    cache: str = field(default="dynamic", metadata={
        "help": "dynamic (grows per step; equals generate()) | static (preallocated; equals "
                "generate(cache_implementation='static'), CUDA-graph captured on a GPU)"})
    batch: int = field(default=1, metadata={
        "help": "rows of a batched decode step: up to this many items step together (engine.batched_step); a row's bits "
                "may depend on the row count, never on its batch-mates, so it is part of the numbers"})
    static_len: int | None = field(default=None, metadata={
        "help": "with a static cache: positions to allocate per cache, when more than an item needs (None: what "
                "generate(cache_implementation='static') allocates; a run whose steps are CUDA graphs sets the longest "
                "item's, runs.make.shared_static_len); the padded keys change the attention's blocking"})
    weights: bool = field(default=True, metadata={
        "help": "False: the config and tokenizer only, for a run whose every step a serving engine takes (the "
                "server's model is its own; ours only tokenizes and scores). Not part of the numbers: never recorded"})

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise StageReplayError(
                f"unknown precision {self.precision!r}", f"use one of {', '.join(PRECISIONS)}"
            )
        if self.attn_impl not in ATTN_IMPLS:
            raise StageReplayError(
                f"unknown attention implementation {self.attn_impl!r}", f"use one of {', '.join(ATTN_IMPLS)}"
            )
        check_cache(self.cache)
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise StageReplayError(f"unknown device {self.device!r}", "use cpu, cuda or cuda:<index>")
        if self.threads < 1:
            raise StageReplayError(f"--threads must be at least 1, got {self.threads}", "pass --threads 1 or more")
        if self.batch < 1:
            raise StageReplayError(f"--batch must be at least 1, got {self.batch}", "pass --batch 1 or more")
        if self.static_len is not None and (self.cache != "static" or self.static_len < 1):
            raise StageReplayError(f"--static-len {self.static_len} sizes a static cache", "pass --cache static "
                                   "and a positive --static-len, or drop --static-len")

    def with_precision(self, precision: str) -> ModelConfig:
        return ModelConfig(**{**asdict(self), "precision": precision})

    def as_dict(self) -> RecordedModel:
        """The fields as records keep them, in their order, `weights` left out: `batch` only when above 1, so a
        batch-1 run records what it always recorded (and a record without it reads back as batch 1)."""
        out: RecordedModel = {"path": self.path, "precision": self.precision, "device": self.device,
                              "threads": self.threads, "attn_impl": self.attn_impl, "cache": self.cache}
        if self.batch != 1:
            out["batch"] = self.batch
        if self.static_len is not None:  # recorded only when set, as `batch`
            out["static_len"] = self.static_len
        return out


def torch_dtype(precision: str) -> torch.dtype:
    import torch

    # fp32-compute keeps the weights in bf16 and upcasts them as they are used (see `_upcast_on_use`).
    return {
        "bf16": torch.bfloat16,
        "fp16": torch.float16,
        "fp32": torch.float32,
        "fp32-compute": torch.bfloat16,
    }[precision]


def check_cache(cache: str) -> str:
    """`cache` if it names a cache kind (CACHES), else a one-line error."""
    if cache not in CACHES:
        raise StageReplayError(f"unknown cache {cache!r}", f"use --cache {' or '.join(CACHES)}")
    return cache


def set_determinism(threads: int, device: str) -> DeterminismSettings:
    """Fix threads and turn on deterministic algorithms; return what was set, for the manifest."""
    import torch

    if device.startswith("cuda"):
        # cuBLAS needs this before its first handle is created to be deterministic.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # TF32 would silently turn "fp32" into 10-bit-mantissa matmuls.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    return {
        "threads": torch.get_num_threads(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
    }


def _check_device(config: ModelConfig) -> None:
    import torch

    if config.device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise StageReplayError(f"device {config.device} requested but CUDA is not available", "use --device cpu")
        index = int(config.device.split(":")[1]) if ":" in config.device else 0
        if index >= torch.cuda.device_count():
            raise StageReplayError(
                f"device {config.device} does not exist ({torch.cuda.device_count()} CUDA devices)",
                "pick an index below the device count",
            )
        if config.precision in ("bf16", "fp32-compute") and not torch.cuda.is_bf16_supported():
            raise StageReplayError(
                f"precision {config.precision} needs bf16, which {torch.cuda.get_device_name(index)} lacks",
                "use --precision fp16 or fp32",
            )


def check_model_dir(path: str | Path) -> Path:
    """Fail fast, before any run directory exists, on a path that cannot hold a model (a folder, or a GGUF file:
    `engine.gguf`)."""
    from stagereplay.engine.gguf import check_gguf, is_gguf

    if is_gguf(path):
        return check_gguf(path)
    p = Path(path)
    if not p.is_dir():
        raise StageReplayError(f"model directory not found: {p}", "pass --model a local directory holding config.json")
    config = p / "config.json"
    if not config.is_file():
        raise StageReplayError(f"no config.json in model directory {p}", "point --model at a saved Hugging Face model")
    try:
        json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise StageReplayError(f"corrupt config.json in {p} ({exc.msg if hasattr(exc, 'msg') else exc})",
                               "re-save the model with save_pretrained") from None
    if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
        raise StageReplayError(f"no weights (*.safetensors or *.bin) in model directory {p}",
                               "re-save the model with save_pretrained")
    return p


@contextmanager
def _quiet_transformers(gguf_file: bool = False) -> Iterator[None]:
    """Within: transformers says only errors and draws no bars; for a GGUF file, its GGUF reader's too (it calls
    tqdm itself, a bar update per tensor, past transformers' switch)."""
    import functools
    import sys

    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    gguf = sys.modules.get("transformers.modeling_gguf_pytorch_utils")
    if gguf is None and gguf_file:
        import transformers.modeling_gguf_pytorch_utils as gguf
    tqdm = getattr(gguf, "tqdm", None)
    if tqdm is not None:
        gguf.tqdm = functools.partial(tqdm, disable=True)  # type: ignore[union-attr]
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()
        if tqdm is not None:
            gguf.tqdm = tqdm  # type: ignore[union-attr]


def _upcast_on_use(model: torch.nn.Module) -> None:
    """LayerCast: weights stay in 16 bits; each module's parameters are upcast to fp32 just for its own forward.

    Upcasting bf16 to fp32 is exact, so the arithmetic is that of an fp32 model at half the weight memory.
    """
    import torch

    def before(module: torch.nn.Module, _args: Any) -> None:
        for p in module.parameters(recurse=False):
            p.data = p.data.float()

    def after(module: torch.nn.Module, _args: Any, _out: Any) -> None:
        for p in module.parameters(recurse=False):
            p.data = p.data.to(torch.bfloat16)

    for module in model.modules():
        if any(True for _ in module.parameters(recurse=False)):
            module.register_forward_pre_hook(before)
            module.register_forward_hook(after)


_TOKENIZERS: dict[tuple[str, int], Any] = {}
"""The last tokenizer loaded, by path and modification time: a command checks its items with it before the
weights load, and the model then takes the same one (a GGUF file's tokenizer is rebuilt from its vocabulary, a
minute for a 262k-token one)."""


def _load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    from stagereplay.engine.gguf import from_pretrained_args

    files = [path, *path.iterdir()] if path.is_dir() else [path]
    key = (str(path.resolve()), max(f.stat().st_mtime_ns for f in files))
    if key in _TOKENIZERS:
        return _TOKENIZERS[key]
    try:
        where, kwargs = from_pretrained_args(path)
        tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
    except Exception as exc:
        raise StageReplayError(f"cannot load the tokenizer in {path} ({type(exc).__name__})",
                               "save the model's tokenizer into the same directory") from None
    _TOKENIZERS.clear()  # one kept: a process that loads many models holds none of the others' vocabularies
    _TOKENIZERS[key] = tokenizer
    return tokenizer


def load_checked_config(path: Path) -> Any:
    """The model's config, refused up front (before any weights or run directory) if its cache is not plain K/V."""
    from transformers import AutoConfig

    from stagereplay.engine.cache import check_cache_kinds
    from stagereplay.engine.gguf import from_pretrained_args

    with _quiet_transformers():
        try:
            where, kwargs = from_pretrained_args(path)
            config = AutoConfig.from_pretrained(where, **kwargs)
        except Exception as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise StageReplayError(f"cannot read the model config in {path}: {first[:200]}",
                                   "re-save the model with save_pretrained") from None
    generation = path / "generation_config.json"
    try:
        implementation = (json.loads(generation.read_text()).get("cache_implementation")
                          if generation.is_file() else None)
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        implementation = None  # transformers reports a broken generation config itself
    check_cache_kinds(config, implementation)
    return config


def supported_attn_impls(config: Any) -> tuple[str, ...]:
    """The attentions of ATTN_IMPLS that transformers has for this model's class (eager always)."""
    from transformers import AutoModelForCausalLM

    try:
        cls = AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, AttributeError):
        return ATTN_IMPLS  # transformers will say itself what it cannot load
    # SDPA has no logit softcapping: a model that caps its attention logits (Gemma 2 always, Gemma 3 when set) has
    # only eager attention, whatever its class says.
    capped = getattr(config.get_text_config(), "attn_logit_softcapping", None) is not None
    return ("eager", "sdpa") if getattr(cls, "_supports_sdpa", False) and not capped else ("eager",)


def resolve_attn_impl(path: str | Path, requested: str = AUTO) -> str:
    """The attention a run of the model in `path` uses: with `auto`, what transformers picks by default (SDPA where
    the model has it, else eager); an explicit choice the model lacks is refused, naming the one it has."""
    if requested != AUTO and requested not in ATTN_IMPLS:
        raise StageReplayError(f"unknown attention implementation {requested!r}",
                               f"use {AUTO} or one of {', '.join(ATTN_IMPLS)}")
    config = load_checked_config(check_model_dir(path))
    supported = supported_attn_impls(config)
    if requested == AUTO:
        return "sdpa" if "sdpa" in supported else "eager"
    if requested not in supported:
        name = type(config).__name__.removesuffix("Config")
        raise StageReplayError(f"transformers has no {requested} attention for {name} models",
                               f"pass --attn-impl {supported[-1]}, or leave --attn-impl unset for the model's own")
    return requested


def load_config_and_tokenizer(path: str) -> tuple[Any, Any]:
    """The model's config and tokenizer without its weights (what a parent process needs to check inputs)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    p = check_model_dir(path)
    config = load_checked_config(p)
    with _quiet_transformers():
        return config, _load_tokenizer(p)


def generation_config(path: str, model_config: Any) -> Any:
    """The generation config a loaded model carries (its EOS ids), without loading it: a folder's
    generation_config.json where it has one, else the one made from the model's config (what `from_pretrained`
    does; a GGUF file's always comes from its config)."""
    from transformers import GenerationConfig

    from stagereplay.engine.gguf import is_gguf

    if not is_gguf(path) and (Path(path) / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(path)
    return GenerationConfig.from_model_config(model_config)


def load_model_and_tokenizer(config: ModelConfig) -> tuple[Any, Any]:
    """Load through AutoModelForCausalLM / AutoTokenizer from a local directory, with no network."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = check_model_dir(config.path)
    _check_device(config)
    model_config = load_checked_config(path)
    from transformers import AutoModelForCausalLM

    from stagereplay.engine.gguf import from_pretrained_args, is_gguf

    with _quiet_transformers(gguf_file=is_gguf(path)):
        tokenizer = _load_tokenizer(path)
        where, kwargs = from_pretrained_args(path, weights=True)  # a GGUF file: dequantized (engine.gguf)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                where, **kwargs, config=model_config, dtype=torch_dtype(config.precision),
                attn_implementation=config.attn_impl,
                **_placement(config.device),
            )
        except Exception as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise StageReplayError(f"cannot load the model in {path}: {first[:200]}",
                                   "check that the directory holds a complete causal LM checkpoint") from None
    vocab = int(model.get_input_embeddings().weight.shape[0])  # type: ignore[index]  # an nn.Embedding
    if len(tokenizer) > vocab:
        raise StageReplayError(
            f"tokenizer in {path} has {len(tokenizer)} tokens but the model embeds only {vocab}",
            "use the tokenizer the model was trained with",
        )
    if config.precision == "fp32-compute":
        _upcast_on_use(model)
    if not _placement(config.device):
        model.to(config.device)  # type: ignore[arg-type]  # transformers' stubs type .to() narrowly
    model.eval()
    return model, tokenizer


def _placement(device: str) -> Placement:
    """`from_pretrained` arguments that load straight onto `device`.

    On a GPU, a one-device `device_map` makes transformers materialise each tensor there as it reads it: no full
    host copy first (55 GiB of host RAM for a 14B model in fp32 otherwise), and no dispatch hooks, since there is
    one device. transformers needs `accelerate` for it (`pip install 'stagereplay[gpu]'`); without it the model
    loads to the host and then moves. On the CPU the weights are read into host memory directly anyway.
    """
    if not device.startswith("cuda"):
        return {}
    import importlib.util

    return {"device_map": device} if importlib.util.find_spec("accelerate") is not None else {}
