"""The submit's sampling reaches the replica: runs.sampling → claim → driver → random_seed /
temperature / runtime_top_p on the Triton request. The stack's replicas run the simple engine,
whose ids are a hash of the request's seed, so the seed is visible in the text streamed back."""

from __future__ import annotations

import pytest
from sluice_client.sdk import SluiceClient

from sluice.v1 import runs_pb2
from tests.support.routing_stack import Stack, collect

pytestmark = pytest.mark.integration

PROMPT = "Tell me about sluice gates."


async def answer(sdk: SluiceClient, seed: int) -> str:
    run = await sdk.submit(PROMPT, max_output_tokens=8, seed=seed)
    events = await collect(sdk.stream(run.run_id))
    return "".join(e.text for e in events if e.type == runs_pb2.EVENT_TYPE_DELTA)


async def test_the_submitted_seed_decides_the_replicas_ids(stack: Stack):
    await stack.start_worker()
    async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
        seven, seven_again, eight, default = [await answer(sdk, seed) for seed in (7, 7, 8, 0)]
        default_again = await answer(sdk, 0)
    assert seven == seven_again and default == default_again    # deterministic per seed
    assert len({seven, eight, default}) == 3                     # seed 0: the prompt's own hash
