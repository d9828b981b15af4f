"""`sluice admin fallbacks|canary …`: the traffic-policy Admin RPCs (issue 14) from the command line.

    sluice admin fallbacks set TENANT --rule chat-70b=chat-8b[:backlog,deadline] [--rule …]  (none: clear)
    sluice admin fallbacks show TENANT
    sluice admin canary start ALIAS VERSION --share PCT [--window-s S] [--min-samples N]
                              [--max-ttft-ratio R] [--max-tpot-ratio R] [--max-failure-increase F]
    sluice admin canary list | share ALIAS PCT | stop ALIAS [--reason TEXT] | promote ALIAS
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from google.protobuf.message import Message

from sluice.v1 import admin_pb2

BAD_RULE = "a rule is FROM=TO or FROM=TO:backlog,deadline (got {value!r})"


def fallback_rule(value: str) -> admin_pb2.FallbackRule:
    """FROM=TO[:cond,cond] → a rule (no conditions: both)."""
    mapping, _, conditions = value.partition(":")
    source, equals, target = mapping.partition("=")
    if not equals or not source or not target:
        raise argparse.ArgumentTypeError(BAD_RULE.format(value=value))
    return admin_pb2.FallbackRule(from_model=source, to_model=target,
                                  conditions=[c.strip() for c in conditions.split(",") if c.strip()])


def basis_points(percent: str) -> int:
    return round(float(percent) * 100)


def add_traffic_parsers(areas: Any, verb: Callable[[Any, str, str], argparse.ArgumentParser]) -> None:
    fallbacks = areas.add_parser("fallbacks", help="models a tenant accepts instead of one requested")
    fallbacks = fallbacks.add_subparsers(dest="admin_verb", required=True)
    set_rules = verb(fallbacks, "set", "replace the tenant's fallback rules (tried in order)")
    set_rules.add_argument("tenant")
    set_rules.add_argument("--rule", dest="rules", type=fallback_rule, action="append", default=[],
                           help="FROM=TO[:backlog,deadline]")
    verb(fallbacks, "show", "the tenant's fallback rules").add_argument("tenant")

    canary = areas.add_parser("canary", help="split an alias's new runs to a candidate").add_subparsers(
        dest="admin_verb", required=True)
    start = verb(canary, "start", "send a share of the alias's new runs to VERSION, under guardrails")
    start.add_argument("alias")
    start.add_argument("version")
    start.add_argument("--share", type=basis_points, required=True, help="percent of conversations, e.g. 20")
    start.add_argument("--window-s", type=float, default=0.0, help="default 300")
    start.add_argument("--min-samples", type=int, default=0, help="per arm and metric; default 20")
    start.add_argument("--max-ttft-ratio", type=float, default=0.0, help="default 1.5")
    start.add_argument("--max-tpot-ratio", type=float, default=0.0, help="default 1.5")
    start.add_argument("--max-failure-increase", type=float, default=0.0, help="default 0.05")
    verb(canary, "list", "every canary: share, state, last judgment, why it ended")
    share = verb(canary, "share", "change an active canary's share")
    share.add_argument("alias")
    share.add_argument("share", type=basis_points, help="percent")
    stop = verb(canary, "stop", "roll the share back to 0%")
    stop.add_argument("alias")
    stop.add_argument("--reason", default="")
    verb(canary, "promote", "move the alias to the candidate").add_argument("alias")


TRAFFIC_REQUESTS: dict[tuple[str, str | None], tuple[str, Callable[[argparse.Namespace], Message]]] = {
    ("fallbacks", "set"): ("SetFallbacks",
                           lambda a: admin_pb2.SetFallbacksRequest(tenant=a.tenant, rules=a.rules)),
    ("fallbacks", "show"): ("GetFallbacks", lambda a: admin_pb2.GetFallbacksRequest(tenant=a.tenant)),
    ("canary", "start"): ("StartCanary", lambda a: admin_pb2.StartCanaryRequest(
        alias=a.alias, candidate_version=a.version, share_bp=a.share,
        guardrails=admin_pb2.CanaryGuardrails(
            window_s=a.window_s, min_samples=a.min_samples, max_ttft_ratio=a.max_ttft_ratio,
            max_tpot_ratio=a.max_tpot_ratio, max_failure_rate_increase=a.max_failure_increase))),
    ("canary", "list"): ("ListCanaries", lambda a: admin_pb2.ListCanariesRequest()),
    ("canary", "share"): ("SetCanaryShare", lambda a: admin_pb2.SetCanaryShareRequest(alias=a.alias,
                                                                                      share_bp=a.share)),
    ("canary", "stop"): ("StopCanary", lambda a: admin_pb2.StopCanaryRequest(alias=a.alias, reason=a.reason)),
    ("canary", "promote"): ("PromoteCanary", lambda a: admin_pb2.PromoteCanaryRequest(alias=a.alias)),
}
