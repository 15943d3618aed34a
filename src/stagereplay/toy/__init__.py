"""The embedded toy reasoning model: two checkpoints of one training run, shipped inside the package.

Each checkpoint directory loads with `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained`, the same path a user's local checkpoint takes. See README.md beside this
file for the model card, and `stagereplay.toy.train` for the recipe.
"""

from __future__ import annotations

from pathlib import Path

TOY_CHECKPOINTS = ("primary", "later")
"""`primary`: saved mid-run, while the model is still imperfect on purpose (55-90% accurate); `later`: the
final step of the same run."""


def toy_checkpoint(name: str = "primary") -> Path:
    """The packaged checkpoint directory called `name` (`primary` or `later`)."""
    if name not in TOY_CHECKPOINTS:
        raise ValueError(f"unknown toy checkpoint {name!r}: use one of {', '.join(TOY_CHECKPOINTS)}")
    return Path(__file__).resolve().parent / name
