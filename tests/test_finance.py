"""Finance on real PostgreSQL: `sluice usage export` against SQL over usage_entries, and
`sluice usage reconcile` over a mix of every terminal status, before and after a hand corruption."""

from __future__ import annotations

import asyncio
import csv
import datetime as dt
import io
import json
import uuid
from dataclasses import dataclass

import pytest
from sluice.ledger.models import Run, RunStatus, UsageEntry
from sluice.ledger.pricing import cost_micros, cost_micros_sql
from sluice.ledger.settlement import settle_run
from sluice_client import cli
from sluice_client.usage_cli import EXIT_DISCREPANCIES
from sqlalchemy import delete, literal, select, text, update

from sluice.v1 import admin_pb2
from tests.support.admin_services import Gateway
from tests.support.ledger_factories import prompt_of

pytestmark = pytest.mark.integration


@dataclass(frozen=True, slots=True)
class Mix:
    finance_key: str
    run_ids: dict[str, list[str]]  # terminal status (or "IN_FLIGHT") → runs that ended so


async def run_cli(gateway: Gateway, key: str, *args: str) -> tuple[int, str]:
    out = io.StringIO()
    code = await asyncio.to_thread(cli.main, [*args, "--address", gateway.address, "--api-key", key], out)
    return code, out.getvalue()


async def settle(
    gateway: Gateway,
    run_id: str,
    status: RunStatus,
    *,
    reached_replica: bool,
    output: int = 0,
    cached: int = 0,
    input_tokens: int | None = None,
) -> None:
    async with gateway.sessionmaker() as session, session.begin():
        if reached_replica:
            await session.execute(update(Run).where(Run.id == uuid.UUID(run_id)).values(replica="r0"))
        assert await settle_run(session, run_id, status, output, cached, None, input_tokens=input_tokens)


async def chaos_mix(gateway: Gateway) -> Mix:
    """Two tenants, three keys, two models and a price change; runs ending in every terminal
    status the way the routing side ends them, and two left in flight."""
    await gateway.model("m-v1", alias="chat")
    await gateway.model("m-v2", prices=(1_000_000, 100_000, 3_000_000))
    acme_a = await gateway.tenant("acme")
    acme_b = await gateway.key(tenant="acme")
    globex = await gateway.tenant("globex")
    ids: dict[str, list[str]] = {}

    async def submit(key: str, tokens: int, cap: int, model: str = "chat") -> str:
        return str((await gateway.submit(key, prompt_of(tokens), cap, model=model)).run_id)

    def note(kind: str, run_id: str) -> None:
        ids.setdefault(kind, []).append(run_id)

    for round_ in range(2):
        for key in (acme_a, acme_b, globex):
            run = await submit(key, 40 + round_, 30)
            await settle(
                gateway, run, RunStatus.COMPLETED, reached_replica=True, output=30 - round_, cached=16
            )
            note("COMPLETED", run)
            run = await submit(key, 20, 30, model="m-v2")
            await settle(gateway, run, RunStatus.CANCELLED, reached_replica=False)  # before it started
            note("CANCELLED", run)
            run = await submit(key, 25, 30, model="m-v2")
            await settle(gateway, run, RunStatus.CANCELLED, reached_replica=True, output=7)  # mid-stream
            note("CANCELLED", run)
            run = await submit(key, 33, 30)
            await settle(gateway, run, RunStatus.INTERRUPTED, reached_replica=True, output=12)  # replica lost
            note("INTERRUPTED", run)
            run = await submit(key, 18, 30)
            await settle(
                gateway, run, RunStatus.FAILED, reached_replica=True, input_tokens=0
            )  # no first token
            note("FAILED", run)
            run = await submit(key, 9, 30)
            await settle(gateway, run, RunStatus.EXPIRED, reached_replica=False)
            note("EXPIRED", run)
        if round_ == 0:  # later runs are admitted, reserved and settled at the new card
            await gateway.admin.SetPriceCard(
                admin_pb2.SetPriceCardRequest(
                    version="m-v1",
                    price_input_per_m_micros=800_000,
                    price_cached_input_per_m_micros=80_000,
                    price_output_per_m_micros=2_400_000,
                ),
                metadata=gateway.as_admin,
            )
    note("IN_FLIGHT", await submit(acme_a, 50, 30))
    note("IN_FLIGHT", await submit(globex, 60, 30, model="m-v2"))
    # Lowered below what globex holds in flight: refused new work, nothing else changes.
    await gateway.admin.SetBudget(
        admin_pb2.SetBudgetRequest(tenant="globex", token_budget=1_000, cost_budget_micros=1_000),
        metadata=gateway.as_admin,
    )
    return Mix(await gateway.key(scope="finance"), ids)


