"""Async Python SDK for Sluice.

    async with SluiceClient("127.0.0.1:50051", api_key="sk-...") as client:
        run = await client.submit("Hello", model="chat", max_output_tokens=64)
        async for event in client.stream(run.run_id):
            print(event.text, end="")

One address serves every service when they run in one process
(services/main.py); separate processes take per-service addresses (or the
ones from the environment: `SluiceClient(Addresses.from_env())`: SLUICE_ADDRESS for one process
serving every service, else SLUICE_ADMISSION_ADDRESS / SLUICE_RUNS_ADDRESS / SLUICE_USAGE_ADDRESS,
each defaulting to the platform's packaged address).

`stream` survives disconnects by itself: it remembers the last sequence it
handed out and, when the connection drops (UNAVAILABLE, a reset, a stream that
ends before the terminal event), reopens `Stream(run_id, after=last)` on the
Runs service, so the caller sees every event exactly once, in order, up to the
terminal event. It gives up after `max_resumes` consecutive failures without
progress. A cursor already at or past the terminal event (GetRun's last_sequence
of a finished run) yields nothing and ends.

Every RPC error is raised as `SluiceError`, a grpc.aio.AioRpcError that also carries the
hints the server attached as trailing metadata (how long to wait, the output cap or the
deadline that would be admitted), so callers need not parse messages.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import grpc.aio

from sluice.v1 import (
    admin_pb2_grpc,
    admission_pb2,
    admission_pb2_grpc,
    common_pb2,
    runs_pb2,
    runs_pb2_grpc,
    usage_pb2,
    usage_pb2_grpc,
)

API_KEY_ENV = "SLUICE_API_KEY"
ADDRESS_ENV = "SLUICE_ADDRESS"
# Per-service address variables and the platform's packaged defaults ([admission|runs|usage].listen).
SERVICE_ADDRESS_ENV = (("SLUICE_ADMISSION_ADDRESS", "127.0.0.1:50051"),
                       ("SLUICE_RUNS_ADDRESS", "127.0.0.1:50052"),
                       ("SLUICE_USAGE_ADDRESS", "127.0.0.1:50053"))
NO_API_KEY = f"no API key: pass api_key or set {API_KEY_ENV}"
RESUMABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL,
                             grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED})
TERMINAL_STATUSES = frozenset({common_pb2.RUN_STATUS_COMPLETED, common_pb2.RUN_STATUS_CANCELLED,
                               common_pb2.RUN_STATUS_INTERRUPTED, common_pb2.RUN_STATUS_FAILED,
                               common_pb2.RUN_STATUS_EXPIRED})


# Trailing-metadata keys of the server's hints (services/errors.py; the SDK imports no server code).
RETRY_AFTER_MS_KEY = "retry-after-ms"
MAX_OUTPUT_TOKENS_THAT_FIT_KEY = "x-max-output-tokens-that-fit"
MIN_DEADLINE_MS_KEY = "x-min-deadline-ms"

T = TypeVar("T")


class SluiceError(grpc.aio.AioRpcError):  # type: ignore[misc]  # grpc ships no type hints
    """An RPC refused by Sluice, with the server's hints (None where it sent none):

    - retry_after_ms: the same request may be admitted after this long (rate limit, load shedding,
      ledger unavailable);
    - max_output_tokens_that_fit: the largest max_output_tokens the budget or the deadline admits
      (0: not even one output token fits this prompt);
    - min_deadline_ms: the shortest deadline_ms the run could meet.

    A grpc.aio.AioRpcError, so code catching that (and reading code() / details()) is unchanged.
    """

    def __init__(self, code: grpc.StatusCode, message: str, *,
                 initial_metadata: grpc.aio.Metadata | None = None,
                 trailing_metadata: grpc.aio.Metadata | None = None,
                 debug_error_string: str | None = None) -> None:
        trailing = trailing_metadata if trailing_metadata is not None else grpc.aio.Metadata()
        super().__init__(code, initial_metadata if initial_metadata is not None else grpc.aio.Metadata(),
                         trailing, message, debug_error_string)
        hints = {str(key): value for key, value in trailing}
        self.retry_after_ms = _int_hint(hints, RETRY_AFTER_MS_KEY)
        self.max_output_tokens_that_fit = _int_hint(hints, MAX_OUTPUT_TOKENS_THAT_FIT_KEY)
        self.min_deadline_ms = _int_hint(hints, MIN_DEADLINE_MS_KEY)

    @classmethod
    def of(cls, error: grpc.aio.AioRpcError) -> SluiceError:
        if isinstance(error, SluiceError):
            return error
        return cls(error.code(), error.details() or "", initial_metadata=error.initial_metadata(),
                   trailing_metadata=error.trailing_metadata(), debug_error_string=error.debug_error_string())

    @property
    def message(self) -> str:
        return self.details() or ""


def _int_hint(hints: Mapping[str, object], key: str) -> int | None:
    # A malformed hint is no hint: the error itself is what the caller must see.
    value = hints.get(key)
    if not isinstance(value, str):
        return None
    try:
        return int(value)
    except ValueError:
        return None


async def _typed(call: Awaitable[T]) -> T:
    try:
        return await call
    except grpc.aio.AioRpcError as error:
        raise SluiceError.of(error) from None


class StreamBroken(Exception):
    """The stream could not be resumed within the retry budget; `after` is where to resume."""

    def __init__(self, run_id: str, after: int, cause: BaseException | None) -> None:
        super().__init__(f"stream of run {run_id} broke after sequence {after}: {cause}")
        self.run_id = run_id
        self.after = after


@dataclass(frozen=True, slots=True)
class Addresses:
    admission: str
    runs: str
    usage: str

    @classmethod
    def single(cls, address: str) -> Addresses:
        return cls(address, address, address)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Addresses:
        """SLUICE_ADDRESS (one process serving every service), else the per-service variables,
        else the platform's default addresses. The SDK reads no platform config file."""
        env = os.environ if environ is None else environ
        if env.get(ADDRESS_ENV):
            return cls.single(env[ADDRESS_ENV])
        admission, runs, usage = (env.get(name) or default for name, default in SERVICE_ADDRESS_ENV)
        return cls(admission, runs, usage)


