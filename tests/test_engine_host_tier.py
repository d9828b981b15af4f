"""The host-memory KV tier: evicted prefix blocks go to host memory and come back at copy cost.

Every expected time is worked out here from the model's shape and the GPU's host link, not read
back from the cost model: Llama-3-8B in bf16 keeps 2 (K, V) × 32 layers × 8 KV heads × 128 dims ×
2 bytes = 131,072 bytes of KV per token; an H100 SXM reaches its host over PCIe Gen5 x16, 64 GB/s
per direction, of which a pinned copy gets 80%.
"""

from dataclasses import replace

import pytest

from sluice.engine.core import HOST_TIER_MODELLED, EngineCore
from sluice.engine.executor import TimingExecutor
from sluice.engine.kv_cache import BlockPool, HostPool
from sluice.engine.types import EngineConfig, EngineRequest, RequestOutput
from tests.engine_helpers import COST, SPACE, expected_tokens, make_config, prompt, request

KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2           # 131,072
HOST_LINK_BYTES_PER_S = 64e9 * 0.8                   # PCIe Gen5 x16, achieved
BLOCK = 4


def transfer_s(blocks: int) -> float:
    return blocks * KV_BYTES_PER_TOKEN * BLOCK / HOST_LINK_BYTES_PER_S


# -- the host pool on its own ---------------------------------------------------------------------


def test_the_host_pool_drops_its_least_recently_offloaded_entry_when_full() -> None:
    host = HostPool(num_blocks=2)
    host.offload(0xA)
    host.offload(0xB)
    host.offload(0xA)          # offloaded again: now the most recent
    host.offload(0xC)          # full: B, the least recent, goes
    assert 0xB not in host and 0xA in host and 0xC in host
    assert (host.offloaded, host.evicted, len(host)) == (4, 1, 2)


def test_evicted_blocks_move_to_the_host_in_eviction_order_and_are_found_there() -> None:
    pool = BlockPool(num_blocks=2, block_size=BLOCK, host_blocks=4)
    first = pool.allocate(2)
    assert first == [0, 1]
    pool.register(first, [0x10, 0x11])
    pool.release(first)                       # tail first: free queue is 1, 0
    pool.allocate(2)                          # evicts 0x11 then 0x10 into the host tier
    assert pool.lookup([0x10, 0x11]) == []
    assert pool.lookup_tiers([0x10, 0x11, 0x12]) == ([], [0x10, 0x11])
    stats = pool.stats()
    assert (stats.host_used_blocks, stats.blocks_offloaded, stats.host_evicted_blocks) == (2, 2, 0)


def test_a_host_run_follows_the_gpu_prefix() -> None:
    pool = BlockPool(num_blocks=3, block_size=BLOCK, host_blocks=4)
    blocks = pool.allocate(3)
    assert blocks is not None
    pool.register(blocks, [0x20, 0x21, 0x22])
    pool.release(blocks)                      # free queue: 2, 1, 0
    pool.allocate(2)                          # evicts 0x22, 0x21; block 0 keeps 0x20 on the GPU
    assert pool.lookup_tiers([0x20, 0x21, 0x22]) == ([0], [0x21, 0x22])


# -- a paused conversation resumed from the host ------------------------------------------------


def config(host_blocks: int | None) -> EngineConfig:
    # 8 blocks of 4 tokens: a 28-token prompt with 4 tokens of answer takes the whole pool.
    base = make_config(block_size=BLOCK, num_blocks=8, max_num_tokens=32)
    return replace(base, host_num_blocks=host_blocks)


def first_token_time(engine: EngineCore, req: EngineRequest) -> tuple[float, RequestOutput, int]:
    """Run `req` alone on an idle engine: (time to its first token, that output, context tokens computed)."""
    engine.add_request(req)
    elapsed, computed = 0.0, 0
    while True:
        step = engine.step()
        elapsed += step.duration_s
        computed += step.num_context_tokens
        for output in step.outputs:
            if output.request_id == req.request_id and output.first_token:
                while engine.has_work():
                    engine.step()
                return elapsed, output, computed


def chat(host_blocks: int | None, evict_between_turns: bool,
         salt: int = 0) -> tuple[float, RequestOutput, int, EngineCore]:
    """Turn 1 (12-token prompt, 4 tokens of answer), maybe another user's long request, then turn 2:
    turn 1's prompt and answer plus 2 new tokens."""
    engine = EngineCore(config(host_blocks), COST)
    turn1 = request("turn1", prompt(12), max_output=4)
    first_token_time(engine, turn1)
    if evict_between_turns:
        first_token_time(engine, request("other", prompt(28, start=500), max_output=4))
    history = prompt(12) + tuple(expected_tokens(turn1, 4))
    turn2 = replace(request("turn2", history + (7, 8), max_output=4), cache_salt=salt)
    ttft, output, computed = first_token_time(engine, turn2)
    return ttft, output, computed, engine