def today() -> str:
    return dt.datetime.now(dt.UTC).date().isoformat()


async def sql_groups(gateway: Gateway, key_column: str) -> list[list[str]]:
    """The SQL GROUP BY the export must equal, written independently of ledger/finance.py."""
    async with gateway.sessionmaker() as session:
        rows = (
            await session.execute(
                text(f"""
            SELECT {key_column}, u.model_version, count(*), sum(u.input_tokens), sum(u.cached_input_tokens),
                   sum(u.output_tokens), sum(u.cost_micros)
            FROM usage_entries u JOIN tenants t ON t.id = u.tenant_id
            LEFT JOIN api_keys k ON k.id = u.api_key_id
            GROUP BY 1, 2 ORDER BY 1, 2""")
            )
        ).all()
    return [[str(value) for value in row] for row in rows]


async def test_the_csv_export_equals_a_sql_group_by_over_usage_entries(gateway: Gateway):
    mix = await chaos_mix(gateway)

    code, out = await run_cli(
        gateway,
        mix.finance_key,
        "usage",
        "export",
        "--from",
        today(),
        "--to",
        today(),
        "--group-by",
        "tenant,model",
        "--format",
        "csv",
    )
    assert code == 0
    header, *rows = list(csv.reader(io.StringIO(out)))
    assert header == [
        "tenant",
        "model_version",
        "runs",
        "input_tokens",
        "cached_input_tokens",
        "output_tokens",
        "cost_micros",
    ]
    assert rows == await sql_groups(gateway, "t.name")
    assert sum(int(row[2]) for row in rows) == 2 * 3 * 6  # every terminal run once, none in flight

    code, paged = await run_cli(
        gateway,
        mix.finance_key,
        "usage",
        "export",
        "--from",
        today(),
        "--to",
        today(),
        "--group-by",
        "tenant,model",
        "--page-size",
        "1",
    )
    assert (code, paged) == (0, out)  # one group per page, the same table

    code, by_key = await run_cli(
        gateway,
        mix.finance_key,
        "usage",
        "export",
        "--from",
        today(),
        "--to",
        today(),
        "--group-by",
        "api_key,model",
    )
    assert list(csv.reader(io.StringIO(by_key)))[1:] == await sql_groups(gateway, "k.key_prefix")
    assert len({row[0] for row in list(csv.reader(io.StringIO(by_key)))[1:]}) == 3  # three submitting keys


async def test_the_json_export_by_hour_keeps_the_totals_and_reports_in_flight_apart(gateway: Gateway):
    mix = await chaos_mix(gateway)

    code, out = await run_cli(
        gateway,
        mix.finance_key,
        "usage",
        "export",
        "--from",
        today(),
        "--to",
        today(),
        "--group-by",
        "tenant,hour",
        "--format",
        "json",
    )

    assert code == 0
    report = json.loads(out)
    async with gateway.sessionmaker() as session:
        total_cost = await session.scalar(text("SELECT sum(cost_micros) FROM usage_entries"))
        held = (
            await session.execute(
                text(
                    "SELECT count(*), sum(reserved_tokens) FROM runs"
                    " WHERE status IN ('ACCEPTED','QUEUED','RUNNING')"
                )
            )
        ).one()
    assert sum(group["cost_micros"] for group in report["groups"]) == total_cost
    now = dt.datetime.now(dt.UTC)
    assert {group["bucket_start"] for group in report["groups"]} <= {
        (now - dt.timedelta(hours=h)).replace(minute=0, second=0, microsecond=0).isoformat() for h in (0, 1)
    }
    assert (
        (report["in_flight"]["runs"], report["in_flight"]["reserved_tokens"])
        == (2, held[1])
        == (held[0], 170)
    )


