"""The load-aware policies: least_loaded and prefix_aware (and its exact-cache oracle).

Load. A replica's load is the number of requests it holds, counted from three
sources that each see something the others miss::

    load = max(waiting + running,   # scraped from the replica: every router's traffic, but stale
               view.in_flight,      # the host's count of runs it sent and has not seen finish
               own in-flight)       # this policy's count from on_routed/on_finished, never stale

The maximum, not the sum: the scraped count already includes the runs this
router sent before the scrape, so adding them would count a run twice, while
runs sent since the scrape (a burst) show up in the in-flight counts at once.

Prefix-aware cost (NVIDIA Dynamo's KV router, in KV blocks of the replica)::

    cost = prefill_weight * blocks still to prefill after the cached overlap
           + blocks of KV the replica is already decoding

Dynamo's default weight is 1; ours is 64, because the two kinds of block are
not worth the same. On seed 003's 70B FP8 / 8 x H100 a prompt block not
reused costs ~1.1 ms of the node's compute, stalling every decode in that
step, while one more block of someone else's KV costs ~0.07 ms over a
350-token answer (~16x). With weight 1 the decode term, which differs by
hundreds of blocks between busy replicas, outvotes a 2,500-token cached
history: in bench/bench_router.py's chat fleet an exact-cache router with
weight 1 kept 69% of prompt tokens cached, with 16 91%, with 64 93%. At 64 the
decode term is in effect the tie-break among replicas holding the same prefix
(new conversations), and balance is left to the explicit bound below.

Prefill queue. Blocks to prefill are time only once it is this prompt's turn:
a prompt sent to a replica that was just given others to prefill waits for
those first (the engine's steps carry a fixed budget of prompt tokens). So the
cost also counts the blocks queued ahead of it, at the same weight::

    cost = prefill_weight * (blocks to prefill here + blocks queued for prefill here)
           + blocks of KV the replica is already decoding

The queue counts at most ``prefill_queue_cap_tokens`` (2,048: one engine step's
prompt budget), so it decides among replicas whose caches save about as much
(a new conversation over a shared system prompt, a turn with little history)
and never outweighs a larger saving. Uncapped, it did: rag at twice its
capacity (150 requests/s on 4 replicas, the capacity sweep's first step) queues
grow on every replica, a question whose 6,000-token document's holder had
~190 blocks more queued went elsewhere and prefilled the document again, which
lengthened every queue: the oracle completed 71 requests/s against 91 with the
cap (and 91 before the queue term). Heavier imbalance is the bound's job.

The queue is the policy's own estimate (the hosts report no first token): each
routed request adds the blocks it was not expected to find cached, and the
replica works the total off at its prefill rate (``ReplicaView.
prefill_tokens_per_s``, or ``prefill_tokens_per_s`` of the options when it does
not report one, over its slowness). This is the trade the cost was always
meant to price, in one unit: the wait the target adds against the prefill its
cache saves, within a step's worth. A new conversation, which every replica
can serve from the shared system prompt, goes where the queue is shortest, not
to the replica with the least decode KV; a follow-up with a few hundred tokens
cached may leave a home with a step's worth more queued.
bench_routing agent at 50% (4 replicas, 30 s, seeds 11-13, 328 requests/s asked):
p95 TTFT 78 -> 59 ms (SGLang's cache_aware 73 ms): agent steps bring up to
1,500 new tokens each, and where they queue is most of the tail.

Host tier. A replica with a host-memory KV tier holds evicted prefixes there and
copies them back instead of prefilling them (engine.kv_cache). The index keeps
both tiers (router.prefix_index), and a block found only in host memory costs
``host_block_cost`` of a prefill block (the replica reports the ratio of copy
to prefill time: 0.018 for 70B FP8 on H100 over PCIe Gen5, 0.0026 on GH200's NVLink-C2C), so::

    cost = prefill_weight * (blocks in neither tier + host_block_cost * blocks only in host memory)
           + blocks of KV the replica is already decoding

A GPU-tier holder beats a host-tier holder, which beats a replica holding none.

Imbalance bound. Cost alone lets a hot prefix pile every request onto one
replica. So before costing, a replica whose load exceeds

    mean load among candidates * (1 + imbalance_bound) + imbalance_slack

is not a candidate at all, whatever it has cached; the least-loaded replica
always is (it is at or under the mean). Defaults 0.5 and 8 requests: among four
replicas, one 100 requests deep is skipped while the other three average 48 or
less. The mean, not the minimum: against the minimum, one empty replica (just
restarted, or just added by the autoscaler) put every replica with more than 8
requests out of bounds, and every follow-up turn of every conversation went to
the cold replica to be prefilled again (seed 11, bench_routing restart at 50%:
p95 TTFT 30 ms against 21 ms with the mean; chat, agent and bursty unchanged
within the seeds' spread). Tighter bounds cost more than they buy in the
chat fleet: at 0.1 and 2, one follow-up turn in five was sent away from its
history, paying a full re-prefill whose chunks slowed every decode on the new
replica (hit rate 78% against 94%, TTFT p95 311 ms against 60 ms), while the
time-averaged load CoV was no better (0.023 against 0.020). The slack keeps
the bound meaningful at low loads, where a relative bound alone would force
strict rotation.

Session affinity. A conversation's home is the replica that served its
previous turn. It holds that turn's prompt and the answer (``on_finished``
carries the answer's length), so for the next turn, whose prompt is that
history plus one new message, it is credited with the prompt and the answer
but the answer's last token (see ``Home``), aligned down to whole blocks:
the index learned the prompt only and, without the answer's length, the home
is credited with what the index saw. The credit counts in the cost, in
``predicted_cached_tokens`` and in what the turn adds to the home's prefill
queue: the new message's blocks, not the answer the home already holds. A
restart since the turn voids it (the epoch), and the map of homes is an LRU
of ``max_conversations``.

With ``home_in_cost = 1`` (the default) the credit is all the home gets: the
cost decides, and the home keeps the turn unless its prefill queue and decode
load outweigh the blocks it holds beyond what the other replica holds, which
with the queue capped at 2,048 tokens happens only while the conversation's
own history (the shared system prompt aside) is shorter than that. With 0
the home takes every turn while it is within the bound (sticky affinity).
bench_routing (4 replicas, 30 s, seeds 11-13, median p95 TTFT in ms, sticky
-> credited in the cost, SGLang's cache_aware in brackets):

    agent   50%: 58.6 -> 45.9 (56.8)   80%: 79.4 -> 59.4 (86.6)
    chat    50%: 15.1 -> 14.8 (15.6)   80%: 17.3 -> 16.6 (18.5)
    bursty  50%: 15.7 -> 15.4 (17.0)   80%: 18.5 -> 18.8 (20.2)
    restart 50%: 19.7 -> 21.5 (24.2)   80%: 26.9 -> 27.0 (38.6)
    slow    50%: 17.2 -> 16.7 (18.7)   80%: 19.2 -> 18.7 (22.8)

with goodput within 3% of the best peer's everywhere. Agent's tool outputs
(~400 tokens, up to 1,500) pile up in one replica's prefill queue, and a
conversation with little history of its own is better served by a replica
with less queued (SGLang's tree sends every turn to its longest match). Before
the answer's length was known the same option credited the home with the
whole new prompt but one block and queued each home turn with its answer,
which the home already held: in chat-shaped workloads, whose answers (~350
tokens) outweigh the messages (~120), the queue was overstated and turns left
homes they should have kept (bursty at 50%: 16 -> 18 ms against SGLang's 17,
a loss), so it was off by default.

Long-context pool. Prompts longer than ``long_context_threshold_tokens`` go
to replicas marked ``long_context`` and shorter ones stay off them, each
falling back to the whole pool when its side is empty (seed 003: a 32k request
takes 8x the KV and stalls the general pool's prefill).

Outcomes (counted by router.metrics):
- ``affinity_hit``: sent to the conversation's replica, or to a replica holding
  the longest cached prefix when candidates differed;
- ``balanced_away``: a replica holding more of the prompt (or the conversation's
  replica) was passed over for load or (with home_in_cost) its prefill queue;
- ``fallback``: every candidate held the same prefix (often none, or just the
  shared system prompt), so load alone decided.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Final

from sluice.router.policy import CachedTokensProbe, ReplicaView, RouteDecision, RouteRequest
from sluice.router.prefix_index import PrefixIndex, extend_hashes

OUTCOME_LEAST_LOADED = "least_loaded"
OUTCOME_AFFINITY_HIT = "affinity_hit"
OUTCOME_BALANCED_AWAY = "balanced_away"
OUTCOME_FALLBACK = "fallback"
UNKNOWN_OPTION = "unknown routing policy option {option!r}; known: {known}"
NOT_WHOLE = "routing policy option {option!r} takes a whole number, got {value!r}"


@dataclass(frozen=True, slots=True)
class PolicyOptions:
    """Knobs of the load-aware policies; every one has the default the bench was run with."""

    imbalance_bound: float = 0.50              # relative headroom over the candidates' mean load
    imbalance_slack: int = 8                   # absolute headroom, in requests
    prefill_weight: float = 64.0               # Dynamo's overlap_score_weight (see the module docstring)
    long_context_threshold_tokens: int = 16_384
    index_ttl_s: float = 600.0                 # prefix-index entries untouched this long are dropped
    index_unit_tokens: int = 64                # tokens per index entry, rounded down to whole KV blocks
    max_conversations: int = 100_000           # session-affinity entries kept (LRU)
    # A replica's prompt-processing rate when it does not report one (seed 003: 70B FP8 on 8 x H100)
    prefill_tokens_per_s: float = 28_000.0
    # Queued prompt tokens counted at most (seed 003's engine step budget, max_num_tokens): the queue
    # decides among replicas whose caches save about as much, never against a larger saving
    prefill_queue_cap_tokens: int = 2048
    # 1: a conversation's home is credited in the cost with what it holds (see "Session affinity");
    # 0: it takes every turn while within the bound
    home_in_cost: int = 1

    @classmethod
    def with_overrides(cls, overrides: Mapping[str, float]) -> PolicyOptions:
        """Defaults with `overrides` (from config or keyword options) cast to each field's type."""
        values = {field.name: getattr(cls(), field.name) for field in fields(cls)}
        for option, value in overrides.items():
            if option not in values:
                raise ValueError(UNKNOWN_OPTION.format(option=option, known=", ".join(sorted(values))))
            if isinstance(values[option], int) and not float(value).is_integer():
                raise ValueError(NOT_WHOLE.format(option=option, value=value))
            values[option] = type(values[option])(value)
        return cls(**values)


