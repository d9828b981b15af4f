"""The one routing-policy interface, used by both hosts.

The live routing service (services/routing) and the fleet simulator (sim/)
build the same `RouteRequest` and `ReplicaView` values and call the same
policy object, so a policy measured in simulation is the policy that runs in
production. Policies are pure: no I/O, no clock reads. Time, when a policy
needs it (TTL eviction), arrives as `now` in seconds on whatever clock the
host runs (wall clock live, virtual clock in the simulator).

Lifecycle, as the host drives it:

    decision = policy.choose(request, views, now)   # pick a replica (or None)
    policy.on_routed(request, decision, now)        # learn: prefix index, in-flight counts
    ...                                             # run executes
    policy.on_finished(request, decision.replica, now, output_tokens=n)
    policy.on_replica_restarted(name)               # host saw start time / counters reset

`output_tokens` is how many tokens the run generated (0 when it produced none,
or when the host does not know): the replica's cache now holds the prompt and
that answer, which a conversation's next turn sends back as history. The
default keeps hosts that do not count tokens working; a policy that reads it
must treat 0 as "nothing known beyond the prompt".
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class RouteRequest:
    request_id: str
    model_version: str                  # the pool key
    token_ids: Sequence[int]            # the tokenized prompt
    max_output_tokens: int
    conversation_id: str | None = None  # session affinity key, when the client sends one
    cache_salt: int = 0                 # trust scope: keys the prefix index (0 = unscoped: sim, tests)


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What a host knows about one replica at decision time."""

    name: str
    pool: str                           # model version served
    block_size: int                     # KV block size in tokens (prefix hashing aligns to it)
    kv_capacity_blocks: int             # total KV blocks of the replica
    healthy: bool = True                # False while the circuit breaker is open
    long_context: bool = False          # member of the long-context pool
    waiting: int = 0                    # queued requests, as last reported by the replica
    running: int = 0                    # active requests, as last reported
    kv_used_blocks: int = 0             # as last reported
    in_flight: int = 0                  # host's own count of runs sent and not finished
    start_time: float = 0.0             # replica's reported start time; a change means a restart
    step_time_s: float = 0.0            # its recent decode step time, as reported (0 = unknown): a
                                        # throttled or degraded replica steps slower at the same load
    host_kv_capacity_blocks: int = 0    # blocks its host-memory KV tier holds (0 = no tier)
    host_block_cost: float = 0.0        # copying a block back from the host tier, as a share of
                                        # prefilling it (CostModel.host_block_cost)
    prefill_tokens_per_s: float = 0.0   # its prompt-processing rate (0 = unknown: the policy's default)


@dataclass(frozen=True, slots=True)
class RouteDecision:
    replica: str
    outcome: str                        # e.g. affinity_hit | balanced_away | fallback | round_robin
    predicted_cached_tokens: int = 0    # prompt tokens the policy expects the replica to have cached


CachedTokensProbe = Callable[[str, Sequence[int]], int]
"""(replica name, prompt token ids) -> prompt tokens that replica has cached right now."""


class RoutingPolicy(Protocol):
    name: str

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView],
               now: float) -> RouteDecision | None:
        """Pick a replica among `replicas` (already filtered to the request's pool
        and to healthy members by the host), or None when none can take it."""
        ...

    def on_routed(self, request: RouteRequest, decision: RouteDecision, now: float) -> None:
        ...

    def on_finished(self, request: RouteRequest, replica: str, now: float,
                    output_tokens: int = 0) -> None:
        ...

    def on_replica_restarted(self, replica: str) -> None:
        ...


class RoundRobin:
    """Take the candidates in turn, in name order; the foundation's policy, blind to load.

    Blind to load, not to capacity: a replica that reports a slower step (`step_time_s`, e.g. a GPU
    throttled to 60%) takes its turn in proportion to its speed against the pool's fastest (smooth
    weighted round robin, as nginx does it), so it never gets more than its fair share of the work
    (issue 17's slow replica: plain rotation sent it 25% of four, against 0.6 / 3.6 = 16.7%). Replicas
    of equal or unknown speed keep strict rotation.
    """

    name = "round_robin"

    def __init__(self) -> None:
        self._credit: dict[str, float] = {}     # replica -> its running credit (smooth weighted RR)

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView],
               now: float) -> RouteDecision | None:
        if not replicas:
            return None
        ordered = sorted(replicas, key=lambda view: view.name)
        fastest = min((view.step_time_s for view in ordered if view.step_time_s > 0.0), default=0.0)
        credit = self._credit
        total = 0.0
        chosen: ReplicaView | None = None
        for view in ordered:
            weight = fastest / view.step_time_s if fastest > 0.0 and view.step_time_s > 0.0 else 1.0
            total += weight
            credit[view.name] = credit.get(view.name, 0.0) + weight
            if chosen is None or credit[view.name] > credit[chosen.name]:
                chosen = view
        assert chosen is not None
        credit[chosen.name] -= total
        return RouteDecision(replica=chosen.name, outcome="round_robin")

    def on_routed(self, request: RouteRequest, decision: RouteDecision, now: float) -> None:
        return None

    def on_finished(self, request: RouteRequest, replica: str, now: float,
                    output_tokens: int = 0) -> None:
        return None

    def on_replica_restarted(self, replica: str) -> None:
        return None


def explain(policy: RoutingPolicy, request: RouteRequest, replicas: Sequence[ReplicaView],
            now: float) -> RouteDecision | None:
    """What `policy` would choose now, without changing what it chooses next (an Explain API).

    least_loaded and prefix_aware decide from state that choose() does not change
    (it only catches up with `now`: TTL expiry, remembered views, a hash cache), so
    they are asked directly; copying a prefix index of millions of entries would
    block the caller for seconds. round_robin's choose() advances its turn, so it
    is asked through a copy.
    """
    if isinstance(policy, RoundRobin):
        return copy.deepcopy(policy).choose(request, replicas, now)
    return policy.choose(request, replicas, now)
