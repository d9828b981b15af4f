"""The RPC edge's field checks (services/validation.py) and off-loop tokenization, without servers."""

from __future__ import annotations

import struct

from sluice.services import tokenization, validation
from sluice.services.validation import FieldLimits, Undecodable, decoder

from sluice.config import Settings
from sluice.models import load_tokenizer
from sluice.v1 import admission_pb2, routing_pb2

TINY_CHAT = "tiny-chat/tokenizer.json"


def test_a_body_that_does_not_parse_becomes_a_value_naming_the_message_not_an_exception():
    decoded = decoder(admission_pb2.SubmitRequest)(b"\xff\xff\xff")
    assert isinstance(decoded, Undecodable)
    assert decoded.message == "sluice.v1.SubmitRequest"
    assert decoded.problem().startswith("request body is not a valid sluice.v1.SubmitRequest (")


def test_a_body_that_parses_is_the_message():
    body = admission_pb2.SubmitRequest(model="chat", max_output_tokens=3).SerializeToString()
    assert decoder(admission_pb2.SubmitRequest)(body) == admission_pb2.SubmitRequest(model="chat",
                                                                                      max_output_tokens=3)


def test_nul_in_any_string_is_refused_naming_the_field_and_position():
    limits = FieldLimits()
    assert limits.problem(admission_pb2.SubmitRequest(request_key="k\0")) == \
        validation.FIELD_HAS_NUL.format(field="request_key", position=1)
    assert limits.problem(routing_pb2.Replica(name="r0", metrics_url="http://\0")) == \
        validation.FIELD_HAS_NUL.format(field="metrics_url", position=7)


def test_limits_come_from_config_and_name_the_field():
    config = Settings().updated(admission={"max_input_bytes": 10, "max_deadline_ms": 1_000},
                                traffic={"max_batch_deadline_ms": 1_000})
    limits = FieldLimits.from_config(config)
    assert limits.problem(admission_pb2.SubmitRequest(input=b"a" * 10, deadline_ms=1_000)) is None
    assert limits.problem(admission_pb2.SubmitRequest(input=b"a" * 11)) == \
        validation.FIELD_TOO_LONG.format(field="input", length=11, unit="bytes", limit=10)
    assert limits.problem(admission_pb2.SubmitRequest(deadline_ms=1_001)) == \
        validation.FIELD_ABOVE_RANGE.format(field="deadline_ms", high=1_000, value=1_001)
    # The edge holds deadline_ms to the larger of the two classes' bounds; admission holds an
    # interactive run to its own (services/admission_rules.check_storable).
    batch_longer = FieldLimits.from_config(config.updated(traffic={"max_batch_deadline_ms": 5_000}))
    assert batch_longer.problem(admission_pb2.SubmitRequest(deadline_ms=5_000)) is None


def test_over_long_strings_and_lists_are_refused():
    limits = FieldLimits(max_items=3)
    assert limits.problem(admission_pb2.SubmitRequest(model="m" * 257)) == \
        validation.FIELD_TOO_LONG.format(field="model", length=257, unit="characters", limit=256)
    assert limits.problem(routing_pb2.ExplainRequest(token_ids=[1, 2, 3, 4])) == \
        validation.FIELD_TOO_LONG.format(field="token_ids", length=4, unit="items", limit=3)
    assert limits.problem(routing_pb2.ExplainRequest(token_ids=[1, 2, 3])) is None


def test_nested_fields_are_named_by_their_path():
    limits = FieldLimits(max_values={"sluice.v1.SamplingParams.seed": 9})
    request = admission_pb2.SubmitRequest(sampling=admission_pb2.SamplingParams(seed=10))
    assert limits.problem(request) == validation.FIELD_ABOVE_RANGE.format(field="sampling.seed", high=9,
                                                                          value=10)


async def test_short_and_long_prompts_get_the_tokenizers_own_encode_ids():
    # The oracle: the library's plain `encode` (with offsets) of the model's input; admission encodes
    # through `encode_batch_fast`, inline or, for a long prompt, off the event loop.
    tokenizer = load_tokenizer(TINY_CHAT)
    for text in ("Why do rivers meander? Ünïcode, 北京, tabs\tand\nlines", "Why do rivers meander? " * 2_000):
        expected = tokenizer.encode(tokenization.model_input(TINY_CHAT, text), add_special_tokens=False).ids
        assert tokenization.encode(TINY_CHAT, text) == expected
        # As runs.prompt_token_ids stores them: 4-byte big-endian integers back to back.
        packed = struct.pack(f">{len(expected)}i", *expected)
        assert await tokenization.encode_packed_off_loop(TINY_CHAT, text) == packed
    assert len(text) >= tokenization.OFF_LOOP_MIN_CHARS
