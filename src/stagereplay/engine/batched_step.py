"""Batched single-token steps whose rows are batch-invariant by construction: many items per forward, each
item's bits independent of what else is in the batch.

A row's result may depend on its batch-mates through the kernels: an fp32 linear on MKL gives a row other bits
at 1 row than at 2, and attention over a padded batch sums a row's keys in an order set by the longest row. So
a batched step here is built from two kinds of operation only:

- row-wise operations (embedding, norms, the projections and MLP, the head) over exactly `rows` rows, idle
  rows padded: at a fixed row count a row's bits depend on its own values only, not on its slot or on the
  other rows' values (`batch_check` checks this on the model's own shapes before a run uses it);
- attention per item: each row's new K/V go into that item's own cache (`cache.update`, as at batch 1), and
  each row's attention runs alone, at batch 1, over its own cache's K/V, with the mask a batch-1 forward makes
  for it: the very attention call the batch-1 engine makes.

So an item's step is the same bits whatever else is in its batch, in whatever slot, and when it runs alone
(at the same row count). Whether those bits also equal batch 1's depends on the kernels (bf16 on the portable
kernels: yes, at every row count tried; fp32 on MKL: no); `batch_check` says which, and a run records it.

    step = BatchedStep(model, rows=16, device="cpu")
    logits = step.forward([(token, cache, past), None, ...])   # one entry per slot; None = idle; [V] per row

The decoder runs as transformers wrote it, at [rows, 1] tokens with [rows, 1] positions (RoPE is per position):
its projections batched, and two seams split the rows. The cache it is given (`_RowCaches`) passes each row's
K/V to that row's cache; the attention implementation it is told to use (`ROWS`, registered with transformers'
AttentionInterface for the duration of the forward) calls the model's own attention once per row over what that
row's cache returned. transformers makes no mask for an implementation it does not know, so the masks are made
per row beforehand (`_row_masks`), under the model's own implementation, from each row's cache as a batch-1
forward makes them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from stagereplay.errors import StageReplayError

if TYPE_CHECKING:
    import torch

Row = tuple[int, Any, int]  # (token, the item's cache, positions the cache holds)


def attention_modules(model: Any) -> list[Any]:
    """Each decoder layer's self-attention module, in layer order."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    return [layer.self_attn for layer in base.layers]


def check_batchable(model: Any) -> None:
    """Refuse, in one line, a model whose masks this module cannot make per row."""
    config = model.config.get_text_config()
    if getattr(config, "use_bidirectional_attention", False):
        raise StageReplayError("--batch needs causal attention; this model attends bidirectionally",
                               "run it with --batch 1")
    try:
        attention_modules(model)
    except AttributeError:
        raise StageReplayError(f"--batch cannot find the decoder layers of {type(model).__name__}",
                               "run it with --batch 1") from None


ROWS = "stagereplay_rows"
"""The attention implementation name under which a batched forward runs (engine.batch.BatchedStep)."""

_current: list[BatchedStep] = []  # the step whose forward is running (one at a time: the batcher's lock)


class _RowCaches:
    """The cache a batched forward is given: each row's new K/V [1, H_kv, 1, D] go to that row's own cache."""

    def __init__(self, step: BatchedStep) -> None:
        self.step = step

    def update(self, keys: Any, values: Any, layer_idx: int, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        kv = []
        for i, cache in enumerate(self.step.caches):
            kv.append(None if cache is None else cache.update(keys[i : i + 1], values[i : i + 1], layer_idx,
                                                              *args, **kwargs))
        self.step.kv[layer_idx] = kv
        return keys, values  # not read: the row attention reads each row's own K/V


def _rows_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any
                    ) -> tuple[Any, None]:
    """The model's own attention once per active row, over that row's K/V, with its own mask. [C, 1, H, D]"""
    import torch

    step = _current[-1]
    layer = module.layer_idx
    attend = step.attention(module)
    rows: list[torch.Tensor | None] = []
    for i, kv in enumerate(step.kv[layer]):
        if kv is None:
            rows.append(None)
            continue
        masks = step.masks[i]
        assert masks is not None
        out, _ = attend(module, query[i : i + 1], kv[0], kv[1], masks[step.sliding[layer]], **kwargs)
        rows.append(out)
    like = next(r for r in rows if r is not None)
    zeros = torch.zeros_like(like)
    return torch.cat([zeros if r is None else r for r in rows]), None


