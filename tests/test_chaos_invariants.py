"""The fault suite's log invariant itself (tests/support/chaos.py) catches what it must."""

from __future__ import annotations

import uuid

from sluice.ledger.models import Run

from sluice.v1 import common_pb2, runs_pb2
from tests.support.chaos import _event_problems

RUN_ID = uuid.UUID("00000000-0000-0000-0000-000000000001")


def _run(status: str = "COMPLETED", terminal_sequence: int = 3) -> Run:
    return Run(id=RUN_ID, status=status, terminal_sequence=terminal_sequence, terminal_published=True)


def _delta(sequence: int) -> runs_pb2.RunEvent:
    return runs_pb2.RunEvent(run_id=str(RUN_ID), sequence=sequence, type=runs_pb2.EVENT_TYPE_DELTA,
                             token_ids=[7])


def _terminal(sequence: int, status: int = common_pb2.RUN_STATUS_COMPLETED) -> runs_pb2.RunEvent:
    return runs_pb2.RunEvent(run_id=str(RUN_ID), sequence=sequence, type=runs_pb2.EVENT_TYPE_TERMINAL,
                             status=status)


def test_a_clean_log_and_a_republished_terminal_pass():
    assert _event_problems(_run(), [_delta(1), _delta(2), _terminal(3), _terminal(3)]) == []


def test_an_event_after_the_terminal_a_gap_and_a_status_mismatch_are_each_reported():
    late = _event_problems(_run(), [_delta(1), _delta(2), _terminal(3), _delta(4)])
    assert late == [f"run {RUN_ID}: 1 events after its terminal (first seq 4)"]
    gap = _event_problems(_run(), [_delta(1), _terminal(3)])
    assert gap == [f"run {RUN_ID}: sequences [1, 3] are not 1..n"]
    wrong = _event_problems(_run("INTERRUPTED"), [_delta(1), _delta(2), _terminal(3)])
    assert wrong == [f"run {RUN_ID}: terminal COMPLETED#3 vs ledger INTERRUPTED#3"]
    missing = _event_problems(_run(), [_delta(1)])
    assert missing == [f"run {RUN_ID} COMPLETED: no TERMINAL event in the log"]


def test_a_terminal_republished_at_another_time_and_epoch_is_a_copy_and_a_changed_one_is_not():
    republished = _terminal(3)
    republished.time_ms, republished.lease_epoch = 99, 2
    assert _event_problems(_run(), [_delta(1), _delta(2), _terminal(3), republished]) == []
    changed = _terminal(3)
    changed.usage.output_tokens = 5
    assert _event_problems(_run(), [_delta(1), _delta(2), _terminal(3), changed]) == [
        f"run {RUN_ID}: 1 events after its terminal (first seq 3)"]
