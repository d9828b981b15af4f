"""ledger/batching.WriteBatcher: which items share a call, when calls go out, and who gets what
result or error. No database: `write` is a recorder whose calls end when the test says so."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
from sluice.ledger.batching import WriteBatcher


@dataclass
class Recorder:
    """A write that records each call's items and answers item * 10 once its gate opens."""

    calls: list[list[int]] = field(default_factory=list)
    gates: list[asyncio.Event] = field(default_factory=list)
    fail_with: Exception | None = None
    held: bool = True            # False: every call answers at once

    async def write(self, items: list[int]) -> list[int]:
        self.calls.append(list(items))
        gate = asyncio.Event()
        self.gates.append(gate)
        if self.held:
            await gate.wait()
        if self.fail_with is not None:
            raise self.fail_with
        return [item * 10 for item in items]


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_lone_item_is_written_at_once_by_itself():
    recorder = Recorder(held=False)
    batcher = WriteBatcher(recorder.write)
    assert await batcher.submit(7) == 70
    assert recorder.calls == [[7]]


async def test_items_that_arrive_while_a_call_is_in_flight_share_the_next_call_each_with_its_own_result():
    recorder = Recorder()
    batcher = WriteBatcher(recorder.write)
    first = batcher.submit(1)
    await settle()
    later = [batcher.submit(item) for item in (2, 3, 4)]
    await settle()
    assert recorder.calls == [[1]]              # one call at a time: 2, 3, 4 wait for it
    recorder.gates[0].set()
    assert await first == 10
    await settle()
    assert recorder.calls == [[1], [2, 3, 4]]
    recorder.gates[1].set()
    assert await asyncio.gather(*later) == [20, 30, 40]


async def test_an_error_fails_every_item_of_its_call_and_the_next_items_go_in_a_new_call():
    recorder = Recorder(fail_with=ConnectionResetError("gone"))
    batcher = WriteBatcher(recorder.write)
    first = batcher.submit(1)
    await settle()
    second, third = batcher.submit(2), batcher.submit(3)
    await settle()
    recorder.gates[0].set()
    with pytest.raises(ConnectionResetError):
        await first
    await settle()
    recorder.gates[1].set()
    for future in (second, third):
        with pytest.raises(ConnectionResetError):
            await future
    recorder.fail_with = None
    retried = batcher.submit(2)                 # a submitter retrying joins a fresh call
    await settle()
    recorder.gates[2].set()
    assert await retried == 20
    assert recorder.calls == [[1], [2, 3], [2]]


async def test_a_lingering_batcher_holds_the_first_item_for_its_linger_and_sends_all_that_joined():
    recorder = Recorder(held=False)
    batcher = WriteBatcher(recorder.write, linger_s=0.2)
    futures = [batcher.submit(1)]
    await asyncio.sleep(0.05)
    futures.append(batcher.submit(2))
    await asyncio.sleep(0.05)
    assert recorder.calls == []                 # 0.1 s in: still lingering
    await asyncio.sleep(0.2)
    assert recorder.calls == [[1, 2]]
    assert await asyncio.gather(*futures) == [10, 20]


async def test_flush_sends_lingering_items_at_once_and_waits_for_every_call():
    recorder = Recorder(held=False)
    batcher = WriteBatcher(recorder.write, linger_s=60.0)
    futures = [batcher.submit(item) for item in (1, 2)]
    await batcher.flush()
    assert recorder.calls == [[1, 2]]
    assert [future.result() for future in futures] == [10, 20]
    assert batcher.waiting == 0


async def test_a_full_batch_goes_without_lingering_and_the_rest_waits_for_the_next_call():
    recorder = Recorder()
    batcher = WriteBatcher(recorder.write, linger_s=60.0, max_items=2)
    futures = [batcher.submit(item) for item in (1, 2, 3)]
    await settle()
    assert recorder.calls == [[1, 2]]           # full at 2; 3 lingers behind the call in flight
    recorder.gates[0].set()
    await settle()
    assert recorder.calls == [[1, 2]]
    flushing = asyncio.ensure_future(batcher.flush())
    await settle()
    assert recorder.calls == [[1, 2], [3]]
    recorder.gates[1].set()
    await flushing
    assert [future.result() for future in futures] == [10, 20, 30]


async def test_a_lingered_item_waiting_behind_a_full_pipe_goes_once_the_call_in_flight_ends():
    recorder = Recorder()
    batcher = WriteBatcher(recorder.write, linger_s=0.05)
    first = batcher.submit(1)
    await asyncio.sleep(0.1)
    assert recorder.calls == [[1]]
    second = batcher.submit(2)
    await asyncio.sleep(0.1)                    # its linger is over, but a call is in flight
    assert recorder.calls == [[1]]
    recorder.gates[0].set()
    await settle()
    assert recorder.calls == [[1], [2]]
    recorder.gates[1].set()
    assert (await first, await second) == (10, 20)


async def test_a_submitter_that_gave_up_does_not_stop_the_others_results():
    recorder = Recorder()
    batcher = WriteBatcher(recorder.write)
    first = batcher.submit(1)
    await settle()
    gave_up, kept = batcher.submit(2), batcher.submit(3)
    gave_up.cancel()
    recorder.gates[0].set()
    await first
    await settle()
    recorder.gates[1].set()
    assert await kept == 30
    assert recorder.calls == [[1], [2, 3]]      # written all the same (the write is idempotent)


async def test_no_call_carries_more_than_max_items():
    recorder = Recorder()
    batcher = WriteBatcher(recorder.write, max_items=2)
    futures = [batcher.submit(1)]
    await settle()
    futures += [batcher.submit(item) for item in (2, 3, 4)]
    recorder.gates[0].set()
    await settle()
    assert recorder.calls == [[1], [2, 3]]
    recorder.gates[1].set()
    await settle()
    recorder.gates[2].set()
    assert await asyncio.gather(*futures) == [10, 20, 30, 40]
    assert recorder.calls == [[1], [2, 3], [4]]
