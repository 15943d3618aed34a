"""What each field of a rollout file's row may hold, checked as the row is read (`tasks.rollouts`), and the words a
refusal uses for the file (`FileKind`: a rollout file for `mismatch --rollouts`, a file of served outputs for
`attest --served`).

    prompt_ids, response_ids   non-empty lists of integer token IDs of the tokenizer (a bool, a float such as 17.0,
                               a string or a null is not a token ID)
    logprobs                   one finite log-probability (<= 0) per response token, in order
    id                         a string or an integer, unique in the file (absent: the row's place)
    temperature                finite and >= 0 (0: greedy)
    top_p                      in (0, 1]
    top_k                      an integer >= 0 (0: off; vLLM's -1, off, is read as 0)
    seed                       an integer in 0..2**64 - 1, the span of a request's generator

A number that stands for an integer (top_k, seed) may be written as a float without a fraction, as a data frame
writes an integer column holding a null, where the float holds it exactly. Every refusal is one line naming the
file, the row and the field, and the fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from stagereplay.errors import StageReplayError

FIELDS = ("prompt_ids", "response_ids", "logprobs", "id")
"""A row's response and where it comes from."""
SAMPLING = ("temperature", "top_p", "top_k", "seed")
"""Sampling settings a row may carry (its own where given, the run's where absent)."""
COLUMNS = (*FIELDS, *SAMPLING)
"""What `--columns` maps for such a file (each defaults to its own name)."""
POSITIVE_SLACK = 1e-4
"""A log-probability above 0 by at most this is rounding (an engine's fp32 log_softmax of a near-certain token)."""
SEED_SPAN = 1 << 64
"""A seed is below this: what a request's generator (torch's, vLLM's) is seeded with."""
EXACT_FLOAT = 1 << 53
"""The integers a float holds exactly: a float past this is not the integer it was written from."""
SHOWN = 40
"""How many characters of a bad value a refusal shows."""


@dataclass(frozen=True)
class FileKind:
    """What a command calls such a file and its rows (its refusals speak its words), and whether a row must give its
    log-probabilities."""

    name: str
    """The file, as its command calls it ("rollout file")."""
    rows: str
    """Its rows, plural ("rollouts")."""
    option: str
    """The option that names the file ("--rollouts")."""
    logprobs: bool
    """Whether every row must give the log-probability of each response token."""


ROLLOUTS = FileKind("rollout file", "rollouts", "--rollouts", logprobs=True)
"""`mismatch --rollouts`: rollouts as RL frameworks dump them."""
SERVED = FileKind("file of served outputs", "served outputs", "--served", logprobs=False)
"""`attest --served`: what a server returned, its log-probabilities optional."""


def shown(value: Any) -> str:
    """`value` as a refusal shows it: its repr, cut at `SHOWN` characters, and what it is where that is the fault."""
    try:
        text = repr(value)
    except ValueError:  # an int past the digits Python prints
        return f"an integer of {value.bit_length()} bits"
    text = text if len(text) <= SHOWN else text[: SHOWN - 3] + "..."
    what = {bool: "a bool", float: "a float", str: "a string", type(None): "null", list: "a list", dict: "an object"}
    return f"{text} ({what[type(value)]})" if type(value) in what else text


def _integral(value: Any) -> int | None:
    """`value` as an integer: an int (not a bool), or a float without a fraction that holds it exactly; else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer() and abs(value) <= EXACT_FLOAT:
        return int(value)
    return None


def _number(value: Any) -> float | None:
    """`value` as a finite float (an int or a float, not a bool); else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        out = float(value)
    except OverflowError:  # an int past a float's range
        return None
    return out if math.isfinite(out) else None


def token_ids(value: Any, name: str, where: str, vocab: int, kind: FileKind) -> tuple[int, ...]:
    """A non-empty list of integer token IDs in 0..vocab-1."""
    if not isinstance(value, (list, tuple)) or not value:
        raise StageReplayError(f"{where}: {name} is not a non-empty list of token IDs (it is {shown(value)})",
                               f"give every row its {name} as a list of integers")
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int):
            raise StageReplayError(f"{where}: {name}[{i}] is {shown(t)}: token IDs must be integers",
                                   "write each token ID as an integer (17, not 17.0, \"17\" or true)")
        if not 0 <= t < vocab:
            raise StageReplayError(f"{where}: {name}[{i}] is {shown(t)}, not a token ID of this tokenizer "
                                   f"(0..{vocab - 1})", f"check the {kind.rows} against the model whose tokenizer "
                                                        "made them")
    return tuple(value)


def logprobs(value: Any, n: int, where: str, kind: FileKind) -> tuple[float, ...]:
    """One finite log-probability (at most 0, up to `POSITIVE_SLACK`) per response token."""
    if not isinstance(value, (list, tuple)):
        raise StageReplayError(f"{where}: logprobs is {shown(value)}, not a list of log-probabilities",
                               "give the log-probability of every response token (vLLM: SamplingParams(logprobs=0))"
                               + ("" if kind.logprobs else ", or leave the field out"))
    if len(value) != n:
        raise StageReplayError(f"{where}: {len(value)} logprobs for {n} response tokens",
                               "give one log-probability per response token, in order")
    for i, v in enumerate(value):
        number = _number(v)
        if number is None or number > POSITIVE_SLACK:
            raise StageReplayError(f"{where}: logprobs[{i}] is {shown(v)}, not a finite log-probability (<= 0)",
                                   "give the log-probability of the sampled token itself (finite, at most 0)")
    return tuple(float(v) for v in value)


def row_id(value: Any, where: str) -> str | None:
    """A row's id: a non-empty string or an integer (None where the row gives none)."""
    if value is None:
        return None
    if isinstance(value, str) and value:
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise StageReplayError(f"{where}: id is {shown(value)}, not a string or an integer",
                           "give each row a unique id (a non-empty string or an integer), or none")


def sampling(raw: dict[str, Any], fields: dict[str, str], where: str) -> dict[str, float | int]:
    """The sampling settings a row gives (module docstring), each checked; absent or null ones left out."""
    out: dict[str, float | int] = {}
    for key in SAMPLING:
        value = raw.get(fields[key])
        if value is None:
            continue
        if key == "temperature":
            number = _number(value)
            if number is None or number < 0:
                raise StageReplayError(f"{where}: temperature is {shown(value)}, not a finite number >= 0",
                                       "give the temperature the row was sampled at (0: greedy), or leave it out")
            out[key] = number
        elif key == "top_p":
            number = _number(value)
            if number is None or not 0 < number <= 1:
                raise StageReplayError(f"{where}: top_p is {shown(value)}, not a number in (0, 1]",
                                       "give the top-p the row was sampled with (1: off), or leave it out")
            out[key] = number
        elif key == "top_k":
            whole = _integral(value)
            if whole is None or whole < -1:
                raise StageReplayError(f"{where}: top_k is {shown(value)}, not an integer >= 0",
                                       "give the top-k the row was sampled with (0: off), or leave it out")
            out[key] = max(whole, 0)  # vLLM's -1 is off, as 0 is
        else:
            whole = _integral(value)
            if whole is None or not 0 <= whole < SEED_SPAN:
                raise StageReplayError(f"{where}: seed is {shown(value)}, not an integer in 0..{SEED_SPAN - 1}",
                                       "give the request's seed as an integer, or leave it out")
            out[key] = whole
    return out
