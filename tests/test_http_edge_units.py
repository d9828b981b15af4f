"""The HTTP edge's pure parts: body validation, SSE cursors, stop strings, chat templates and the
one error mapping."""

from __future__ import annotations

import pytest
from sluice.ledger.repositories import ModelCard
from sluice.ledger.seed import TINY_CHAT, read_chat_template
from sluice.services.edge.answer import StopScanner
from sluice.services.edge.bodies import ChatBody, InferenceBody, output_cap, parse_body
from sluice.services.edge.errors import (
    BODY_NOT_UTF8,
    NO_CHAT_TEMPLATE,
    UNRECOGNIZED_ARGUMENT,
    UNSUPPORTED_ARGUMENT,
    InvalidField,
    RunEnded,
    error_reply,
)
from sluice.services.edge.sse import frame, resume_cursor
from sluice.services.edge.templates import Message, message, render
from sluice.services.errors import (
    MAX_OUTPUT_TOKENS_THAT_FIT_KEY,
    MIN_DEADLINE_MS_KEY,
    AlreadyExists,
    DeadlineExceeded,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)


def refusal(raw: bytes, model: type = ChatBody) -> InvalidField:
    with pytest.raises(InvalidField) as caught:
        parse_body(raw, model)
    return caught.value


def test_a_well_formed_chat_body_parses_to_its_fields():
    body = parse_body(b'{"model":"chat","messages":[{"role":"user","content":"hi"}],"max_tokens":5,'
                      b'"temperature":0.5,"stream":true,"stream_options":{"include_usage":true}}', ChatBody)
    fields = (body.model, body.messages[0].content, output_cap(body), body.temperature)
    assert fields == ("chat", "hi", 5, 0.5)
    assert body.stream and body.stream_options is not None and body.stream_options.include_usage


def test_wrong_types_unknown_and_unsupported_fields_are_refused_naming_the_field():
    assert refusal(b'{"model":"chat","messages":[{"role":"user","content":"hi"}],"max_tokens":"5"}').param \
        == "max_tokens"
    unknown = refusal(b'{"model":"chat","messages":[{"role":"user","content":"hi"}],"colour":1}')
    assert (unknown.param, unknown.message) == ("colour", UNRECOGNIZED_ARGUMENT.format(param="colour"))
    tools = refusal(b'{"model":"chat","messages":[{"role":"user","content":"hi"}],"tools":[]}')
    assert tools.message == UNSUPPORTED_ARGUMENT.format(param="tools", why="tool calling is not served")
    content = refusal(b'{"model":"chat","messages":[{"role":"user","content":7}]}')
    assert content.param == "messages[0].content"
    assert refusal(b'{"model":"chat","messages":[]}').param == "messages"
    assert refusal(b'{"model":"chat","messages":[{"role":"user","content":"x"}],"n":2}').param == "n"


def test_negative_caps_booleans_for_integers_and_bad_utf8_are_refused():
    negative = refusal(b'{"model":"m","input":"x","maxOutputTokens":-1}', InferenceBody)
    boolean = refusal(b'{"model":"m","input":"x","maxOutputTokens":true}', InferenceBody)
    assert negative.param == boolean.param == "maxOutputTokens"
    latin1 = refusal(b'{"model":"m","input":"caf\xe9"}', InferenceBody)
    assert latin1.message == BODY_NOT_UTF8.format(position=25)
    assert refusal(b'{"model":').param is None


def test_max_tokens_and_max_completion_tokens_must_agree():
    both = (b'{"model":"m","messages":[{"role":"user","content":"x"}],'
            b'"max_tokens":3,"max_completion_tokens":4}')
    with pytest.raises(InvalidField) as caught:
        output_cap(parse_body(both, ChatBody))
    assert caught.value.param == "max_completion_tokens"


def test_last_event_id_wins_over_after_because_eventsource_repeats_the_original_url():
    assert resume_cursor("0", "35") == 35
    assert resume_cursor("12", None) == 12
    assert resume_cursor(None, None) == 0
    with pytest.raises(InvalidField):
        resume_cursor("-1", None)


def test_an_sse_frame_carries_the_sequence_as_its_id():
    assert frame({"a": 1}, event="delta", event_id=36) == b'id: 36\nevent: delta\ndata: {"a":1}\n\n'


def test_stop_strings_hold_back_a_possible_start_and_cut_at_the_first_stop():
    scanner = StopScanner(["END", "\n\n"])
    assert scanner.feed("hello E") == ("hello ", False)      # "E" may begin "END"
    assert scanner.feed("x") == ("Ex", False)
    assert scanner.feed("done\n") == ("done", False)
    assert scanner.feed("\nmore") == ("", True)               # "\n\n" completed across pieces
    assert StopScanner([]).feed("END") == ("END", False)
    tail = StopScanner(["END"])
    assert tail.feed("abcEN") == ("abc", False) and tail.flush() == "EN"


def test_tiny_chat_renders_each_message_on_its_role_marker_and_opens_the_assistant_turn():
    card = ModelCard("tiny-chat-v1", "chat", 4096, "standard", read_chat_template(TINY_CHAT.chat_template))
    rendered = render(card, [message("developer", "Be brief.", "p"), Message("user", "Hi")])
    assert rendered == "<|system|>Be brief.\n<|user|>Hi\n<|assistant|>"


def test_a_model_without_a_chat_template_refuses_chat_and_a_tool_role_is_refused():
    with pytest.raises(InvalidField) as caught:
        render(ModelCard("plain-v1", None, 10, "standard", None), [Message("user", "x")])
    assert caught.value.message == NO_CHAT_TEMPLATE.format(model="plain-v1")
    with pytest.raises(InvalidField) as role:
        message("tool", "x", "messages[2].role")
    assert role.value.param == "messages[2].role"


def test_domain_errors_map_once_to_status_type_code_and_hints():
    budget = error_reply(ResourceExhausted("no room", metadata=[(MAX_OUTPUT_TOKENS_THAT_FIT_KEY, "1000")]))
    assert (budget.status, budget.body["error"]["code"], budget.body["error"]["max_output_tokens_that_fit"]) \
        == (429, "budget_exceeded", 1000)
    shed = error_reply(Unavailable("busy", retry_after_ms=1500))
    assert (shed.status, shed.headers) == (503, {"retry-after": "2", "retry-after-ms": "1500"})
    assert error_reply(Unauthenticated("k")).status == 401
    assert error_reply(PermissionDenied("tier")).status == 403
    late = error_reply(DeadlineExceeded("late", metadata=[(MIN_DEADLINE_MS_KEY, "9000")]))
    assert (late.status, late.body["error"]["min_deadline_ms"]) == (504, 9000)
    assert error_reply(NotFound("r")).status == 404
    assert error_reply(AlreadyExists("k")).body["error"]["code"] == "idempotency_key_reused"
    assert error_reply(RunEnded("EXPIRED", "")).status == 504
