"""The routing policies teams deploy instead of Sluice's, reproduced for the simulator.

Each follows its project's published algorithm and defaults, re-implemented here
(no code copied) so that `bench/bench_routing.py` can run them beside
Sluice's `prefix_aware` on the very same traces, behind the same `RoutingPolicy`
interface. They are simulator-only: nothing in the live worker builds them.

sglang_cache_aware — SGLang's model gateway / sgl-router ``cache_aware`` policy
(followed: sglang-router's router.rs design comment and the CacheAware defaults
of its ``parse_policy_config``: cache_threshold 0.3, balance_abs_threshold 64,
balance_rel_threshold 1.5, eviction_interval_secs 120, max_tree_size 2^26; the
same algorithm ships in SMG and vLLM's router)::

    imbalanced = max_load - min_load > 64 and max_load > 1.5 * min_load
    if imbalanced:            route to the least-loaded worker
    elif match_rate > 0.3:    route to the worker whose tree shares the longest prefix
    else:                     route to the worker with the smallest tree
    then insert the prompt into the chosen worker's tree

  Load is the router's own count of requests sent and not finished. The
  approximate tree is kept per worker at 16-token granularity (the gateway's
  token tree is page-aligned) and evicted by size every 120 s (LRU leaves). The
  router never learns that a worker restarted: its tree keeps the lost prefixes.

llmd / llmd_precise — llm-d inference scheduler (Gateway API Inference
Extension EPP) with its documented default profile: weighted scorers, max-score
picker, random tie-break::

    score = 3 * prefix + 2 * queue + 2 * kv
    prefix = matched blocks / prompt blocks (16-token blocks, at most 256 matched)
    queue  = (max_waiting - waiting) / (max_waiting - min_waiting)   (1 when all equal)
    kv     = 1 - KV utilization

  ``llmd`` learns prefixes from the requests it routed (an LRU of 31,250 indexed
  blocks per pod, its DefaultLRUCapacityPerServer); ``llmd_precise`` is the
  precise-prefix-cache scorer fed by the engines' KV events, which in the
  simulator is each replica's exact cache (the fleet's probe).

dynamo_kv — NVIDIA Dynamo's KV router (KvRouterConfig defaults:
overlap_score_weight 1.0, router_temperature 0, so softmax sampling reduces to
argmin)::

    cost = 1.0 * max(prompt blocks - overlap blocks, 0) + active decode blocks

  with the overlap from KV events (exact, as for llmd_precise) and decode blocks
  from the worker's reported KV use and the router's own routed requests. Dynamo
  also counts the prefill blocks of requests still prefilling; the policy
  interface carries no first-token event, so that term is left out (queued
  prefill is then under-counted; Sluice's policy shares that view).

The answer's length that hosts pass to ``on_finished`` is accepted and ignored by
all three: SGLang's tree and llm-d's LRU index the routed prompt text only, and
the precise scorer and Dynamo read the engines' caches, which hold the answer already.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from sluice.router.policies import InFlight, kv_utilization
from sluice.router.policy import CachedTokensProbe, ReplicaView, RouteDecision, RouteRequest, RoutingPolicy
from sluice.router.prefix_index import block_hashes

PEER_POLICIES = ("sglang_cache_aware", "llmd", "llmd_precise", "dynamo_kv")
UNKNOWN_PEER = "unknown peer policy {name!r}; known: " + ", ".join(PEER_POLICIES)
NEEDS_PROBE = "{name} reads the engines' KV events: give cached_tokens=<the fleet's exact-cache probe>"

OUTCOME_CACHE_MATCH = "cache_match"
OUTCOME_SMALLEST_TREE = "smallest_tree"
OUTCOME_SHORTEST_QUEUE = "shortest_queue"
OUTCOME_MAX_SCORE = "max_score"
OUTCOME_MIN_COST = "min_cost"


class PendingHashes:
    """Prompt hashes computed by choose() for on_routed() to insert, keyed by request id. Bounded: a
    choose() that is never followed by on_routed() (an explain, a refused run) must not grow it."""

    LIMIT = 64

    def __init__(self) -> None:
        self._by_request: OrderedDict[str, list[int]] = OrderedDict()

    def keep(self, request_id: str, hashes: list[int]) -> None:
        self._by_request[request_id] = hashes
        if len(self._by_request) > self.LIMIT:
            self._by_request.popitem(last=False)

    def pop(self, request_id: str, default: None = None) -> list[int] | None:
        return self._by_request.pop(request_id, default)


class BlockTrees:
    """Per-worker sets of chained prompt-block hashes, LRU-ordered: the approximate trees a gateway
    keeps of what it routed. ``size`` is a worker's tree size in blocks (shared prefixes counted once
    per worker, as a radix tree does)."""

    def __init__(self, block_size: int, capacity_blocks: int) -> None:
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self._trees: dict[str, OrderedDict[int, None]] = {}

    def size(self, worker: str) -> int:
        tree = self._trees.get(worker)
        return 0 if tree is None else len(tree)

    def overlap(self, hashes: Sequence[int], worker: str) -> int:
        """Leading blocks of ``hashes`` the worker's tree holds."""
        tree = self._trees.get(worker)
        if tree is None:
            return 0
        matched = 0
        for block_hash in hashes:
            if block_hash not in tree:
                break
            matched += 1
        return matched

    def insert(self, worker: str, hashes: Sequence[int]) -> None:
        tree = self._trees.setdefault(worker, OrderedDict())
        for block_hash in reversed(hashes):        # tail first: parents stay more recent than leaves
            tree[block_hash] = None
            tree.move_to_end(block_hash)
        self.evict(worker)

    def evict(self, worker: str) -> None:
        """Trim the worker's tree to capacity, least recently used leaves first."""
        tree = self._trees.get(worker)
        while tree is not None and len(tree) > self.capacity_blocks:
            tree.popitem(last=False)


