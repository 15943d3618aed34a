"""Batched exact replay: an item's record is the same bits whatever else is in its batch (engine.batched_step).

Checked on every tiny architecture (sliding windows shorter than the sequence included), in bf16 and fp32:
the batched step row by row (together, alone, in another slot), whole runs' item payloads across item orders,
subsets and items run alone, and every experiment of `paper`. Under portable kernels a row's bits do not depend
on the row count either, so there the batched step equals the batch-1 step, which checks the per-row attention
and masks themselves. Negative controls, each failing on any CPU: a batch whose attention is padded across rows
with the padding attended (a naive batch that forgets its mask), whose rows move with their batch-mates by value;
and a batched step that leaves batch 1's bits (each row's attention doubled), which the check before a run must
call so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tiny import SLIDING, tiered

from stagereplay.engine import batched_step as batch
from stagereplay.engine.cache import new_cache
from stagereplay.engine.decode import Stepper
from stagereplay.engine.lm import load
from stagereplay.execution.kernels import PORTABLE

ARCHS = ("qwen2", "llama", "qwen3", "mistral-sw", "gemma2", "gemma3")
PROMPTS = ("Q: what is 12+7? Think.", "Hello there, a longer prompt than the others", "abc")
ROWS = 4


def _cache(lm, kind: str, prompt: list[int], n: int):
    """An empty cache of `kind` for a prompt and n steps (a static one sized as generate() sizes it)."""
    return new_cache(lm.model, kind, len(prompt) + n)


def _steps(lm, slots: dict[int, int], n: int = 24, cache: str = "dynamic") -> dict[int, list[torch.Tensor]]:
    """Greedy steps of PROMPTS[k] in slot slots[k] of a ROWS-row batched step, all together: each step's logits."""
    step, eager = batch.BatchedStep(lm.model, ROWS, "cpu"), Stepper(lm.model, "cpu")
    prompts = {k: lm.tokenizer.encode(PROMPTS[k]) for k in slots}
    caches = {k: _cache(lm, cache, prompts[k], n) for k in slots}
    logits = {k: eager.forward(prompts[k], caches[k], 0) for k in slots}
    out: dict[int, list[torch.Tensor]] = {k: [] for k in slots}
    for t in range(n):
        rows: list = [None] * ROWS
        for k, slot in slots.items():
            rows[slot] = (int(torch.argmax(logits[k].float())), caches[k], len(prompts[k]) + t)
        made = step.forward(rows)
        for k, slot in slots.items():
            logits[k] = made[slot]
            out[k].append(made[slot])
    return out


def _batch1(lm, k: int, n: int = 24, cache: str = "dynamic") -> list[torch.Tensor]:
    eager, prompt = Stepper(lm.model, "cpu"), lm.tokenizer.encode(PROMPTS[k])
    own = _cache(lm, cache, prompt, n)
    logits, out = eager.forward(prompt, own, 0), []
    for t in range(n):
        logits = eager.forward([int(torch.argmax(logits.float()))], own, len(prompt) + t)
        out.append(logits)
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.int16 if x.dtype == torch.bfloat16 else torch.int32),
                           y.view(torch.int16 if y.dtype == torch.bfloat16 else torch.int32))
               for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_row_is_the_same_bits_together_alone_and_in_any_slot(tiny_dir, arch, precision, cache):
    lm = load(str(tiny_dir(arch)), precision=precision)
    together = _steps(lm, {0: 0, 1: 1, 2: 2}, cache=cache)
    for k in range(3):
        assert _same(together[k], _steps(lm, {k: ROWS - 1 - k}, cache=cache)[k]), f"item {k} moved with its mates"
    if arch in SLIDING:  # the sequences outgrow the window of 8
        assert len(lm.tokenizer.encode(PROMPTS[2])) + 24 > 8


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_fp32_compute_batched_rows_are_fp32_batched_rows(tiny_dir, cache):
    """fp32-compute (16-bit weights upcast per module) batches as fp32 does: each row invariant, and the same bits
    as the fp32 model's batched row (an exact upcast), on every architecture."""
    for arch in ARCHS:
        compute, fp32 = (load(str(tiny_dir(arch)), precision=p) for p in ("fp32-compute", "fp32"))
        together = _steps(compute, {0: 0, 1: 1, 2: 2}, cache=cache)
        assert _same(together[1], _steps(compute, {1: 3}, cache=cache)[1]), arch
        assert all(_same(together[k], _steps(fp32, {k: k}, cache=cache)[k]) for k in range(3)), arch


