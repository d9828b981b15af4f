"""Admission's pure rules: the payload hash, request checks, the cap that fits, load shedding and the
deadline floor (no servers)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sluice.ledger.repositories import WindowEntry
from sluice.services import errors
from sluice.services.admission_rules import (
    PoolPace,
    Sampling,
    SubmitIntent,
    check_context,
    check_deadline,
    check_request_shape,
    check_storable,
    deadline_floor,
    largest_cap_that_fits,
    largest_cap_within,
    normalize_float,
    payload_hash,
    rate_window_retry_after,
)
from sluice.services.auth import api_key_from_metadata

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


# --- load shedding and the deadline floor ---------------------------------------------------------

PACE = PoolPace(max_backlog=100, drain_runs_per_s=50.0, ms_per_prompt_token=0.5, ms_per_output_token=7.0)


def test_the_floor_is_queue_wait_plus_prefill_plus_the_whole_cap_each_rounded_up():
    floor = deadline_floor(backlog=3, prompt_tokens=101, cap=10, pace=PACE)
    # 3 runs / 50 per s = 60 ms; 101 × 0.5 = 50.5 → 51 ms; 10 × 7 = 70 ms.
    assert (floor.queue_ms, floor.prefill_ms, floor.decode_ms, floor.total_ms) == (60, 51, 70, 181)


def test_a_deadline_at_the_floor_is_feasible():
    check_deadline(181, backlog=3, prompt_tokens=101, cap=10, pace=PACE)


def test_a_deadline_under_the_floor_names_the_deadline_and_the_cap_that_would_do():
    with pytest.raises(errors.DeadlineExceeded) as caught:
        check_deadline(180, backlog=3, prompt_tokens=101, cap=10, pace=PACE)
    # 180 - 60 - 51 = 69 ms left for output: 9 tokens (63 ms), not 10 (70 ms).
    assert caught.value.message == errors.DEADLINE_CANNOT_BE_MET.format(
        deadline_ms=180, queue_ms=60, prompt=101, prefill_ms=51, cap=10, decode_ms=70, floor_ms=181,
        advice=errors.DEADLINE_ADVICE_RAISE_OR_LOWER_CAP.format(floor_ms=181, fit=9))
    assert caught.value.message.endswith(
        "raise deadline_ms to at least 181 or lower max_output_tokens to at most 9")
    assert caught.value.metadata == ((errors.MIN_DEADLINE_MS_KEY, "181"),
                                     (errors.MAX_OUTPUT_TOKENS_THAT_FIT_KEY, "9"))


def test_when_no_cap_fits_only_a_longer_deadline_is_offered():
    with pytest.raises(errors.DeadlineExceeded) as caught:
        check_deadline(100, backlog=3, prompt_tokens=101, cap=10, pace=PACE)  # 111 ms before any output
    assert caught.value.message.endswith(": raise deadline_ms to at least 181")
    assert caught.value.metadata == ((errors.MIN_DEADLINE_MS_KEY, "181"),)


def test_the_cap_within_a_time_never_rounds_past_it():
    assert largest_cap_within(69, 7.0) == 9
    assert largest_cap_within(70, 7.0) == 10
    # 300 × 0.17 is 51.00000000000001 in floats, which the floor rounds up to 52 ms: the offer must
    # be a cap the floor itself accepts, so 299.
    assert largest_cap_within(51, 0.17) == 299
    assert deadline_floor(0, 0, 299, PoolPace(1, 1.0, 0.0, 0.17)).total_ms == 51
    assert largest_cap_within(0, 7.0) == 0


def test_the_pace_refuses_a_config_that_makes_no_sense():
    with pytest.raises(ValueError, match="max_backlog_per_pool"):
        PoolPace(max_backlog=0, drain_runs_per_s=1.0, ms_per_prompt_token=0.0, ms_per_output_token=0.0)
    with pytest.raises(ValueError, match="pool_drain_runs_per_s"):
        PoolPace(max_backlog=1, drain_runs_per_s=0.0, ms_per_prompt_token=0.0, ms_per_output_token=0.0)


@pytest.mark.parametrize(("field", "value"), [("model", "ch\x00at"), ("request_key", "k\x00"),
                                              ("conversation_id", "\x00c")])
def test_a_nul_in_any_stored_text_field_is_refused_naming_field_and_position(field: str, value: str) -> None:
    with pytest.raises(errors.InvalidArgument) as refused:
        check_storable(intent(**{field: value}), max_deadline_ms=1_000)
    assert str(refused.value) == errors.FIELD_HAS_NUL.format(field=field, position=value.index("\x00"))
    assert refused.value.field == field


def test_a_deadline_past_the_configured_bound_is_refused_and_the_bound_itself_is_not() -> None:
    check_storable(intent(deadline_ms=1_000), max_deadline_ms=1_000)
    with pytest.raises(errors.InvalidArgument) as refused:
        check_storable(intent(deadline_ms=2**63 - 1), max_deadline_ms=1_000)
    assert str(refused.value) == errors.FIELD_ABOVE_RANGE.format(field="deadline_ms", high=1_000,
                                                                 value=2**63 - 1)
