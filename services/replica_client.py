"""Async client for a replica's `tensorrt_llm` model (Triton gRPC, decoupled streaming).

Speaks Triton's gRPC protocol through tritonclient's generated stubs on a
grpc.aio channel (one channel per replica address per event loop), so it works
the same against the pytriton CPU replica and a TensorRT-LLM Triton.

Outcomes of `stream_generate`, as the routing worker needs to tell them apart:
- finished: the iterator ends normally after the last token chunk;
- stopped by `stop(address, request_id)` from this process: the iterator
  yields one last empty chunk with `stopped=True`, then ends normally. (The
  replica, like TensorRT-LLM, just ends a stopped stream; the client knows it
  asked, so it marks the end. A stop sent by another process ends the
  iterator without the marker.);
- abandoned (the consumer stops iterating, or is cancelled, before the end):
  the client sends `stop` for it in the background so the replica frees it;
- the replica refused the request (bad input, id already streaming):
  `ReplicaRejected` with Triton's message;
- the replica went away (connection refused/reset, process killed, nothing
  received for `inactivity_timeout_s`): `ReplicaLost`. Keepalive pings also
  detect a peer that vanished without closing the connection.

Cost per response (issue 9.1): a read is one plain await (no timer per read: one sweeper task
per event loop checks every open stream's silence four times a second), and a response is
parsed by reading the raw bytes of the tensors used (output_ids and kv_cache_reused_blocks), not by
building an InferResult with a numpy array per output. The routing worker's replica monitor
judges a hung replica sooner than these limits, from its step time and scraped liveness.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import struct
import time
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
import numpy as np
from google.protobuf.message import DecodeError
from numpy.typing import NDArray
from sluice.services import replica_conn
from sluice.services.replica_request import (
    EMPTY_FINAL_RESPONSE_PARAM,
    OUTPUTS_READ,
    SCALAR_BYTES,
    RequestTemplates,
    scalar_inputs,
)
from sluice.services.replica_responses import ResponseLayout
from sluice.services.replica_responses import is_final as _is_final
from tritonclient.grpc import service_pb2, service_pb2_grpc

from sluice.replica.protocol import MODEL_NAME, REQUEST_ID_PARAM

LOG = logging.getLogger(__name__)

DEFAULT_FIRST_TOKEN_TIMEOUT_S = 30.0     # queueing on a busy replica may delay the first token
DEFAULT_INACTIVITY_TIMEOUT_S = 10.0      # between two responses of a running stream
DEFAULT_KEEPALIVE_MS = 2000              # the replica permits pings this often (replica/serve.py)
SWEEP_INTERVAL_S = 0.25                  # how often the loop's sweeper checks every open stream's silence
# A stream's response layout (replica_responses.py) is learned only while at least this many responses
# may follow: learning one costs ~50 us (a probe parsed and compared), a full parse ~5.7 us and a read
# at the learned offsets ~0.9 us, so it pays from about the eleventh response on. (A 2-token run
# learned a layout it read once: ~45 us of its routing CPU for nothing.)
LEARN_MIN_RESPONSES_LEFT = 12

ERR_LOST_INACTIVE = "replica {address} sent nothing for {seconds:.1f}s on request {request_id}"
ERR_LOST_RPC = "replica {address} lost during request {request_id}: {code} {details}"
ERR_LOST_EOF = "replica {address} closed the stream of request {request_id} before its final response"
ERR_LOST_UNARY = "replica {address}: {code} {details}"
ERR_ID_PREFIX_MISMATCH = "response for request {got!r} on the stream of {want!r}"


class ReplicaError(Exception):
    """Base of the errors this client raises."""


class ReplicaLost(ReplicaError):
    """The replica stopped answering mid-request; tokens already yielded stand, no more will come."""


class ReplicaRejected(ReplicaError):
    """The replica answered with an error for this request (Triton error message in args[0])."""


@dataclass(frozen=True, slots=True)
class TokenChunk:
    token_ids: tuple[int, ...]           # newly generated tokens, in order (empty only when stopped)
    num_input_tokens: int                # prompt tokens sent (the interface reports no count)
    kv_cache_reused_blocks: int          # prompt KV blocks served from the replica's prefix cache
    stopped: bool = False                # the request was stopped; this empty chunk is the last


@dataclass(slots=True)
class _LoopState:
    """Per event loop: grpc.aio channels must not be shared across loops."""

    channels: dict[str, grpc.aio.Channel] = field(default_factory=dict)
    stubs: dict[str, service_pb2_grpc.GRPCInferenceServiceStub] = field(default_factory=dict)
    # (address, request id) of streams open on this loop -> whether stop() was sent for them.
    stop_sent: dict[tuple[str, str], bool] = field(default_factory=dict)
    background: set[asyncio.Task[None]] = field(default_factory=set)   # stops for abandoned streams
    streams: set[_Watched] = field(default_factory=set)   # open streams, watched by the sweeper
    sweeper: asyncio.Task[None] | None = None
    # Plaintext replicas' token streams (replica_conn): one HTTP/2 connection per address, and the
    # connection being made for an address while the first streams to it wait.
    connections: dict[str, replica_conn.ReplicaConnection] = field(default_factory=dict)
    connecting: dict[str, asyncio.Future[replica_conn.ReplicaConnection]] = field(default_factory=dict)


_loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopState] = weakref.WeakKeyDictionary()


def _state() -> _LoopState:
    loop = asyncio.get_running_loop()
    state = _loops.get(loop)
    if state is None:
        state = _loops[loop] = _LoopState()
    return state


@dataclass(slots=True)
class _Tls:
    credentials: grpc.ChannelCredentials | None = None   # None: plaintext


_tls = _Tls()


def use_tls(credentials: grpc.ChannelCredentials | None) -> None:
    """Connect to replicas with these credentials from now on ([replica_tls]; None: plaintext).
    Set once at process start, before the first channel: channels already open keep theirs."""
    _tls.credentials = credentials


def _stub(address: str) -> service_pb2_grpc.GRPCInferenceServiceStub:
    """The address's stub, made once: a stub builds a callable per RPC of the service."""
    state = _state()
    stub = state.stubs.get(address)
    if stub is not None:
        return stub
    channels = state.channels
    channel = channels.get(address)
    if channel is None:
        options = [
            ("grpc.keepalive_time_ms", DEFAULT_KEEPALIVE_MS),
            ("grpc.keepalive_timeout_ms", DEFAULT_KEEPALIVE_MS),
            ("grpc.keepalive_permit_without_calls", 0),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ]
        credentials = _tls.credentials
        channel = (grpc.aio.insecure_channel(address, options=options) if credentials is None
                   else grpc.aio.secure_channel(address, credentials, options=options))
        channels[address] = channel
    stub = state.stubs[address] = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    return stub