def test_under_portable_kernels_the_batched_step_is_the_batch_1_step(tiny_dir):
    """Portable bf16 kernels give a row the same bits at every row count, so each row must equal the batch-1
    step: the per-row attention, masks and sliding windows are then the batch-1 engine's own, on dynamic caches
    and on static ones (each row attending over its own preallocated length, masked)."""
    for arch in ARCHS:
        tiny_dir(arch)  # built here, read by the child
    root = Path(tiny_dir("qwen2")).parent
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_batch as t; "
            f"from stagereplay.engine.lm import load; "
            f"bad = [(a, c) for a in t.ARCHS for c in ('dynamic', 'static') if not all(t._same(t._steps(l, {{k: k}}, "
            f"cache=c)[k], t._batch1(l, k, cache=c)) for k in range(3) for l in [load({str(root)!r} + '/' + a, "
            f"precision='bf16')])]; print('differ:', bad)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **PORTABLE}, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "differ: []" in out.stdout, out.stdout


ROWS_ATTENTION = batch._rows_attention  # the batched step's own, kept before any test replaces it


def _padded_attention(module, query, key, value, attention_mask, **kwargs):
    """What a naive batch gets wrong: every row's K/V padded to the longest row's and attended in one call, the
    padding attended too (its mask forgotten). A row then weighs `longest - own` zero keys beside its own, so it
    moves with its longest batch-mate by value, on any kernel. (Padding masked out would move a row only through
    the kernel's blocking over the padded length, which on some CPUs and dtypes moves no bit.)"""
    step = batch._current[-1]
    layer = module.layer_idx
    kvs = step.kv[layer]
    longest = max(kv[0].shape[-2] for kv in kvs if kv is not None)
    keys, values, masks = [], [], []
    for i, (q, kv) in enumerate(zip(query, kvs, strict=True)):
        k, v = kv if kv is not None else (torch.zeros_like(q[None, :1].expand(1, key.shape[1], 1, -1)),) * 2
        own = step.masks[i][step.sliding[layer]] if kv is not None else None  # [1, 1, 1, T], or None: every key
        if own is None:
            own = torch.ones(k.shape[-2], dtype=torch.bool)
        else:  # a boolean mask, or an additive one (0 where a key is attended)
            own = own.reshape(-1) if own.dtype == torch.bool else own.reshape(-1) == 0
        pad = longest - k.shape[-2]
        keys.append(torch.nn.functional.pad(k, (0, 0, pad, 0)))
        values.append(torch.nn.functional.pad(v, (0, 0, pad, 0)))
        masks.append(torch.cat([torch.ones(pad, dtype=torch.bool), own]))
    mask = torch.stack(masks)[:, None, None, :]
    return step.attention(module)(module, query, torch.cat(keys), torch.cat(values), mask, **kwargs)


def _doubled_attention(module, query, key, value, attention_mask, **kwargs):
    """A batched step whose rows leave batch 1's bits but not each other's: each row's own attention (the batched
    step's), its output doubled. Row by row, so a row is the same bits whatever its batch-mates; other values than
    batch 1's, on any kernel."""
    out, weights = ROWS_ATTENTION(module, query, key, value, attention_mask, **kwargs)
    return out * 2, weights


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_negative_control_a_batch_padded_across_rows_is_not_invariant(tiny_dir, monkeypatch, cache):
    lm = load(str(tiny_dir("qwen2")), precision="fp32")
    monkeypatch.setattr(batch, "_rows_attention", _padded_attention)
    together = _steps(lm, {0: 0, 1: 1, 2: 2}, cache=cache)
    alone = _steps(lm, {2: 3}, cache=cache)
    assert not _same(together[2], alone[2])


def _payloads(run: Path) -> dict[str, str]:
    return {r["item_id"] + "/" + r["experiment"] + "/" + r["checkpoint"] + "/" + r["part"]:
            json.dumps(r["payload"], sort_keys=True)
            for r in map(json.loads, (run / "ledger.jsonl").read_text().splitlines()) if r["kind"] == "item"}


def _data(tmp_path: Path, items_file: Path, ids: list[int], name: str) -> Path:
    rows = (items_file.read_text().splitlines())
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(rows[i] + "\n" for i in ids))
    return path


MATCHED_CASES = [(arch, precision, "dynamic") for arch in ARCHS for precision in ("bf16", "fp32")] + [
    ("qwen2", "bf16", "static"), ("mistral-sw", "fp32", "static"), ("gemma2", "fp32", "static"),
    ("gemma3", "bf16", "static"), ("llama", "fp32-compute", "dynamic"), ("qwen3", "fp32-compute", "static")]


@pytest.mark.parametrize(("arch", "precision", "cache"), tiered(MATCHED_CASES, quick=(
    ("qwen2", "bf16", "dynamic"), ("qwen2", "bf16", "static"), ("mistral-sw", "fp32", "static"),
    ("gemma3", "bf16", "static"), ("llama", "fp32-compute", "dynamic"))))
