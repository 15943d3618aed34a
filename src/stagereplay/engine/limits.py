"""How long a sequence may get: the model's context, the stage-1 and suffix budgets, length-dependent RoPE.

A reasoning trace runs to thousands of tokens, so the budgets are checked against the context before anything
runs, and a RoPE scaling whose frequencies change with the sequence length is recorded: past its original
context, a one-shot prefill and the live loop compute with different frequencies (an algorithmic difference,
not a rounding one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypedDict

from stagereplay.errors import StageReplayError

STAGE1_BUDGET = 8192
"""Default stage-1 budget for a user's model, when the context leaves that much."""

LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
"""RoPE types whose frequencies depend on the current sequence length (transformers' `dynamic_rope_update`)."""


def model_context(config: Any) -> int:
    """Positions the model was built for (unbounded when its config does not say)."""
    return int(getattr(config.get_text_config(), "max_position_embeddings", None) or 1 << 30)


def stage1_budget(context: int, longest_prompt: int, max_new_tokens: int, cap: int = STAGE1_BUDGET) -> int:
    """The default stage-1 budget: `cap`, or what the context leaves after prompt and suffix."""
    return min(cap, context - longest_prompt - max_new_tokens)


def static_cache_len(prompt_len: int, max_stage1_tokens: int | None, max_new_tokens: int, context: int) -> int:
    """The positions a static cache is allocated for, for an item of `prompt_len` prompt tokens: what
    generate(cache_implementation="static", max_new_tokens=budget + max_new_tokens) allocates, prompt + stage-1
    budget + max_new_tokens - 1 (the last token emitted is never fed back); the budget is `max_stage1_tokens`,
    else the default for this prompt (`stage1_budget`)."""
    budget = max_stage1_tokens or stage1_budget(context, prompt_len, max_new_tokens)
    return prompt_len + budget + max_new_tokens - 1


def check_budgets(longest_prompt: int, stage1: int | None, max_new_tokens: int, context: int,
                  cap: int = STAGE1_BUDGET, where: str = "the model's context") -> int:
    """The stage-1 budget to use: the one given if prompt + stage 1 + suffix fit the context, else the default
    (`cap`, or less where the context leaves less). `where` names the context in errors (a serving engine's
    context can be smaller than the model's).

    Raises a one-line error when the given budget does not fit, or when the default leaves no room.
    """
    if stage1 is not None:
        total = longest_prompt + stage1 + max_new_tokens
        if total > context:
            raise StageReplayError(
                f"longest prompt {longest_prompt} + stage-1 budget {stage1} + suffix budget {max_new_tokens} = "
                f"{total} tokens exceed {where} of {context}",
                "lower --max-stage1-tokens or --max-new-tokens",
            )
        return stage1
    budget = stage1_budget(context, longest_prompt, max_new_tokens, cap)
    if budget < 1:
        raise StageReplayError(
            f"longest prompt {longest_prompt} + suffix budget {max_new_tokens} leave no stage-1 tokens in "
            f"{where} of {context}",
            "lower --max-new-tokens or shorten the prompts",
        )
    return budget


class RecordedRope(TypedDict):
    """A `Rope` as the manifest records it, with whether the run's longest sequence may move its frequencies."""

    type: str
    original_context: int | None
    length_dependent: bool
    may_change: bool


@dataclass(frozen=True)
class Rope:
    """The config's RoPE scaling, as the manifest records it."""

    type: str
    original_context: int | None  # positions the frequencies were trained for, where the type has one
    length_dependent: bool

    def may_change(self, longest: int) -> bool:
        """Whether a sequence of `longest` positions can move a length-dependent RoPE off its trained frequencies."""
        return self.length_dependent and self.original_context is not None and longest > self.original_context

    def as_dict(self, longest: int) -> RecordedRope:
        return {"type": self.type, "original_context": self.original_context,
                "length_dependent": self.length_dependent, "may_change": self.may_change(longest)}


def rope_scaling(config: Any) -> Rope:
    """The RoPE type and original context from `rope_parameters` (transformers 5) or `rope_scaling`.

    Per-layer-type parameters (Gemma 3: sliding and full layers) count as length-dependent if any is.
    """
    text = config.get_text_config()
    params = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    groups = [params] if "rope_type" in params or "type" in params else [p for p in params.values()
                                                                          if isinstance(p, dict)]
    if not groups:
        return Rope("none", None, False)
    types = [str(g.get("rope_type") or g.get("type") or "default") for g in groups]
    dependent = [t for t in types if t in LENGTH_DEPENDENT_ROPE]
    chosen = dependent[0] if dependent else types[0]
    original = next((g.get("original_max_position_embeddings") for g in groups
                     if g.get("original_max_position_embeddings")), None)
    if original is None and dependent:
        # dynamic NTK scales only past the configured context (transformers' `original_max_seq_len`).
        original = getattr(text, "original_max_position_embeddings", None) or getattr(
            text, "max_position_embeddings", None)
    return Rope(chosen, int(original) if original else None, bool(dependent))