async def close_channels() -> None:
    """Close this event loop's channels and connections (call before the loop ends)."""
    state = _state()
    state.stubs.clear()
    while state.connections:
        _, connection = state.connections.popitem()
        connection.close()
    channels = state.channels
    while channels:
        _, channel = channels.popitem()
        await channel.close()


def _tensor(request: service_pb2.ModelInferRequest, name: str, array: NDArray[Any], datatype: str) -> None:
    _raw_tensor(request, name, array.shape, array.tobytes(), datatype)


def _raw_tensor(request: service_pb2.ModelInferRequest, name: str, shape: Sequence[int], raw: bytes,
                datatype: str) -> None:
    tensor = request.inputs.add()
    tensor.name = name
    tensor.datatype = datatype
    tensor.shape.extend(shape)
    request.raw_input_contents.append(raw)


def build_request(request_id: str, prompt_ids: Sequence[int], max_new_tokens: int,
                  end_id: int | None = None, *, stop: bool = False, seed: int | None = None,
                  streaming: bool = True, cache_salt: int = 0, temperature: float | None = None,
                  top_p: float | None = None, stop_words: Sequence[Sequence[int]] = (),
                  perf_metrics: bool = True) -> service_pb2.ModelInferRequest:
    """One request of the `tensorrt_llm` interface (tensorrtllm_backend v0.19.0, batch of one;
    deploy/triton/CONTRACT.md). Sampling fields left None/empty are not sent (the backend's
    defaults: greedy, no nucleus cut, no stop words). `perf_metrics` asks for the perf outputs,
    which the backend returns only when asked: the platform reads kv_cache_reused_blocks from them.
    A run's request without stop words is sent as bytes from a template instead (replica_request.py)."""
    request = service_pb2.ModelInferRequest(model_name=MODEL_NAME, id=request_id)
    ids = list(prompt_ids)
    _raw_tensor(request, "input_ids", (1, len(ids)), struct.pack(f"<{len(ids)}i", *ids), "INT32")
    for name, datatype, value in scalar_inputs(len(ids), max_new_tokens, end_id, streaming=streaming,
                                               perf_metrics=perf_metrics, seed=seed, cache_salt=cache_salt,
                                               temperature=temperature, top_p=top_p):
        _raw_tensor(request, name, (1, 1), SCALAR_BYTES[datatype](value), datatype)
    for name in OUTPUTS_READ if perf_metrics else OUTPUTS_READ[:2]:
        request.outputs.add().name = name
    if stop_words:
        _tensor(request, "stop_words_list", stop_words_tensor(stop_words), "INT32")
    if stop:
        _raw_tensor(request, "stop", (1, 1), SCALAR_BYTES["BOOL"](True), "BOOL")
    request.parameters[REQUEST_ID_PARAM].string_param = request_id
    # Without this Triton drops the flags-only last response, and the client could not see the end.
    request.parameters[EMPTY_FINAL_RESPONSE_PARAM].bool_param = True
    return request


