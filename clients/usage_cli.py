"""`sluice usage export|reconcile`: finance's commands (a finance or admin key; a tenant key
exports its own tenant only).

    sluice usage export --from 2026-11-01 --to 2026-11-30 --group-by tenant,model [--bucket 6h]
                        [--tenant NAME] [--format csv|json] [--page-size N]
    sluice usage reconcile [--period 2026-11]

`export` fetches every page and prints one table: a row per group with its settled runs, tokens and
cost. CSV has a header row; JSON also carries the reservations still in flight (never billed).
`reconcile` prints each discrepancy the ledger shows and exits EXIT_DISCREPANCIES if there is one.
"""

from __future__ import annotations

import argparse
import csv
import json
from typing import Any, TextIO

from sluice_client.sdk import SluiceClient

from sluice.v1 import usage_pb2

EXIT_DISCREPANCIES = 4
AMOUNTS = ("runs", "input_tokens", "cached_input_tokens", "output_tokens", "cost_micros")
# group_by key → the column it fills
KEY_COLUMNS = {
    "tenant": "tenant",
    "api_key": "api_key",
    "model": "model_version",
    "route": "route",
    "pool": "pool",
    "tier": "tier",
    "day": "bucket_start",
    "hour": "bucket_start",
}


def add_usage_commands(usage: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
    commands = usage.add_subparsers(dest="usage_command", required=False)
    export = commands.add_parser(
        "export", help="settled usage grouped, all pages, CSV or JSON", parents=[common]
    )
    export.add_argument("--from", dest="start", required=True, help="ISO date or date-time (UTC)")
    export.add_argument("--to", dest="end", required=True, help="a date includes that whole day")
    export.add_argument("--group-by", default="tenant,model",
                        help="any of tenant,api_key,model,route,pool,tier,day,hour")
    export.add_argument("--bucket", default="", help="time bucket with day/hour, e.g. 15m, 6h, 7d")
    export.add_argument("--tenant", default="")
    export.add_argument("--format", choices=("csv", "json"), default="csv")
    export.add_argument("--page-size", type=int, default=0)
    reconcile = commands.add_parser(
        "reconcile", help="prove a period from the ledger; non-zero on a discrepancy", parents=[common]
    )
    reconcile.add_argument("--period", default="", help="YYYY-MM (default: this month)")


def columns(group_by: list[str]) -> list[str]:
    keys = list(dict.fromkeys(KEY_COLUMNS[key] for key in group_by if key in KEY_COLUMNS))
    return keys + list(AMOUNTS)


def group_row(group: usage_pb2.UsageGroup) -> dict[str, Any]:
    settled = group.settled
    return {
        "tenant": group.tenant,
        "api_key": group.api_key,
        "model_version": group.model_version,
        "route": group.route,
        "pool": group.pool,
        "tier": group.tier,
        "bucket_start": group.bucket_start,
        "runs": group.runs,
        "input_tokens": settled.input_tokens,
        "cached_input_tokens": settled.cached_input_tokens,
        "output_tokens": settled.output_tokens,
        "cost_micros": settled.cost_micros,
    }


async def export(client: SluiceClient, args: argparse.Namespace, out: TextIO) -> int:
    group_by = [key.strip() for key in args.group_by.split(",") if key.strip()]
    request = usage_pb2.QueryUsageRequest(
        to=args.end, group_by=group_by, bucket=args.bucket, tenant=args.tenant, page_size=args.page_size
    )
    setattr(request, "from", args.start)  # `from` is a Python keyword
    groups, in_flight = await client.usage_groups(request)
    names = columns([key.lower() for key in group_by])
    rows = [{name: row[name] for name in names} for row in map(group_row, groups)]
    if args.format == "json":
        print(
            json.dumps(
                {
                    "groups": rows,
                    "in_flight": {
                        "runs": in_flight.runs,
                        "reserved_tokens": in_flight.reserved_tokens,
                        "reserved_cost_micros": in_flight.reserved_cost_micros,
                    },
                },
                indent=2,
            ),
            file=out,
        )
        return 0
    writer = csv.DictWriter(out, fieldnames=names, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return 0


async def reconcile(client: SluiceClient, args: argparse.Namespace, out: TextIO) -> int:
    result = await client.reconcile(args.period)
    for discrepancy in result.discrepancies:
        print(discrepancy.detail, file=out)
    verdict = "reconciles" if not result.discrepancies else f"has {len(result.discrepancies)} discrepancies"
    print(
        f"period {result.period}: {result.runs_checked} runs, {result.entries_checked} usage entries,"
        f" {result.budgets_checked} budgets checked; the ledger {verdict}",
        file=out,
    )
    return EXIT_DISCREPANCIES if result.discrepancies else 0
