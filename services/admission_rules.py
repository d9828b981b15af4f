"""Admission's pure rules: request checks, the payload hash, and what output cap would fit.

No I/O here. Each check raises the domain error whose message tells the caller what to change;
the service (services/admission.py) runs them in order around its database work.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ledger.pricing import PriceCard, largest_output_cap_within_cost
from ledger.repositories import WindowEntry
from services.errors import (
    CONTEXT_ADVICE_LOWER_CAP,
    CONTEXT_ADVICE_SHORTEN_PROMPT,
    CONTEXT_TOO_LONG,
    DEADLINE_NEGATIVE,
    EMPTY_INPUT,
    INPUT_NOT_UTF8,
    OUTPUT_CAP_NOT_POSITIVE,
    REQUEST_KEY_MISSING,
    REQUEST_KEY_TOO_LONG,
    SAMPLING_OUT_OF_RANGE,
    InvalidArgument,
)

PAYLOAD_HASH_VERSION = b"sluice.submit.v1"

# Allowed sampling ranges; 0 means the engine default (greedy temperature, top_p off).
TEMPERATURE_RANGE = (0.0, 2.0)
TOP_P_RANGE = (0.0, 1.0)


@dataclass(frozen=True, slots=True)
class Sampling:
    temperature: float
    top_p: float
    seed: int

    def as_json(self) -> dict[str, float | int]:
        return {"temperature": self.temperature, "top_p": self.top_p, "seed": self.seed}


@dataclass(frozen=True, slots=True)
class SubmitIntent:
    """A Submit request as admission sees it, decoded from the wire but not yet checked."""

    model: str                       # alias or exact version, as the caller wrote it
    input: bytes                     # UTF-8 text, unchecked
    max_output_tokens: int
    request_key: str
    deadline_ms: int                 # 0 → the configured default
    sampling: Sampling
    conversation_id: str | None      # routing affinity hint


def normalize_float(value: float) -> float:
    """float32 wire values (0.7 → 0.699999988…) as the short decimal the caller meant."""
    return float(f"{value:.6g}")


def check_request_shape(intent: SubmitIntent, max_request_key_chars: int) -> str:
    """Checks that need no database; returns the decoded input text."""
    if not intent.request_key:
        raise InvalidArgument(REQUEST_KEY_MISSING.format(limit=max_request_key_chars))
    if len(intent.request_key) > max_request_key_chars:
        raise InvalidArgument(
            REQUEST_KEY_TOO_LONG.format(length=len(intent.request_key), limit=max_request_key_chars)
        )
    if intent.max_output_tokens <= 0:
        raise InvalidArgument(OUTPUT_CAP_NOT_POSITIVE.format(cap=intent.max_output_tokens))
    if intent.deadline_ms < 0:
        raise InvalidArgument(DEADLINE_NEGATIVE.format(deadline_ms=intent.deadline_ms))
    _check_range("temperature", intent.sampling.temperature, TEMPERATURE_RANGE)
    _check_range("top_p", intent.sampling.top_p, TOP_P_RANGE)
    if not intent.input:
        raise InvalidArgument(EMPTY_INPUT)
    try:
        return intent.input.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidArgument(INPUT_NOT_UTF8.format(position=error.start)) from None


def _check_range(name: str, value: float, bounds: tuple[float, float]) -> None:
    low, high = bounds
    if math.isnan(value) or not low <= value <= high:
        raise InvalidArgument(SAMPLING_OUT_OF_RANGE.format(name=name, low=low, high=high, value=value))


def check_context(model_version: str, context_limit: int, prompt_tokens: int, cap: int) -> None:
    if prompt_tokens + cap <= context_limit:
        return
    if prompt_tokens >= context_limit:
        advice = CONTEXT_ADVICE_SHORTEN_PROMPT.format(limit=context_limit)
    else:
        advice = CONTEXT_ADVICE_LOWER_CAP.format(fit=context_limit - prompt_tokens)
    raise InvalidArgument(
        CONTEXT_TOO_LONG.format(
            prompt=prompt_tokens, cap=cap, model=model_version, limit=context_limit, advice=advice
        )
    )


def payload_hash(model: str, text: bytes, max_output_tokens: int, sampling: Sampling) -> str:
    """sha256 over a canonical encoding of what the run will compute.

    `model` is the name the caller sent (alias or version), not the version it resolved to: a
    retry of the same request after an operator moves an alias must still find its original run
    (pinned to the version resolved the first time), not be refused as a different payload.

    Layout: version tag, NUL, sorted compact JSON of the scalar fields, NUL, the raw input bytes.
    The input goes last and unescaped so hashing a long prompt costs one pass over its bytes.
    """
    header = json.dumps(
        {"model": model, "max_output_tokens": max_output_tokens, "sampling": sampling.as_json()},
        sort_keys=True,
        separators=(",", ":"),
    ).encode("utf-8")
    digest = hashlib.sha256(PAYLOAD_HASH_VERSION)
    digest.update(b"\0")
    digest.update(header)
    digest.update(b"\0")
    digest.update(text)
    return digest.hexdigest()


def largest_cap_that_fits(model: PriceCard, prompt_tokens: int, tokens_left: int, cost_left_micros: int,
                          context_limit: int) -> int:
    """The largest max_output_tokens whose reservation fits both budgets and the context; <= 0: none.

    Seed 002: 10,000 tokens left, a 9,000-token prompt → at most 1,000.
    """
    fit = min(tokens_left - prompt_tokens, context_limit - prompt_tokens)
    by_cost = largest_output_cap_within_cost(model, prompt_tokens, cost_left_micros)
    return fit if by_cost is None else min(fit, by_cost)


def rate_window_retry_after(entries: Sequence[WindowEntry], limit: int, needed: int,
                            window: dt.timedelta) -> dt.timedelta:
    """How long until enough of the window's admissions age out for `needed` more tokens to fit.

    `entries` are oldest first; each leaves the window when its age reaches `window`. Requires
    needed <= limit (a request larger than the limit never fits; the caller says so instead).
    """
    assert needed <= limit, f"request of {needed} tokens can never fit a limit of {limit}"
    total = sum(entry.tokens for entry in entries)
    wait = dt.timedelta(0)
    for entry in entries:
        if total + needed <= limit:
            break
        total -= entry.tokens
        wait = window - entry.age
    return max(wait, dt.timedelta(0))