# -- SGLang ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SglangOptions:
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval_s: float = 120.0
    max_tree_size_tokens: int = 1 << 26
    tree_block_tokens: int = 16


class SglangCacheAware:
    name = "sglang_cache_aware"

    def __init__(self, options: SglangOptions | None = None) -> None:
        self.options = options or SglangOptions()
        opts = self.options
        self._trees = BlockTrees(opts.tree_block_tokens, opts.max_tree_size_tokens // opts.tree_block_tokens)
        self._in_flight = InFlight()
        self._next_eviction = opts.eviction_interval_s
        self._pending = PendingHashes()

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView],
               now: float) -> RouteDecision | None:
        if not replicas:
            return None
        self._evict_if_due(replicas, now)
        count = self._in_flight.count
        loads = {view.name: count.get(view.name, 0) for view in replicas}
        low, high = min(loads.values()), max(loads.values())
        opts = self.options
        if high - low > opts.balance_abs_threshold and high > opts.balance_rel_threshold * low:
            chosen = min(replicas, key=lambda view: (loads[view.name], view.name)).name
            return RouteDecision(replica=chosen, outcome=OUTCOME_SHORTEST_QUEUE)
        hashes = block_hashes(request.token_ids, opts.tree_block_tokens, request.cache_salt)
        self._pending.keep(request.request_id, hashes)
        matches = {view.name: self._trees.overlap(hashes, view.name) for view in replicas}
        best = max(replicas, key=lambda view: (matches[view.name], -loads[view.name], view.name))
        matched_tokens = matches[best.name] * opts.tree_block_tokens
        if request.token_ids and matched_tokens / len(request.token_ids) > opts.cache_threshold:
            return RouteDecision(replica=best.name, outcome=OUTCOME_CACHE_MATCH,
                                 predicted_cached_tokens=matched_tokens)
        smallest = min(replicas, key=lambda view: (self._trees.size(view.name), view.name))
        return RouteDecision(replica=smallest.name, outcome=OUTCOME_SMALLEST_TREE,
                             predicted_cached_tokens=matches[smallest.name] * opts.tree_block_tokens)

    def _evict_if_due(self, replicas: Sequence[ReplicaView], now: float) -> None:
        if now < self._next_eviction:
            return
        self._next_eviction = now + self.options.eviction_interval_s
        for view in replicas:
            self._trees.evict(view.name)

    def on_routed(self, request: RouteRequest, decision: RouteDecision, now: float) -> None:
        hashes = self._pending.pop(request.request_id, None)
        if hashes is None:
            hashes = block_hashes(request.token_ids, self.options.tree_block_tokens, request.cache_salt)
        self._trees.insert(decision.replica, hashes)
        self._in_flight.add(request.request_id, decision.replica, 0)

    def on_finished(self, request: RouteRequest, replica: str, now: float,
                    output_tokens: int = 0) -> None:
        self._in_flight.remove(request.request_id)

    def on_replica_restarted(self, replica: str) -> None:
        return None                                # the gateway is not told; its tree goes stale

    def tree_size(self, replica: str) -> int:
        return self._trees.size(replica)


# -- llm-d ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LlmdOptions:
    prefix_weight: float = 3.0
    queue_weight: float = 2.0
    kv_weight: float = 2.0
    block_tokens: int = 16
    max_prefix_blocks: int = 256
    lru_capacity_blocks: int = 31_250
    seed: int = 0