def stop_words_tensor(words: Sequence[Sequence[int]]) -> NDArray[np.int32]:
    """TensorRT-LLM's stop_words_list [1, 2, n]: the words' ids back to back, then each word's end
    offset (padded with -1)."""
    flat = [int(token) for word in words for token in word]
    ends = np.cumsum([len(word) for word in words]).tolist()
    offsets = ends + [-1] * (len(flat) - len(ends))
    return np.asarray([[flat, offsets]], dtype=np.int32)


def error_text(message: str) -> str:
    """The human part of a Triton error; pytriton sends a whole traceback ending "pkg.Error: text"."""
    if not message.startswith("Traceback"):
        return message
    last = [line for line in message.splitlines() if line.strip()][-1]
    kind, sep, text = last.partition(": ")
    return text if sep and " " not in kind else last


def _tensor_ints(raw: bytes, datatype: str, name: str) -> tuple[int, ...]:
    """One output tensor's values, straight from its raw bytes (little-endian, as Triton sends), with a
    compiled Struct per (datatype, size): a stream's responses all have the same few shapes."""
    key = (datatype, len(raw))
    unpack = _UNPACKERS.get(key)
    if unpack is None:
        width = _INT_WIDTHS.get(datatype)
        if width is None:
            raise ReplicaRejected(f"unexpected datatype {datatype} for {name}")
        unpack = _UNPACKERS[key] = struct.Struct(f"<{len(raw) // width}{'i' if width == 4 else 'q'}").unpack
    return unpack(raw)


_INT_WIDTHS = {"INT32": 4, "INT64": 8}
_UNPACKERS: dict[tuple[str, int], Callable[[bytes], tuple[Any, ...]]] = {}


def parse_chunk(response: service_pb2.ModelInferResponse, num_input_tokens: int,
                reused_blocks: int) -> TokenChunk:
    """The tensors the platform uses, and only those: output_ids, and kv_cache_reused_blocks, a perf
    output present only when the request asked for it (kept from earlier responses when absent).
    The interface has no prompt-token count: `num_input_tokens` is what the client sent.
    InferResult would build a numpy array per output of every response; this reads each tensor's
    bytes once. The outputs are read by index: iterating protobuf's repeated field costs several
    times as much per element (one parse per token of every stream: it shows)."""
    token_ids: tuple[int, ...] = ()
    outputs = response.outputs
    for index in range(len(outputs)):
        output = outputs[index]
        name = output.name
        if name == "output_ids":
            token_ids = _tensor_ints(response.raw_output_contents[index], output.datatype, name)
        elif name == "kv_cache_reused_blocks":
            reused_blocks = _tensor_ints(response.raw_output_contents[index], output.datatype, name)[0]
    return TokenChunk(token_ids, num_input_tokens, reused_blocks)