def test_matched_records_are_the_same_bits_in_any_order_subset_or_alone(tiny_dir, items_file, tmp_path, arch,
                                                                         precision, cache):
    from stagereplay.engine.boundary import After
    from stagereplay.engine.decode import DecodeConfig
    from stagereplay.runs import Inputs, matched

    def run(ids: list[int], name: str) -> dict[str, str]:
        out = tmp_path / name
        matched(out, Inputs.of(model=str(tiny_dir(arch)), data=str(_data(tmp_path, items_file, ids, name)),
                            boundary=After(6), decode=DecodeConfig(max_new_tokens=12), precision=precision,
                            batch=ROWS, cache=cache), quiet=True)
        return _payloads(out)

    forward, backward, alone = run([0, 1, 2, 3, 4], "forward"), run([4, 3, 2, 1, 0], "backward"), run([3], "alone")
    assert forward == backward
    assert {k: v for k, v in forward.items() if k.startswith("q003/")} == alone


def _matched_at(rows: int, tiny_dir, data: Path, tmp_path: Path, precision: str, cache: str) -> tuple[dict, dict]:
    """matched at --batch `rows` on four items: each item record's payload, and the manifest."""
    from stagereplay.engine.boundary import After
    from stagereplay.engine.decode import DecodeConfig
    from stagereplay.execution.models import release_models
    from stagereplay.runs import Inputs, matched

    release_models()
    out = tmp_path / f"b{rows}"
    matched(out, Inputs.of(model=str(tiny_dir("qwen2")), data=str(data), boundary=After(6),
                        decode=DecodeConfig(max_new_tokens=12), precision=precision, batch=rows, cache=cache),
            quiet=True)
    return _payloads(out), json.loads((out / "manifest.json").read_text())


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_check_before_a_run_says_whether_batching_changes_any_bit(tiny_dir, items_file, tmp_path, precision,
                                                                      cache, caplog):
    """The answer said (logged) and recorded before a batched run predicts it: records equal to --batch 1's
    exactly when the check found the batched step equal to the batch-1 step on this model. Which answer a setting
    gets is the kernels' (fp32 on MKL has differed on the CPUs tried, bf16 on portable kernels has not; native
    bf16: either, by CPU); the test below plants the answer "differs" on any CPU."""
    import logging

    data = _data(tmp_path, items_file, [0, 1, 2, 3], "items")
    caplog.set_level(logging.INFO, logger="stagereplay")
    one, _ = _matched_at(1, tiny_dir, data, tmp_path, precision, cache)
    four, manifest = _matched_at(4, tiny_dir, data, tmp_path, precision, cache)
    check = manifest["environment"]["determinism"]["batch_check"]
    assert check["invariant"] and check["rows"] == 4
    assert "--batch 4: each row's bits are independent of its batch-mates" in caplog.text
    assert (one == four) == check["equals_batch_1"]


def test_the_check_says_when_batching_moves_bits_and_the_records_move(tiny_dir, items_file, tmp_path, monkeypatch,
                                                                       caplog):
    """Negative control of the answer "batching changes no bit", on any CPU: a batched step whose rows are the
    same bits whatever their batch-mates but not batch 1's (each row's attention doubled) runs, the check says it
    differs from batch 1, and the records do."""
    import logging

    data = _data(tmp_path, items_file, [0, 1, 2, 3], "items")
    caplog.set_level(logging.INFO, logger="stagereplay")
    monkeypatch.setattr(batch, "_rows_attention", _doubled_attention)
    try:
        one, _ = _matched_at(1, tiny_dir, data, tmp_path, "bf16", "dynamic")
        four, manifest = _matched_at(4, tiny_dir, data, tmp_path, "bf16", "dynamic")
    finally:
        from stagereplay.execution.models import release_models

        release_models()  # no later test gets a model loaded while the batched step was doubled
    check = manifest["environment"]["determinism"]["batch_check"]
    assert check["invariant"] and not check["equals_batch_1"]
    assert "but differ from --batch 1's here" in caplog.text
    assert one != four


def test_a_step_that_depends_on_its_batch_mates_is_refused_before_the_run(tiny_dir, items_file, tmp_path,
                                                                          monkeypatch):
    """Negative control of the check: with attention padded across rows, the check before the run sees a row
    move with its batch-mates, and the run is refused in one line before any run directory exists."""
    from stagereplay.engine.boundary import After
    from stagereplay.engine.decode import DecodeConfig
    from stagereplay.engine.proof import prove_batched
    from stagereplay.errors import StageReplayError
    from stagereplay.execution.models import release_models
    from stagereplay.runs import Inputs, matched

    monkeypatch.setattr(batch, "_rows_attention", _padded_attention)
    lm = load(str(tiny_dir("qwen2")), precision="fp32")
    prompts = [lm.tokenizer.encode(p) for p in PROMPTS]
    assert not prove_batched(lm.model, ROWS, "cpu", prompts).invariant
    release_models()
    with pytest.raises(StageReplayError, match="depend on its batch-mates"):
        matched(tmp_path / "out", Inputs.of(model=str(tiny_dir("qwen2")), data=str(items_file), n=3, boundary=After(6),
                                         decode=DecodeConfig(max_new_tokens=8), precision="fp32", batch=ROWS),
                quiet=True)
    assert not (tmp_path / "out").exists()
    release_models()


