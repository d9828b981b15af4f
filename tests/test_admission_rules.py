"""Admission's pure rules: the payload hash, request checks and the cap that fits (no servers)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from ledger.repositories import WindowEntry
from services import errors
from services.admission_rules import (
    Sampling,
    SubmitIntent,
    check_context,
    check_request_shape,
    largest_cap_that_fits,
    normalize_float,
    payload_hash,
    rate_window_retry_after,
)
from services.auth import api_key_from_metadata
from tests.support.ledger_factories import DEFAULT_MODEL

GREEDY = Sampling(temperature=0.0, top_p=0.0, seed=0)


def intent(**changes: object) -> SubmitIntent:
    fields: dict[str, object] = {
        "model": "chat", "input": b"hello", "max_output_tokens": 16, "request_key": "k",
        "deadline_ms": 0, "sampling": GREEDY, "conversation_id": None,
    }
    fields.update(changes)
    return SubmitIntent(**fields)  # type: ignore[arg-type]


def test_seed_002_ten_thousand_left_and_a_9000_token_prompt_fit_a_cap_of_1000():
    fit = largest_cap_that_fits(DEFAULT_MODEL, prompt_tokens=9_000, tokens_left=10_000,
                                cost_left_micros=10**12, context_limit=100_000)
    assert fit == 1_000


def test_the_cap_that_fits_is_also_bounded_by_the_context():
    assert largest_cap_that_fits(DEFAULT_MODEL, 4_000, 10**9, 10**12, context_limit=4_096) == 96


def test_the_payload_hash_is_stable_and_covers_model_input_cap_and_sampling():
    base = payload_hash("chat", b"hello", 16, GREEDY)
    assert base == payload_hash("chat", b"hello", 16, Sampling(0.0, 0.0, 0))
    others = {
        payload_hash("chat-v2", b"hello", 16, GREEDY),
        payload_hash("chat", b"hello!", 16, GREEDY),
        payload_hash("chat", b"hello", 17, GREEDY),
        payload_hash("chat", b"hello", 16, Sampling(0.5, 0.0, 0)),
        payload_hash("chat", b"hello", 16, Sampling(0.0, 0.9, 0)),
        payload_hash("chat", b"hello", 16, Sampling(0.0, 0.0, 7)),
    }
    assert base not in others and len(others) == 6


def test_float32_sampling_values_normalize_to_what_the_caller_wrote():
    import numpy as np

    assert normalize_float(float(np.float32(0.7))) == 0.7
    assert normalize_float(float(np.float32(0.95))) == 0.95


def test_request_checks_return_the_decoded_text():
    assert check_request_shape(intent(input="héllo".encode()), 128) == "héllo"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"request_key": ""}, errors.REQUEST_KEY_MISSING.format(limit=128)),
        ({"request_key": "x" * 129}, errors.REQUEST_KEY_TOO_LONG.format(length=129, limit=128)),
        ({"max_output_tokens": 0}, errors.OUTPUT_CAP_NOT_POSITIVE.format(cap=0)),
        ({"deadline_ms": -5}, errors.DEADLINE_NEGATIVE.format(deadline_ms=-5)),
        ({"input": b""}, errors.EMPTY_INPUT),
        ({"input": b"ok\xc3("}, errors.INPUT_NOT_UTF8.format(position=2)),
        (
            {"sampling": Sampling(float("nan"), 0.0, 0)},
            errors.SAMPLING_OUT_OF_RANGE.format(name="temperature", low=0.0, high=2.0, value=float("nan")),
        ),
        (
            {"sampling": Sampling(0.0, 1.5, 0)},
            errors.SAMPLING_OUT_OF_RANGE.format(name="top_p", low=0.0, high=1.0, value=1.5),
        ),
    ],
)
def test_malformed_requests_are_invalid_argument_with_what_to_change(changes, message):
    with pytest.raises(errors.InvalidArgument) as caught:
        check_request_shape(intent(**changes), 128)
    assert caught.value.message == message


def test_context_overflow_says_how_far_to_lower_the_cap():
    with pytest.raises(errors.InvalidArgument) as caught:
        check_context("tiny-chat-v1", 4_096, 4_000, 200)
    assert caught.value.message.endswith("lower max_output_tokens to at most 96")


@pytest.mark.parametrize(
    ("metadata", "key"),
    [
        ((("x-api-key", "sk-1"),), "sk-1"),
        ((("authorization", "Bearer sk-2"),), "sk-2"),
        ((("authorization", "bearer   sk-3 "),), "sk-3"),
        ((("user-agent", "x"), ("X-Api-Key", "sk-4")), "sk-4"),
    ],
)
def test_the_api_key_comes_from_either_header(metadata, key):
    assert api_key_from_metadata(metadata) == key


@pytest.mark.parametrize("metadata", [(), (("authorization", "Basic abc"),), (("x-api-key", "  "),)])
def test_no_usable_key_is_unauthenticated(metadata):
    with pytest.raises(errors.Unauthenticated) as caught:
        api_key_from_metadata(metadata)
    assert caught.value.message == errors.MISSING_API_KEY


def test_retry_after_waits_for_just_enough_of_the_oldest_admissions_to_age_out():
    window = timedelta(seconds=60)
    entries = [WindowEntry(timedelta(seconds=50), 300), WindowEntry(timedelta(seconds=20), 300),
               WindowEntry(timedelta(seconds=5), 300)]
    assert rate_window_retry_after(entries, limit=1_000, needed=100, window=window) == timedelta(0)
    assert rate_window_retry_after(entries, limit=1_000, needed=400, window=window) == timedelta(seconds=10)
    assert rate_window_retry_after(entries, limit=1_000, needed=700, window=window) == timedelta(seconds=40)
