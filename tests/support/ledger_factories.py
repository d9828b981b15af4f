"""Factories for ledger rows and a word-level test tokenizer with exact token counts.

The test tokenizer splits on whitespace and maps each word of its small vocabulary to one id, so
`prompt_of(9_000)` is exactly 9,000 tokens: the seed-002 arithmetic can be pinned to the token.
"""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass
from pathlib import Path

from sluice.ledger.models import ApiKey, Budget, Model, Run, Tenant, UsageEntry
from sluice.ledger.repositories import hash_api_key
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from tokenizers import Tokenizer, models, pre_tokenizers

TEST_WORDS = ("alpha", "bravo", "charlie", "delta", "echo")
TEST_VOCAB = {"[UNK]": 0, "<|endoftext|>": 1, **{w: i + 2 for i, w in enumerate(TEST_WORDS)}}

MICROS = 1_000_000


def build_word_tokenizer(path: Path) -> str:
    tokenizer = Tokenizer(models.WordLevel(vocab=TEST_VOCAB, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path))
    return str(path)


def prompt_of(tokens: int, word: str = "alpha") -> str:
    """A prompt that the test tokenizer turns into exactly `tokens` tokens."""
    return " ".join([word] * tokens)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    version: str = "test-model-v1"
    alias: str | None = "test"
    context_limit: int = 16_384
    quality_tier: str = "standard"
    price_input_per_m_micros: int = MICROS // 2        # $0.50 / M
    price_cached_input_per_m_micros: int = MICROS // 20  # $0.05 / M
    price_output_per_m_micros: int = 3 * MICROS // 2   # $1.50 / M
    chat_template: str | None = None                  # Jinja text (the registry's column)


@dataclass(frozen=True, slots=True)
class TenantHandle:
    id: uuid.UUID
    name: str
    api_key: str


DEFAULT_MODEL = ModelSpec()


async def add_model(session: AsyncSession, tokenizer: str, spec: ModelSpec = DEFAULT_MODEL) -> Model:
    model = Model(
        version=spec.version,
        alias=spec.alias,
        tokenizer=tokenizer,
        context_limit=spec.context_limit,
        worker_pool=spec.version,
        quality_tier=spec.quality_tier,
        end_id=1,
        price_input_per_m_micros=spec.price_input_per_m_micros,
        price_cached_input_per_m_micros=spec.price_cached_input_per_m_micros,
        price_output_per_m_micros=spec.price_output_per_m_micros,
        chat_template=spec.chat_template,
    )
    session.add(model)
    await session.flush()
    return model


def first_of_this_month() -> dt.date:
    return dt.datetime.now(dt.UTC).date().replace(day=1)


async def add_tenant(
    session: AsyncSession,
    name: str,
    *,
    token_budget: int = 1_000_000,
    cost_budget_micros: int = 1_000 * MICROS,
    used_tokens: int = 0,
    allowed_tiers: tuple[str, ...] = ("standard",),
    period_start: dt.date | None = None,
    max_concurrent_runs: int | None = None,
    tokens_per_minute: int | None = None,
    shared_cache_scope: str | None = None,
) -> TenantHandle:
    tenant = Tenant(id=uuid.uuid4(), name=name, allowed_tiers=list(allowed_tiers),
                    max_concurrent_runs=max_concurrent_runs, tokens_per_minute=tokens_per_minute,
                    shared_cache_scope=shared_cache_scope)
    session.add(tenant)
    await session.flush()
    api_key = f"sk-test-{name}-{uuid.uuid4().hex}"
    session.add(ApiKey(id=uuid.uuid4(), tenant_id=tenant.id, key_hash=hash_api_key(api_key),
                       key_prefix=api_key[:8]))
    session.add(Budget(tenant_id=tenant.id, period_start=period_start or first_of_this_month(),
                       token_budget=token_budget, cost_budget_micros=cost_budget_micros,
                       used_tokens=used_tokens, reserved_tokens=0,
                       reserved_cost_micros=0, used_cost_micros=0))
    await session.flush()
    return TenantHandle(id=tenant.id, name=name, api_key=api_key)


@dataclass(frozen=True, slots=True)
class BudgetRow:
    token_budget: int
    reserved_tokens: int
    used_tokens: int
    cost_budget_micros: int
    reserved_cost_micros: int
    used_cost_micros: int


async def budget_row(sessionmaker: async_sessionmaker[AsyncSession], tenant_id: uuid.UUID) -> BudgetRow:
    async with sessionmaker() as session:
        budget = await session.scalar(
            select(Budget).where(Budget.tenant_id == tenant_id, Budget.period_start == first_of_this_month())
        )
        assert budget is not None
        return BudgetRow(budget.token_budget, budget.reserved_tokens, budget.used_tokens,
                         budget.cost_budget_micros, budget.reserved_cost_micros, budget.used_cost_micros)


async def count_runs(sessionmaker: async_sessionmaker[AsyncSession],
                     tenant_id: uuid.UUID | None = None) -> int:
    async with sessionmaker() as session:
        query = select(func.count()).select_from(Run)
        if tenant_id is not None:
            query = query.where(Run.tenant_id == tenant_id)
        return int(await session.scalar(query) or 0)


async def get_run(sessionmaker: async_sessionmaker[AsyncSession], run_id: str | uuid.UUID) -> Run:
    async with sessionmaker() as session:
        run = await session.get(Run, uuid.UUID(str(run_id)))
        assert run is not None
        return run


async def count_usage_entries(sessionmaker: async_sessionmaker[AsyncSession], run_id: uuid.UUID) -> int:
    async with sessionmaker() as session:
        query = select(func.count()).select_from(UsageEntry).where(UsageEntry.run_id == run_id)
        return int(await session.scalar(query) or 0)
