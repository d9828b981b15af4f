"""Paged KV pool with prefix reuse by chained block hashes.

The pool is `num_blocks` blocks of `block_size` tokens. A sequence holds a list
of block ids; block i stores its tokens [i × block_size, (i + 1) × block_size).

Prefix reuse. A *full* block is identified by the hash of its tokens chained
to the hash of the block before it, so equal hashes mean equal prefixes, not
just equal blocks:

    h0 = hash((root, tokens[0:B]))   h1 = hash((h0, tokens[B:2B]))   ...

Trust scopes. `root` is ROOT_HASH salted with the request's cache salt (its trust scope, DESIGN.md
"Trust scopes"; TensorRT-LLM's `cache_salt_id`): two requests with different salts start from
different roots, so no block of one chain can ever equal a block of the other and one scope never
finds (or times) another scope's prompts. Only the first block needs the salt: every later hash
covers its parent. Salt 0 means none (the unsalted root, as TensorRT-LLM treats a missing salt).

Once a full block's KV is computed it is registered under its hash; a later
request whose prompt has the same chain takes the block (ref count + 1)
instead of recomputing it. Partial blocks are never shared.

Free queue and eviction. Every block with ref count 0 sits in one LRU queue,
whether it still holds a reusable prefix or not:

    head (evicted first) ─ never-used / oldest released ── … ── newest released ─ tail

Allocation pops from the head; a popped block that was registered loses its
hash (that is the eviction). A cache hit on a block in the queue pulls it out.
Sequences release their blocks tail-first, so a sequence's last blocks (the
least shared part of its prefix) are evicted before its first ones.

Host tier. With a host pool (`host_blocks` > 0) an eviction is an offload: the
evicted block's hash moves to the host pool, which keeps its own LRU order and
forgets its oldest entry when full. Only cached blocks with no owner are ever
evicted, so what reaches the host is the prefix of a session between turns
(or of a request paused to make room). A later prompt whose chain continues
into the host tier takes fresh blocks for those hashes and registers them
(`onboard`), and the executor prices the copy back (CostModel.onboard_time_s)
instead of a prefill:

    GPU pool:   h0 h1 ─┐                         lookup_tiers(h0..h4) = ([b0, b1], [h2, h3])
    host pool:         └ h2 h3                   h4 is computed, h2 h3 copied back

The host side holds hashes only: the timing executor computes no KV, so the
tier is modelled, not stored (the model executor runs without one). A host run
is looked for only after the GPU prefix ends; a GPU block behind it is missed.

Counters follow TensorRT-LLM's KvCacheStats: max, free (ref count 0, cached or
not), used (= max − free), and cumulative reused / missed / allocated blocks
(reused counts blocks from either tier: neither is recomputed). TensorRT-LLM's
Triton metrics have no host-tier kinds, so those are Sluice's: host max/used
blocks, blocks offloaded / onboarded / evicted from the host, host tier hits.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

# Chained-hash root. Python's hash of a tuple of ints is deterministic across runs
# (PYTHONHASHSEED randomizes only str/bytes), which the exact tests rely on.
ROOT_HASH = 0x5EED


def salted_root(cache_salt: int) -> int:
    """The parent of a request's first block: ROOT_HASH, salted unless `cache_salt` is 0."""
    return ROOT_HASH if cache_salt == 0 else hash((ROOT_HASH, cache_salt))


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int = ROOT_HASH,
                 start: int = 0) -> list[int]:
    """Chained hashes of the full blocks of `token_ids` from token `start` (a block boundary),
    chained onto `parent` (the hash of the block before `start`)."""
    hashes: list[int] = []
    end = len(token_ids) - block_size
    for offset in range(start, end + 1, block_size):
        parent = hash((parent, tuple(token_ids[offset:offset + block_size])))
        hashes.append(parent)
    return hashes


@dataclass(frozen=True, slots=True)
class KVCacheStats:
    max_blocks: int          # blocks in the pool
    free_blocks: int         # ref count 0 (includes cached blocks that can be evicted)
    used_blocks: int         # max − free
    tokens_per_block: int
    reused_blocks: int       # cumulative: prompt blocks served from the cache
    missed_blocks: int       # cumulative: full prompt blocks that had to be computed
    alloc_total_blocks: int  # cumulative: blocks handed to sequences (new + reused)
    alloc_new_blocks: int    # cumulative: blocks taken from the free queue
    cached_blocks: int       # blocks currently registered under a hash
    host_max_blocks: int = 0         # host tier size (0: no tier)
    host_used_blocks: int = 0        # block hashes held in host memory
    blocks_offloaded: int = 0        # cumulative: evicted GPU blocks copied to the host tier
    blocks_onboarded: int = 0        # cumulative: host blocks copied back on a prefix hit
    host_evicted_blocks: int = 0     # cumulative: host entries dropped, least recently used first
    host_tier_hits: int = 0          # cumulative: admissions that found part of their prefix on the host

    @property
    def fraction(self) -> float:
        """Used share of the pool (nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction"})."""
        return self.used_blocks / self.max_blocks if self.max_blocks else 0.0

    @property
    def cache_hit_rate(self) -> float:
        looked_up = self.reused_blocks + self.missed_blocks
        return self.reused_blocks / looked_up if looked_up else 0.0


