"""Per-token arrays as a record holds them: little-endian bytes in base64 text, with the dtype as a prefix.

    f32:<base64>   fp32 log-probabilities, bit for bit (a float printed as decimal JSON round-trips too, but at
                   twice the size, and a bitwise comparison wants the bits it was given)
    i32:<base64>   token IDs

A response of 4,096 tokens holds 16 KiB of log-probabilities per arm, 22 KiB as text.
"""

from __future__ import annotations

import base64
import hashlib

import numpy as np

KINDS = {"f32": "<f4", "i32": "<i4"}


def encode(values: np.ndarray, kind: str) -> str:
    """`values` as `<kind>:<base64 of its little-endian bytes>`."""
    return f"{kind}:{base64.b64encode(np.ascontiguousarray(values, dtype=KINDS[kind]).tobytes()).decode()}"


def decode(text: str) -> np.ndarray:
    """The array `encode` wrote; a ValueError names what is wrong with a text that is not one."""
    kind, sep, body = text.partition(":")
    if not sep or kind not in KINDS:
        raise ValueError(f"not an encoded array (a prefix {', '.join(KINDS)} then ':'): {text[:16]!r}")
    return np.frombuffer(base64.b64decode(body, validate=True), dtype=KINDS[kind]).copy()


def fingerprint(text: str) -> str:
    """sha256 of the encoded array's bytes (the dtype is in the text's prefix)."""
    return hashlib.sha256(text.encode()).hexdigest()