# -- helpers shared by both policies -------------------------------------------------------------


def split_long_context(request: RouteRequest, replicas: Sequence[ReplicaView],
                       threshold_tokens: int) -> list[ReplicaView]:
    """The candidates on the request's side of the long-context split (or all, if that side is empty)."""
    wants_long = len(request.token_ids) > threshold_tokens
    side = [view for view in replicas if view.long_context == wants_long]
    return side if side else list(replicas)


def kv_utilization(view: ReplicaView) -> float:
    return view.kv_used_blocks / view.kv_capacity_blocks if view.kv_capacity_blocks > 0 else 0.0


def slowest_ratio(view: ReplicaView, fastest_step_s: float) -> float:
    """How many times longer than the pool's fastest replica this one takes per step (1 when either
    is unknown). A request on a replica twice as slow holds it twice as long, so load is weighted by
    it: least-loaded by count alone keeps feeding a slow replica its full share (seed 000)."""
    if fastest_step_s <= 0.0 or view.step_time_s <= 0.0:
        return 1.0
    return view.step_time_s / fastest_step_s


def fastest_step(candidates: Sequence[ReplicaView]) -> float:
    return min((view.step_time_s for view in candidates if view.step_time_s > 0.0), default=0.0)


def load_limit(mean_load: float, bound: float, slack: int) -> float:
    """Highest load a replica may have and still be chosen."""
    return mean_load * (1.0 + bound) + slack