class HostPool:
    """The host-memory tier: hashes of offloaded blocks in LRU order (oldest first)."""

    def __init__(self, num_blocks: int) -> None:
        assert num_blocks >= 0, "the host tier cannot have a negative size"
        self.num_blocks = num_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.offloaded = 0
        self.onboarded = 0
        self.evicted = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru

    def offload(self, block_hash: int) -> None:
        """Keep an evicted block's hash, dropping the least recently used one past capacity."""
        if not self.num_blocks:
            return
        lru = self._lru
        if block_hash in lru:
            lru.move_to_end(block_hash)
        else:
            lru[block_hash] = None
            if len(lru) > self.num_blocks:
                lru.popitem(last=False)
                self.evicted += 1
        self.offloaded += 1

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """The leading run of `hashes` held here."""
        found: list[int] = []
        lru = self._lru
        for block_hash in hashes:
            if block_hash not in lru:
                break
            found.append(block_hash)
        return found

    def take(self, hashes: Sequence[int]) -> None:
        """Hand `hashes` (from lookup) back to the GPU: they leave the host tier."""
        for block_hash in hashes:
            del self._lru[block_hash]
        self.onboarded += len(hashes)
        self.hits += 1 if hashes else 0


class BlockPool:
    """Block ids, ref counts, the LRU free queue and the hash → block map, and the host tier."""

    def __init__(self, num_blocks: int, block_size: int, host_blocks: int = 0) -> None:
        assert num_blocks > 0 and block_size > 0, "the pool needs at least one block of at least one token"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.host = HostPool(host_blocks)
        self._ref_count = [0] * num_blocks
        self._hash_of: list[int | None] = [None] * num_blocks
        self._block_of: dict[int, int] = {}
        # Ordered set of free block ids; the head is evicted first.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.reused_blocks = 0
        self.missed_blocks = 0
        self.alloc_total_blocks = 0
        self.alloc_new_blocks = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_count[block_id]

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """Blocks holding the longest cached prefix of `hashes` (no ref taken)."""
        found: list[int] = []
        block_of = self._block_of
        for block_hash in hashes:
            block_id = block_of.get(block_hash)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def lookup_tiers(self, hashes: Sequence[int]) -> tuple[list[int], list[int]]:
        """The longest cached prefix of `hashes` across both tiers: the GPU blocks of its start and
        the hashes of the host-tier run that follows (no ref taken, nothing moved)."""
        gpu = self.lookup(hashes)
        if not self.host.num_blocks or len(gpu) == len(hashes):
            return gpu, []
        return gpu, self.host.lookup(hashes[len(gpu):])

    def allocate(self, count: int) -> list[int] | None:
        """`count` fresh blocks from the head of the free queue, evicting their hashes (to the host
        tier, when there is one); None (and nothing changed) when fewer are free."""
        if count > len(self._free):
            return None
        blocks: list[int] = []
        free = self._free
        host = self.host
        for _ in range(count):
            block_id, _ = free.popitem(last=False)
            block_hash = self._hash_of[block_id]
            if block_hash is not None:
                self._hash_of[block_id] = None
                del self._block_of[block_hash]
                host.offload(block_hash)
            self._ref_count[block_id] = 1
            blocks.append(block_id)
        self.alloc_new_blocks += count
        self.alloc_total_blocks += count
        return blocks

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on cached blocks (a prefix hit), pulling free ones out of the queue."""
        for block_id in block_ids:
            if self._ref_count[block_id] == 0:
                del self._free[block_id]
            self._ref_count[block_id] += 1
        self.alloc_total_blocks += len(block_ids)

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block, tail first; blocks reaching 0 join the queue's tail."""
        for block_id in reversed(block_ids):
            count = self._ref_count[block_id] - 1
            assert count >= 0, f"block {block_id} released more often than taken"
            self._ref_count[block_id] = count
            if count == 0:
                self._free[block_id] = None

    def register(self, block_ids: Sequence[int], hashes: Sequence[int]) -> None:
        """Make computed full blocks findable by hash. A block whose hash another block already
        holds stays unregistered (its twin serves future hits)."""
        for block_id, block_hash in zip(block_ids, hashes, strict=False):
            if self._hash_of[block_id] is not None or block_hash in self._block_of:
                continue
            self._hash_of[block_id] = block_hash
            self._block_of[block_hash] = block_id

    def onboard(self, host_hashes: Sequence[int], count: int) -> list[int]:
        """`count` fresh blocks whose first len(host_hashes) take those hashes back from the host
        tier, registered under them. The hashes leave the host before allocating, so the offloads
        this allocation causes cannot push them out. The caller checked that `count` are free."""
        self.host.take(host_hashes)
        blocks = self.allocate(count)
        assert blocks is not None, "onboard() needs its blocks checked free"
        self.register(blocks, host_hashes)
        return blocks

    def count_hits(self, reused: int, missed: int) -> None:
        self.reused_blocks += reused
        self.missed_blocks += missed

    def stats(self) -> KVCacheStats:
        free = len(self._free)
        return KVCacheStats(
            max_blocks=self.num_blocks, free_blocks=free, used_blocks=self.num_blocks - free,
            tokens_per_block=self.block_size, reused_blocks=self.reused_blocks,
            missed_blocks=self.missed_blocks, alloc_total_blocks=self.alloc_total_blocks,
            alloc_new_blocks=self.alloc_new_blocks, cached_blocks=len(self._block_of),
            host_max_blocks=self.host.num_blocks, host_used_blocks=len(self.host),
            blocks_offloaded=self.host.offloaded, blocks_onboarded=self.host.onboarded,
            host_evicted_blocks=self.host.evicted, host_tier_hits=self.host.hits,
        )
