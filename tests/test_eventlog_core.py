"""The event log's pure core: numbering, coalescing, reader de-duplication."""

from sluice.eventlog.events import (
    DeltaCoalescer,
    EventDeduper,
    RunEventSequencer,
    delta_event,
    status_name,
    status_value,
    terminal_event,
    tokens_in,
)
from sluice.v1 import common_pb2, runs_pb2

RUN = "00000000-0000-0000-0000-000000000001"


def _deltas(*sequences: int) -> list[runs_pb2.RunEvent]:
    return [delta_event(RUN, s, [s], "", 0) for s in sequences]


def test_sequencer_numbers_events_from_one_in_order_of_creation():
    seq = RunEventSequencer(RUN)
    events = [seq.status(common_pb2.RUN_STATUS_RUNNING, 0), seq.delta([7, 8], "ab", 1),
              seq.terminal(common_pb2.RUN_STATUS_COMPLETED, common_pb2.TokenUsage(), "", 2)]
    assert [e.sequence for e in events] == [1, 2, 3]
    assert [e.type for e in events] == [runs_pb2.EVENT_TYPE_STATUS, runs_pb2.EVENT_TYPE_DELTA,
                                        runs_pb2.EVENT_TYPE_TERMINAL]


def test_sequencer_resumes_after_a_known_last_sequence():
    assert RunEventSequencer(RUN, last_sequence=41).delta([1], "", 0).sequence == 42


def test_status_names_round_trip_between_ledger_text_and_enum():
    assert status_value("INTERRUPTED") == common_pb2.RUN_STATUS_INTERRUPTED
    assert status_name(common_pb2.RUN_STATUS_QUEUED) == "QUEUED"


def test_coalescer_holds_tokens_until_the_window_after_the_first_one_closes():
    window = DeltaCoalescer(window_ms=5)
    window.add([1], now_ms=100)
    window.add([2, 3], now_ms=103)
    assert not window.due(now_ms=104.9)
    assert window.remaining_ms(now_ms=104) == 1
    assert window.due(now_ms=105)
    assert window.take() == [1, 2, 3]
    assert not window.pending() and window.remaining_ms(now_ms=200) is None


def test_coalescer_closes_a_window_at_its_token_limit_without_waiting_out_its_time():
    window = DeltaCoalescer(window_ms=200, max_tokens=4)
    window.add([1, 2], now_ms=0)
    assert not window.full() and not window.due(now_ms=1) and window.remaining_ms(now_ms=1) == 199
    window.add([3, 4], now_ms=2)
    assert window.full() and window.due(now_ms=2) and window.remaining_ms(now_ms=2) == 0
    assert window.take() == [1, 2, 3, 4] and not window.full()


def test_an_aligned_coalescer_closes_each_window_at_the_next_multiple_of_its_length_on_the_clock():
    window = DeltaCoalescer(window_ms=200, aligned=True)
    window.add([1], now_ms=1_030)                     # opens between 1,000 and 1,200: closes at 1,200
    assert window.remaining_ms(now_ms=1_030) == 170
    window.add([2], now_ms=1_130)
    assert not window.due(now_ms=1_199.9) and window.due(now_ms=1_200)
    assert window.take() == [1, 2]
    window.add([3], now_ms=1_200)                     # at a multiple: a whole window
    assert window.remaining_ms(now_ms=1_200) == 200
    # Another run's window, opened elsewhere in the same stretch, closes at the same instant.
    other = DeltaCoalescer(window_ms=200, aligned=True)
    other.add([7], now_ms=1_399)
    assert other.remaining_ms(now_ms=1_399) == window.remaining_ms(now_ms=1_399) == 1
    # No token waits longer than the window, and the token limit still closes one at once.
    limited = DeltaCoalescer(window_ms=200, max_tokens=2, aligned=True)
    limited.add([1, 2], now_ms=1_250)
    assert limited.due(now_ms=1_250)


def test_an_aligned_coalescer_with_zero_window_emits_every_chunk():
    window = DeltaCoalescer(window_ms=0, aligned=True)
    window.add([9], now_ms=1)
    assert window.due(now_ms=1)


def test_coalescer_with_zero_window_emits_every_chunk():
    window = DeltaCoalescer(window_ms=0)
    window.add([9], now_ms=1)
    assert window.due(now_ms=1)


def test_deduper_passes_exactly_the_sequences_after_the_cursor():
    dedupe = EventDeduper(after=35)
    passed = [e.sequence for e in _deltas(*range(1, 41)) if dedupe.accept(e)]
    assert passed == list(range(36, 41))
    assert dedupe.gaps == 0


def test_deduper_drops_a_republished_terminal_event_and_stops_at_the_first():
    usage = common_pb2.TokenUsage(output_tokens=2)
    terminal = terminal_event(RUN, 3, common_pb2.RUN_STATUS_INTERRUPTED, usage, "lost", 0)
    dedupe = EventDeduper(after=0)
    stream = [*_deltas(1, 2), terminal, terminal]
    assert [e.sequence for e in stream if dedupe.accept(e)] == [1, 2, 3]
    assert dedupe.finished


def test_deduper_for_a_cursor_at_the_terminal_event_passes_nothing_and_finishes():
    terminal = terminal_event(RUN, 3, common_pb2.RUN_STATUS_COMPLETED, common_pb2.TokenUsage(), "", 0)
    dedupe = EventDeduper(after=3)
    assert [e.sequence for e in [*_deltas(1, 2), terminal] if dedupe.accept(e)] == []
    assert dedupe.finished


def test_deduper_counts_a_gap_it_cannot_repair():
    dedupe = EventDeduper(after=0)
    assert [dedupe.accept(e) for e in _deltas(1, 4)] == [True, True]
    assert dedupe.gaps == 2


def test_tokens_in_counts_delta_tokens_only():
    events = [delta_event(RUN, 1, [1, 2, 3], "", 0), delta_event(RUN, 2, [4], "", 0),
              terminal_event(RUN, 3, common_pb2.RUN_STATUS_COMPLETED, common_pb2.TokenUsage(), "", 0)]
    assert tokens_in(events) == 4