class BatchedStep:
    """One forward over `rows` slots, each an item's single-token step on its own cache (module docstring)."""

    def __init__(self, model: Any, rows: int, device: str) -> None:
        import inspect

        check_batchable(model)
        self.model = model
        self.rows = rows
        self.device = device
        self.config = model.config.get_text_config()
        self.modules = attention_modules(model)
        # Mistral and Llama-style modules carry no window of their own: their model gives every layer the
        # config's (Mistral) or none (Llama). Qwen2/3 and Gemma 2/3 say per layer.
        window = getattr(self.config, "sliding_window", None)
        self.sliding = [getattr(m, "sliding_window", window) is not None for m in self.modules]
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "past_key_values" if "past_key_values" in params and "cache" not in params else "cache"
        self.caches: list[Any] = []
        self.masks: list[dict[bool, Any] | None] = []
        self.kv: dict[int, list[Any]] = {}

    def attention(self, module: Any) -> Any:
        """The attention function a batch-1 forward of `module` calls: the registered one for the model's
        implementation, or the module's own eager one."""
        import sys

        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        eager = sys.modules[type(module).__module__].eager_attention_forward
        return ALL_ATTENTION_FUNCTIONS.get_interface(self.implementation, eager)

    def forward(self, rows: Sequence[Row | None]) -> list[torch.Tensor | None]:
        """The logits [V] of each active slot's step (None for an idle slot); grows each active row's cache."""
        import torch

        if len(rows) != self.rows:
            raise ValueError(f"{len(rows)} slots for a step of {self.rows} rows")
        if not any(r is not None for r in rows):
            return [None] * self.rows
        with torch.inference_mode():
            # The tokens and positions [2, C, 1] come from the host in one copy that the host does not wait for: a
            # copy from pageable memory (`torch.tensor(..., device=cuda)`) would wait for the device, as a read does.
            host = torch.tensor([[[r[0] if r else 0] for r in rows], [[r[2] if r else 0] for r in rows]],
                                dtype=torch.long)
            if torch.device(self.device).type == "cuda":
                host = host.pin_memory()  # the caching host allocator keeps it until the copy is done
            ids, positions = host.to(self.device, non_blocking=True)  # [C, 1] each
            self.caches = [r[1] if r else None for r in rows]
            self.masks = [self._row_masks(r[1], positions[i : i + 1]) if r else None for i, r in enumerate(rows)]
            with self._as_rows():
                out = self.model(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1,
                                 **{self.cache_kw: _RowCaches(self)})
            logits = out.logits[:, -1]  # [C, V]
            self.caches, self.masks, self.kv = [], [], {}
            # A copy per row: the caller keeps some steps' logits, which must not hold the whole [C, V] tensor.
            return [logits[i].clone() if r is not None else None for i, r in enumerate(rows)]

    def _row_masks(self, cache: Any, positions: torch.Tensor) -> dict[bool, Any]:
        """The masks a batch-1 forward of this row makes (full, and sliding when a layer slides), from the row's
        cache before the step, as the model makes them before its first layer."""
        import torch
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        embeds = torch.empty((1, 1, 1), dtype=self.model.dtype, device=self.device)  # read for dtype and device
        kwargs = {"config": self.config, "inputs_embeds": embeds, "attention_mask": None,
                  _cache_keyword(create_causal_mask): cache, "position_ids": positions}
        masks: dict[bool, Any] = {}
        if not all(self.sliding):
            masks[False] = create_causal_mask(**kwargs)
        if any(self.sliding):
            masks[True] = create_sliding_window_causal_mask(**kwargs)
        return masks

    @contextmanager
    def _as_rows(self) -> Iterator[None]:
        """Within: the model runs under the `ROWS` attention implementation, with this step's rows."""
        from transformers import AttentionInterface

        AttentionInterface.register(ROWS, _rows_attention)
        configs = {id(c): c for c in (self.model.config, self.config)}.values()
        self.implementation = self.config._attn_implementation
        _current.append(self)
        for c in configs:
            c._attn_implementation = ROWS
        try:
            yield
        finally:
            for c in configs:
                c._attn_implementation = self.implementation
            _current.pop()


def _cache_keyword(make_mask: Any) -> str:
    """What transformers' mask functions call the cache: `past_key_values` until 5.2x, then `cache` (the old name
    kept as a deprecated keyword for a while)."""
    import inspect

    parameters = inspect.signature(make_mask).parameters
    cache = parameters.get("cache")
    return "cache" if cache is not None and cache.kind is not inspect.Parameter.KEYWORD_ONLY else "past_key_values"
