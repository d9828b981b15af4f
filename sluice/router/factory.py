"""Policies by name: the one factory both hosts (the routing service and the fleet simulator) use.

It sits above router.policy (the interface and round_robin) and router.policies (the load- and
cache-aware policies), so neither of those imports the other back.
"""

from __future__ import annotations

from collections.abc import Mapping

from sluice.router.policies import LeastLoaded, PolicyOptions, PrefixAware
from sluice.router.policy import CachedTokensProbe, RoundRobin, RoutingPolicy

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
    return _build(name, PolicyOptions.with_overrides(options), cached_tokens)


def _build(name: str, settings: PolicyOptions, cached_tokens: CachedTokensProbe | None) -> RoutingPolicy:
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
    options = PolicyOptions.with_overrides({str(key): float(value) for key, value in table.items()})
    return _build(str(routing.get("policy", "round_robin")), options, None)
