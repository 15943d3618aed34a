"""What the benchmarks share: the random models they draw (one builder, one table of shapes), the tokenizer and
items saved beside them, prompts, clocks, the device's copy bandwidth, the resident set, our engine on a bare model,
a decode step's profile, and the speculation counts of a run's ledger.

Every script in bench/ imports it the same way, `from common import ...`: Python puts the folder of the script it
runs first on `sys.path`, so `python bench/SCRIPT.py` finds this module from any directory. A script imports this
module, never another script (tests/test_bench.py checks it); what two scripts need lives here. Nothing here imports
torch or transformers at import time, so a script's `--help` stays instant.
"""

from __future__ import annotations

import importlib
import json
import random
import resource
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# --- Random models -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """A random Qwen2's shape, and how its weights are drawn. Every model is bf16 with untied embeddings, BOS 1,
    EOS 2 and PAD 0 (the ids `save_tokenizer` gives its special tokens)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    head_dim: int | None = None
    """Written to config.json only when given (else transformers derives hidden // heads)."""
    context: int = 32768
    """max_position_embeddings."""
    std: float | None = None
    """None: transformers' own initialisation, drawn in bf16. A float: transformers' initialisation in fp32, then
    every matrix redrawn from N(0, std) (wider than its 0.02) and the whole rounded to bf16."""


SHAPES: dict[str, Shape] = {
    "qwen2.5-14b": Shape(48, 5120, 40, 8, 13824, 152064),
    "qwen2.5-7b": Shape(28, 3584, 28, 4, 18944, 152064),
    "50m": Shape(8, 512, 8, 2, 1536, 28000),
    "vocab152k": Shape(4, 256, 4, 2, 512, 151936),  # batch.py's: Qwen2.5's vocabulary on a small decoder
    "tiny": Shape(2, 64, 4, 2, 128, 256),  # the benchmarks' smoke runs (tests/test_bench.py)
    # long_trace.py's: DeepSeek-R1-Distill-Qwen-1.5B's cache (28 layers, 2 KV heads of 128) on a narrow decoder.
    "r1-cache": Shape(28, 256, 2, 2, 512, 1024, head_dim=128, std=0.08),
    # scale.py's (and plan.py --scale's): Qwen2.5's vocabulary, context 8192; its smoke size.
    "scale": Shape(4, 256, 4, 2, 512, 151_936, context=8192, std=0.08),
    "scale-tiny": Shape(2, 64, 4, 2, 128, 4096, context=512, std=0.08),
}
SHORT_NAMES = {"7b": "qwen2.5-7b", "14b": "qwen2.5-14b", "50m": "50m", "tiny": "tiny"}
"""gpu_decode.py's `--shape` names (Qwen2.5's 7B and 14B by their size), and the SHAPES entry each names."""
EOS = 2


def config_of(name: str) -> Any:
    """The Qwen2Config of the shape `name`."""
    from transformers import Qwen2Config

    s = SHAPES[name]
    extra = {} if s.head_dim is None else {"head_dim": s.head_dim}
    return Qwen2Config(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
                       num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                       max_position_embeddings=s.context, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       bos_token_id=1, eos_token_id=EOS, pad_token_id=0, **extra)


def random_model(name: str, device: str = "cpu", seed: int = 0, eos_out_of_reach: bool = False) -> Any:
    """The random bf16 Qwen2 of the shape `name`, its weights drawn on `device` from `seed` (in memory).

    `eos_out_of_reach`: EOS's output row is zero, so its logit (0) stays below the largest of the vocabulary's
    random ones and greedy decoding runs to its length limit (what a speed or memory benchmark needs)."""
    import torch
    from transformers import AutoModelForCausalLM

    std = SHAPES[name].std
    forked = [torch.device(device).index or 0] if device.startswith("cuda") else []
    with torch.random.fork_rng(devices=forked):
        torch.manual_seed(seed)  # transformers' initialisation reads the global generators; the fork restores them
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config_of(name),
                                                     dtype=torch.bfloat16 if std is None else torch.float32)
        with torch.no_grad():
            if std is not None:
                for p in model.parameters():
                    if p.dim() > 1:
                        p.normal_(0.0, std)
            if eos_out_of_reach:
                model.lm_head.weight[EOS] = 0.0
    if std is not None:
        model = model.to(torch.bfloat16)
    return model.eval()


SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]


def save_tokenizer(path: Path, vocab_size: int) -> None:
    """Characters first, then filler tokens `<tN>` up to `vocab_size`, so every ID decodes."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = SPECIALS + CHARS
    names += [f"<t{i}>" for i in range(vocab_size - len(names))]
    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(names)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(path)


def save_random_model(name: str, out: Path, device: str = "cpu", seed: int = 0,
                      eos_out_of_reach: bool = False) -> Path:
    """`random_model(...)` saved to `out` (bf16 safetensors) with a tokenizer over every ID: a model folder
    `stagereplay` loads like any other."""
    model = random_model(name, device, seed, eos_out_of_reach)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    save_tokenizer(out, SHAPES[name].vocab)
    return out


def config_only(name: str, out: Path) -> Path:
    """A directory holding only the shape's config.json: what `stagereplay plan` reads (no weights)."""
    out.mkdir(parents=True, exist_ok=True)
    config_of(name).save_pretrained(out)
    return out


def arithmetic_items(path: Path, n: int = 200, seed: int = 0) -> Path:
    """`n` seeded two-number sums asking for steps: prompts for `stagereplay matched --data` on a random model."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            f.write(json.dumps({"id": f"r{i:03d}", "prompt": f"Q: {a}+{b}=? Show your steps.\n",
                                "answer": str(a + b)}) + "\n")
    return path


def think_items(path: Path, n: int) -> Path:
    """`n` fixed sums (`Q: 10+20=? Think.` and on) for a run whose boundary is a token count."""
    path.write_text("".join(json.dumps({"id": f"t{i}", "prompt": f"Q: {10 + i}+{20 + i}=? Think.\n",
                                        "answer": str(30 + 2 * i)}) + "\n" for i in range(n)))
    return path


@dataclass(frozen=True)
class ScaleRun:
    """scale.py's workload (plan.py --scale plans the same): the model's shape, stage 1 and suffix tokens, items."""

    shape: str
    stage1: int
    suffix: int
    items: int = 2


SCALE_RUNS = {"full": ScaleRun("scale", 1024, 512), "tiny": ScaleRun("scale-tiny", 24, 12)}


# --- Prompts -------------------------------------------------------------------------------------------------------


def random_prompts(vocab: int, n: int, length: int = 32, seed: int = 0) -> list[list[int]]:
    """`n` prompts of `length` ids drawn from `seed`, none of the four special ids."""
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(length)] for _ in range(n)]


def fixed_prompt(vocab: int, length: int) -> list[int]:
    """One prompt of `length` ids that steps through the vocabulary, no special ids (ids 0..2)."""
    return [(7 * i + 11) % (vocab - 3) + 3 for i in range(length)]


# --- Clocks, bandwidth, memory -------------------------------------------------------------------------------------


def clock(name: str) -> Callable[[], float]:
    """`wall`: the host's clock; `cpu`: this process's CPU time (steadier on a shared CPU, with one thread)."""
    return time.process_time if name == "cpu" else time.perf_counter


def sync(device: str) -> None:
    """Wait for the device's queued work, so that a clock read after it counts that work (nothing on a CPU)."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def device_seconds(fn: Callable[[], Any], device: str, repeats: int) -> tuple[list[float], Any]:
    """Wall seconds of each of `repeats` calls of `fn`, the device's work included (synced before and after each),
    and what the last call returned."""
    times, out = [], None
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return times, out


def copy_bandwidth(device: str, mib: int, repeats: int = 5) -> float:
    """Bytes per second a large device-to-device `copy_` moves (each byte read once and written once)."""
    import torch

    src = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm up
    times, _ = device_seconds(lambda: dst.copy_(src), device, repeats)
    return 2 * src.numel() / min(times)


def rss_mib() -> float:
    """This process's resident set now, in MiB (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


# --- Our engine on a model in memory -------------------------------------------------------------------------------


def bare_lm(model: Any, device: str, cache: str) -> Any:
    """Our engine (`LM`) on a model in memory, with no tokenizer: EOS comes from the model's generation config."""
    from types import SimpleNamespace

    from stagereplay.engine.lm import LM
    from stagereplay.engine.model import ModelConfig

    return LM(model, SimpleNamespace(eos_token_id=None), ModelConfig(path="random", device=device, cache=cache))


