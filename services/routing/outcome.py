"""How an attempt ended, decided in one pure function (no I/O, no clock).

An attempt is one replica streaming one run. The driver observes it (tokens
received, the error that ended the replica's stream, the reason it stopped the
stream itself) and asks `decide` what follows:

    tokens received? ──yes──▶ end the run: COMPLETED, or the stop's status, or
         │                    INTERRUPTED (replica lost) / FAILED (refused, other error)
         no
         ▼
    failed before its first token (refused, lost, hung, silent past the first-token
    limit)? ──yes──▶ RETRY on a replica not tried yet while attempts < max_attempts,
         │           else FAILED "no replica produced a first token", prompt not charged
         no
         ▼
    the stop's status (cancelled, expired) or COMPLETED with no tokens

Consumed compute counts (DESIGN.md): the prompt is charged once some replica held
it (produced output, or held the request until the driver stopped it); a run no
replica ever took is not charged.
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.ledger.models import RunStatus
from sluice.services.finish import Ending
from sluice.services.replica_client import ReplicaLost, ReplicaRejected

from sluice.router.retry import NO_REPLICA_STARTED, FailureAction, after_replica_failure

DETAIL_CANCELLED = "cancelled by the caller"
DETAIL_EXPIRED = "deadline passed before the run completed"
DETAIL_NO_FIRST_TOKEN = "replica {replica} produced no token within {seconds:g}s"
DETAIL_REPLICA_LOST = "replica {replica} lost mid-stream after {tokens} tokens: {error}"
DETAIL_REPLICA_HUNG = "replica {replica} stopped answering after {tokens} tokens: {why}"
DETAIL_REPLICA_REJECTED = "replica {replica} refused the run: {error}"
DETAIL_NOT_STARTED = NO_REPLICA_STARTED + "; the last: {last}"
DETAIL_FAILED_BEFORE_START = "replica {replica} failed before the first token: {error}"


@dataclass(frozen=True, slots=True)
class Stop:
    """Why the driver stopped the replica's stream itself."""

    status: RunStatus
    detail: str
    no_first_token: bool = False  # the first-token limit: a failed attempt, retryable
    hung: bool = False            # the replica went silent and its liveness lapsed (monitor.py)


@dataclass(frozen=True, slots=True)
class Attempt:
    """One replica's attempt at the run, as the driver observed it."""

    replica: str
    received_tokens: int          # tokens this replica produced (within the run's cap)
    error: BaseException | None   # what ended the replica's stream, if it failed
    stop: Stop | None             # why the driver stopped it, if it did


@dataclass(frozen=True, slots=True)
class RunSoFar:
    attempts: int                 # replicas tried, this attempt's included
    max_attempts: int
    last_sequence: int            # last event of the run durable in the log
    output_tokens: int            # tokens in its durable DELTA events
    cached_input_tokens: int      # reported by the replica that produced the tokens
    prompt_taken: bool            # an earlier attempt's replica held the prompt


@dataclass(frozen=True, slots=True)
class Decision:
    ending: Ending | None         # None: retry on a replica not tried yet
    replica_failed: bool          # count against the replica's circuit breaker
    prompt_taken: bool            # carried into the next attempt or the settlement
    detail: str                   # why the attempt ended (for the log, and a retry's reason)


def attempt_detail(attempt: Attempt) -> str:
    if attempt.stop is not None:
        return attempt.stop.detail
    if isinstance(attempt.error, ReplicaRejected):
        return DETAIL_REPLICA_REJECTED.format(replica=attempt.replica, error=attempt.error)
    return DETAIL_FAILED_BEFORE_START.format(replica=attempt.replica, error=attempt.error)


def failed_before_first_token(attempt: Attempt) -> bool:
    """No token, and the replica refused or lost the request, or never answered in time."""
    if attempt.received_tokens:
        return False
    if attempt.stop is not None:
        return attempt.stop.no_first_token or attempt.stop.hung
    return isinstance(attempt.error, ReplicaLost | ReplicaRejected)


def decide(attempt: Attempt, run: RunSoFar) -> Decision:
    """What follows `attempt`: the run's Ending, or a retry elsewhere (ending None)."""
    stop, error = attempt.stop, attempt.error
    stopped_silent = stop is not None and (stop.no_first_token or stop.hung)
    replica_failed = stopped_silent or isinstance(error, ReplicaLost)
    held = attempt.received_tokens > 0 or (stop is not None and error is None)
    prompt_taken = run.prompt_taken or held
    detail = attempt_detail(attempt)
    if failed_before_first_token(attempt):
        if after_replica_failure(0, run.attempts, run.max_attempts) is FailureAction.RETRY:
            return Decision(None, replica_failed, prompt_taken, detail)
        return Decision(not_started(run, detail, prompt_taken), replica_failed, prompt_taken, detail)
    last, tokens, cached = run.last_sequence, run.output_tokens, run.cached_input_tokens
    if stop is not None and stop.hung:
        return Decision(Ending(RunStatus.INTERRUPTED, last, tokens, stop.detail, cached_input_tokens=cached),
                        True, prompt_taken, stop.detail)
    if stop is not None:
        return Decision(Ending(stop.status, last, tokens, stop.detail, cached_input_tokens=cached,
                               prompt_taken=prompt_taken), False, prompt_taken, stop.detail)
    if isinstance(error, ReplicaLost):
        lost = DETAIL_REPLICA_LOST.format(replica=attempt.replica, tokens=tokens, error=error)
        return Decision(Ending(RunStatus.INTERRUPTED, last, tokens, lost, cached_input_tokens=cached),
                        True, prompt_taken, lost)
    if isinstance(error, ReplicaRejected):
        return Decision(Ending(RunStatus.FAILED, last, tokens, detail, prompt_taken=prompt_taken),
                        False, prompt_taken, detail)
    if error is not None:
        failed = f"replica stream failed: {error!r}"
        return Decision(Ending(RunStatus.FAILED, last, tokens, failed, prompt_taken=prompt_taken),
                        False, prompt_taken, failed)
    completed = Ending(RunStatus.COMPLETED, last, tokens, cached_input_tokens=cached)
    return Decision(completed, False, prompt_taken, "completed")


def not_started(run: RunSoFar, last_detail: str, prompt_taken: bool) -> Ending:
    """No replica produced a first token: FAILED, the prompt charged only if some replica held it."""
    return Ending(RunStatus.FAILED, run.last_sequence, run.output_tokens,
                  DETAIL_NOT_STARTED.format(attempts=run.attempts, last=last_detail),
                  prompt_taken=prompt_taken)