class _Watched(Protocol):
    """A stream the loop's sweeper watches: silent for longer than `limit_s`, it is expired."""

    last_activity: float                 # monotonic time of the last response (or of the send)
    limit_s: float                       # the first-response limit, then the inactivity limit

    def expire(self, silent_s: float) -> None:
        """End the stream ReplicaLost: nothing came for `silent_s`."""


@dataclass(slots=True, eq=False)      # identity: kept in a set
class _OpenStream:
    """A grpc.aio stream (TLS replicas, `_exchange`) as the sweeper watches it."""

    call: Any                            # the grpc.aio stream-stream call
    address: str
    request_id: str
    limit_s: float
    last_activity: float
    error: ReplicaLost | None = None     # set by the sweeper before it cancels the call

    def expire(self, silent_s: float) -> None:
        if self.error is None:
            self.error = ReplicaLost(ERR_LOST_INACTIVE.format(
                address=self.address, seconds=silent_s, request_id=self.request_id))
            self.call.cancel()


class _Generation:
    """One request on a plaintext replica's shared HTTP/2 connection (replica_conn), as the
    connection's sink for its stream: each response is parsed as it arrives, on the event loop, and
    its tokens handed to `on_chunk` by a plain call (None: kept in `chunks` for an iterator, woken
    through `waiter`). `ended` resolves when the replica sent the final response, or fails with the
    ReplicaError that ended the request."""

    __slots__ = ("address", "request_id", "num_input_tokens", "reused", "on_chunk", "chunks", "waiter",
                 "limit_s", "inactivity_s", "last_activity", "connection", "stream_id", "ended", "layout",
                 "tokens_left")

    def __init__(self, address: str, request_id: str, num_input_tokens: int,
                 on_chunk: Callable[[TokenChunk], None] | None, first_timeout_s: float,
                 inactivity_timeout_s: float, connection: replica_conn.ReplicaConnection,
                 max_new_tokens: int = 0) -> None:
        self.address, self.request_id, self.num_input_tokens = address, request_id, num_input_tokens
        self.tokens_left = max_new_tokens    # at most this many more tokens (responses) will come
        self.reused = 0
        self.on_chunk = on_chunk
        self.chunks: collections.deque[TokenChunk] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None
        self.limit_s, self.inactivity_s = first_timeout_s, inactivity_timeout_s
        self.last_activity = time.monotonic()
        self.connection = connection
        self.stream_id = 0
        self.ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.layout = ResponseLayout()

    # --- replica_conn.StreamSink ---

    def message(self, body: bytes) -> None:
        self.last_activity = self.connection.last_received    # when the read that brought it came
        self.limit_s = self.inactivity_s
        known = self.layout.tokens(body)
        if known is not None:                # the stream's usual response: its values at their offsets
            token_ids, reused = known
            if reused is not None:
                self.reused = reused
            if token_ids:
                self.tokens_left -= len(token_ids)
                self._deliver(TokenChunk(token_ids, self.num_input_tokens, self.reused))
            return
        try:
            message = service_pb2.ModelStreamInferResponse.FromString(body)
            if message.error_message:
                raise ReplicaRejected(error_text(message.error_message))
            response = message.infer_response
            if not response.outputs:         # the empty final response
                self._end(None)
                return
            chunk = parse_chunk(response, self.num_input_tokens, self.reused)
        except ReplicaError as exc:
            self._end(exc)
            return
        except DecodeError as exc:
            self._end(ReplicaLost(ERR_LOST_RPC.format(address=self.address, request_id=self.request_id,
                                                      code="INTERNAL", details=exc)))
            return
        self.tokens_left -= len(chunk.token_ids)
        if self.tokens_left >= LEARN_MIN_RESPONSES_LEFT:
            self.layout.learn(body, message)
        self.reused = chunk.kv_cache_reused_blocks
        if chunk.token_ids and not self._deliver(chunk):   # a final response may carry no tokens
            return
        if _is_final(response):
            self._end(None)

    def _deliver(self, chunk: TokenChunk) -> bool:
        """Hand a chunk to the consumer; False when the consumer failed, which ended its request (not
        the connection)."""
        if self.on_chunk is None:
            self.chunks.append(chunk)
            self._wake()
            return True
        try:
            self.on_chunk(chunk)
        except Exception as exc:
            self._end(exc)
            return False
        return True

    def closed(self, code: str | None, details: str) -> None:
        """The stream ended before the final response: the server closed it, or the connection went."""
        self._end(ReplicaLost(ERR_LOST_EOF.format(address=self.address, request_id=self.request_id)
                              if code is None else
                              ERR_LOST_RPC.format(address=self.address, request_id=self.request_id,
                                                  code=code, details=details)))

    # --- the sweeper, the consumer ---

    def expire(self, silent_s: float) -> None:
        self._end(ReplicaLost(ERR_LOST_INACTIVE.format(address=self.address, seconds=silent_s,
                                                       request_id=self.request_id)))

    def abandon(self) -> None:
        """The consumer is gone: drop the stream here (the caller stops it on the replica)."""
        self._end(None)

    async def wait(self) -> None:
        """Until a chunk is kept or the request ended (the iterator's wake-up)."""
        if self.chunks or self.ended.done():
            return
        waiter = self.waiter = asyncio.get_running_loop().create_future()
        try:
            await waiter
        finally:
            self.waiter = None

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _end(self, error: Exception | None) -> None:
        _state().streams.discard(self)
        self.connection.cancel(self.stream_id)   # a no-op once the server ended the stream
        if not self.ended.done():
            if error is None:
                self.ended.set_result(None)
            else:
                self.ended.set_exception(error)
        self._wake()