# --- A decode step's profile (step_profile.py; gpu_decode.py --profile; gpu_check.py's rows) -----------------------

LABELS = {  # label: (module, class, method) whose calls it times
    "step": ("stagereplay.engine.decode", "Stepper", "forward"),
    "pick": ("stagereplay.engine.decode", "Sampler", "pick"),
    "record": ("stagereplay.engine.steps", "StepRecord", "add"),
}
PREFIX = "stagereplay::"


@contextmanager
def labelled() -> Iterator[None]:
    """Within: each LABELS method runs inside a profiler range of its label (a multi-token forward is `prefill`)."""
    import torch

    saved = []
    for label, (module, cls, name) in LABELS.items():
        klass = getattr(importlib.import_module(module), cls)
        original = getattr(klass, name)

        def wrapped(*args: Any, _original: Any = original, _label: str = label, **kwargs: Any) -> Any:
            if _label == "step" and len(args[1]) > 1:  # Stepper.forward(self, ids, ...): a prefill
                _label = "prefill"
            with torch.profiler.record_function(PREFIX + _label):
                return _original(*args, **kwargs)

        setattr(klass, name, wrapped)
        saved.append((klass, name, original))
    try:
        yield
    finally:
        for klass, name, original in saved:
            setattr(klass, name, original)


def profile_live(lm: Any, prompt: Sequence[int], stage1: int, suffix: int) -> dict[str, Any]:
    """One live arm of `stage1` + `suffix` steps on `lm`, warmed up once, then profiled: per-step figures."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from stagereplay.engine.boundary import After
    from stagereplay.engine.decode import DecodeConfig

    dc = DecodeConfig(max_new_tokens=suffix, max_stage1_tokens=stage1)
    cuda = lm.config.device.startswith("cuda")

    def item() -> int:
        state = lm.live(list(prompt), After(stage1), dc)
        if cuda:
            torch.cuda.synchronize()
        return len(state.prefix) - len(prompt) + len(state.live_suffix.suffix) - 1  # decode steps made

    item()  # the warm-up: proofs, captures and graphs, allocator pools
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with labelled(), profile(activities=activities) as prof:
        started = time.perf_counter()
        steps = item()
        wall = time.perf_counter() - started
    rows = prof.key_averages()

    def host(label: str) -> float:
        return sum(e.cpu_time_total for e in rows if e.key == PREFIX + label) / 1e6

    def count(*keys: str) -> int:
        return sum(e.count for e in rows if any(k in e.key for k in keys))

    device = (sum(getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0) for e in rows)
              / 1e6 if cuda else None)
    labels = {label: host(label) for label in ("step", "pick", "record", "prefill")}
    other = wall - sum(labels.values())
    per = 1e3 / steps
    return {
        "steps": steps, "wall_ms": wall * per, "device_ms": None if device is None else device * per,
        **{f"{label}_ms": seconds * per for label, seconds in labels.items() if label != "prefill"},
        "other_ms": other * per,
        "host_reads": count("aten::_local_scalar_dense") / steps,
        "syncs": count("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize") / steps,
        "dtoh_copies": count("DtoH", "Device -> Pageable", "Device -> Pinned") / steps if cuda else None,
    }


def profile_line(name: str, p: dict[str, Any]) -> str:
    """`profile NAME: S steps; per step wall W ms, device D ms (P% of wall); step ...; host reads R, syncs Y, ...`."""
    return f"profile {name}: {p['steps']} steps; {profile_figures(p)}"


def profile_figures(p: dict[str, Any]) -> str:
    """A profile's per-step figures (`profile_live`), as one line says them."""
    device = ("" if p["device_ms"] is None else
              f", device {p['device_ms']:.3f} ms ({100 * p['device_ms'] / p['wall_ms']:.0f}% of wall)")
    tail = "" if p["dtoh_copies"] is None else f", syncs {p['syncs']:.2f}, DtoH copies {p['dtoh_copies']:.2f}"
    return (f"per step wall {p['wall_ms']:.3f} ms{device}; step {p['step_ms']:.3f}, pick {p['pick_ms']:.3f}, record "
            f"{p['record_ms']:.3f}, other {p['other_ms']:.3f} ms; host reads {p['host_reads']:.2f}{tail}")


# --- A run's ledger ------------------------------------------------------------------------------------------------