async def test_reconcile_passes_after_a_mix_of_every_terminal_status(gateway: Gateway):
    mix = await chaos_mix(gateway)
    assert {kind: len(runs) for kind, runs in mix.run_ids.items()} == {
        "COMPLETED": 6,
        "CANCELLED": 12,
        "INTERRUPTED": 6,
        "FAILED": 6,
        "EXPIRED": 6,
        "IN_FLIGHT": 2,
    }

    code, out = await run_cli(gateway, mix.finance_key, "usage", "reconcile")

    assert code == 0, out
    assert out.endswith(
        f"period {today()[:7]}: 38 runs, 36 usage entries, 2 budgets checked; the ledger reconciles\n"
    )


async def test_reconcile_names_a_usage_row_corrupted_by_hand(gateway: Gateway):
    mix = await chaos_mix(gateway)
    run_id = mix.run_ids["COMPLETED"][-1]  # globex's, second round: at the new card
    async with gateway.sessionmaker() as session, session.begin():
        entry = await session.scalar(select(UsageEntry).where(UsageEntry.run_id == uuid.UUID(run_id)))
        assert entry is not None
        right = entry.cost_micros
        await session.execute(
            update(UsageEntry).where(UsageEntry.id == entry.id).values(cost_micros=right + 7)
        )
        used = await session.scalar(
            text(
                "SELECT used_cost_micros FROM budgets b JOIN tenants t"
                " ON t.id = b.tenant_id WHERE t.name = 'globex'"
            )
        )

    code, out = await run_cli(gateway, mix.finance_key, "usage", "reconcile")

    assert code == EXIT_DISCREPANCIES
    period = today()[:7]
    assert out.splitlines() == [
        f"usage_cost: usage entry of run {run_id}: expected {right}, found {right + 7}",
        f"budget_used_cost: budget globex {period}: expected {used + 7}, found {used}",
        f"period {period}: 38 runs, 36 usage entries, 2 budgets checked; the ledger has 2 discrepancies",
    ]
    # Independently: the right cost is the second card's price of the entry's tokens (41 prompt,
    # 16 of them cached, 29 output).
    card = type(
        "Card",
        (),
        {
            "price_input_per_m_micros": 800_000,
            "price_cached_input_per_m_micros": 80_000,
            "price_output_per_m_micros": 2_400_000,
        },
    )
    assert right == cost_micros(card, 41, 16, 29)


async def test_reconcile_names_a_terminal_run_whose_usage_row_was_deleted(gateway: Gateway):
    mix = await chaos_mix(gateway)
    run_id = mix.run_ids["INTERRUPTED"][0]
    async with gateway.sessionmaker() as session, session.begin():
        await session.execute(delete(UsageEntry).where(UsageEntry.run_id == uuid.UUID(run_id)))

    code, out = await run_cli(gateway, mix.finance_key, "usage", "reconcile", "--period", today()[:7])

    assert code == EXIT_DISCREPANCIES
    lines = out.splitlines()
    assert lines[0] == f"terminal_run_without_usage: run {run_id} (INTERRUPTED): expected 1, found 0"
    assert [line.split(":")[0] for line in lines[1:-1]] == ["budget_used_tokens", "budget_used_cost"]


@pytest.mark.parametrize(
    ("tokens", "prices"),
    [
        ((0, 0, 0), (500_000, 50_000, 1_500_000)),
        ((1, 0, 0), (500_000, 50_000, 1_500_000)),  # 0.5 micro-USD rounds up to 1
        ((41, 16, 29), (800_000, 80_000, 2_400_000)),
        ((999_999, 999_999, 1), (3, 1, 999_999)),
        ((123_457, 2_000, 65_432), (1_000_000, 100_000, 3_000_000)),
    ],
)
async def test_the_sql_cost_rounds_exactly_as_the_python_cost(sessionmaker, tokens, prices):
    card = type(
        "Card",
        (),
        dict(
            zip(
                ("price_input_per_m_micros", "price_cached_input_per_m_micros", "price_output_per_m_micros"),
                [literal(p) for p in prices],
                strict=True,
            )
        ),
    )
    python_card = type(
        "Card",
        (),
        dict(
            zip(
                ("price_input_per_m_micros", "price_cached_input_per_m_micros", "price_output_per_m_micros"),
                prices,
                strict=True,
            )
        ),
    )
    async with sessionmaker() as session:
        in_sql = await session.scalar(select(cost_micros_sql(*(literal(t) for t in tokens), card)))
    assert in_sql == cost_micros(python_card, *tokens)