class PrefillBacklog:
    """Prompt blocks sent to each replica that it has not prefilled yet, as this policy estimates them:
    each routed request adds the blocks it was not expected to find cached, and a replica works the
    total off at its prefill rate (a leaky bucket: the policy hears of no first token). An estimate
    on the low side, since decodes share every step with the prefill chunks."""

    def __init__(self) -> None:
        self._level: dict[str, tuple[float, float]] = {}   # replica -> (blocks, as of when)

    def blocks(self, replica: str, now: float, drain_per_s: float) -> float:
        entry = self._level.get(replica)
        if entry is None:
            return 0.0
        blocks, since = entry
        left = blocks - (now - since) * drain_per_s if now > since else blocks
        return left if left > 0.0 else 0.0

    def add(self, replica: str, blocks: float, now: float, drain_per_s: float) -> None:
        self._level[replica] = (self.blocks(replica, now, drain_per_s) + blocks, now)

    def drop_replica(self, replica: str) -> None:
        self._level.pop(replica, None)


class InFlight:
    """The policy's own count of requests routed and not yet finished, per replica."""

    def __init__(self) -> None:
        self._runs: dict[str, tuple[str, int]] = {}      # request id -> (replica, KV blocks)
        self.count: dict[str, int] = {}
        self.blocks: dict[str, int] = {}

    def add(self, request_id: str, replica: str, blocks: int) -> None:
        self.remove(request_id)
        self._runs[request_id] = (replica, blocks)
        self.count[replica] = self.count.get(replica, 0) + 1
        self.blocks[replica] = self.blocks.get(replica, 0) + blocks

    def remove(self, request_id: str) -> None:
        entry = self._runs.pop(request_id, None)
        if entry is None:
            return
        replica, blocks = entry
        self.count[replica] -= 1
        self.blocks[replica] -= blocks

    def drop_replica(self, replica: str) -> None:
        for request_id in [rid for rid, (name, _) in self._runs.items() if name == replica]:
            del self._runs[request_id]
        self.count.pop(replica, None)
        self.blocks.pop(replica, None)

    def load(self, view: ReplicaView) -> int:
        return max(view.waiting + view.running, view.in_flight, self.count.get(view.name, 0))


