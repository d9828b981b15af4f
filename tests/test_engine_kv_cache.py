"""The paged KV pool: exact block ids, prefix reuse, LRU eviction, nothing leaked."""

from sluice.engine.kv_cache import ROOT_HASH, BlockPool, block_hashes
from tests.engine_helpers import (
    assert_nothing_leaked,
    make_config,
    make_engine,
    prompt,
    request,
    run_to_completion,
)


def test_block_hashes_cover_only_full_blocks() -> None:
    assert len(block_hashes(list(range(11)), 4)) == 2
    assert block_hashes([], 4) == []


def test_block_hashes_chain_so_equal_blocks_after_different_prefixes_differ() -> None:
    first = block_hashes([1, 2, 3, 4, 9, 9, 9, 9], 4)
    second = block_hashes([5, 6, 7, 8, 9, 9, 9, 9], 4)
    assert first[1] != second[1]
    assert first[0] == hash((ROOT_HASH, (1, 2, 3, 4)))


def test_block_hashes_can_continue_a_chain() -> None:
    tokens = list(range(12))
    whole = block_hashes(tokens, 4)
    assert block_hashes(tokens, 4, parent=whole[0], start=4) == whole[1:]


def test_a_fresh_pool_hands_out_block_ids_in_order() -> None:
    pool = BlockPool(num_blocks=6, block_size=4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert (pool.num_free, pool.num_used) == (1, 5)


def test_allocation_beyond_the_free_blocks_returns_none_and_changes_nothing() -> None:
    pool = BlockPool(num_blocks=3, block_size=4)
    pool.allocate(2)
    assert pool.allocate(2) is None
    assert pool.num_free == 1
    assert pool.allocate(1) == [2]


def test_released_blocks_are_reused_last_and_tail_first() -> None:
    pool = BlockPool(num_blocks=5, block_size=4)
    held = pool.allocate(3)
    assert held == [0, 1, 2]
    pool.release(held)
    # Never-used blocks 3 and 4 go first, then the released ones, the sequence's tail first.
    assert pool.allocate(5) == [3, 4, 2, 1, 0]


def test_a_prefix_hit_takes_a_reference_and_leaves_the_free_queue() -> None:
    pool = BlockPool(num_blocks=4, block_size=4)
    held = pool.allocate(2)
    assert held is not None
    hashes = block_hashes(list(range(8)), 4)
    pool.register(held, hashes)
    pool.release(held)
    assert pool.num_free == 4
    hits = pool.lookup(hashes)
    assert hits == [0, 1]
    pool.touch(hits)
    assert (pool.ref_count(0), pool.ref_count(1), pool.num_free) == (1, 1, 2)


def test_lookup_stops_at_the_first_miss() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    blocks = pool.allocate(3)
    assert blocks is not None
    hashes = block_hashes([1, 2, 3, 4, 5, 6], 2)
    pool.register([blocks[0], blocks[2]], [hashes[0], hashes[2]])
    assert pool.lookup(hashes) == [blocks[0]]


def test_unreferenced_cached_blocks_are_evicted_least_recently_released_first() -> None:
    pool = BlockPool(num_blocks=4, block_size=4)
    old = pool.allocate(2)
    assert old == [0, 1]
    old_hashes = block_hashes(list(range(8)), 4)
    pool.register(old, old_hashes)
    pool.release(old)              # free queue: 2, 3, 1, 0
    assert pool.allocate(3) == [2, 3, 1]
    # Block 1 was evicted (its hash is gone); block 0 still serves the first block of the prefix.
    assert pool.lookup(old_hashes) == [0]
    assert pool.stats().cached_blocks == 1


def test_a_twin_block_stays_unregistered() -> None:
    pool = BlockPool(num_blocks=2, block_size=4)
    hashes = block_hashes([1, 2, 3, 4], 4)
    pool.register([0], hashes)
    pool.register([1], hashes)
    assert pool.lookup(hashes) == [0]
    assert pool.stats().cached_blocks == 1


def test_stats_follow_trt_llm_counters() -> None:
    pool = BlockPool(num_blocks=8, block_size=16)
    held = pool.allocate(3)
    assert held is not None
    pool.touch(held[:1])
    pool.count_hits(reused=1, missed=2)
    stats = pool.stats()
    assert (stats.max_blocks, stats.free_blocks, stats.used_blocks, stats.tokens_per_block) == (8, 5, 3, 16)
    assert (stats.reused_blocks, stats.missed_blocks) == (1, 2)
    assert (stats.alloc_new_blocks, stats.alloc_total_blocks) == (3, 4)
    assert stats.fraction == 3 / 8
    assert stats.cache_hit_rate == 1 / 3


# --- through the engine ---------------------------------------------------------------------


def test_admission_allocates_the_whole_context_with_exact_block_ids() -> None:
    engine = make_engine()
    engine.add_request(request("a", prompt(10)))
    engine.add_request(request("b", prompt(5, start=500)))
    engine.step()
    running = {seq.request_id: seq.block_ids for seq in engine.scheduler.running}
    assert running == {"a": [0, 1, 2], "b": [3, 4]}


def test_a_shared_prefix_is_reused_from_a_finished_request() -> None:
    engine = make_engine()
    engine.add_request(request("a", prompt(10), max_output=1))
    run_to_completion(engine)
    engine.add_request(request("b", prompt(9) + (7, 7, 7)))
    engine.step()
    (seq,) = engine.scheduler.running
    # a's first two blocks (tokens 100..107) are shared; the third was released first and is the
    # least recently used, but 13 free blocks remain so it was not evicted and b does not match it.
    assert seq.block_ids[:2] == [0, 1]
    assert (seq.reused_blocks, seq.num_cached_tokens) == (2, 8)
    assert engine.pool.stats().reused_blocks == 2


def test_the_last_block_of_a_fully_cached_prompt_is_recomputed() -> None:
    engine = make_engine()
    engine.add_request(request("a", prompt(8), max_output=1))
    run_to_completion(engine)
    engine.add_request(request("b", prompt(8), max_output=1))
    outputs = run_to_completion(engine)
    assert outputs[-1].kv_cache_reused_blocks == 1
    assert outputs[-1].num_cached_tokens == 4


def test_a_waiting_request_reuses_a_prefix_while_its_owner_still_runs() -> None:
    engine = make_engine(make_config(max_num_tokens=8))
    engine.add_request(request("a", prompt(8), max_output=8))
    engine.step()                                  # a's context: both blocks computed and registered
    engine.add_request(request("b", prompt(8) + (5,), max_output=4))
    engine.step()
    b = next(seq for seq in engine.scheduler.running if seq.request_id == "b")
    a = next(seq for seq in engine.scheduler.running if seq.request_id == "a")
    assert b.block_ids[:2] == a.block_ids[:2]
    assert engine.pool.ref_count(a.block_ids[0]) == 2


def test_generated_tokens_are_cached_for_the_next_turn() -> None:
    engine = make_engine()
    first = request("turn-1", prompt(6), max_output=6)
    engine.add_request(first)
    answer = [token for output in run_to_completion(engine) for token in output.new_token_ids]
    history = first.prompt_token_ids + tuple(answer) + (9, 9)
    # 6 prompt + 5 computed answer tokens = 11 → 2 full blocks of KV to reuse.
    assert engine.cached_prefix_tokens(history) == 8
    engine.add_request(request("turn-2", history, max_output=1))
    outputs = run_to_completion(engine)
    assert outputs[0].kv_cache_reused_blocks == 2


def test_nothing_leaks_after_finish_and_stop() -> None:
    engine = make_engine()
    for index in range(6):
        engine.add_request(request(f"r{index}", prompt(5 + index, start=10 * index), max_output=5))
    for _ in range(3):
        engine.step()
    assert engine.stop("r0") and engine.stop("r5")
    run_to_completion(engine)
    assert_nothing_leaked(engine)


def test_stop_frees_the_blocks_at_once() -> None:
    engine = make_engine()
    engine.add_request(request("a", prompt(10), max_output=8))
    engine.step()
    assert engine.pool.num_used == 3
    assert engine.stop("a")
    assert engine.pool.num_used == 0
    (output,) = engine.take_outputs()
    assert (output.finished, output.finish_reason) == (True, "stopped")
    assert not engine.stop("a")