def test_a_conversation_resumed_from_the_host_tier_reprefills_nothing_and_waits_only_for_the_copy() -> None:
    # Turn 1 leaves its 3 prompt blocks cached (the answer's last token never had its KV computed,
    # so block 3 is partial). The other request takes all 8 blocks, evicting those 3 to the host.
    gpu_ttft, gpu_output, gpu_computed, _ = chat(host_blocks=8, evict_between_turns=False)
    host_ttft, host_output, host_computed, engine = chat(host_blocks=8, evict_between_turns=True)

    assert gpu_output.num_cached_tokens == host_output.num_cached_tokens == 12
    assert gpu_computed == host_computed == 18 - 12          # only the answer and the new tokens
    assert host_ttft - gpu_ttft == pytest.approx(transfer_s(3), rel=1e-9)
    stats = engine.stats().kv
    assert (stats.blocks_onboarded, stats.host_tier_hits) == (3, 1)


def test_without_the_tier_the_evicted_conversation_is_prefilled_again() -> None:
    ttft, output, computed, engine = chat(host_blocks=0, evict_between_turns=True)
    assert output.num_cached_tokens == 0 and computed == 18
    assert engine.stats().kv.blocks_offloaded == 0


def test_another_trust_scope_finds_nothing_in_the_host_tier() -> None:
    _, output, computed, engine = chat(host_blocks=8, evict_between_turns=True, salt=99)
    assert output.num_cached_tokens == 0 and computed == 18
    assert engine.stats().kv.host_tier_hits == 0


# -- sizing from the GPU profile ---------------------------------------------------------------


def test_the_host_tier_defaults_to_half_the_hosts_memory_per_gpu() -> None:
    engine = EngineCore(config(host_blocks=None), COST)
    # DGX H100: 2 TB for 8 GPUs = 256 GB each, half of it pinned for KV, 131,072 bytes a token.
    assert engine.pool.host.num_blocks == int(256e9 * 0.5 // KV_BYTES_PER_TOKEN) // BLOCK


def test_the_model_executor_runs_without_a_host_tier() -> None:
    executor = TimingExecutor(COST, SPACE)     # stands in for any executor given without a cost model
    with pytest.raises(ValueError, match="modelled"):
        EngineCore(config(host_blocks=8), executor=executor)
    assert "host_num_blocks to 0" in HOST_TIER_MODELLED


# -- a request paused by the scheduler (max_utilization) ---------------------------------------


def resume_step(host_blocks: int) -> tuple[int, float, EngineCore]:
    """A and B (8-token prompts, 8 tokens of answer) share a 5-block pool: at the first decode both
    need a block and one is free, so B (the newest) is paused with its 2 prompt blocks cached. A's
    growth evicts B's second block. (context tokens, duration) of the step that resumes B."""
    config = replace(make_config(block_size=BLOCK, num_blocks=5, max_num_seqs=2, max_num_tokens=64,
                                 policy="max_utilization"), host_num_blocks=host_blocks)
    engine = EngineCore(config, COST)
    engine.add_request(request("A", prompt(8), max_output=8))
    engine.add_request(request("B", prompt(8, start=500), max_output=8))
    paused = False
    while engine.has_work():
        step = engine.step()
        paused = paused or step.num_paused == 1
        if paused and step.num_context_tokens:
            while engine.has_work():
                engine.step()
            return step.num_context_tokens, step.duration_s, engine
    raise AssertionError("B was never resumed")


def test_a_request_paused_by_the_scheduler_resumes_from_the_host_tier_without_recomputing_it() -> None:
    # B's context on resume: 8 prompt tokens + its 1 streamed token. Its first prompt block is still
    # on the GPU, its second came back from the host: only the streamed token is computed, and the
    # step costs the 9-token context chunk plus one block's copy.
    computed, duration, engine = resume_step(host_blocks=8)
    assert computed == 1
    assert duration == pytest.approx(COST.step_time_totals_s(1, 0, 0, 9) + transfer_s(1), rel=1e-9)
    assert (engine.stats().kv.blocks_onboarded, engine.stats().kv.host_tier_hits) == (1, 1)
    # Without the tier the evicted block is computed again with the streamed token.
    computed, duration, _ = resume_step(host_blocks=0)
    assert computed == 1 + BLOCK