def _prompt_blocks(request: RouteRequest, block_size: int) -> int:
    return -(-len(request.token_ids) // block_size)


# -- least_loaded --------------------------------------------------------------------------------


class LeastLoaded:
    """Fewest requests first; KV utilization, then name, break ties."""

    name = "least_loaded"

    def __init__(self, options: PolicyOptions | None = None) -> None:
        self.options = options or PolicyOptions()
        self._in_flight = InFlight()
        self._block_size: dict[str, int] = {}

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView],
               now: float) -> RouteDecision | None:
        candidates = split_long_context(request, replicas, self.options.long_context_threshold_tokens)
        if not candidates:
            return None
        load = self._in_flight.load
        fastest = fastest_step(candidates)
        best = min(candidates, key=lambda view: (load(view) * slowest_ratio(view, fastest),
                                                 kv_utilization(view), view.name))
        self._block_size[best.name] = best.block_size
        return RouteDecision(replica=best.name, outcome=OUTCOME_LEAST_LOADED)

    def on_routed(self, request: RouteRequest, decision: RouteDecision, now: float) -> None:
        block_size = self._block_size.get(decision.replica, 16)
        self._in_flight.add(request.request_id, decision.replica, _prompt_blocks(request, block_size))

    def on_finished(self, request: RouteRequest, replica: str, now: float,
                    output_tokens: int = 0) -> None:
        self._in_flight.remove(request.request_id)

    def on_replica_restarted(self, replica: str) -> None:
        self._in_flight.drop_replica(replica)


