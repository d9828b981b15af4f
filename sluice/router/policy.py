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
    policy.on_finished(request, decision.replica, now)
    policy.on_replica_restarted(name)               # host saw start time / counters reset
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from sluice.router.policies import PolicyOptions


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

    def on_finished(self, request: RouteRequest, replica: str, now: float) -> None:
        ...

    def on_replica_restarted(self, replica: str) -> None:
        ...


class RoundRobin:
    """Cycle through the candidates in name order; the foundation's policy."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView],
               now: float) -> RouteDecision | None:
        if not replicas:
            return None
        ordered = sorted(replicas, key=lambda view: view.name)
        chosen = ordered[self._next % len(ordered)]
        self._next += 1
        return RouteDecision(replica=chosen.name, outcome="round_robin")

    def on_routed(self, request: RouteRequest, decision: RouteDecision, now: float) -> None:
        return None

    def on_finished(self, request: RouteRequest, replica: str, now: float) -> None:
        return None

    def on_replica_restarted(self, replica: str) -> None:
        return None


KNOWN_POLICIES = ("round_robin", "least_loaded", "prefix_aware", "oracle")
UNKNOWN_POLICY = "unknown routing policy {name!r}; known: " + ", ".join(KNOWN_POLICIES)
ORACLE_NEEDS_PROBE = "the oracle policy needs cached_tokens=<probe of each replica's exact cache>"


def make_policy(name: str, *, cached_tokens: CachedTokensProbe | None = None,
                **options: float) -> RoutingPolicy:
    """Factory used by both hosts, so both run the very same policy class for a name.

    `options` override fields of `router.policies.PolicyOptions` (imbalance_bound,
    imbalance_slack, prefill_weight, long_context_threshold_tokens, index_ttl_s,
    max_conversations); round_robin ignores them. `cached_tokens` is only for the
    simulator's oracle: a probe of each replica's exact cache.
    """
    # Imported here: router.policies builds on the dataclasses above.
    from sluice.router.policies import PolicyOptions

    return _build(name, PolicyOptions.with_overrides(options), cached_tokens)


def _build(name: str, settings: PolicyOptions, cached_tokens: CachedTokensProbe | None) -> RoutingPolicy:
    from sluice.router.policies import LeastLoaded, PrefixAware

    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded(settings)
    if name == "prefix_aware":
        return PrefixAware(settings)
    if name == "oracle":
        if cached_tokens is None:
            raise ValueError(ORACLE_NEEDS_PROBE)
        return PrefixAware(settings, cached_tokens=cached_tokens)
    raise ValueError(UNKNOWN_POLICY.format(name=name))


BAD_POLICY_OPTIONS = "[routing].policy_options must be a table of numbers, got {value!r}"


def make_policy_from_config(routing: Mapping[str, object]) -> RoutingPolicy:
    """The policy a `[routing]` config section names: `policy` plus an optional `policy_options` table,
    e.g. ``policy_options = { imbalance_bound = 0.2, long_context_threshold_tokens = 32768 }``."""
    table = routing.get("policy_options", {})
    if not isinstance(table, Mapping) or not all(
            isinstance(value, int | float) and not isinstance(value, bool) for value in table.values()):
        raise ValueError(BAD_POLICY_OPTIONS.format(value=table))
    from sluice.router.policies import PolicyOptions

    options = PolicyOptions.with_overrides({str(key): float(value) for key, value in table.items()})
    return _build(str(routing.get("policy", "round_robin")), options, None)


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