def draft_totals(run: Path) -> tuple[int, int] | None:
    """Tokens speculation drafted and accepted over the run's live requests (None: no arm says it speculated)."""
    totals, seen = [0, 0], False
    for line in (run / "ledger.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] != "item":
            continue
        for arm in record["payload"].get("arms", []):
            if arm["name"] == "live" and arm.get("draft") is not None:
                seen = True
                totals[0] += arm["draft"]["drafted"]
                totals[1] += arm["draft"]["accepted"]
    return (totals[0], totals[1]) if seen else None


# --- Servers -------------------------------------------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerDidNotStart(SystemExit):
    """A server that exited or never answered: the script exits naming its log, unless it catches this."""

    def __init__(self, log: Path) -> None:
        super().__init__(f"error: the server did not start; its log: {log}")
        self.log = log

    def reason(self) -> str:
        """The log's first error line (llama-server's `E` lines), without its timestamp; else the first exception a
        Python server logged (vLLM's root cause, `NotImplementedError: ...`), else the log's path."""
        import re

        lines = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        first = next((line for line in lines if " E " in line), None)
        if first is not None:
            return first.split(" E ", 1)[-1].strip()
        raised = (re.search(r"\b[A-Z]\w*(?:Error|Exception): .*", line) for line in lines if " WARNING " not in line)
        return next((m.group(0).strip() for m in raised if m), "see " + str(self.log))


def wait_up(proc: Any, url: str, path: str, log: Path, tries: int) -> str:
    """`url` once `path` answers; else the server is stopped and `ServerDidNotStart` raised."""
    import urllib.request

    for _ in range(tries):
        try:
            with urllib.request.urlopen(url + path, timeout=2):
                return url
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.2)
    proc.kill()
    raise ServerDidNotStart(log)


def start_llama_server(binary: str, model: str, flags: Sequence[str], log: Path, saves: Path | None = None
                       ) -> tuple[Any, str]:
    """llama-server on 127.0.0.1 at a free port (no web UI; a slot folder where `saves` is given): its process and
    its address once /health answers."""
    import subprocess

    port = free_port()
    slots: list[str] = []
    if saves is not None:
        saves.mkdir(parents=True, exist_ok=True)
        slots = ["--slot-save-path", str(saves)]
    cmd = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "--no-webui", *slots, *flags]
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
                            start_new_session=True)  # its own process group: `stop_server` stops it alone
    return proc, wait_up(proc, f"http://127.0.0.1:{port}", "/health", log, 600)


def start_vllm_server(python: str, model: str, flags: Sequence[str], log: Path, threads: int) -> tuple[Any, str]:
    """`vllm serve` (its OpenAI server, run by `python`: the vLLM venv's, as .ci/run makes it) on 127.0.0.1 at a free
    port, in its own process group (`stop_server` ends its engine processes too): its process and its address once
    /v1/models answers."""
    import os
    import subprocess
    import tempfile

    port = free_port()
    # Its processes talk over Unix sockets under VLLM_RPC_BASE_PATH (the temporary folder by default), whose paths
    # must fit in 107 characters: a short folder of its own, where a deep TMPDIR (a test's) would not fit.
    sockets = os.environ.get("VLLM_RPC_BASE_PATH") or tempfile.mkdtemp(prefix="vllm-", dir="/tmp" if os.path.isdir(
        "/tmp") else None)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "VLLM_RPC_BASE_PATH": sockets}
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1", "--port",
           str(port), "--max-logprobs", "5", "--seed", "0", *flags]
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env,  # noqa: SIM115
                            start_new_session=True)
    try:
        return proc, wait_up(proc, f"http://127.0.0.1:{port}", "/v1/models", log, 3000)
    except ServerDidNotStart:
        stop_server(proc)
        raise


def stop_server(proc: Any) -> None:
    """A server started in its own process group, stopped with every process it started."""
    import os
    import signal
    import subprocess

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# --- Attest: a variant's rows against the honest null --------------------------------------------------------------

ATTEST_GRID = (8, 16, 32, 64, 128, 256, 512, 1024, 2048)


@dataclass
class AttestVariant:
    """One served variant of the claimed model: its per-item scores (the statistic's) and mismatches, and whether it
    is honest (part of the null)."""

    scores: list[Any]
    mismatches: list[Any]
    honest: bool