def _watch(stream: _Watched) -> None:
    """Register with this loop's sweeper, starting it if it is not running."""
    state = _state()
    state.streams.add(stream)
    if state.sweeper is None or state.sweeper.done():
        state.sweeper = asyncio.get_running_loop().create_task(_sweep(state), name="replica-sweeper")


async def _sweep(state: _LoopState) -> None:
    """One timer per event loop instead of one per read: every SWEEP_INTERVAL_S, end the streams that
    have been silent past their limit, and let each connection check its keepalive. Exits when no
    stream is open (restarted by the next one)."""
    while state.streams:
        await asyncio.sleep(SWEEP_INTERVAL_S)
        now = time.monotonic()
        for stream in list(state.streams):
            silent = now - stream.last_activity
            if silent > stream.limit_s:
                stream.expire(silent)
        for connection in list(state.connections.values()):
            connection.check(now)


async def _connection(address: str, request_id: str) -> replica_conn.ReplicaConnection:
    """This loop's connection to `address`, made once for every stream that asks meanwhile."""
    state = _state()
    connection = state.connections.get(address)
    if connection is not None and connection.usable:
        return connection
    pending = state.connecting.get(address)
    if pending is None:
        pending = state.connecting[address] = asyncio.ensure_future(replica_conn.connect(address))
        pending.add_done_callback(lambda done: (state.connecting.pop(address, None),
                                                done.cancelled() or done.exception()))
    try:
        connection = await asyncio.shield(pending)
    except OSError as exc:
        raise ReplicaLost(ERR_LOST_RPC.format(address=address, request_id=request_id, code="UNAVAILABLE",
                                              details=exc)) from exc
    state.connections[address] = connection
    return connection


