"""Seed the demo ledger: `python -m sluice.ledger.seed [--key KEY] [--other-key KEY] [--admin-key KEY]
[--dsn DSN]`.

Idempotent: running it again changes nothing except refreshing the model row (end_id from the
tokenizer) and the tenants' tiers and limits, and adding a key given with --key. Creates

- tenant "demo" with API key DEMO_API_KEY (fixed and documented, for the local demo only), a
  budget for the current UTC month of 1,000,000 tokens and $50, and limits of 64 concurrent runs
  and 1,000,000 tokens per minute;
- tenant "other" with OTHER_API_KEY, for isolation demos and tests (same budget; 8 concurrent
  runs, 200,000 tokens per minute);
- an admin-scoped API key DEMO_ADMIN_KEY (fixed and documented, for the local demo only) for the
  Admin API and finance (`sluice admin …`, `sluice usage export|reconcile`);
- model version "tiny-chat-v1" (alias "chat"): the CPU model's tokenizer, context 4,096 tokens,
  pool "tiny-chat-v1", tier "standard", $0.50 / $0.05 cached / $1.50 per million tokens, end_id
  read from the tokenizer's <|endoftext|>, and its chat template (tiny-chat/chat_template.jinja);
- model version "smollm2-135m-instruct" (alias "chat-small"): the real SmolLM2-135M-Instruct that
  the default replicas r0/r1 compute on CPU (engine/llama), its tokenizer and chat template
  (sluice/models/smollm2-135m-instruct), context 8,192 tokens (the model's, and the replica's
  default KV pool), pool "smollm2-135m-instruct", tier "standard", $0.10 / $0.01 cached / $0.30
  per million tokens, end_id its end-of-turn token <|im_end|>, chat template the GGUF's own.

Each model's prices are its current price card (price_cards).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import uuid
from dataclasses import dataclass

from sluice.ledger.admin import ModelAdmin
from sluice.ledger.db import make_engine, make_sessionmaker
from sluice.ledger.models import ApiKey, Budget, KeyScope, Model, Tenant
from sluice.ledger.repositories import hash_api_key
from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from sluice.models import load_tokenizer, resolve_tokenizer_path

DEMO_API_KEY = "sk-demo-00000000000000000000000000000000"
OTHER_API_KEY = "sk-other-0000000000000000000000000000000"
DEMO_ADMIN_KEY = "sk-admin-0000000000000000000000000000000"
END_OF_TEXT = "<|endoftext|>"
LIMIT_COLUMNS = ("allowed_tiers", "max_concurrent_runs", "tokens_per_minute")  # refreshed on re-seed
USD = 1_000_000  # micro-USD


@dataclass(frozen=True, slots=True)
class TenantSeed:
    name: str
    api_key: str
    allowed_tiers: tuple[str, ...]
    token_budget: int
    cost_budget_micros: int
    max_concurrent_runs: int | None = None  # None = unlimited
    tokens_per_minute: int | None = None


@dataclass(frozen=True, slots=True)
class ModelSeed:
    version: str
    alias: str | None
    tokenizer: str
    context_limit: int
    worker_pool: str
    quality_tier: str
    price_input_per_m_micros: int
    price_cached_input_per_m_micros: int
    price_output_per_m_micros: int
    chat_template: str | None = None  # Jinja file beside the tokenizer (package-relative); None: none
    end_token: str = END_OF_TEXT    # the token whose id is the model's end_id


TINY_CHAT = ModelSeed(
    version="tiny-chat-v1",
    alias="chat",
    tokenizer="tiny-chat/tokenizer.json",
    context_limit=4096,
    worker_pool="tiny-chat-v1",
    quality_tier="standard",
    price_input_per_m_micros=USD // 2,          # $0.50 per million input tokens
    price_cached_input_per_m_micros=USD // 20,  # $0.05 per million cached input tokens
    price_output_per_m_micros=3 * USD // 2,     # $1.50 per million output tokens
    chat_template="tiny-chat/chat_template.jinja",
)

# 135M parameters on a CPU: priced well below tiny-chat's "8B on an H100" card.
SMOLLM2 = ModelSeed(
    version="smollm2-135m-instruct",
    alias="chat-small",
    tokenizer="smollm2-135m-instruct/tokenizer.json",
    context_limit=8192,
    worker_pool="smollm2-135m-instruct",
    quality_tier="standard",
    price_input_per_m_micros=USD // 10,         # $0.10 per million input tokens
    price_cached_input_per_m_micros=USD // 100,  # $0.01 per million cached input tokens
    price_output_per_m_micros=3 * USD // 10,    # $0.30 per million output tokens
    end_token="<|im_end|>",                     # end of turn: where an instruct answer stops
    chat_template="smollm2-135m-instruct/chat_template.jinja",   # the GGUF's own, verbatim
)
MODELS = (TINY_CHAT, SMOLLM2)


def tenant_seeds(demo_key: str, other_key: str) -> tuple[TenantSeed, ...]:
    return (
        TenantSeed("demo", demo_key, ("standard",), token_budget=1_000_000, cost_budget_micros=50 * USD,
                   max_concurrent_runs=64, tokens_per_minute=1_000_000),
        TenantSeed("other", other_key, ("standard",), token_budget=1_000_000, cost_budget_micros=50 * USD,
                   max_concurrent_runs=8, tokens_per_minute=200_000),
    )


def end_id_of(tokenizer_path: str, end_token: str = END_OF_TEXT) -> int:
    end_id = load_tokenizer(tokenizer_path).token_to_id(end_token)
    if end_id is None:
        raise SystemExit(f"{tokenizer_path} has no {end_token} token: cannot set the model's end_id")
    return int(end_id)


def read_chat_template(path: str | None) -> str | None:
    """The template text the registry stores (the file is only where it ships)."""
    return resolve_tokenizer_path(path).read_text(encoding="utf-8") if path else None


def first_of_month(today: dt.date) -> dt.date:
    return today.replace(day=1)


async def upsert_model(session: AsyncSession, model: ModelSeed) -> None:
    values = {
        "version": model.version,
        "alias": model.alias,
        "tokenizer": model.tokenizer,
        "context_limit": model.context_limit,
        "worker_pool": model.worker_pool,
        "quality_tier": model.quality_tier,
        "end_id": end_id_of(model.tokenizer, model.end_token),
        "price_input_per_m_micros": model.price_input_per_m_micros,
        "price_cached_input_per_m_micros": model.price_cached_input_per_m_micros,
        "price_output_per_m_micros": model.price_output_per_m_micros,
        "chat_template": read_chat_template(model.chat_template),
    }
    statement = pg_insert(Model).values(**values)
    await session.execute(
        statement.on_conflict_do_update(
            index_elements=[Model.version],
            set_={k: statement.excluded[k] for k in values if k != "version"},
        )
    )
    await ModelAdmin(session).ensure_price_card(model.version)


async def ensure_tenant(session: AsyncSession, seed: TenantSeed, period_start: dt.date) -> uuid.UUID:
    statement = pg_insert(Tenant).values(
        id=uuid.uuid4(),
        name=seed.name,
        allowed_tiers=list(seed.allowed_tiers),
        max_concurrent_runs=seed.max_concurrent_runs,
        tokens_per_minute=seed.tokens_per_minute,
    )
    await session.execute(
        statement.on_conflict_do_update(
            index_elements=[Tenant.name],
            set_={k: statement.excluded[k] for k in LIMIT_COLUMNS},
        )
    )
    tenant_id = await session.scalar(select(Tenant.id).where(Tenant.name == seed.name))
    assert tenant_id is not None
    await session.execute(
        pg_insert(ApiKey)
        .values(id=uuid.uuid4(), tenant_id=tenant_id, key_hash=hash_api_key(seed.api_key),
                key_prefix=seed.api_key[:8])
        .on_conflict_do_nothing(index_elements=[ApiKey.key_hash])
    )
    await session.execute(
        pg_insert(Budget)
        .values(tenant_id=tenant_id, period_start=period_start, token_budget=seed.token_budget,
                cost_budget_micros=seed.cost_budget_micros)
        .on_conflict_do_nothing(index_elements=[Budget.tenant_id, Budget.period_start])
    )
    return tenant_id


async def ensure_admin_key(session: AsyncSession, key: str) -> None:
    await session.execute(
        pg_insert(ApiKey)
        .values(id=uuid.uuid4(), tenant_id=None, key_hash=hash_api_key(key), key_prefix=key[:8],
                scope=KeyScope.ADMIN.value, label="seeded demo admin key")
        .on_conflict_do_nothing(index_elements=[ApiKey.key_hash])
    )


async def seed(dsn: str | None, demo_key: str, other_key: str, admin_key: str = DEMO_ADMIN_KEY) -> None:
    engine = make_engine(dsn, pool_size=1, max_overflow=0)
    try:
        async with make_sessionmaker(engine)() as session, session.begin():
            for model in MODELS:
                await upsert_model(session, model)
            period = first_of_month(dt.datetime.now(dt.UTC).date())
            for tenant in tenant_seeds(demo_key, other_key):
                await ensure_tenant(session, tenant, period)
            await ensure_admin_key(session, admin_key)
    finally:
        await engine.dispose()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--key", default=DEMO_API_KEY, help="API key for tenant 'demo'")
    parser.add_argument("--other-key", default=OTHER_API_KEY, help="API key for tenant 'other'")
    parser.add_argument("--admin-key", default=DEMO_ADMIN_KEY, help="an admin-scoped API key")
    parser.add_argument("--dsn", default=None, help="database DSN (default: config [database].dsn)")
    args = parser.parse_args(argv)
    asyncio.run(seed(args.dsn, args.key, args.other_key, args.admin_key))
    for model in MODELS:
        print(f"model {model.version} (alias {model.alias!r}) ready")
    print(f"tenant demo  API key: {args.key}")
    print(f"tenant other API key: {args.other_key}")
    print(f"admin API key:        {args.admin_key}  (sluice admin …, sluice usage export|reconcile)")


if __name__ == "__main__":
    main()
