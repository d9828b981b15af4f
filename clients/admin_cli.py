"""`sluice admin …`: the Admin API from the command line (needs an admin-scoped key).

    sluice admin tenants create NAME [--tiers standard,premium] [--max-concurrent N] [--tpm N]
                                     [--token-budget N] [--cost-budget-micros N]
    sluice admin tenants list | show NAME | suspend NAME [--resume]
    sluice admin tenants limits NAME [--max-concurrent N] [--tpm N] [--tiers a,b]   (0 = unlimited)
    sluice admin budget set TENANT --tokens N --cost-micros N [--period YYYY-MM]
    sluice admin keys create [--tenant T] [--scope tenant|finance|admin] [--label L] [--expires-in-s N]
    sluice admin keys list [--tenant T] | rotate KEY [--overlap-s N] | revoke KEY
    sluice admin models register VERSION --tokenizer PATH --context-limit N --price-input M
                                 --price-cached M --price-output M [--pool P] [--tier T] [--end-id N]
                                 [--alias A]
    sluice admin models list | price VERSION --input M --cached M --output M | alias ALIAS VERSION
    sluice admin models retire VERSION
    sluice admin replicas list | remove NAME
    sluice admin replicas upsert NAME --grpc-address HOST:PORT [--pool P] [--metrics-url U] [--block-size N]
                                 [--kv-capacity-blocks N] [--long-context]
    sluice admin audit [--limit N] [--action ACTION]
    sluice admin fallbacks … | canary …   (clients/admin_traffic_cli.py)

Each prints the response as JSON. A created or rotated key's secret is printed once, with a
reminder on stderr: it cannot be shown again. KEY is a key id or its public prefix (sk-…).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any, TextIO

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from sluice_client.admin_traffic_cli import TRAFFIC_REQUESTS, add_traffic_parsers
from sluice_client.sdk import SluiceClient

from sluice.v1 import admin_pb2, routing_pb2

SECRET_NOTICE = "sluice: store this key's secret now: it is never shown again"


def _read_text(path: str) -> str:
    with open(path, encoding="utf-8") as file:
        return file.read()


def _tiers(value: str) -> list[str]:
    return [tier.strip() for tier in value.split(",") if tier.strip()]


def add_admin_parser(commands: Any, common: argparse.ArgumentParser) -> None:
    admin = commands.add_parser("admin", help="tenants, keys, budgets, models, replicas (admin key)")
    areas = admin.add_subparsers(dest="admin_area", required=True)

    def verb(area: Any, name: str, help_text: str) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = area.add_parser(name, help=help_text, parents=[common])
        return parser

    tenants = areas.add_parser("tenants", help="create, list, show, suspend, limits").add_subparsers(
        dest="admin_verb", required=True
    )
    create = verb(tenants, "create", "a new tenant")
    create.add_argument("name")
    create.add_argument("--tiers", type=_tiers, default=[])
    create.add_argument("--max-concurrent", type=int, default=0)
    create.add_argument("--tpm", type=int, default=0, help="tokens per minute (0 = unlimited)")
    create.add_argument("--token-budget", type=int, default=0)
    create.add_argument("--cost-budget-micros", type=int, default=0)
    verb(tenants, "list", "every tenant")
    verb(tenants, "show", "a tenant and its current budget").add_argument("name")
    suspend = verb(tenants, "suspend", "refuse its new runs (runs in flight finish)")
    suspend.add_argument("name")
    suspend.add_argument("--resume", action="store_true", help="lift the suspension instead")
    limits = verb(tenants, "limits", "change limits (0 = unlimited; unset = unchanged)")
    limits.add_argument("name")
    limits.add_argument("--max-concurrent", type=int, default=None)
    limits.add_argument("--tpm", type=int, default=None)
    limits.add_argument("--tiers", type=_tiers, default=[])

    budget = areas.add_parser("budget", help="a tenant's budget for a period").add_subparsers(
        dest="admin_verb", required=True
    )
    set_budget = verb(budget, "set", "set a period's token and cost budget")
    set_budget.add_argument("tenant")
    set_budget.add_argument("--tokens", type=int, required=True)
    set_budget.add_argument("--cost-micros", type=int, required=True)
    set_budget.add_argument("--period", default="", help="YYYY-MM (default: this month)")

    keys = areas.add_parser("keys", help="create, list, rotate, revoke API keys").add_subparsers(
        dest="admin_verb", required=True
    )
    create_key = verb(keys, "create", "a new key (its secret is shown once)")
    create_key.add_argument("--tenant", default="")
    create_key.add_argument("--scope", default="tenant", choices=("tenant", "finance", "admin"))
    create_key.add_argument("--label", default="")
    create_key.add_argument("--expires-in-s", type=int, default=0)
    verb(keys, "list", "keys (prefix, scope, created, last used, expiry)").add_argument(
        "--tenant", default=""
    )
    rotate = verb(keys, "rotate", "a new key; the old one stays valid for the overlap")
    rotate.add_argument("key")
    rotate.add_argument("--overlap-s", type=int, default=0, help="default: one hour")
    verb(keys, "revoke", "refuse the key from the next request").add_argument("key")

    models = areas.add_parser("models", help="register, price, alias, retire").add_subparsers(
        dest="admin_verb", required=True
    )
    register = verb(models, "register", "a new model version with its price card")
    register.add_argument("version")
    register.add_argument("--tokenizer", required=True)
    register.add_argument("--context-limit", type=int, required=True)
    register.add_argument("--pool", default="")
    register.add_argument("--tier", default="")
    register.add_argument("--end-id", type=int, default=0)
    register.add_argument("--alias", default="")
    register.add_argument("--chat-template", type=_read_text, default="",
                          help="a Jinja file for the HTTP edge")
    for name in ("input", "cached", "output"):
        register.add_argument(f"--price-{name}", type=int, required=True, help="micro-USD per million tokens")
    verb(models, "list", "every version")
    price = verb(models, "price", "a new price card (applies to runs admitted after it)")
    price.add_argument("version")
    for name in ("input", "cached", "output"):
        price.add_argument(f"--{name}", type=int, required=True, help="micro-USD per million tokens")
    alias = verb(models, "alias", "move an alias to a version (accepted runs keep theirs)")
    alias.add_argument("alias")
    alias.add_argument("version")
    verb(models, "retire", "admit no new runs on a version").add_argument("version")

    replicas = areas.add_parser("replicas", help="the durable replica registry").add_subparsers(
        dest="admin_verb", required=True
    )
    verb(replicas, "list", "the registry routing processes follow")
    upsert = verb(replicas, "upsert", "add or replace a replica")
    upsert.add_argument("name")
    upsert.add_argument("--grpc-address", required=True, help="the replica's Triton gRPC host:port")
    upsert.add_argument("--pool", default="")
    upsert.add_argument("--metrics-url", default="")
    upsert.add_argument("--block-size", type=int, default=0)
    upsert.add_argument("--kv-capacity-blocks", type=int, default=0)
    upsert.add_argument("--long-context", action="store_true")
    verb(replicas, "remove", "remove a replica (also a configured one)").add_argument("name")

    add_traffic_parsers(areas, verb)

    audit = areas.add_parser("audit", help="recent admin changes, newest first", parents=[common])
    audit.add_argument("--limit", type=int, default=0)
    audit.add_argument("--action", default="")


def _limits(args: argparse.Namespace) -> admin_pb2.SetLimitsRequest:
    request = admin_pb2.SetLimitsRequest(name=args.name, allowed_tiers=args.tiers)
    if args.max_concurrent is not None:
        request.max_concurrent_runs = args.max_concurrent
    if args.tpm is not None:
        request.tokens_per_minute = args.tpm
    return request


# (area, verb) → (Admin method, request built from the arguments)
REQUESTS: dict[tuple[str, str | None], tuple[str, Callable[[argparse.Namespace], Message]]] = {
    ("tenants", "create"): (
        "CreateTenant",
        lambda a: admin_pb2.CreateTenantRequest(
            name=a.name,
            allowed_tiers=a.tiers,
            max_concurrent_runs=a.max_concurrent,
            tokens_per_minute=a.tpm,
            token_budget=a.token_budget,
            cost_budget_micros=a.cost_budget_micros,
        ),
    ),
    ("tenants", "list"): ("ListTenants", lambda a: admin_pb2.ListTenantsRequest()),
    ("tenants", "show"): ("GetTenant", lambda a: admin_pb2.GetTenantRequest(name=a.name)),
    ("tenants", "suspend"): (
        "SuspendTenant",
        lambda a: admin_pb2.SuspendTenantRequest(name=a.name, resume=a.resume),
    ),
    ("tenants", "limits"): ("SetLimits", _limits),
    ("budget", "set"): (
        "SetBudget",
        lambda a: admin_pb2.SetBudgetRequest(
            tenant=a.tenant, period=a.period, token_budget=a.tokens, cost_budget_micros=a.cost_micros
        ),
    ),
    ("keys", "create"): (
        "CreateApiKey",
        lambda a: admin_pb2.CreateApiKeyRequest(
            tenant=a.tenant, scope=a.scope, label=a.label, expires_in_s=a.expires_in_s
        ),
    ),
    ("keys", "list"): ("ListApiKeys", lambda a: admin_pb2.ListApiKeysRequest(tenant=a.tenant)),
    ("keys", "rotate"): (
        "RotateApiKey",
        lambda a: admin_pb2.RotateApiKeyRequest(id=a.key, overlap_s=a.overlap_s),
    ),
    ("keys", "revoke"): ("RevokeApiKey", lambda a: admin_pb2.RevokeApiKeyRequest(id=a.key)),
    ("models", "register"): (
        "RegisterModel",
        lambda a: admin_pb2.RegisterModelRequest(
            version=a.version,
            tokenizer=a.tokenizer,
            context_limit=a.context_limit,
            worker_pool=a.pool,
            quality_tier=a.tier,
            end_id=a.end_id,
            alias=a.alias,
            chat_template=a.chat_template,
            price_input_per_m_micros=a.price_input,
            price_cached_input_per_m_micros=a.price_cached,
            price_output_per_m_micros=a.price_output,
        ),
    ),
    ("models", "list"): ("ListModels", lambda a: admin_pb2.ListModelsRequest()),
    ("models", "price"): (
        "SetPriceCard",
        lambda a: admin_pb2.SetPriceCardRequest(
            version=a.version,
            price_input_per_m_micros=a.input,
            price_cached_input_per_m_micros=a.cached,
            price_output_per_m_micros=a.output,
        ),
    ),
    ("models", "alias"): (
        "MoveAlias",
        lambda a: admin_pb2.MoveAliasRequest(alias=a.alias, version=a.version),
    ),
    ("models", "retire"): ("RetireModel", lambda a: admin_pb2.RetireModelRequest(version=a.version)),
    ("replicas", "list"): ("ListReplicas", lambda a: routing_pb2.ListReplicasRequest()),
    ("replicas", "upsert"): (
        "UpsertReplica",
        lambda a: routing_pb2.Replica(
            name=a.name,
            grpc_address=a.grpc_address,
            pool=a.pool,
            metrics_url=a.metrics_url,
            block_size=a.block_size,
            kv_capacity_blocks=a.kv_capacity_blocks,
            long_context=a.long_context,
        ),
    ),
    ("replicas", "remove"): ("RemoveReplica", lambda a: routing_pb2.RemoveReplicaRequest(name=a.name)),
    ("audit", None): ("ListAudit", lambda a: admin_pb2.ListAuditRequest(limit=a.limit, action=a.action)),
    **TRAFFIC_REQUESTS,
}


async def run_admin(client: SluiceClient, args: argparse.Namespace, out: TextIO) -> int:
    method, build = REQUESTS[(args.admin_area, getattr(args, "admin_verb", None))]
    response = await client.admin(method, build(args))
    print(json.dumps(MessageToDict(response, preserving_proto_field_name=True), indent=2), file=out)
    if isinstance(response, admin_pb2.CreatedApiKey):
        print(SECRET_NOTICE, file=sys.stderr)
    return 0