async def _start(address: str, request_id: str, request: bytes, num_input_tokens: int,
                 on_chunk: Callable[[TokenChunk], None] | None, first_timeout_s: float,
                 inactivity_timeout_s: float, max_new_tokens: int = 0) -> _Generation:
    """Send one request (a serialised ModelInferRequest) on its own stream of the address's shared
    connection."""
    connection = await _connection(address, request_id)
    generation = _Generation(address, request_id, num_input_tokens, on_chunk, first_timeout_s,
                             inactivity_timeout_s, connection, max_new_tokens)
    try:
        generation.stream_id = connection.start(_STREAM_INFER, generation)
    except ConnectionError as exc:
        raise ReplicaLost(ERR_LOST_RPC.format(address=address, request_id=request_id, code="UNAVAILABLE",
                                              details=exc)) from exc
    _watch(generation)
    with contextlib.suppress(ConnectionError):   # a lost connection told the generation already
        await connection.send(generation.stream_id, request)
    return generation


_STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"


async def _exchange(address: str, request: service_pb2.ModelInferRequest, first_timeout_s: float,
                    inactivity_timeout_s: float) -> AsyncIterator[service_pb2.ModelInferResponse]:
    """grpc.aio, for TLS replicas: send one request on its own stream; yield its responses up to and
    including the final one.

    Reads are plain awaits: the silence limits are enforced by the loop's sweeper, which cancels a
    call that went quiet (its pending read then raises, and the sweeper's ReplicaLost is raised)."""
    call = _stub(address).ModelStreamInfer()
    stream = _OpenStream(call, address, request.id, first_timeout_s, time.monotonic())
    _watch(stream)
    try:
        try:
            await call.write(request)
            while True:
                message = await call.read()
                stream.last_activity = time.monotonic()
                stream.limit_s = inactivity_timeout_s
                if message is grpc.aio.EOF:
                    raise ReplicaLost(ERR_LOST_EOF.format(address=address, request_id=request.id))
                if message.error_message:
                    raise ReplicaRejected(error_text(message.error_message))
                yield message.infer_response
                if _is_final(message.infer_response):
                    return
        except grpc.aio.AioRpcError as exc:
            if stream.error is not None:
                raise stream.error from None
            raise ReplicaLost(ERR_LOST_RPC.format(address=address, request_id=request.id,
                                                  code=exc.code().name, details=exc.details())) from exc
        except asyncio.CancelledError:
            if stream.error is not None:     # cancelled by the sweeper, not by our consumer
                raise stream.error from None
            raise
    finally:
        _state().streams.discard(stream)
        call.cancel()


async def _tls_chunks(address: str, request: service_pb2.ModelInferRequest, num_input_tokens: int,
                      first_timeout_s: float, inactivity_timeout_s: float) -> AsyncIterator[TokenChunk]:
    reused = 0
    async for response in _exchange(address, request, first_timeout_s, inactivity_timeout_s):
        if not response.outputs:             # the empty final response
            break
        chunk = parse_chunk(response, num_input_tokens, reused)
        reused = chunk.kv_cache_reused_blocks
        if chunk.token_ids:                  # a final response may carry no tokens
            yield chunk


