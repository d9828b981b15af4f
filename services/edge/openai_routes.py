"""The OpenAI-compatible API: models, chat completions, completions, and the Responses API's
background mode (create, retrieve with `stream=true&starting_after=N`, cancel).

Every answer is one Sluice run submitted through AdmissionService.submit: `Idempotency-Key`
becomes the run's request_key (without one, each request is a new run, as with OpenAI), chat
messages are rendered with the model registry's template, and answers are read from the run's
event stream. Nothing here cancels a run when a client goes away.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Sequence

from sluice.ledger.repositories import ModelRepository
from sluice.services.admission import Admitted
from sluice.services.admission_rules import Sampling, SubmitIntent, normalize_float
from sluice.services.auth import Metadata, authenticate
from sluice.services.edge.answer import follow_answer
from sluice.services.edge.bodies import (
    ChatBody,
    ChatMessage,
    CompletionBody,
    ResponsesBody,
    TextPart,
    output_cap,
    parse_body,
    stop_strings,
)
from sluice.services.edge.errors import ErrorReply, RunEnded
from sluice.services.edge.shapes import (
    Answer,
    ResponseState,
    chat_chunk,
    chat_completion,
    completion_chunk,
    finish_reason,
    response_event,
    response_object,
    run_id_of_response,
    text_completion,
    usage_chunk,
)
from sluice.services.edge.sse import DONE, frame, parse_cursor
from sluice.services.edge.templates import Message, message, render
from sluice.services.edge.web import (
    IDEMPOTENCY_KEY_HEADER,
    RUN_ID_HEADER,
    EdgeServices,
    caller,
    edge_of,
    events_until_closed,
    framed_errors,
    http_errors,
    json_reply,
    read_body,
    sse_response,
)
from sluice.services.errors import UNKNOWN_MODEL, NotFound
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from sluice.eventlog.events import TERMINAL_STATUSES, status_name
from sluice.v1 import runs_pb2

COMPLETED = "COMPLETED"


# --- shared: prompt, submit, answer -----------------------------------------------------------


def content_text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def chat_messages(items: Sequence[ChatMessage], instructions: str | None = None) -> list[Message]:
    found = [message(m.role, content_text(m.content), f"messages[{i}].role") for i, m in enumerate(items)]
    return ([Message("system", instructions)] if instructions else []) + found


async def chat_prompt(edge: EdgeServices, metadata: Metadata, model: str, messages: Sequence[Message]) -> str:
    card = await edge.cards.get(model)
    if card is None:
        # Authenticate first so that a bad key is a 401 whatever model it names, as in admission.
        async with edge.sessions() as session:
            await authenticate(session, metadata)
        raise NotFound(UNKNOWN_MODEL.format(model=model))
    return render(card, messages)


async def submit(edge: EdgeServices, request: Request, model: str, prompt: str, cap: int,
                 temperature: float | None, top_p: float | None, seed: int | None,
                 rendered: bool) -> Admitted:
    """`rendered`: chat messages were rendered here with the registry's template, so admission
    must not wrap them in a chat turn again. A completions prompt is not: it is the same input a
    gRPC Submit or POST /v1/inference sends, and the same key and payload there is the same run."""
    key = request.headers.get(IDEMPOTENCY_KEY_HEADER) or f"openai-{uuid.uuid4().hex}"
    sampling = Sampling(temperature=normalize_float(temperature or 0.0), top_p=normalize_float(top_p or 0.0),
                        seed=seed or 0)
    intent = SubmitIntent(model=model, input=prompt.encode(), max_output_tokens=cap, request_key=key,
                          deadline_ms=0, sampling=sampling, conversation_id=None, rendered=rendered)
    return await edge.admission.submit(caller(request), intent)


def _ended(piece_terminal: runs_pb2.RunEvent, stopped: bool) -> None:
    """Raise for a run that ended without an answer (a stop string's own cancel is an answer)."""
    status = status_name(piece_terminal.status)
    if status != COMPLETED and not stopped:
        raise RunEnded(status, piece_terminal.detail)


def openai_error_frame(reply: ErrorReply) -> bytes:
    return frame(reply.body)          # `data: {"error": {...}}`: the openai client raises APIError


async def answer_frames(edge: EdgeServices, metadata: Metadata, answer: Answer, run_id: str,
                        stops: Sequence[str], include_usage: bool, chat: bool) -> AsyncIterator[bytes]:
    if chat:
        yield frame(chat_chunk(answer, {"role": "assistant", "content": ""}))
    async for piece in follow_answer(edge.runs, metadata, run_id, stops):
        if piece.text:
            yield frame(chat_chunk(answer, {"content": piece.text}) if chat
                        else completion_chunk(answer, piece.text))
        if piece.terminal is not None:
            _ended(piece.terminal, piece.stopped)
            usage = piece.terminal.usage
            finish = finish_reason(usage, answer.max_output_tokens, piece.stopped)
            yield frame(chat_chunk(answer, {}, finish) if chat else completion_chunk(answer, "", finish))
            if include_usage:
                yield frame(usage_chunk(answer, usage, chat))
    yield DONE


async def answer_reply(edge: EdgeServices, request: Request, admitted: Admitted,
                       body: ChatBody | CompletionBody, chat: bool) -> Response:
    run_id = str(admitted.run_id)
    answer = Answer(f"{'chatcmpl' if chat else 'cmpl'}-{run_id}", int(time.time()), admitted.model_version,
                    admitted.max_output_tokens)
    metadata, stops = caller(request), stop_strings(body.stop)
    headers = {RUN_ID_HEADER: run_id}
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        frames = answer_frames(edge, metadata, answer, run_id, stops, include_usage, chat)
        return sse_response(framed_errors(frames, "openai.answer", openai_error_frame), headers)
    parts: list[str] = []
    async for piece in follow_answer(edge.runs, metadata, run_id, stops):
        parts.append(piece.text)
        if piece.terminal is not None:
            _ended(piece.terminal, piece.stopped)
            usage = piece.terminal.usage
            finish = finish_reason(usage, answer.max_output_tokens, piece.stopped)
            shape = chat_completion if chat else text_completion
            return json_reply(shape(answer, "".join(parts), finish, usage), headers=headers)
    raise AssertionError(f"run {run_id}: stream ended without a terminal event")


# --- routes --------------------------------------------------------------------------------------


@http_errors
async def list_models(request: Request) -> Response:
    edge = edge_of(request)
    async with edge.sessions() as session:
        tenant = await authenticate(session, caller(request))
        cards = await ModelRepository(session).cards()
    data = []
    for card in cards:
        if card.quality_tier not in tenant.allowed_tiers:
            continue
        for name in (card.version, card.alias):
            if name:
                data.append({"id": name, "object": "model", "created": 0, "owned_by": "sluice",
                             "version": card.version, "context_window": card.context_limit,
                             "chat": card.chat_template is not None})
    return json_reply({"object": "list", "data": data})


@http_errors
async def chat_completions(request: Request) -> Response:
    edge = edge_of(request)
    body = parse_body(await read_body(request, edge.settings.max_body_bytes), ChatBody)
    cap = output_cap(body) or edge.settings.default_max_tokens
    prompt = await chat_prompt(edge, caller(request), body.model, chat_messages(body.messages))
    admitted = await submit(edge, request, body.model, prompt, cap, body.temperature, body.top_p, body.seed,
                            rendered=True)
    return await answer_reply(edge, request, admitted, body, chat=True)


@http_errors
async def completions(request: Request) -> Response:
    edge = edge_of(request)
    body = parse_body(await read_body(request, edge.settings.max_body_bytes), CompletionBody)
    prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
    admitted = await submit(edge, request, body.model, prompt, body.max_tokens, body.temperature, body.top_p,
                            body.seed, rendered=False)
    return await answer_reply(edge, request, admitted, body, chat=False)


def state_of(run: runs_pb2.Run, text: str | None, background: bool | None) -> ResponseState:
    return ResponseState(run_id=run.run_id, created_at=run.created_at_ms // 1000, model=run.model_version,
                         status=status_name(run.status), max_output_tokens=run.max_output_tokens,
                         background=background, text=text, usage=run.usage, detail=run.detail)


async def answer_text(edge: EdgeServices, metadata: Metadata, run_id: str, upto: int | None) -> str:
    """The run's text from its retained events (through `upto`, or to the terminal event)."""
    parts: list[str] = []
    async with events_until_closed(edge, metadata, run_id, 0) as events:
        async for event in events:
            if upto is not None and event.sequence > upto:
                break
            parts.append(event.text)
            if event.sequence == upto:
                break
    return "".join(parts)


async def response_frames(edge: EdgeServices, metadata: Metadata, state: ResponseState, after: int,
                          created: bool) -> AsyncIterator[bytes]:
    """Responses events for the run events after `after`, sequence numbers kept (a POST's stream
    also opens with `response.created` as sequence 0, which no run event uses)."""
    if created:
        yield frame({"type": "response.created", "sequence_number": 0, "response": response_object(state)},
                    event="response.created")
    parts: list[str] = []
    async for event in edge.runs.stream(metadata, state.run_id, after):
        if event.type == runs_pb2.EVENT_TYPE_DELTA:
            parts.append(event.text)
        else:
            state = dataclasses.replace(state, status=status_name(event.status))
        if event.type == runs_pb2.EVENT_TYPE_TERMINAL:
            prefix = await answer_text(edge, metadata, state.run_id, after) if after else ""
            state = dataclasses.replace(state, text=prefix + "".join(parts), usage=event.usage,
                                        detail=event.detail)
        kind, data = response_event(event, state)
        yield frame(data, event=kind)


def responses_error_frame(reply: ErrorReply) -> bytes:
    return frame(reply.body, event="error")


@http_errors
async def create_response(request: Request) -> Response:
    edge = edge_of(request)
    body = parse_body(await read_body(request, edge.settings.max_body_bytes), ResponsesBody)
    metadata = caller(request)
    items = [ChatMessage(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    prompt = await chat_prompt(edge, metadata, body.model, chat_messages(items, body.instructions))
    admitted = await submit(edge, request, body.model, prompt,
                            body.max_output_tokens or edge.settings.default_max_tokens,
                            body.temperature, body.top_p, None, rendered=True)
    run_id = str(admitted.run_id)
    headers = {RUN_ID_HEADER: run_id}
    state = ResponseState(run_id=run_id, created_at=int(time.time()), model=admitted.model_version,
                          status=admitted.status.value, max_output_tokens=admitted.max_output_tokens,
                          background=body.background, text=None, usage=None)
    if body.stream:
        frames = response_frames(edge, metadata, state, 0, created=True)
        return sse_response(framed_errors(frames, "responses.create", responses_error_frame), headers)
    if not body.background:
        text = await answer_text(edge, metadata, run_id, None)   # waits for the terminal event
        run = await edge.runs.get_run(metadata, run_id)
        state = state_of(run, text, False)
    return json_reply(response_object(state), headers=headers)


@http_errors
async def retrieve_response(request: Request) -> Response:
    edge = edge_of(request)
    metadata = caller(request)
    run = await edge.runs.get_run(metadata, run_id_of_response(request.path_params["response_id"]))
    headers = {RUN_ID_HEADER: run.run_id}
    if request.query_params.get("stream", "").lower() in ("true", "1"):
        after = parse_cursor(request.query_params.get("starting_after"), "starting_after")
        frames = response_frames(edge, metadata, state_of(run, None, None), after, created=False)
        return sse_response(framed_errors(frames, "responses.retrieve", responses_error_frame), headers)
    done = run.status in TERMINAL_STATUSES
    text = await answer_text(edge, metadata, run.run_id, None) if done else None
    return json_reply(response_object(state_of(run, text, None)), headers=headers)


@http_errors
async def cancel_response(request: Request) -> Response:
    edge = edge_of(request)
    metadata = caller(request)
    run_id = run_id_of_response(request.path_params["response_id"])
    await edge.runs.cancel(metadata, run_id)
    run = await edge.runs.get_run(metadata, run_id)
    return json_reply(response_object(state_of(run, None, None)), headers={RUN_ID_HEADER: run.run_id})


ROUTES = [
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/responses", create_response, methods=["POST"]),
    Route("/v1/responses/{response_id}", retrieve_response, methods=["GET"]),
    Route("/v1/responses/{response_id}/cancel", cancel_response, methods=["POST"]),
]