def _every_stage(out: Path, model: Path, data: Path, precision: str) -> dict[str, str]:
    """matched at --batch ROWS, then the bridge, transplants, the 2x2 (both precisions) and resample (both
    precisions), each stage following the run's recorded batch: every item record's payload."""
    from stagereplay.engine.boundary import After
    from stagereplay.engine.decode import DecodeConfig
    from stagereplay.experiments.protocol.resample import ResampleConfig
    from stagereplay.experiments.protocol.transplant import TransplantConfig
    from stagereplay.runs import BridgeOptions, Inputs, bridge, matched, precision_2x2, resample, transplant

    matched(out, Inputs.of(model=str(model), data=str(data), boundary=After(6), decode=DecodeConfig(max_new_tokens=10),
                        precision=precision, batch=ROWS), quiet=True)
    bridge(out, BridgeOptions(5), quiet=True)
    transplant(out, TransplantConfig(select="all-divergent"), quiet=True)
    precision_2x2(out, quiet=True)
    resample(out, ResampleConfig(k=2, n=5, precisions=("bf16", "fp32")), quiet=True)
    assert json.loads((out / "manifest.json").read_text())["stages"]["matched/primary"]["model"]["batch"] == ROWS
    return _payloads(out)


# Each architecture once, the run's own precision alternating (the 2x2 and resample stages run both anyway;
# matched alone runs every architecture at both, above).
STAGE_CASES = [("qwen2", "bf16"), ("llama", "fp32"), ("qwen3", "bf16"), ("mistral-sw", "fp32"), ("gemma2", "bf16"),
               ("gemma3", "fp32")]


@pytest.mark.parametrize(("arch", "precision"), [
    # qwen2 and a sliding-window model in the default tier, the other architectures in the slow tier (CI runs both)
    c if c[0] in ("qwen2", "mistral-sw") else pytest.param(*c, marks=pytest.mark.slow) for c in STAGE_CASES])
def test_every_stage_records_the_same_bits_in_any_order_subset_or_alone(tiny_dir, items_file, tmp_path, arch,
                                                                        precision):
    """Every item record of every stage of a --batch run is the same bytes whether the items ran in one order, the
    other, or one alone."""

    def run(ids: list[int], name: str) -> dict[str, str]:
        return _every_stage(tmp_path / name, tiny_dir(arch), _data(tmp_path, items_file, ids, name), precision)

    forward, backward, alone = run([0, 1, 2, 3, 4], "forward"), run([4, 3, 2, 1, 0], "backward"), run([3], "alone")
    assert {k.split("/")[1] for k in forward} >= {"matched", "bridge", "precision_2x2", "resample"}
    assert forward == backward
    assert {k: v for k, v in forward.items() if k.startswith("q003/")} == alone


def test_negative_control_records_of_a_batch_padded_across_rows_depend_on_the_batch(tiny_dir, items_file, tmp_path,
                                                                                    monkeypatch):
    """The comparison above, with attention padded across rows and the padding attended (`_padded_attention`) and
    the check before the run switched off (it would refuse the run): an item's records are other bytes with
    batch-mates than alone, or the run stops where a divergent step's batch-1 replay (the diagnostics) fails to
    reproduce the batched one."""
    from stagereplay.engine.lm import LM
    from stagereplay.execution.models import release_models

    def unchecked(lm: LM, prompts: object) -> None:
        lm.prover.batch_proof = SimpleNamespace(as_dict=lambda: {"skipped": True})  # what the environment records

    monkeypatch.setattr(batch, "_rows_attention", _padded_attention)
    monkeypatch.setattr(LM, "prove_batch", unchecked)

    def run(ids: list[int], name: str) -> dict[str, str]:
        return _every_stage(tmp_path / name, tiny_dir("qwen2"), _data(tmp_path, items_file, ids, name), "fp32")

    from stagereplay.errors import StageReplayError

    try:
        together, alone = run([0, 1, 2, 3, 4], "together"), run([3], "alone")
    except StageReplayError as exc:  # caught inside the run: a divergent step's batch-1 replay does not reproduce it
        assert "did not reproduce" in str(exc)
        return
    finally:
        release_models()  # no later test gets the unchecked model
    assert {k: v for k, v in together.items() if k.startswith("q003/")} != alone
