"""Following one run's answer for the OpenAI routes: text pieces, stop strings, the ending.

OpenAI's `stop` is applied here, at the door: text is held back while it could still be the start
of a stop string; when one appears, the text before it is the answer, the run is cancelled (so its
replica stops and only the tokens consumed so far are charged) and the stream reads on, silently,
to the terminal event for the usage. A run ended this way finishes with `finish_reason: stop`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from sluice.services.auth import Metadata
from sluice.services.runs import RunsService

from sluice.v1 import runs_pb2


class StopScanner:
    """Splits streamed text at the first stop string. Pure."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to show now, whether a stop string was found)."""
        if not self._stops:
            return text, False
        buffer = self._held + text
        hits = [i for i in (buffer.find(stop) for stop in self._stops) if i >= 0]
        if hits:
            self._held = ""
            return buffer[:min(hits)], True
        keep = self._longest_partial_stop(buffer)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[:len(buffer) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _longest_partial_stop(self, buffer: str) -> int:
        """Length of the longest end of `buffer` that begins some stop string."""
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if stop.startswith(buffer[-size:]):
                    longest = size
                    break
        return longest


@dataclass(frozen=True, slots=True)
class Piece:
    text: str                                  # answer text to show ("" at the end)
    terminal: runs_pb2.RunEvent | None = None  # the run's terminal event, on the last piece
    stopped: bool = False                      # a stop string ended the answer


async def follow_answer(runs: RunsService, metadata: Metadata, run_id: str,
                        stops: Sequence[str]) -> AsyncIterator[Piece]:
    scanner = StopScanner(stops)
    stopped = False
    async for event in runs.stream(metadata, run_id, 0):
        if event.type == runs_pb2.EVENT_TYPE_DELTA and not stopped:
            text, stopped = scanner.feed(event.text)
            if text:
                yield Piece(text)
            if stopped:
                await runs.cancel(metadata, run_id)
        elif event.type == runs_pb2.EVENT_TYPE_TERMINAL:
            rest = "" if stopped else scanner.flush()
            if rest:
                yield Piece(rest)
            yield Piece("", event, stopped)
