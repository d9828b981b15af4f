"""Which replica probably holds which prompt prefix, learned from the requests routed.

A prompt is cut into full blocks of the replica's KV block size and each block
gets a chained hash, ``h[i] = hash((h[i-1], tokens of block i))`` seeded with
the block size, the way paged-KV engines key their reusable blocks (vLLM,
SGLang, TensorRT-LLM). A request's trust scope (its cache salt, DESIGN.md
"Trust scopes") is mixed into the seed, so the chains of two scopes never share
an entry: the index neither predicts nor reveals another scope's prefixes.
Because a block's hash covers every token before it, two prompts share ``h[i]``
only when they share the whole prefix up to block ``i``; the longest run of
leading hashes a replica holds is the prefix it can
reuse. A trailing partial block is never hashed: engines reuse full blocks only.

The caller picks the unit: a policy may hash every KV block, or (as
prefix_aware does by default) a whole number of blocks per entry, trading
overlap precision for a shorter chain to hash and walk; "block" below means
that unit.

The index is a guess, not the replica's truth: it records what the router sent,
not what the engine kept. It bounds that guess the way the engine bounds its
cache: each replica holds at most ``kv_capacity_blocks`` entries, evicted least
recently used first, and entries untouched for ``ttl_s`` are dropped. A restart
drops every entry of the replica at once.

Layout, chosen so that a lookup among 64 replicas costs one dict probe per
block rather than one per replica per block::

    holders:  block hash -> bitmask of replicas that hold it
    lru[r]:   OrderedDict block hash -> last touch time, oldest first

Blocks of one prompt are touched tail first, so a prompt's parent blocks are
always more recent than its children and LRU eviction trims prefixes from the
tail, never leaving a child without its parent.

Host tier. A replica with a host-memory KV tier (engine.kv_cache.HostPool) keeps
what its GPU pool evicts, so the index keeps a second bounded LRU per replica:
an entry pushed out of the GPU side by capacity moves to the host side (up to
``host_capacity_blocks``, oldest dropped first), and recording it again brings
it back, as the engine's onboarding does. ``match_tiers`` reports, per replica,
the leading blocks held on the GPU and those held in either tier, so a policy
can price the difference as a copy rather than a prefill::

    holders:       block hash -> replicas holding it on the GPU
    host_holders:  block hash -> replicas holding it in host memory
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass


def chain_seed(block_size: int, cache_salt: int = 0) -> int:
    """The parent of a chain's first block: the block size (chains of different block sizes never
    collide), salted with the trust scope unless `cache_salt` is 0."""
    return block_size if cache_salt == 0 else hash((block_size, cache_salt))


def block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: int = 0) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids``.

    Python's hash of a tuple of ints is deterministic across processes (only
    str/bytes hashing is salted), cheap, and 64-bit: about 45 us for a
    4,000-token prompt in blocks of 16 on these machines.
    """
    return extend_hashes(token_ids, block_size, [], cache_salt)


def extend_hashes(token_ids: Sequence[int], block_size: int, hashes: list[int],
                  cache_salt: int = 0) -> list[int]:
    """Complete ``hashes`` (the chain of the first ``len(hashes)`` blocks) to every full block; in place."""
    assert block_size > 0, "block_size must be positive"
    tokens = token_ids if isinstance(token_ids, tuple) else tuple(token_ids)
    end = len(tokens) - len(tokens) % block_size
    append = hashes.append
    parent = hashes[-1] if hashes else chain_seed(block_size, cache_salt)
    for start in range(len(hashes) * block_size, end, block_size):
        parent = hash((parent, tokens[start:start + block_size]))
        append(parent)
    return hashes


@dataclass(frozen=True, slots=True)
class IndexStats:
    replicas: int                       # replicas with at least one entry
    entries: int                        # (replica, block) pairs held
    distinct_blocks: int                # block hashes held by at least one replica
    host_entries: int = 0               # (replica, block) pairs held in host tiers


@dataclass(frozen=True, slots=True)
class TierOverlap:
    """Leading blocks of a prompt each replica holds, by tier."""

    gpu: dict[str, int]                 # held in the GPU pool (reused by reference)
    either: dict[str, int]              # held in the GPU pool or the host tier (≥ gpu; the rest is copied)


