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


def _fenced(event: runs_pb2.RunEvent, epoch: int) -> runs_pb2.RunEvent:
    event.lease_epoch = epoch
    return event


def test_a_reaped_run_reads_past_its_fence_and_the_lost_owners_late_event_but_a_real_gap_does_not():
    # Owner of epoch 1 wrote 1 and 2; a reaper (epoch 2) fenced, read 1..2 and ended the run at 3; the
    # old owner's delayed 3 landed after the fence. A reader sees 1, 2, 3 (the reaper's terminal).
    fence = runs_pb2.RunEvent(run_id=str(RUN_ID), sequence=0, type=runs_pb2.EVENT_TYPE_STATUS, lease_epoch=2)
    interrupted = common_pb2.RUN_STATUS_INTERRUPTED
    reaped = [_fenced(_delta(1), 1), _fenced(_delta(2), 1), fence, _fenced(_delta(3), 1),
              _fenced(_terminal(3, interrupted), 2)]
    assert _event_problems(_run("INTERRUPTED"), reaped) == []
    gap = [_fenced(_delta(1), 1), fence, _fenced(_terminal(3, interrupted), 2)]
    assert _event_problems(_run("INTERRUPTED"), gap) == [f"run {RUN_ID}: sequences [1, 3] are not 1..n"]
