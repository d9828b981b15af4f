"""What to do with a run whose replica failed: retry elsewhere only before its first token.

A run that has streamed even one token to the event log has been seen: running
it again on another replica would regenerate a different continuation under the
same run id, which the design forbids (DESIGN.md, "Worker loss"). So once the
first token exists, a replica failure ends the run INTERRUPTED with the tokens
so far. Before the first token nothing has been promised, so the run may move
to another replica, a bounded number of times, never to one it already tried.

Host usage (the routing worker), on a replica error or a first-token timeout::

    action = after_replica_failure(tokens_streamed, attempts, max_attempts)
    if action is FailureAction.RETRY:
        policy.on_finished(request, failed_replica, now)   # release the failed attempt (output_tokens 0)
        views = [v for v in views if v.name not in tried]  # retry_candidates(views, tried)
        ...choose, persist the new replica on the run row, send...
    elif action is FailureAction.INTERRUPT: end INTERRUPTED with the durable tokens
    else: end FAILED with detail NO_REPLICA_STARTED

The released attempt reports no output tokens (on_finished's default 0): a retry happens only
before the first token, so the failed replica generated nothing the run will send back, and
the conversation's home moves to the replica the retry is routed to.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from enum import StrEnum

from sluice.router.policy import ReplicaView

DEFAULT_MAX_ATTEMPTS = 2
NO_REPLICA_STARTED = "no replica produced a first token after {attempts} attempt(s)"


class FailureAction(StrEnum):
    RETRY = "retry"              # no token yet: send the run to another replica
    INTERRUPT = "interrupt"      # tokens were streamed: end INTERRUPTED, never regenerate
    FAIL = "fail"                # no token yet but attempts are spent (or nowhere else to go): end FAILED


def after_replica_failure(tokens_streamed: int, attempts: int,
                          max_attempts: int = DEFAULT_MAX_ATTEMPTS,
                          other_replicas_available: bool = True) -> FailureAction:
    """`attempts` counts the replicas already tried, including the one that just failed."""
    assert tokens_streamed >= 0 and attempts >= 1, "a failure follows at least one attempt"
    if tokens_streamed > 0:
        return FailureAction.INTERRUPT
    if attempts < max_attempts and other_replicas_available:
        return FailureAction.RETRY
    return FailureAction.FAIL


def retry_candidates(replicas: Sequence[ReplicaView], tried: Collection[str]) -> list[ReplicaView]:
    """Replicas a retry may go to: any the run has not tried yet."""
    return [view for view in replicas if view.name not in tried]
