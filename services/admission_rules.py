"""Admission's pure rules: request checks, the payload hash, and what output cap would fit.

No I/O here. Each check raises the domain error whose message tells the caller what to change;
the service (services/admission.py) runs them in order around its database work.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sluice.ledger.pricing import PriceCard, largest_output_cap_within_cost
from sluice.ledger.repositories import WindowEntry
from sluice.services.errors import (
    CONTEXT_ADVICE_LOWER_CAP,
    CONTEXT_ADVICE_SHORTEN_PROMPT,
    CONTEXT_TOO_LONG,
    DEADLINE_ADVICE_RAISE,
    DEADLINE_ADVICE_RAISE_OR_LOWER_CAP,
    DEADLINE_CANNOT_BE_MET,
    DEADLINE_NEGATIVE,
    EMPTY_INPUT,
    FIELD_ABOVE_RANGE,
    FIELD_HAS_NUL,
    INPUT_NOT_UTF8,
    MAX_OUTPUT_TOKENS_THAT_FIT_KEY,
    MIN_DEADLINE_MS_KEY,
    OUTPUT_CAP_NOT_POSITIVE,
    REQUEST_KEY_MISSING,
    REQUEST_KEY_TOO_LONG,
    SAMPLING_OUT_OF_RANGE,
    DeadlineExceeded,
    InvalidArgument,
)

from sluice.traffic.fallback import NO_NARROWING, Narrowing
from sluice.traffic.priority import Priority

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

    @classmethod
    def from_json(cls, stored: Mapping[str, Any]) -> Sampling:
        """What as_json stored in runs.sampling (missing keys: the engine default, 0)."""
        return cls(float(stored.get("temperature", 0.0)), float(stored.get("top_p", 0.0)),
                   int(stored.get("seed", 0)))


ENGINE_DEFAULT = Sampling(0.0, 0.0, 0)   # greedy, no nucleus cut, the replica's own seed


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
    # The input is already the model's whole prompt (the HTTP edge rendered chat messages with the
    # registry's template): admission must not wrap it in a chat turn again.
    rendered: bool = False
    # What the request says about fallback: it can only narrow the tenant's permission.
    fallback: Narrowing = NO_NARROWING
    # interactive (default) or batch (sluice/traffic/priority.py); not part of the payload hash: it
    # changes when the run is scheduled, not what it computes.
    priority: Priority = Priority.INTERACTIVE


def normalize_float(value: float) -> float:
    """float32 wire values (0.7 → 0.699999988…) as the short decimal the caller meant."""
    return float(f"{value:.6g}")


def check_storable(intent: SubmitIntent, max_deadline_ms: int) -> None:
    """What every door must refuse before a query sees the request: a NUL in a text field (PostgreSQL
    text cannot hold one) and a deadline past the configured bound (it would overflow a timestamp)."""
    for name, value in (("model", intent.model), ("request_key", intent.request_key),
                        ("conversation_id", intent.conversation_id or "")):
        position = value.find("\x00")
        if position >= 0:
            raise InvalidArgument(FIELD_HAS_NUL.format(field=name, position=position), field=name)
    if intent.deadline_ms > max_deadline_ms:
        raise InvalidArgument(FIELD_ABOVE_RANGE.format(field="deadline_ms", high=max_deadline_ms,
                                                       value=intent.deadline_ms), field="deadline_ms")


def check_request_shape(intent: SubmitIntent, max_request_key_chars: int) -> str:
    """Checks that need no database; returns the decoded input text."""
    if not intent.request_key:
        raise InvalidArgument(REQUEST_KEY_MISSING.format(limit=max_request_key_chars), field="request_key")
    if len(intent.request_key) > max_request_key_chars:
        raise InvalidArgument(
            REQUEST_KEY_TOO_LONG.format(length=len(intent.request_key), limit=max_request_key_chars),
            field="request_key",
        )
    if intent.max_output_tokens <= 0:
        raise InvalidArgument(OUTPUT_CAP_NOT_POSITIVE.format(cap=intent.max_output_tokens),
                              field="max_output_tokens")
    if intent.deadline_ms < 0:
        raise InvalidArgument(DEADLINE_NEGATIVE.format(deadline_ms=intent.deadline_ms), field="deadline_ms")
    _check_range("temperature", intent.sampling.temperature, TEMPERATURE_RANGE)
    _check_range("top_p", intent.sampling.top_p, TOP_P_RANGE)
    if not intent.input:
        raise InvalidArgument(EMPTY_INPUT, field="input")
    try:
        return intent.input.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidArgument(INPUT_NOT_UTF8.format(position=error.start), field="input") from None


def _check_range(name: str, value: float, bounds: tuple[float, float]) -> None:
    low, high = bounds
    if math.isnan(value) or not low <= value <= high:
        raise InvalidArgument(SAMPLING_OUT_OF_RANGE.format(name=name, low=low, high=high, value=value),
                              field=f"sampling.{name}")


def limit_advice(limit: int, prompt_tokens: int) -> str:
    """What to change when prompt + output cap exceeds `limit` (a context or a tokens-per-minute
    limit): the cap, if the prompt alone fits, else the prompt."""
    if prompt_tokens < limit:
        return CONTEXT_ADVICE_LOWER_CAP.format(fit=limit - prompt_tokens)
    return CONTEXT_ADVICE_SHORTEN_PROMPT.format(limit=limit)


def check_context(model_version: str, context_limit: int, prompt_tokens: int, cap: int) -> None:
    if prompt_tokens + cap <= context_limit:
        return
    raise InvalidArgument(
        CONTEXT_TOO_LONG.format(
            prompt=prompt_tokens, cap=cap, model=model_version, limit=context_limit,
            advice=limit_advice(context_limit, prompt_tokens),
        ),
        field="max_output_tokens",
    )


def payload_hash(model: str, text: bytes, max_output_tokens: int, sampling: Sampling,
                 rendered: bool = False) -> str:
    """sha256 over a canonical encoding of what the run will compute.

    `model` is the name the caller sent (alias or version), not the version it resolved to: a
    retry of the same request after an operator moves an alias must still find its original run
    (pinned to the version resolved the first time), not be refused as a different payload.

    Layout: version tag, NUL, sorted compact JSON of the scalar fields, NUL, the raw input bytes.
    The input goes last and unescaped so hashing a long prompt costs one pass over its bytes.
    `rendered` enters the JSON only when set, so every hash made before it existed still matches.
    """
    fields: dict[str, object] = {"model": model, "max_output_tokens": max_output_tokens,
                                 "sampling": sampling.as_json()}
    if rendered:
        fields["rendered"] = True
    header = json.dumps(
        fields,
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


# --- load shedding and deadline feasibility -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class PoolPace:
    """What admission assumes about a worker pool's speed ([admission] in config/sluice.toml).

    Deliberately optimistic (a fast drain, a batch-1 token time): the deadline floor built from it
    is a LOWER bound on how long a run takes, so it refuses only runs that certainly cannot finish
    in time, never one that merely might not.
    """

    max_backlog: int                 # ACCEPTED runs a model may have waiting before submits are shed
    drain_runs_per_s: float          # how fast the pool's routing workers claim waiting runs
    ms_per_prompt_token: float       # prefill time per prompt token
    ms_per_output_token: float       # decode time per output token of one run

    def __post_init__(self) -> None:
        if self.max_backlog < 1:
            raise ValueError(f"[admission].max_backlog_per_pool must be at least 1 (got {self.max_backlog})")
        if not self.drain_runs_per_s > 0:
            raise ValueError(
                f"[admission].pool_drain_runs_per_s must be positive (got {self.drain_runs_per_s})")
        if not (self.ms_per_prompt_token >= 0 and self.ms_per_output_token >= 0):
            raise ValueError("[admission].expected_ms_per_*_token must be 0 or positive")

    def queue_wait_ms(self, backlog: int) -> int:
        """How long the runs waiting now take to leave the queue, in whole ms (rounded up)."""
        return math.ceil(backlog * 1000 / self.drain_runs_per_s)


@dataclass(frozen=True, slots=True)
class DeadlineFloor:
    """The least time a run can take, in whole ms: each part rounded up, the total their sum."""

    queue_ms: int                    # the runs waiting ahead of it
    prefill_ms: int                  # its prompt
    decode_ms: int                   # its whole output cap

    @property
    def total_ms(self) -> int:
        return self.queue_ms + self.prefill_ms + self.decode_ms


def deadline_floor(backlog: int, prompt_tokens: int, cap: int, pace: PoolPace) -> DeadlineFloor:
    return DeadlineFloor(
        queue_ms=pace.queue_wait_ms(backlog),
        prefill_ms=math.ceil(prompt_tokens * pace.ms_per_prompt_token),
        decode_ms=math.ceil(cap * pace.ms_per_output_token),
    )


def largest_waiting_within(deadline_ms: int, prompt_tokens: int, cap: int, pace: PoolPace) -> int:
    """The most runs that may wait ahead of this one for check_deadline still to pass (the floor's
    queue wait grows with them); -1 when it fails with none waiting."""
    floor = deadline_floor(0, prompt_tokens, cap, pace)
    room_ms = deadline_ms - floor.prefill_ms - floor.decode_ms
    if room_ms < 0:
        return -1
    waiting = math.floor(room_ms * pace.drain_runs_per_s / 1000)
    while pace.queue_wait_ms(waiting + 1) <= room_ms:      # float rounding at the edge, either way
        waiting += 1
    while waiting > 0 and pace.queue_wait_ms(waiting) > room_ms:
        waiting -= 1
    return waiting


def largest_cap_within(time_left_ms: int, ms_per_output_token: float) -> int:
    """The largest output cap whose decode time (rounded up) fits `time_left_ms`; <= 0: none."""
    if time_left_ms <= 0:
        return 0
    fit = math.floor(time_left_ms / ms_per_output_token)
    while fit > 0 and math.ceil(fit * ms_per_output_token) > time_left_ms:  # float rounding at the edge
        fit -= 1
    return fit


def check_deadline(deadline_ms: int, backlog: int, prompt_tokens: int, cap: int, pace: PoolPace) -> None:
    """DEADLINE_EXCEEDED when the run cannot finish by its deadline even at the pool's best pace.

    The message gives the deadline that would do (and the cap that would fit this deadline, when
    a smaller cap can); both ride in trailing metadata too.
    """
    floor = deadline_floor(backlog, prompt_tokens, cap, pace)
    if deadline_ms >= floor.total_ms:
        return
    hints = [(MIN_DEADLINE_MS_KEY, str(floor.total_ms))]
    fit = 0
    if pace.ms_per_output_token > 0:
        fit = largest_cap_within(deadline_ms - floor.queue_ms - floor.prefill_ms, pace.ms_per_output_token)
    if fit > 0:
        advice = DEADLINE_ADVICE_RAISE_OR_LOWER_CAP.format(floor_ms=floor.total_ms, fit=fit)
        hints.append((MAX_OUTPUT_TOKENS_THAT_FIT_KEY, str(fit)))
    else:
        advice = DEADLINE_ADVICE_RAISE.format(floor_ms=floor.total_ms)
    raise DeadlineExceeded(
        DEADLINE_CANNOT_BE_MET.format(
            deadline_ms=deadline_ms, queue_ms=floor.queue_ms, prompt=prompt_tokens,
            prefill_ms=floor.prefill_ms, cap=cap, decode_ms=floor.decode_ms, floor_ms=floor.total_ms,
            advice=advice,
        ),
        metadata=hints,
    )