class Llmd:
    """llm-d's EPP default profile; precise when given the engines' exact caches (KV events)."""

    def __init__(self, options: LlmdOptions | None = None,
                 cached_tokens: CachedTokensProbe | None = None) -> None:
        self.options = options or LlmdOptions()
        self._probe = cached_tokens
        self.name = "llmd_precise" if cached_tokens is not None else "llmd"
        self._trees = BlockTrees(self.options.block_tokens, self.options.lru_capacity_blocks)
        self._rng = random.Random(self.options.seed)
        self._pending = PendingHashes()

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView],
               now: float) -> RouteDecision | None:
        if not replicas:
            return None
        opts = self.options
        matched = self._matched_blocks(request, replicas)
        total = min(len(request.token_ids) // opts.block_tokens, opts.max_prefix_blocks)
        waiting = [view.waiting for view in replicas]
        low, high = min(waiting), max(waiting)
        scores: list[tuple[float, ReplicaView]] = []
        for view in replicas:
            prefix = matched[view.name] / total if total else 0.0
            queue = 1.0 if high == low else (high - view.waiting) / (high - low)
            kv = 1.0 - kv_utilization(view)
            score = opts.prefix_weight * prefix + opts.queue_weight * queue + opts.kv_weight * kv
            scores.append((score, view))
        best_score = max(score for score, _ in scores)
        tied = [view for score, view in scores if score >= best_score - 1e-12]
        chosen = tied[self._rng.randrange(len(tied))] if len(tied) > 1 else tied[0]
        return RouteDecision(replica=chosen.name, outcome=OUTCOME_MAX_SCORE,
                             predicted_cached_tokens=matched[chosen.name] * opts.block_tokens)

    def _matched_blocks(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> dict[str, int]:
        opts = self.options
        if self._probe is not None:
            probe = self._probe
            return {view.name: min(probe(view.name, request.token_ids) // opts.block_tokens,
                                   opts.max_prefix_blocks) for view in replicas}
        hashes = self._hashes(request)
        self._pending.keep(request.request_id, hashes)
        return {view.name: self._trees.overlap(hashes, view.name) for view in replicas}

    def on_routed(self, request: RouteRequest, decision: RouteDecision, now: float) -> None:
        hashes = self._pending.pop(request.request_id, None)
        if self._probe is None:
            self._trees.insert(decision.replica, hashes if hashes is not None else self._hashes(request))

    def _hashes(self, request: RouteRequest) -> list[int]:
        opts = self.options
        return block_hashes(request.token_ids, opts.block_tokens, request.cache_salt)[:opts.max_prefix_blocks]

    def on_finished(self, request: RouteRequest, replica: str, now: float,
                    output_tokens: int = 0) -> None:
        return None

    def on_replica_restarted(self, replica: str) -> None:
        return None                                # approximate: pods keep their names across restarts


# -- Dynamo ---------------------------------------------------------------------------------------


class DynamoKv:
    name = "dynamo_kv"

    def __init__(self, cached_tokens: CachedTokensProbe, overlap_score_weight: float = 1.0) -> None:
        self._probe = cached_tokens
        self._weight = overlap_score_weight
        self._in_flight = InFlight()
        self._block_size: dict[str, int] = {}

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView],
               now: float) -> RouteDecision | None:
        if not replicas:
            return None
        best: tuple[float, str] | None = None
        chosen: ReplicaView | None = None
        overlap_of: dict[str, int] = {}
        for view in replicas:
            size = view.block_size
            prompt_blocks = -(-len(request.token_ids) // size)
            overlap = self._probe(view.name, request.token_ids) // size
            overlap_of[view.name] = overlap
            decode = max(view.kv_used_blocks, self._in_flight.blocks.get(view.name, 0))
            cost = (self._weight * max(prompt_blocks - overlap, 0) + decode, view.name)
            if best is None or cost < best:
                best, chosen = cost, view
        assert chosen is not None
        self._block_size[chosen.name] = chosen.block_size
        return RouteDecision(replica=chosen.name, outcome=OUTCOME_MIN_COST,
                             predicted_cached_tokens=overlap_of[chosen.name] * chosen.block_size)

    def on_routed(self, request: RouteRequest, decision: RouteDecision, now: float) -> None:
        size = self._block_size.get(decision.replica, 16)
        self._in_flight.add(request.request_id, decision.replica, -(-len(request.token_ids) // size))

    def on_finished(self, request: RouteRequest, replica: str, now: float,
                    output_tokens: int = 0) -> None:
        self._in_flight.remove(request.request_id)

    def on_replica_restarted(self, replica: str) -> None:
        self._in_flight.drop_replica(replica)


def make_peer_policy(name: str, cached_tokens: CachedTokensProbe | None = None) -> RoutingPolicy:
    """A peer policy by name with its published defaults; the KV-event ones need the fleet's probe."""
    if name == "sglang_cache_aware":
        return SglangCacheAware()
    if name == "llmd":
        return Llmd()
    if name in ("llmd_precise", "dynamo_kv"):
        if cached_tokens is None:
            raise ValueError(NEEDS_PROBE.format(name=name))
        return Llmd(cached_tokens=cached_tokens) if name == "llmd_precise" else DynamoKv(cached_tokens)
    raise ValueError(UNKNOWN_PEER.format(name=name))
