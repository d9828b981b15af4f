"""Submit contexts this gateway process read a moment ago, so that a Submit is one round trip.

A Submit's read (ledger/admission_sql.read_submit_context) finds the caller's key, tenant and model
and counts the model's backlog; its write reserves and inserts. For a tenant submitting to one model
again and again the read tells the same thing every time but the backlog. Kept here, the read is
skipped: the Submit is decided on the kept context with no backlog at all, and its write
(insert_reserving_if_held) checks in its own snapshot all that the decision took from here: the key
still good (not revoked, not expired, the same tenant and scope), the tenant's and the model's rows at
the very versions read (any admin change makes a new row version), the name still resolving to that
model with no canary on it, and the backlogs within the bounds under which the decision is the same
(services/traffic.backlog_bounds). Whatever fails, nothing is written, the entry is dropped
and the Submit is decided again on a fresh read: no refusal, no fallback, no admission is ever made
on what is only remembered. A key revoked or a tenant suspended is refused from the next Submit on,
as without the cache.

What is kept: contexts of tenant-scoped keys without concurrency or tokens-per-minute limits (those
take the transactional path anyway), for a name no canary splits. Keyed by a digest of the key (never
the key itself) and the name; FRESH_S bounds an entry's age (a fresh read now and then) and LIMIT the
entries (oldest dropped first).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

from sluice.ledger.admission_sql import SubmitContext
from sluice.services.admitted_here import key_digest

FRESH_S = 30.0      # an entry is used this long after its read, then read again
LIMIT = 4096        # entries kept at most (tenants x names)


@dataclass(frozen=True, slots=True)
class _Entry:
    context: SubmitContext
    at: float


def cacheable(context: SubmitContext) -> bool:
    """Whether a fresh context may be kept: a tenant key's, of a tenant without rate limits, for a
    model found with the row versions to check, the name split by no canary."""
    caller = context.caller
    return (caller is not None and caller.tenant is not None and not caller.tenant.has_rate_limits
            and not caller.tenant.suspended and context.model is not None and context.versions is not None
            and not context.canary_active and not context.canary)


class SubmitContexts:
    """Contexts read within FRESH_S, by (key digest, model name). One event loop's."""

    def __init__(self, fresh_s: float = FRESH_S, limit: int = LIMIT,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.fresh_s = fresh_s
        self.limit = limit
        self._clock = clock
        self._entries: dict[tuple[bytes, str], _Entry] = {}     # oldest read first

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str, model_name: str) -> SubmitContext | None:
        """The context read for this key and name within FRESH_S, with no backlog (the write counts
        it), or None."""
        slot = (key_digest(key), model_name)
        entry = self._entries.get(slot)
        if entry is None:
            return None
        if self._clock() - entry.at >= self.fresh_s:
            del self._entries[slot]
            return None
        return entry.context

    def put(self, key: str, model_name: str, context: SubmitContext) -> None:
        """Keep a context just read (when `cacheable`), its backlogs set to none."""
        if not cacheable(context):
            return
        entries = self._entries
        slot = (key_digest(key), model_name)
        entries.pop(slot, None)
        while len(entries) >= self.limit:
            del entries[next(iter(entries))]
        entries[slot] = _Entry(dataclasses.replace(context, backlog=0, batch_backlog=0), self._clock())

    def forget(self, key: str, model_name: str) -> None:
        self._entries.pop((key_digest(key), model_name), None)