def attest_rows(variants: dict[str, AttestVariant], half: int, draws: int, alpha: float = 0.01,
                grid: Sequence[int] = ATTEST_GRID, title: str = "") -> tuple[list[dict[str, Any]], list[int], dict[str, Any]]:
    """The null (every honest variant's first `half` items, pooled) and one printed row per variant on the held-out
    items: its statistic with its 95% interval over items and mismatch rate; for an honest variant the false-positive
    rate of the per-item decision at `alpha` (Wilson interval); for a substitution the AUC against the null at runs of
    t tokens and the tokens needed for 99% power. Returns the rows, [flagged, decided] of the honest variants, and
    the null's size."""
    from stagereplay.experiments.attest.stats import (
        Items,
        curve,
        decide,
        item_interval,
        run_statistic,
        tokens_for_power,
    )
    from stagereplay.experiments.core.stats import wilson_interval

    null = Items.of([s for v in variants.values() if v.honest for s in v.scores[:half]])
    print(f"\n{title}null: {len(null)} items, {null.tokens} tokens (calibration prompts, honest variants pooled); "
          f"held out: {len(next(iter(variants.values())).scores) - half} prompts")
    width = max(18, *(len(n) for n in variants))
    print(f"{'variant':<{width}} {'items':>5} {'tokens':>6} {'statistic [95% over items]':>30} {'mismatch':>8} "
          f"{'FPR at 1% [95%]':>20} {'AUC at 32/128/512 tok':>22} {'tok for 99% power':>17}")
    rows, flagged = [], [0, 0]
    for name, v in variants.items():
        held = Items.of(v.scores[half:])
        stat, (lo, hi) = run_statistic(held), item_interval(held)
        mismatch = run_statistic(Items.of(v.mismatches[half:]))
        row: dict[str, Any] = {"variant": name, "honest": v.honest, "items": len(held), "tokens": held.tokens,
                               "statistic": stat, "interval": [lo, hi], "mismatch_rate": mismatch}
        fpr = auc_text = power_text = ""
        if v.honest:
            flags = sum(decide(Items.of([s]), null, alpha, draws, seed=i, needed=False).flagged
                        for i, s in enumerate(v.scores[half:]))
            w = wilson_interval(flags, len(held))
            row.update(flagged=flags, fpr_interval=list(w))
            fpr = f"{flags}/{len(held)} [{w[0]:.3f}, {w[1]:.3f}]"
            flagged[0] += flags
            flagged[1] += len(held)
        else:
            c = curve(held, null, grid, alpha, draws)
            needed = tokens_for_power(c)
            row.update(auc=dict(zip(map(int, c.tokens), map(float, c.auc), strict=True)),
                       power=dict(zip(map(int, c.tokens), map(float, c.power), strict=True)), tokens_needed=needed)
            auc_text = "/".join(f"{row['auc'][t]:.3f}" for t in (32, 128, 512))
            power_text = f"<= {needed}" if needed is not None else f"> {grid[-1]}"
        rows.append(row)
        print(f"{name:<{width}} {len(held):>5} {held.tokens:>6} {stat:>10.4f} [{lo:.4f}, {hi:.4f}]   "
              f"{mismatch:>8.4f} {fpr:>20} {auc_text:>22} {power_text:>17}")
    return rows, flagged, {"null_items": len(null), "null_tokens": null.tokens}


def attest_summary(row: dict[str, Any], grid: Sequence[int] = ATTEST_GRID, at: int = 128) -> str:
    """A substitution's row in a line: its AUC at `at` tokens and the tokens it needs for 99% power."""
    needed = row["tokens_needed"]
    power = f"<= {needed}" if needed is not None else f"> {grid[-1]}"
    return f"AUC {row['auc'][at]:.3f} at {at} tokens, 99% power {power}"


def attest_figure(rows: Sequence[dict[str, Any]], path: Path, title: str) -> Path:
    """Each substitution's AUC against the honest null by run length (tokens), on a log axis, as a PNG at `path`:
    Token-DiFR's figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for row in rows:
        if "auc" in row:
            tokens = sorted(row["auc"], key=int)
            ax.plot([int(t) for t in tokens], [row["auc"][t] for t in tokens], marker="o", label=row["variant"])
    ax.axhline(0.999, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("served tokens per run (whole responses)")
    ax.set_ylabel("AUC against the honest null")
    ax.set_ylim(0.0, 1.02)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
