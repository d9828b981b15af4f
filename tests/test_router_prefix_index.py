"""The prefix index: chained block hashes, overlap walks, capacity-bound LRU, TTL, restarts."""

from __future__ import annotations

from sluice.router.prefix_index import PrefixIndex, block_hashes

BS = 4


def tokens(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def index_with(capacity: int = 100, ttl_s: float = 600.0,
               replicas: tuple[str, ...] = ("r0", "r1")) -> PrefixIndex:
    index = PrefixIndex(ttl_s=ttl_s)
    for name in replicas:
        index.set_capacity(name, capacity, now=0.0)
    return index


def test_only_full_blocks_are_hashed():
    assert len(block_hashes(tokens(0, 11), BS)) == 2
    assert len(block_hashes(tokens(0, 12), BS)) == 3
    assert block_hashes(tokens(0, 3), BS) == []


def test_hashes_are_chained_so_equal_blocks_at_different_prefixes_differ():
    first = block_hashes([1, 2, 3, 4, 9, 9, 9, 9], BS)
    second = block_hashes([5, 6, 7, 8, 9, 9, 9, 9], BS)
    assert first[1] != second[1]


def test_an_extended_prompt_shares_the_leading_hashes_of_its_prefix():
    prefix = block_hashes(tokens(0, 12), BS)
    extended = block_hashes(tokens(0, 12) + [77] * 9, BS)
    assert extended[:3] == prefix
    assert len(extended) == 5


def test_block_size_is_part_of_the_chain():
    assert block_hashes(tokens(0, 8), 4)[0] != block_hashes(tokens(0, 8), 8)[0]


def test_overlap_counts_the_leading_blocks_each_replica_holds():
    index = index_with()
    index.record("r0", block_hashes(tokens(0, 12), BS), now=1.0)
    query = block_hashes(tokens(0, 12) + [500] * 8, BS)
    assert index.overlap_blocks(query, ["r0", "r1"]) == {"r0": 3, "r1": 0}


def test_overlap_stops_at_the_first_block_a_replica_lacks():
    index = index_with()
    hashes = block_hashes(tokens(0, 16), BS)
    index.record("r0", [hashes[0], hashes[2], hashes[3]], now=1.0)   # block 1 missing
    assert index.overlap_blocks(hashes, ["r0"]) == {"r0": 1}


def test_overlap_of_a_replica_the_index_never_saw_is_zero():
    index = index_with()
    index.record("r0", block_hashes(tokens(0, 8), BS), now=1.0)
    overlap = index.overlap_blocks(block_hashes(tokens(0, 8), BS), ["r0", "stranger"])
    assert overlap == {"r0": 2, "stranger": 0}


def test_several_replicas_holding_different_depths():
    index = index_with(replicas=("r0", "r1", "r2"))
    hashes = block_hashes(tokens(0, 20), BS)
    index.record("r0", hashes[:1], now=1.0)
    index.record("r1", hashes[:4], now=1.0)
    index.record("r2", hashes, now=1.0)
    assert index.overlap_blocks(hashes, ["r0", "r1", "r2"]) == {"r0": 1, "r1": 4, "r2": 5}


def test_entries_never_exceed_the_replica_kv_capacity():
    index = index_with(capacity=4)
    hashes = block_hashes(tokens(0, 24), BS)                         # 6 blocks
    index.record("r0", hashes, now=1.0)
    assert index.entries("r0") == 4
    assert index.overlap_blocks(hashes, ["r0"]) == {"r0": 4}


def test_least_recently_used_prompt_is_evicted_first():
    index = index_with(capacity=4)
    p, q, r = (block_hashes(tokens(start, 8), BS) for start in (0, 100, 200))
    index.record("r0", p, now=1.0)
    index.record("r0", q, now=2.0)
    index.record("r0", p, now=3.0)                                   # p touched again: q is now oldest
    index.record("r0", r, now=4.0)
    assert [index.overlap_blocks(h, ["r0"])["r0"] for h in (p, q, r)] == [2, 0, 2]


def test_eviction_trims_a_prefix_from_its_tail():
    index = index_with(capacity=3)
    prompt = block_hashes(tokens(0, 12), BS)                         # 3 blocks
    index.record("r0", prompt, now=1.0)
    index.record("r0", block_hashes(tokens(900, 4), BS), now=2.0)  # needs one slot
    assert index.overlap_blocks(prompt, ["r0"]) == {"r0": 2}


def test_shrinking_capacity_evicts_at_once():
    index = index_with(capacity=10)
    index.record("r0", block_hashes(tokens(0, 24), BS), now=1.0)
    index.set_capacity("r0", 2, now=2.0)
    assert index.entries("r0") == 2


def test_entries_untouched_past_the_ttl_expire():
    index = index_with(ttl_s=10.0)
    old = block_hashes(tokens(0, 8), BS)
    fresh = block_hashes(tokens(100, 8), BS)
    index.record("r0", old, now=0.0)
    index.record("r0", fresh, now=5.0)
    index.expire(now=12.0)
    assert index.overlap_blocks(old, ["r0"]) == {"r0": 0}
    assert index.overlap_blocks(fresh, ["r0"]) == {"r0": 2}


def test_touching_an_entry_renews_its_ttl():
    index = index_with(ttl_s=10.0)
    prompt = block_hashes(tokens(0, 8), BS)
    index.record("r0", prompt, now=0.0)
    index.record("r0", prompt, now=8.0)
    index.expire(now=15.0)
    assert index.overlap_blocks(prompt, ["r0"]) == {"r0": 2}


def test_a_restarted_replica_entries_are_gone_and_others_keep_theirs():
    index = index_with()
    prompt = block_hashes(tokens(0, 12), BS)
    index.record("r0", prompt, now=1.0)
    index.record("r1", prompt, now=1.0)
    index.drop_replica("r0")
    assert index.entries("r0") == 0
    assert index.overlap_blocks(prompt, ["r0", "r1"]) == {"r0": 0, "r1": 3}
    assert index.stats().distinct_blocks == 3


def test_dropping_the_last_holder_frees_the_block_hash():
    index = index_with()
    index.record("r0", block_hashes(tokens(0, 12), BS), now=1.0)
    index.drop_replica("r0")
    assert index.stats().entries == 0
    assert index.stats().distinct_blocks == 0


def test_a_dropped_replica_bit_is_reused_so_masks_stay_as_wide_as_the_fleet():
    index = index_with(replicas=("r0", "r1", "r2"))
    prompt = block_hashes(tokens(0, 8), BS)
    for name in ("r0", "r1"):
        index.record(name, prompt, now=1.0)
    index.drop_replica("r0")
    index.set_capacity("r2", 100, now=2.0)
    index.record("r2", prompt, now=2.0)                              # takes r0's old bit
    assert index.overlap_blocks(prompt, ["r0", "r1", "r2"]) == {"r0": 0, "r1": 2, "r2": 2}
    assert max(index._holders.values()).bit_length() == 2            # bits 0 and 1 only