# -- prefix_aware --------------------------------------------------------------------------------


# A scored candidate is a plain tuple, not a dataclass: choose() builds 64 of them per decision and
# the decision must stay under 200 us. Field order is the ranking: cost, then load, then KV
# utilization, then name, so min() over eligible candidates is the choice.
_Scored = tuple[float, float, float, str, int, ReplicaView]
_LOAD: Final = 1
_OVERLAP: Final = 4
_VIEW: Final = 5


@dataclass(frozen=True, slots=True)
class Home:
    """Where a conversation's last turn went, and how much of the conversation that replica holds."""

    replica: str
    epoch: int               # the replica's epoch then: a restart since voids the home
    request_id: str          # the turn sent there (only its finish may add the answer)
    held_tokens: int         # leading tokens of the conversation whose KV the replica computed

    def answered(self, prompt_tokens: int, output_tokens: int) -> Home:
        """After the turn's answer: its prompt and the answer but the answer's last token, whose KV
        the engine computes only when it samples past it (an end token it does not count), so this
        never credits a block the replica may lack, and is short by one block at most."""
        return replace(self, held_tokens=prompt_tokens + output_tokens - 1)

    def cached_blocks(self, prompt_tokens: int, block_size: int) -> int:
        """Whole blocks of a next prompt of `prompt_tokens` the replica can reuse: what it holds, but
        never the prompt's last token (an engine always computes it)."""
        reusable = min(self.held_tokens, prompt_tokens - 1)
        return reusable // block_size if reusable > 0 else 0