class PrefixIndex:
    """Bounded map from block-hash chains to the replicas that probably hold them."""

    def __init__(self, ttl_s: float = 600.0) -> None:
        assert ttl_s > 0, "ttl_s must be positive"
        self._ttl_s = ttl_s
        self._holders: dict[int, int] = {}
        self._lru: dict[str, OrderedDict[int, float]] = {}
        self._capacity: dict[str, int] = {}
        self._bit: dict[str, int] = {}
        self._names_by_bit: dict[int, str] = {}
        self._masks: dict[tuple[str, ...], tuple[int, tuple[str, ...]]] = {}
        self._free_bits: list[int] = []            # heap of bits released by dropped replicas
        self._bits_issued = 0
        self._host_holders: dict[int, int] = {}
        self._host_lru: dict[str, OrderedDict[int, float]] = {}
        self._host_capacity: dict[str, int] = {}

    # -- queries ---------------------------------------------------------------------------------

    def overlap_blocks(self, hashes: Sequence[int], replicas: Iterable[str]) -> dict[str, int]:
        """Leading blocks of ``hashes`` each of ``replicas`` holds; 0 for those holding none.

        Walks the chain once with a bitmask of replicas still matching; a replica
        leaves the mask at the first block it lacks, so its overlap is that index.
        """
        names = tuple(replicas)
        alive, unknown = self._mask(names)
        drops: list[tuple[int, int]] = []                          # (depth, replicas leaving there)
        holders = self._holders
        depth = 0
        for block_hash in hashes:
            if not alive:
                break
            still = alive & holders.get(block_hash, 0)
            if still != alive:
                drops.append((depth, alive & ~still))
                alive = still
            depth += 1
        if alive:
            drops.append((depth, alive))
        return self._resolve(names, unknown, drops)

    def match(self, token_ids: Sequence[int], block_size: int, replicas: Iterable[str],
              cache_salt: int = 0) -> tuple[dict[str, int], list[int]]:
        """``overlap_blocks`` that hashes the prompt as it walks and stops where no replica matches.

        Returns the overlaps and the hashes computed so far (every block up to and
        including the first one no candidate holds); ``extend_hashes`` completes
        them when the prompt is recorded. A new conversation that shares only the
        system prompt is hashed only that far at decision time.
        """
        names = tuple(replicas)
        alive, unknown = self._mask(names)
        drops: list[tuple[int, int]] = []
        hashes: list[int] = []
        tokens = token_ids if isinstance(token_ids, tuple) else tuple(token_ids)
        end = len(tokens) - len(tokens) % block_size
        holders = self._holders
        append = hashes.append
        parent = chain_seed(block_size, cache_salt)
        depth = 0
        for start in range(0, end, block_size):
            if not alive:
                break
            parent = hash((parent, tokens[start:start + block_size]))
            append(parent)
            still = alive & holders.get(parent, 0)
            if still != alive:
                drops.append((depth, alive & ~still))
                alive = still
            depth += 1
        if alive:
            drops.append((depth, alive))
        return self._resolve(names, unknown, drops), hashes

    def match_tiers(self, token_ids: Sequence[int], block_size: int, replicas: Iterable[str],
                    cache_salt: int = 0) -> tuple[TierOverlap, list[int]]:
        """``match`` by tier: hashing stops where no replica holds the block in either tier."""
        names = tuple(replicas)
        tokens = token_ids if isinstance(token_ids, tuple) else tuple(token_ids)
        end = len(tokens) - len(tokens) % block_size
        hashes: list[int] = []

        def chain() -> Iterator[int]:
            parent = chain_seed(block_size, cache_salt)
            for start in range(0, end, block_size):
                parent = hash((parent, tokens[start:start + block_size]))
                hashes.append(parent)
                yield parent

        return self._walk_tiers(names, chain()), hashes

    def overlap_tiers(self, hashes: Sequence[int], replicas: Iterable[str]) -> TierOverlap:
        """``overlap_blocks`` by tier, for an already hashed prompt."""
        return self._walk_tiers(tuple(replicas), iter(hashes))

    def _walk_tiers(self, names: tuple[str, ...], chain: Iterator[int]) -> TierOverlap:
        """One walk, two masks: replicas still matching on the GPU, and in either tier. A replica
        leaves the first at its first block not on the GPU, the second at its first block in
        neither; the walk ends when every replica has left the second."""
        alive, unknown = self._mask(names)
        on_gpu = alive
        gpu_drops: list[tuple[int, int]] = []
        drops: list[tuple[int, int]] = []
        holders, host_holders = self._holders, self._host_holders
        depth = 0
        for block_hash in chain:
            if not alive:
                break
            gpu = holders.get(block_hash, 0)
            still_gpu = on_gpu & gpu
            if still_gpu != on_gpu:
                gpu_drops.append((depth, on_gpu & ~still_gpu))
                on_gpu = still_gpu
            still = alive & (gpu | host_holders.get(block_hash, 0))
            if still != alive:
                drops.append((depth, alive & ~still))
                alive = still
            depth += 1
        if alive:
            drops.append((depth, alive))
        if on_gpu:
            gpu_drops.append((depth, on_gpu))
        return TierOverlap(gpu=self._resolve(names, unknown, gpu_drops),
                           either=self._resolve(names, unknown, drops))

    def has_host_entries(self) -> bool:
        """Whether any replica holds anything in a host tier (when not, ``match`` says it all)."""
        return bool(self._host_holders)

    def _mask(self, names: tuple[str, ...]) -> tuple[int, tuple[str, ...]]:
        """Bitmask of the named replicas the index knows, and the names it does not (cached per name set)."""
        cached = self._masks.get(names)
        if cached is not None:
            return cached
        mask = 0
        unknown: list[str] = []
        bits = self._bit
        for name in names:
            bit = bits.get(name)
            if bit is None:
                unknown.append(name)
            else:
                mask |= bit
        if len(self._masks) >= 64:
            self._masks.clear()
        result = self._masks[names] = (mask, tuple(unknown))
        return result

    def _resolve(self, names: tuple[str, ...], unknown: tuple[str, ...],
                 drops: list[tuple[int, int]]) -> dict[str, int]:
        """Turn (depth, mask) drop points into a dict. The largest group (typically every replica
        leaving at the end of the shared system prompt) is filled in one C-level call; only the
        others are assigned replica by replica."""
        if not drops:
            return dict.fromkeys(names, 0)
        largest = max(drops, key=lambda drop: drop[1].bit_count())
        overlap = dict.fromkeys(names, largest[0])
        for name in unknown:
            overlap[name] = 0
        names_by_bit = self._names_by_bit
        for depth, mask in drops:
            if mask is largest[1]:
                continue
            while mask:
                low = mask & -mask
                overlap[names_by_bit[low]] = depth
                mask ^= low
        return overlap

    def entries(self, replica: str) -> int:
        lru = self._lru.get(replica)
        return 0 if lru is None else len(lru)

    def host_entries(self, replica: str) -> int:
        lru = self._host_lru.get(replica)
        return 0 if lru is None else len(lru)

    def stats(self) -> IndexStats:
        return IndexStats(
            replicas=sum(1 for lru in self._lru.values() if lru),
            entries=sum(len(lru) for lru in self._lru.values()),
            distinct_blocks=len(self._holders),
            host_entries=sum(len(lru) for lru in self._host_lru.values()),
        )

    # -- updates ---------------------------------------------------------------------------------

    def set_capacity(self, replica: str, kv_capacity_blocks: int, now: float,
                     host_capacity_blocks: int = 0) -> None:
        """Bound the replica's entries to its KV capacity (GPU pool, host tier), evicting LRU
        entries beyond it."""
        assert kv_capacity_blocks >= 0 and host_capacity_blocks >= 0, "capacities must not be negative"
        if self._capacity.get(replica) == kv_capacity_blocks and \
                self._host_capacity.get(replica, 0) == host_capacity_blocks:
            return
        self._capacity[replica] = kv_capacity_blocks
        self._host_capacity[replica] = host_capacity_blocks
        lru = self._lru.get(replica)
        if lru is not None:
            self._evict(replica, lru, kv_capacity_blocks, now)
        host = self._host_lru.get(replica)
        if host is not None:
            self._evict_host(self._bit[replica], host, host_capacity_blocks, now)

    def record(self, replica: str, hashes: Sequence[int], now: float) -> None:
        """The replica was sent a prompt with these block hashes: it now holds them."""
        capacity = self._capacity.get(replica)
        assert capacity is not None, f"set_capacity({replica!r}) must precede record()"
        bit = self._bit_for(replica)
        lru = self._lru.setdefault(replica, OrderedDict())
        holders = self._holders
        host = self._host_lru.get(replica)
        if host:                                      # blocks sent again are copied back to the GPU
            for block_hash in hashes[:capacity]:
                if host.pop(block_hash, None) is not None:
                    self._clear(self._host_holders, block_hash, bit)
        # Only the first `capacity` blocks can be resident at once; touch them tail first
        # so parents end up more recent than children.
        for block_hash in reversed(hashes[:capacity]):
            mask = holders.get(block_hash, 0)
            if mask & bit:
                lru.move_to_end(block_hash)
            else:
                holders[block_hash] = mask | bit
            lru[block_hash] = now
        self._evict(replica, lru, capacity, now)

    def expire(self, now: float) -> None:
        """Drop entries untouched for longer than the TTL (oldest sit at the front), in both tiers."""
        horizon = now - self._ttl_s
        for tier, holders in ((self._lru, self._holders), (self._host_lru, self._host_holders)):
            for replica, lru in tier.items():
                bit = self._bit[replica]
                while lru:
                    block_hash, touched = next(iter(lru.items()))
                    if touched >= horizon:
                        break
                    del lru[block_hash]
                    self._clear(holders, block_hash, bit)

    def drop_replica(self, replica: str) -> None:
        """Forget everything the replica held (it restarted with an empty cache, or left).

        Its bit goes back to a free list: replica names come and go under an autoscaler, and
        masks must stay as wide as the fleet, not as the fleet's history."""
        lru = self._lru.pop(replica, None)
        if lru is None:
            return
        bit = self._bit.pop(replica)
        for block_hash in lru:
            self._clear(self._holders, block_hash, bit)
        for block_hash in self._host_lru.pop(replica, {}):
            self._clear(self._host_holders, block_hash, bit)
        del self._names_by_bit[bit]
        heapq.heappush(self._free_bits, bit)
        self._masks.clear()

    def _evict(self, replica: str, lru: OrderedDict[int, float], capacity: int, now: float) -> None:
        """Trim the GPU side to `capacity`; entries pushed out by capacity (not by age) move to the
        replica's host side when it has one."""
        bit = self._bit[replica]
        horizon = now - self._ttl_s
        host_capacity = self._host_capacity.get(replica, 0)
        host = self._host_lru.setdefault(replica, OrderedDict()) if host_capacity else None
        while lru:
            block_hash, touched = next(iter(lru.items()))
            if len(lru) <= capacity and touched >= horizon:
                break
            del lru[block_hash]
            self._clear(self._holders, block_hash, bit)
            if host is not None and touched >= horizon:
                host[block_hash] = touched
                host.move_to_end(block_hash)
                self._host_holders[block_hash] = self._host_holders.get(block_hash, 0) | bit
        if host is not None:
            self._evict_host(bit, host, host_capacity, now)

    def _evict_host(self, bit: int, host: OrderedDict[int, float], capacity: int, now: float) -> None:
        horizon = now - self._ttl_s
        while host:
            block_hash, touched = next(iter(host.items()))
            if len(host) <= capacity and touched >= horizon:
                return
            del host[block_hash]
            self._clear(self._host_holders, block_hash, bit)

    @staticmethod
    def _clear(holders: dict[int, int], block_hash: int, bit: int) -> None:
        remaining = holders[block_hash] & ~bit
        if remaining:
            holders[block_hash] = remaining
        else:
            del holders[block_hash]

    def _bit_for(self, replica: str) -> int:
        bit = self._bit.get(replica)
        if bit is None:
            if self._free_bits:
                bit = heapq.heappop(self._free_bits)
            else:
                bit = 1 << self._bits_issued
                self._bits_issued += 1
            self._bit[replica] = bit
            self._names_by_bit[bit] = replica
            self._masks.clear()
        return bit
