"""Measured figures of the run path on the real stack (printed; bounds are loose sanity checks)."""

from __future__ import annotations

import pytest
from sluice_client.sdk import SluiceClient

from bench.bench_run_path import measure
from tests.support.routing_stack import Stack

pytestmark = pytest.mark.integration


async def test_submit_to_first_token_and_event_throughput(stack: Stack, capsys):
    await stack.start_worker()
    async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
        await measure(sdk, 2, 1, 4)
        sequential = await measure(sdk, 20, 1, 20)
        concurrent = await measure(sdk, 32, 32, 100)
    with capsys.disabled():
        print(f"\n[one at a time]\n{sequential.render()}")
        print(f"[32 concurrent × 100 tokens]\n{concurrent.render()}")
    assert sequential.completed == 20 and concurrent.completed == 32
    assert concurrent.tokens == 32 * 100
    assert sequential.percentile(50) < 1_000