async def stream_generate(address: str, request_id: str, prompt_ids: Sequence[int], max_new_tokens: int,
                          end_id: int | None = None, *, seed: int | None = None, streaming: bool = True,
                          cache_salt: int = 0,
                          temperature: float | None = None, top_p: float | None = None,
                          stop_words: Sequence[Sequence[int]] = (),
                          first_token_timeout_s: float = DEFAULT_FIRST_TOKEN_TIMEOUT_S,
                          inactivity_timeout_s: float = DEFAULT_INACTIVITY_TIMEOUT_S,
                          ) -> AsyncIterator[TokenChunk]:
    """Stream a generation from the replica at `address` ("host:port"); see the module doc for outcomes.

    streaming=False asks for TensorRT-LLM's non-streaming mode: one chunk with every token at the end
    (first_token_timeout_s then bounds the whole generation).
    """
    request = build_request(request_id, prompt_ids, max_new_tokens, end_id, seed=seed, streaming=streaming,
                            cache_salt=cache_salt, temperature=temperature, top_p=top_p,
                            stop_words=stop_words)
    num_input_tokens = len(prompt_ids)
    stop_sent = _state().stop_sent
    key = (address, request_id)
    stop_sent[key] = False
    ended = False                                # the replica sent the final response, or is gone
    generation: _Generation | None = None
    reused = 0
    try:
        if _tls.credentials is not None:
            async for chunk in _tls_chunks(address, request, num_input_tokens, first_token_timeout_s,
                                           inactivity_timeout_s):
                reused = chunk.kv_cache_reused_blocks
                yield chunk
        else:
            generation = await _start(address, request_id, request.SerializeToString(), num_input_tokens,
                                      None, first_token_timeout_s,
                                      inactivity_timeout_s, max_new_tokens)
            chunks = generation.chunks
            while True:
                while chunks:
                    chunk = chunks.popleft()
                    reused = chunk.kv_cache_reused_blocks
                    yield chunk
                if generation.ended.done():
                    break
                await generation.wait()
            generation.ended.result()            # raises what ended the request
        ended = True
        stopped = stop_sent.get(key, False)
    except ReplicaError:
        ended = True
        raise
    finally:
        stop_sent.pop(key, None)
        if not ended:
            if generation is not None:
                generation.abandon()
            _stop_in_background(address, request_id)
    if stopped:
        yield TokenChunk((), num_input_tokens, reused, stopped=True)


_TEMPLATES = RequestTemplates()     # a run's request as bytes (generate's: the routing driver's path)


async def generate(address: str, request_id: str, prompt_ids: Sequence[int], max_new_tokens: int,
                   end_id: int | None = None, *, on_chunk: Callable[[TokenChunk], None],
                   seed: int | None = None, cache_salt: int = 0, temperature: float | None = None,
                   top_p: float | None = None, stop_words: Sequence[Sequence[int]] = (),
                   first_token_timeout_s: float = DEFAULT_FIRST_TOKEN_TIMEOUT_S,
                   inactivity_timeout_s: float = DEFAULT_INACTIVITY_TIMEOUT_S) -> None:
    """stream_generate, pushed: each chunk is handed to `on_chunk` as its response is parsed, on the
    event loop by a plain call from the connection's data_received (no task wake-up per token: the
    routing driver's hot path, issue 9.1). Returns when the replica ended the stream (the stopped
    marker is not delivered); raises what stream_generate raises, or what `on_chunk` raised. When
    cancelled or its consumer failed, the request is stopped on the replica in the background, as
    an abandoned stream is."""
    if _tls.credentials is not None:
        async for chunk in stream_generate(address, request_id, prompt_ids, max_new_tokens, end_id, seed=seed,
                                           cache_salt=cache_salt, temperature=temperature, top_p=top_p,
                                           stop_words=stop_words, first_token_timeout_s=first_token_timeout_s,
                                           inactivity_timeout_s=inactivity_timeout_s):
            if chunk.token_ids:
                on_chunk(chunk)
        return
    request = (_TEMPLATES.encode(request_id, prompt_ids, max_new_tokens, end_id, seed=seed,
                                 cache_salt=cache_salt, temperature=temperature, top_p=top_p)
               if not stop_words else
               build_request(request_id, prompt_ids, max_new_tokens, end_id, seed=seed, cache_salt=cache_salt,
                             temperature=temperature, top_p=top_p, stop_words=stop_words).SerializeToString())
    generation = await _start(address, request_id, request, len(prompt_ids), on_chunk, first_token_timeout_s,
                              inactivity_timeout_s, max_new_tokens)
    ended = False                                # the replica sent the final response, or is gone
    try:
        await generation.ended
        ended = True
    except ReplicaError:
        ended = True
        raise
    finally:
        if not ended:                            # cancelled, or the consumer failed
            generation.abandon()
            _stop_in_background(address, request_id)


