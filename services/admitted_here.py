"""Runs this gateway process admitted a moment ago, for the Stream its client opens right after.

A client's Stream usually follows its Submit within milliseconds, on the same connection and so
the same gateway process. Stream's ledger lookup (the key authenticated and tenant-scoped, the run
its tenant's, its trace, where its events start: ledger/runs_sql.py) then only tells what this
process knew a moment before: Submit authenticated that very key, checked its scope and wrote the
run for its tenant, and a run just written has no events yet. Remembering that skips one statement
per run (~250 us of gateway CPU and PostgreSQL's share: issue 9).

What it may change, and why it is bounded: the lookup also refuses a key revoked or expired since.
An entry serves only the Stream of the very key that submitted the run, once (a second Stream, a
resume, reads the ledger), and only within FRESH_S of the Submit: a key revoked or expired within
that second may still open the first stream of a run it had just submitted (the run itself goes on
regardless: revoking a key does not cancel its runs). Any other key, any other run, and anything
later reads the ledger as before. The key is kept as a digest, never as itself.
"""

from __future__ import annotations

import hashlib
import hmac
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

FRESH_S = 1.0       # an admission serves its run's first Stream this long after Submit
LIMIT = 8192        # entries kept at most (a Submit burst whose Streams never come)


@dataclass(frozen=True, slots=True)
class Admission:
    """What Submit knew of the run: who submitted it, its trace, when."""

    key_digest: bytes
    traceparent: str | None
    at: float


def key_digest(key: str) -> bytes:
    """What a process keeps of an API key to recognise it again: a digest, never the key."""
    return hashlib.blake2b(key.encode(), digest_size=16).digest()


class RecentAdmissions:
    """Admissions of the last FRESH_S, oldest first. Not thread-safe: one event loop's."""

    def __init__(self, fresh_s: float = FRESH_S, limit: int = LIMIT,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.fresh_s = fresh_s
        self.limit = limit
        self._clock = clock
        self._entries: dict[uuid.UUID, Admission] = {}     # insertion (= admission time) order

    def __len__(self) -> int:
        return len(self._entries)

    def admitted(self, run_id: uuid.UUID, key: str, traceparent: str | None) -> None:
        """A new run was committed for the tenant of `key` (a tenant-scoped key, authenticated now)."""
        now = self._clock()
        entries = self._entries
        while entries:
            oldest = next(iter(entries))
            if len(entries) < self.limit and now - entries[oldest].at < self.fresh_s:
                break
            del entries[oldest]
        entries[run_id] = Admission(key_digest(key), traceparent, now)

    def take(self, run_id: uuid.UUID, key: str) -> Admission | None:
        """The run's admission, if this process made it within FRESH_S with this very key; forgotten
        either way (a later Stream of the run reads the ledger)."""
        found = self._entries.pop(run_id, None)
        if found is None or self._clock() - found.at >= self.fresh_s:
            return None
        return found if hmac.compare_digest(found.key_digest, key_digest(key)) else None
