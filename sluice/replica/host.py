"""Drives an Engine on an asyncio loop and fans its outputs out to streams.

The host is the only place with a clock. Triton callables `submit` and
`abort` between steps; `run` loops step -> sleep(modelled time) -> deliver.
Everything runs on one event loop (pytriton's inference-handler loop), so the
engine, which is not thread-safe, is only touched from that loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from sluice.replica.engine_api import Engine, EngineStats, GenerationRequest, StepOutput

ERR_ID_IN_USE = "request id {!r} is already streaming on this replica"


@dataclass(frozen=True, slots=True)
class Aborted:
    """Delivered to a stream whose request was stopped."""


ABORTED = Aborted()
StreamItem = StepOutput | Aborted


class RequestIdInUse(ValueError):
    pass


async def take_ready(queue: asyncio.Queue[StreamItem]) -> tuple[list[StepOutput], bool]:
    """A stream's outputs queued since the last call (waiting for the first), and whether the stream
    has ended (finished, or ABORTED). A consumer that keeps up gets one step per call, so one
    response per step; one that falls behind gets the steps queued meanwhile together."""
    items = [await queue.get()]
    while not queue.empty():
        items.append(queue.get_nowait())
    outputs: list[StepOutput] = []
    for item in items:
        if isinstance(item, Aborted):
            return outputs, True
        outputs.append(item)
        if item.finished:
            return outputs, True
    return outputs, False


class EngineHost:
    def __init__(self, engine: Engine, on_stats: Callable[[EngineStats], None] | None = None) -> None:
        self._engine = engine
        self._on_stats = on_stats or (lambda _stats: None)
        self._streams: dict[str, asyncio.Queue[StreamItem]] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    def submit(self, request: GenerationRequest) -> asyncio.Queue[StreamItem]:
        """Add a request; its outputs arrive on the returned queue, the last one `finished` or ABORTED."""
        if request.request_id in self._streams:
            raise RequestIdInUse(ERR_ID_IN_USE.format(request.request_id))
        self._ensure_running()
        self._engine.add_request(request)      # raises EngineRequestError before any state is kept
        queue: asyncio.Queue[StreamItem] = asyncio.Queue()
        self._streams[request.request_id] = queue
        assert self._wake is not None
        self._wake.set()
        self._on_stats(self._engine.stats())
        return queue

    def abort(self, request_id: str) -> bool:
        """Stop a live request: the engine frees it and its stream gets ABORTED. False if unknown."""
        queue = self._streams.pop(request_id, None)
        known = self._engine.abort(request_id)
        if queue is not None:
            queue.put_nowait(ABORTED)
        self._on_stats(self._engine.stats())
        return known or queue is not None

    def forget(self, request_id: str) -> None:
        """The consumer went away without finishing: drop the request quietly."""
        if self._streams.pop(request_id, None) is not None:
            self._engine.abort(request_id)

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-host")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wake is not None
        while True:
            if not self._engine.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            started = loop.time()
            result = self._engine.step()
            self._on_stats(self._engine.stats())
            # Sleep the rest of the modelled step time; sleep(0) still yields so callables can submit.
            await asyncio.sleep(max(0.0, result.duration_s - (loop.time() - started)))
            for output in result.outputs:
                queue = self._streams.get(output.request_id)
                if queue is None:          # aborted or forgotten during the step
                    continue
                queue.put_nowait(output)
                if output.finished:
                    del self._streams[output.request_id]