def _stop_in_background(address: str, request_id: str) -> None:
    """The consumer abandoned a live stream: stop it on the replica so it frees its slot.

    Needed because the pytriton replica does not see gRPC stream cancellation
    (TensorRT-LLM's Triton does; the extra stop is then a harmless no-op).
    """
    state = _state()

    async def quietly() -> None:
        try:
            await stop(address, request_id)
        except ReplicaError as exc:
            LOG.debug("stop for abandoned request %s on %s failed: %s", request_id, address, exc)

    task = asyncio.get_running_loop().create_task(quietly())
    state.background.add(task)
    task.add_done_callback(state.background.discard)


async def stop(address: str, request_id: str, timeout_s: float = 5.0) -> None:
    """Ask the replica to stop `request_id`; returns once the replica acknowledged (no-op if unknown)."""
    stop_sent = _state().stop_sent
    if (address, request_id) in stop_sent:
        stop_sent[(address, request_id)] = True
    request = build_request(request_id, [0], 1, stop=True)
    if _tls.credentials is not None:
        async for _ in _exchange(address, request, timeout_s, timeout_s):
            pass
        return
    generation = await _start(address, request_id, request.SerializeToString(), 1, lambda chunk: None,
                              timeout_s, timeout_s)
    try:
        await asyncio.shield(generation.ended)
    finally:
        generation.abandon()


async def is_ready(address: str, timeout_s: float = 2.0) -> bool:
    """True when the replica's `tensorrt_llm` model is loaded and ready. On a plaintext replica it is
    asked over the connection the token streams share (replica_conn), as the routing process does
    once a second per replica: through grpc.aio a check cost ~0.3 ms of the event loop and kept gRPC
    core's threads busy, ~1.5 ms of an idle routing process's CPU per second in all (issue 9)."""
    request = service_pb2.ModelReadyRequest(name=MODEL_NAME)
    if _tls.credentials is not None:
        try:
            reply = await _stub(address).ModelReady(request, timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return bool(reply.ready)
    try:
        body = await _unary(address, _MODEL_READY, request.SerializeToString(), timeout_s)
        return bool(service_pb2.ModelReadyResponse.FromString(body).ready)
    except (ReplicaError, TimeoutError, DecodeError):
        return False


_MODEL_READY = "/inference.GRPCInferenceService/ModelReady"


class _Reply:
    """A unary call's sink: its one message, then its end (replica_conn.StreamSink)."""

    __slots__ = ("address", "body", "done")

    def __init__(self, address: str) -> None:
        self.address = address
        self.body: bytes | None = None
        self.done: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    def message(self, body: bytes) -> None:
        if self.body is None:
            self.body = body

    def closed(self, code: str | None, details: str) -> None:
        if self.done.done():
            return
        if code is None and self.body is not None:
            self.done.set_result(self.body)
        else:
            self.done.set_exception(ReplicaLost(ERR_LOST_UNARY.format(
                address=self.address, code=code or "OK", details=details or "no reply")))


async def _unary(address: str, path: str, request: bytes, timeout_s: float) -> bytes:
    """One unary call on the address's shared connection: its reply's bytes, ReplicaLost when the
    replica answered with an error or went away, TimeoutError past `timeout_s` (connecting included).
    A call that timed out on a connection carrying nothing else closes it, so that the next call
    connects afresh rather than wait again on a peer that may have vanished without closing (the
    keepalive pings only connections with open streams)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with asyncio.timeout_at(deadline):
        connection = await _connection(address, path)
    reply = _Reply(address)
    try:
        stream_id = connection.start(path, reply)
    except ConnectionError as exc:
        raise ReplicaLost(ERR_LOST_UNARY.format(address=address, code="UNAVAILABLE", details=exc)) from exc
    try:
        async with asyncio.timeout_at(deadline):
            await connection.send(stream_id, request, last=True)
            return await reply.done
    except (TimeoutError, asyncio.CancelledError):
        connection.cancel(stream_id)
        if connection.open_streams == 0:
            connection.close()
        raise
    except ConnectionError as exc:          # lost while sending
        raise ReplicaLost(ERR_LOST_UNARY.format(address=address, code="UNAVAILABLE", details=exc)) from exc