class SluiceClient:
    def __init__(self, address: str | Addresses, api_key: str | None = None, *,
                 max_resumes: int = 5, resume_backoff_s: float = 0.2,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        """`credentials` (e.g. grpc.ssl_channel_credentials(ca, key, chain) for TLS or mutual TLS)
        make every channel a secure one; without them the channels are plaintext."""
        key = api_key or os.environ.get(API_KEY_ENV)
        if not key:
            raise ValueError(NO_API_KEY)
        self.addresses = Addresses.single(address) if isinstance(address, str) else address
        self.max_resumes = max_resumes
        self.resume_backoff_s = resume_backoff_s
        self._metadata = (("x-api-key", key),)
        self._credentials = credentials
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._admission = admission_pb2_grpc.AdmissionStub(self._channel(self.addresses.admission))
        self._runs = runs_pb2_grpc.RunsStub(self._channel(self.addresses.runs))
        self._usage = usage_pb2_grpc.UsageServiceStub(self._channel(self.addresses.usage))
        # Every gateway serves Admin beside Admission (services/main.py).
        self._admin = admin_pb2_grpc.AdminStub(self._channel(self.addresses.admission))

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = (grpc.aio.insecure_channel(address) if self._credentials is None
                                       else grpc.aio.secure_channel(address, self._credentials))
        return self._channels[address]

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    async def __aenter__(self) -> SluiceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- calls --------------------------------------------------------------------------------

    async def submit(self, prompt: str | bytes, *, model: str = "chat", max_output_tokens: int = 256,
                     request_key: str | None = None, deadline_ms: int = 0, temperature: float = 0.0,
                     top_p: float = 0.0, seed: int = 0,
                     conversation_id: str = "", batch: bool = False) -> admission_pb2.SubmitResponse:
        """Submit a run. Reuse `request_key` to retry safely: the same payload returns the same run.
        `batch`: priority class batch (the tenant must be permitted it) instead of interactive."""
        request = admission_pb2.SubmitRequest(
            model=model, input=prompt.encode("utf-8") if isinstance(prompt, str) else prompt,
            max_output_tokens=max_output_tokens, request_key=request_key or uuid.uuid4().hex,
            deadline_ms=deadline_ms,
            sampling=admission_pb2.SamplingParams(temperature=temperature, top_p=top_p, seed=seed),
            conversation_id=conversation_id,
            priority=common_pb2.PRIORITY_BATCH if batch else common_pb2.PRIORITY_INTERACTIVE)
        return await _typed(self._admission.Submit(request, metadata=self._metadata))

    async def get_run(self, run_id: str) -> runs_pb2.Run:
        return await _typed(self._runs.GetRun(runs_pb2.GetRunRequest(run_id=run_id), metadata=self._metadata))

    async def cancel(self, run_id: str) -> runs_pb2.CancelResponse:
        return await _typed(self._runs.Cancel(runs_pb2.CancelRequest(run_id=run_id), metadata=self._metadata))

    async def usage(self, from_date: str = "", to_date: str = "") -> usage_pb2.GetUsageResponse:
        request = usage_pb2.GetUsageRequest(from_date=from_date, to_date=to_date)
        return await _typed(self._usage.GetUsage(request, metadata=self._metadata))

    async def query_usage(self, request: usage_pb2.QueryUsageRequest) -> usage_pb2.QueryUsageResponse:
        """One page of grouped settled usage (every tenant with a finance key)."""
        return await _typed(self._usage.QueryUsage(request, metadata=self._metadata))

    async def usage_groups(self, request: usage_pb2.QueryUsageRequest
                           ) -> tuple[list[usage_pb2.UsageGroup], usage_pb2.InFlight]:
        """Every page of `request`'s groups, and the reservations in flight."""
        groups: list[usage_pb2.UsageGroup] = []
        page = usage_pb2.QueryUsageRequest()
        page.CopyFrom(request)
        while True:
            response = await self.query_usage(page)
            groups.extend(response.groups)
            if not response.next_page_token:
                return groups, response.in_flight
            page.page_token = response.next_page_token

    async def reconcile(self, period: str = "") -> usage_pb2.ReconcileResponse:
        request = usage_pb2.ReconcileRequest(period=period)
        return await _typed(self._usage.Reconcile(request, metadata=self._metadata))

    async def admin(self, method: str, request: Any) -> Any:
        """Call Admin.<method> (e.g. "RevokeApiKey") with the request message it takes."""
        return await _typed(getattr(self._admin, method)(request, metadata=self._metadata))

    def stream_once(self, run_id: str, after: int = 0) -> grpc.aio.UnaryStreamCall:
        """One Stream call, no resuming (tests use it to drop a connection on purpose)."""
        return self._runs.Stream(runs_pb2.StreamRequest(run_id=run_id, after=after), metadata=self._metadata)

    async def stream(self, run_id: str, after: int = 0) -> AsyncIterator[runs_pb2.RunEvent]:
        """Every event with sequence > after, up to and including the terminal one, resuming
        by itself after disconnects. Errors that resuming cannot fix (NOT_FOUND, OUT_OF_RANGE,
        UNAUTHENTICATED, ...) are raised as SluiceError."""
        last = after
        failures = 0
        while True:
            call = self.stream_once(run_id, last)
            try:
                async for event in call:
                    if event.sequence <= last:
                        continue  # defensive: never hand out a sequence twice
                    last = event.sequence
                    failures = 0
                    yield event
                    if event.type == runs_pb2.EVENT_TYPE_TERMINAL:
                        return
                # Ended cleanly before a terminal event: the server does that when the cursor is at or
                # past the run's terminal event (nothing left to send); anything else is resumed.
                if await self._ended_by(run_id, last):
                    return
                cause: BaseException | None = None
            except grpc.aio.AioRpcError as error:
                if error.code() not in RESUMABLE_CODES:
                    raise SluiceError.of(error) from None
                cause = error
            finally:
                call.cancel()
            failures += 1
            if failures > self.max_resumes:
                raise StreamBroken(run_id, last, cause)
            await asyncio.sleep(self.resume_backoff_s * 2 ** (failures - 1))

    async def _ended_by(self, run_id: str, cursor: int) -> bool:
        """True when the run is finished and `cursor` is at or past its terminal event."""
        run = await self.get_run(run_id)
        return is_terminal_status(run.status) and run.last_sequence <= cursor

    async def chat(self, prompt: str, **submit: Any) -> AsyncIterator[runs_pb2.RunEvent]:
        """Submit and stream in one call."""
        run = await self.submit(prompt, **submit)
        async for event in self.stream(run.run_id):
            yield event


def is_terminal_status(status: int) -> bool:
    return status in TERMINAL_STATUSES


def status_name(status: int) -> str:
    """RunStatus enum value -> its short name ('COMPLETED'), as the ledger spells it."""
    return str(common_pb2.RunStatus.Name(status)).removeprefix("RUN_STATUS_")