class PrefixAware:
    """Dynamo-style cost over a learned prefix index, session affinity, an explicit imbalance bound.

    With ``cached_tokens`` given it becomes the oracle: the same cost and bound,
    but each replica's overlap comes from the probe (the replica's exact cache)
    instead of the learned index, and no session affinity (exact overlap makes it moot).
    """

    name = "prefix_aware"

    def __init__(self, options: PolicyOptions | None = None,
                 cached_tokens: CachedTokensProbe | None = None) -> None:
        self.options = options or PolicyOptions()
        self._probe = cached_tokens
        if cached_tokens is not None:
            self.name = "oracle"
        self._index = PrefixIndex(ttl_s=self.options.index_ttl_s)
        self._in_flight = InFlight()
        self._backlog = PrefillBacklog()
        self._drain: dict[str, float] = {}          # replica -> prompt blocks it prefills per second
        self._views: dict[str, ReplicaView] = {}
        self._epoch: dict[str, int] = {}
        # (trust scope, conversation id) -> its home: one tenant's conversation ids never steer
        # another's runs.
        self._conversations: OrderedDict[tuple[int, str], Home] = OrderedDict()
        # (request id, unit) -> (the prompt object hashed, its chain so far)
        self._hash_cache: OrderedDict[tuple[str, int], tuple[Sequence[int], list[int]]] = OrderedDict()
        self._last_expiry = float("-inf")

    # -- the decision ----------------------------------------------------------------------------

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView],
               now: float) -> RouteDecision | None:
        options = self.options
        candidates = split_long_context(request, replicas, options.long_context_threshold_tokens)
        if not candidates:
            return None
        self._observe(candidates, now)

        # The oracle sees each replica's cache exactly; a conversation's home could only blind it.
        held = self._home(request) if self._probe is None else None
        home = held.replica if held is not None else None
        scored, mean_load, most, least = self._score(request, candidates, now, held)
        limit = load_limit(mean_load, options.imbalance_bound, options.imbalance_slack)
        eligible = [entry for entry in scored if entry[_LOAD] <= limit]

        if home is not None and not options.home_in_cost:
            for entry in eligible:
                if entry[_VIEW].name == home:
                    return self._decide(request, entry, OUTCOME_AFFINITY_HIT)
        best = min(eligible)
        home_passed_over = home is not None and any(entry[_VIEW].name == home for entry in scored)
        if best[_VIEW].name == home:
            outcome = OUTCOME_AFFINITY_HIT
        elif best[_OVERLAP] < most or home_passed_over:
            outcome = OUTCOME_BALANCED_AWAY
        elif most > least:
            outcome = OUTCOME_AFFINITY_HIT
        else:
            outcome = OUTCOME_FALLBACK
        return self._decide(request, best, outcome)

    def _observe(self, candidates: Sequence[ReplicaView], now: float) -> None:
        """Remember each candidate's view (block size, capacity) for on_routed; resize the index."""
        views = self._views
        index = self._index
        for view in candidates:
            known = views.get(view.name)
            if known is None or known.kv_capacity_blocks != view.kv_capacity_blocks or \
                    known.host_kv_capacity_blocks != view.host_kv_capacity_blocks:
                stride = self._stride(view.block_size)
                index.set_capacity(view.name, view.kv_capacity_blocks // stride, now,
                                   view.host_kv_capacity_blocks // stride)
            views[view.name] = view
        # TTL expiry is checked at most once a second: it walks every replica's oldest entry.
        if now - self._last_expiry >= 1.0 or now < self._last_expiry:
            index.expire(now)
            self._last_expiry = now

    def _score(self, request: RouteRequest, candidates: Sequence[ReplicaView], now: float,
               held: Home | None) -> tuple[list[_Scored], float, int, int]:
        """One tuple per candidate, ordered so that min() picks the best (see _Scored), with the
        mean load and the highest and lowest overlap among them (the conversation's home credited
        with what it holds, see `Home`). One pass, no builtin calls per candidate: this loop is
        most of the decision's cost after hashing."""
        overlaps, on_gpu, stride = self._overlaps(request, candidates)
        home = held.replica if held is not None else None
        weight = self.options.prefill_weight
        own_count = self._in_flight.count
        own_blocks = self._in_flight.blocks
        backlog = self._backlog.blocks
        drains = self._drain
        default_rate = self.options.prefill_tokens_per_s
        queue_cap = self.options.prefill_queue_cap_tokens
        prompt_tokens = len(request.token_ids)
        scored: list[_Scored] = []
        append = scored.append
        fastest = fastest_step(candidates)
        total_load = 0.0
        most = -1
        least = 1 << 62
        for view in candidates:
            name = view.name
            overlap = overlaps[name] * stride
            used = view.kv_used_blocks
            own = own_blocks.get(name, 0)
            decode = used if used >= own else own
            load = view.waiting + view.running
            if view.in_flight > load:
                load = view.in_flight
            own = own_count.get(name, 0)
            if own > load:
                load = own
            # Cost and load in time: prefill and decode both run `slowness` times longer on a slow replica.
            slowness = slowest_ratio(view, fastest) if fastest > 0.0 else 1.0
            weighted = load * slowness
            capacity = view.kv_capacity_blocks
            on_gpu_blocks = on_gpu[name] * stride if on_gpu is not None else overlap
            if name == home and held is not None:
                # It holds the previous turn's prompt and answer; the index saw the prompt only.
                credit = held.cached_blocks(prompt_tokens, view.block_size)
                if credit > overlap:
                    overlap = on_gpu_blocks = credit
            uncached: float = -(-prompt_tokens // view.block_size) - overlap
            if on_gpu_blocks < overlap:         # blocks found only in host memory cost a copy
                uncached += view.host_block_cost * (overlap - on_gpu_blocks)
            # Prompt blocks queued ahead delay this prompt's first token as its own uncached ones do.
            rate = view.prefill_tokens_per_s if view.prefill_tokens_per_s > 0.0 else default_rate / slowness
            drain = drains[name] = rate / view.block_size
            queued = backlog(name, now, drain)
            cap = queue_cap / view.block_size
            if queued > cap:
                queued = cap
            cost = (weight * (uncached + queued) + decode) * slowness
            append((cost, weighted, used / capacity if capacity > 0 else 0.0, name, overlap, view))
            total_load += weighted
            if overlap > most:
                most = overlap
            if overlap < least:
                least = overlap
        return scored, total_load / len(candidates), most, least

    def _overlaps(self, request: RouteRequest, candidates: Sequence[ReplicaView]
                  ) -> tuple[dict[str, int], dict[str, int] | None, int]:
        """Cached prompt length per candidate in either tier, the same on the GPU alone (None when no
        replica holds anything in a host tier: then it is the first), in index entries, and the KV
        blocks per entry. The oracle's probe sees both tiers as one."""
        if self._probe is not None:
            probe = self._probe
            return {view.name: probe(view.name, request.token_ids) // view.block_size
                    for view in candidates}, None, 1
        sizes = {view.block_size for view in candidates}
        if len(sizes) == 1:                                         # the usual pool: one block size
            block_size = sizes.pop()
            names = [view.name for view in candidates]
            either, on_gpu = self._overlap_units(request, block_size, names)
            return either, on_gpu, self._stride(block_size)
        overlaps: dict[str, int] = {}                               # mixed sizes: in blocks
        gpu_overlaps: dict[str, int] | None = None
        for block_size in sizes:
            stride = self._stride(block_size)
            names = [view.name for view in candidates if view.block_size == block_size]
            either, on_gpu = self._overlap_units(request, block_size, names)
            for name, units in either.items():
                overlaps[name] = units * stride
            if on_gpu is not None:
                gpu_overlaps = gpu_overlaps if gpu_overlaps is not None else {}
                gpu_overlaps.update((name, units * stride) for name, units in on_gpu.items())
        if gpu_overlaps is not None:
            for name, blocks in overlaps.items():
                gpu_overlaps.setdefault(name, blocks)
        return overlaps, gpu_overlaps, 1

    def _overlap_units(self, request: RouteRequest, block_size: int,
                       names: list[str]) -> tuple[dict[str, int], dict[str, int] | None]:
        unit = self._stride(block_size) * block_size
        index = self._index
        cached = self._cached_hashes(request, unit)
        reuse = cached is not None and len(cached) * unit > len(request.token_ids) - unit
        if index.has_host_entries():
            if cached is not None and reuse:
                tiers = index.overlap_tiers(cached, names)
            else:
                tiers, hashes = index.match_tiers(request.token_ids, unit, names, request.cache_salt)
                self._remember_hashes(request, unit, hashes)
            return tiers.either, tiers.gpu
        if cached is not None and reuse:
            return index.overlap_blocks(cached, names), None
        units, hashes = index.match(request.token_ids, unit, names, request.cache_salt)
        self._remember_hashes(request, unit, hashes)
        return units, None

    def _stride(self, block_size: int) -> int:
        """KV blocks per index entry. One entry per 64 tokens rather than per block cuts the
        decision's hashing and index walk ~2x for 16-token blocks; the overlap it finds is
        then exact to within one entry (under 64 tokens), which the cost barely notices."""
        return max(1, self.options.index_unit_tokens // block_size)

    def _decide(self, request: RouteRequest, entry: _Scored, outcome: str) -> RouteDecision:
        view = entry[_VIEW]
        block_size = view.block_size
        # An engine always computes the prompt's last token, so a whole-prompt match reuses one block less.
        reusable = min(entry[_OVERLAP], (len(request.token_ids) - 1) // block_size)
        return RouteDecision(replica=view.name, outcome=outcome,
                             predicted_cached_tokens=max(reusable, 0) * block_size)

    def _home(self, request: RouteRequest) -> Home | None:
        """The conversation's home, unless it restarted since (its cache, and the credit, are gone)."""
        if request.conversation_id is None:
            return None
        home = self._conversations.get((request.cache_salt, request.conversation_id))
        if home is None:
            return None
        return home if self._epoch.get(home.replica, 0) == home.epoch else None

    def _hashes(self, request: RouteRequest, unit: int) -> list[int]:
        """The prompt's full chain in index units; choose() may have left a partial one to complete."""
        hashes = self._cached_hashes(request, unit)
        if hashes is None:
            hashes = []
            self._remember_hashes(request, unit, hashes)
        return extend_hashes(request.token_ids, unit, hashes, request.cache_salt)

    def _cached_hashes(self, request: RouteRequest, unit: int) -> list[int] | None:
        # choose() and on_routed() hash the same prompt object; a reused request id with another
        # prompt (an Explain call, a resend) must not pick up a stale chain, hence the identity check.
        entry = self._hash_cache.get((request.request_id, unit))
        return entry[1] if entry is not None and entry[0] is request.token_ids else None

    def _remember_hashes(self, request: RouteRequest, unit: int, hashes: list[int]) -> None:
        self._hash_cache[(request.request_id, unit)] = (request.token_ids, hashes)
        if len(self._hash_cache) > 64:
            self._hash_cache.popitem(last=False)

    # -- learning --------------------------------------------------------------------------------

    def on_routed(self, request: RouteRequest, decision: RouteDecision, now: float) -> None:
        view = self._views.get(decision.replica)
        block_size = view.block_size if view is not None else 16
        prompt_blocks = _prompt_blocks(request, block_size)
        self._in_flight.add(request.request_id, decision.replica, prompt_blocks)
        drain = self._drain.get(decision.replica, self.options.prefill_tokens_per_s / block_size)
        self._backlog.add(decision.replica, prompt_blocks - decision.predicted_cached_tokens // block_size,
                          now, drain)
        unit = self._stride(block_size) * block_size
        if view is not None and self._probe is None:
            self._index.record(decision.replica, self._hashes(request, unit), now)
        if request.conversation_id is not None:
            conversations = self._conversations
            key = (request.cache_salt, request.conversation_id)
            conversations[key] = Home(decision.replica, self._epoch.get(decision.replica, 0),
                                      request.request_id, len(request.token_ids))
            conversations.move_to_end(key)
            while len(conversations) > self.options.max_conversations:
                conversations.popitem(last=False)
        self._hash_cache.pop((request.request_id, unit), None)

    def on_finished(self, request: RouteRequest, replica: str, now: float,
                    output_tokens: int = 0) -> None:
        self._in_flight.remove(request.request_id)
        if request.conversation_id is None or output_tokens <= 0:
            return
        key = (request.cache_salt, request.conversation_id)
        home = self._conversations.get(key)
        # Only the turn the home was last given: a late finish of an earlier or moved turn says
        # nothing about what the home holds now.
        if home is not None and home.request_id == request.request_id and home.replica == replica:
            self._conversations[key] = home.answered(len(request.token_ids), output_tokens)

    def on_replica_restarted(self, replica: str) -> None:
        """The replica's cache is empty: forget its prefixes, its conversations and its in-flight runs."""
        self._index.drop_replica(replica)
        self._epoch[replica] = self._epoch.get(replica, 0) + 1
        self._in_flight.drop_replica(replica)
        self._backlog.drop_replica(replica)

    # -- introspection for hosts and tests -------------------------------------------------------

    @property
    def index(self) -> PrefixIndex:
        return self._index

    def in_flight(self, replica: str) -> int:
        return self._in_flight.count.get(replica, 0)

    def prefill_backlog(self, replica: str, now: float) -> float:
        """Prompt blocks this policy believes `replica` still has to prefill at `now`."""
        return self._backlog.blocks(replica, now, self._drain.get(replica, 0.0))
