"""What a gateway remembers of the runs it just admitted (services/admitted_here.py): an entry serves
only the submitting key, once, within FRESH_S of the Submit, and the memory stays bounded."""

from __future__ import annotations

import uuid

from sluice.services.admitted_here import RecentAdmissions


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_admission_serves_the_submitting_keys_first_stream_once_with_its_trace():
    recent = RecentAdmissions(fresh_s=1.0, clock=Clock())
    run = uuid.uuid4()
    recent.admitted(run, "sk-key", "00-trace-01")
    found = recent.take(run, "sk-key")
    assert found is not None and found.traceparent == "00-trace-01"
    assert recent.take(run, "sk-key") is None             # a second Stream reads the ledger


def test_another_key_or_a_stale_admission_is_not_served_and_is_forgotten():
    clock = Clock()
    recent = RecentAdmissions(fresh_s=1.0, clock=clock)
    other_key, stale = uuid.uuid4(), uuid.uuid4()
    recent.admitted(other_key, "sk-key", None)
    recent.admitted(stale, "sk-key", None)
    assert recent.take(other_key, "sk-other") is None
    assert recent.take(other_key, "sk-key") is None       # forgotten by the failed take
    clock.now += 1.0
    assert recent.take(stale, "sk-key") is None           # FRESH_S after Submit: the ledger decides
    assert recent.take(uuid.uuid4(), "sk-key") is None


def test_admissions_older_than_fresh_s_or_past_the_limit_are_dropped_as_new_ones_come():
    clock = Clock()
    recent = RecentAdmissions(fresh_s=1.0, limit=3, clock=clock)
    runs = [uuid.uuid4() for _ in range(5)]
    for run in runs[:2]:
        recent.admitted(run, "k", None)
    clock.now += 1.0
    recent.admitted(runs[2], "k", None)
    assert len(recent) == 1                               # the two stale ones went
    for run in runs[3:]:
        recent.admitted(run, "k", None)
    assert len(recent) == 3
    recent.admitted(uuid.uuid4(), "k", None)
    assert len(recent) == 3 and recent.take(runs[2], "k") is None   # the oldest went at the limit
    assert recent.take(runs[4], "k") is not None
