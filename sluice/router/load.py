"""Replica load from TensorRT-LLM's Prometheus metrics, combined with the router's own counts.

A scrape is a snapshot of the past: between two scrapes a burst of runs can
land on one replica and the scrape will not show it. So the tracker keeps, per
replica, the runs this router sent since the last scrape, and the host puts the
router's own in-flight count beside the scraped numbers in ``ReplicaView``
(the policies take the larger of the two; see router.policies).

Restart detection. A replica that restarts comes back with an empty KV cache,
so the router must forget which prefixes it held. It shows up as a change of
``sluice_replica_start_time_seconds``, or, where that gauge is missing (a real
TensorRT-LLM engine), as the cumulative reused-blocks counter going backwards.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import dataclass

from sluice.router.policy import RoutingPolicy

REQUEST_METRIC = "nv_trt_llm_request_metrics"
KV_METRIC = "nv_trt_llm_kv_cache_block_metrics"
GENERAL_METRIC = "nv_trt_llm_general_metrics"
START_TIME_METRIC = "sluice_replica_start_time_seconds"
HOST_TIER_METRIC = "sluice_kv_host_tier_metrics"
STEP_TIME_SMOOTHING = 0.3            # weight of the newest estimate in the running step time


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """One scrape of one replica, in TensorRT-LLM's terms (None where the metric was absent)."""

    active: int = 0                       # request_type=active: admitted and not finished
    waiting: int = 0                      # request_type=waiting: queued, not yet admitted
    scheduled: int = 0                    # request_type=scheduled: in the last step's batch
    context: int = 0                      # request_type=context: in context (prefill) phase
    max_requests: int = 0                 # request_type=max: batch slot limit
    kv_max_blocks: int = 0                # kv_cache_block_type=max
    kv_free_blocks: int = 0               # kv_cache_block_type=free
    kv_used_blocks: int = 0               # kv_cache_block_type=used
    kv_tokens_per_block: int = 0          # kv_cache_block_type=tokens_per: the block size
    kv_reused_blocks: int = 0             # kv_cache_block_type=reused: cumulative
    kv_fraction: float = 0.0              # kv_cache_block_type=fraction (derived when absent)
    start_time: float | None = None       # sluice_replica_start_time_seconds
    host_max_blocks: int = 0              # sluice_kv_host_tier_metrics{kv_host_tier_type=max}: 0 = no tier
    host_block_cost: float = 0.0          # kv_host_tier_type=block_cost: copy-back over prefill time
    iterations: int | None = None         # general_type=iteration_counter: engine steps so far


_REQUEST_FIELDS = {"active": "active", "waiting": "waiting", "scheduled": "scheduled",
                   "context": "context", "max": "max_requests"}
_KV_FIELDS = {"max": "kv_max_blocks", "free": "kv_free_blocks", "used": "kv_used_blocks",
              "tokens_per": "kv_tokens_per_block", "reused": "kv_reused_blocks"}


_HOST_FIELDS = {"max": "host_max_blocks"}

_LABEL = {REQUEST_METRIC: re.compile(r'[{,]\s*request_type="([^"]*)"'),
          KV_METRIC: re.compile(r'[{,]\s*kv_cache_block_type="([^"]*)"'),
          HOST_TIER_METRIC: re.compile(r'[{,]\s*kv_host_tier_type="([^"]*)"'),
          GENERAL_METRIC: re.compile(r'[{,]\s*general_type="([^"]*)"'),
          START_TIME_METRIC: None}
_FIELDS = {REQUEST_METRIC: _REQUEST_FIELDS, KV_METRIC: _KV_FIELDS, HOST_TIER_METRIC: _HOST_FIELDS}


def parse_metrics(text: str) -> LoadSnapshot:
    """Read a replica's /metrics text. Samples of several models on one server are summed.

    A line scan for the metric names used, not a full exposition parser: the routing
    process scrapes every replica a few times a second, and prometheus_client's parser took
    ~270 us per replica (17 ms of the event loop per round at 64 replicas), this ~20 us.
    """
    values: dict[str, float] = {}
    fraction: float | None = None
    start_time: float | None = None
    host_block_cost = 0.0
    iterations: int | None = None
    for line in text.splitlines():
        if not line.startswith(("nv_trt_llm_", "sluice_replica_", "sluice_kv_")):
            continue
        name, value = _sample(line)
        if name not in _LABEL:
            continue
        if name == START_TIME_METRIC:
            start_time = value
            continue
        pattern = _LABEL[name]
        assert pattern is not None
        match = pattern.search(line, len(name))
        kind = match.group(1) if match else ""
        if name == KV_METRIC and kind == "fraction":
            fraction = value
            continue
        if name == HOST_TIER_METRIC and kind == "block_cost":
            host_block_cost = max(host_block_cost, value)
            continue
        if name == GENERAL_METRIC:
            if kind == "iteration_counter":
                iterations = (iterations or 0) + int(value)
            continue
        field = _FIELDS[name].get(kind)
        if field is not None:
            values[field] = values.get(field, 0.0) + value
    counts = {field: int(value) for field, value in values.items()}
    if fraction is None:
        max_blocks = counts.get("kv_max_blocks", 0)
        fraction = counts.get("kv_used_blocks", 0) / max_blocks if max_blocks else 0.0
    return LoadSnapshot(**counts, kv_fraction=fraction, start_time=start_time,
                        host_block_cost=host_block_cost, iterations=iterations)


def _sample(line: str) -> tuple[str, float]:
    """(metric name, value) of one exposition line: ``name{labels} value [timestamp]``."""
    brace = line.find("{")
    if brace >= 0:
        name, rest = line[:brace], line[line.rindex("}") + 1:]
    else:
        name, _, rest = line.partition(" ")
    fields = rest.split()
    if not fields:
        raise ValueError(f"metrics line without a value: {line!r}")
    return name.strip(), float(fields[0])


def restarted(previous: LoadSnapshot | None, current: LoadSnapshot) -> bool:
    """Did the replica restart between two scrapes (its prefix cache is gone)?"""
    if previous is None:
        return False
    if previous.start_time is not None and current.start_time is not None:
        return previous.start_time != current.start_time
    return current.kv_reused_blocks < previous.kv_reused_blocks


def step_time_between(previous: LoadSnapshot, previous_at: float,
                      current: LoadSnapshot, current_at: float) -> float | None:
    """Seconds per engine step between two scrapes taken at `previous_at` and `current_at`: the
    time between them over the iterations the engine ran, or None when that says nothing.

    Only while the replica was busy at both scrapes: an idle engine does not step, so a gap with
    idle time in it would read as slow steps. The scrape times are the router's own clock, not
    TensorRT-LLM's iteration timestamp gauge, whose unit and resolution are not the same in every
    version (deploy/triton/CONTRACT.md). A step is longer with a bigger batch, so this is a
    per-step time at the replica's own load: a throttled replica reads slower at the same batch,
    and a replica with a bigger batch reads slower too, which pushes the same way (send it less)."""
    if previous.iterations is None or current.iterations is None:
        return None
    steps = current.iterations - previous.iterations
    elapsed = current_at - previous_at
    if steps <= 0 or elapsed <= 0.0 or previous.active <= 0 or current.active <= 0:
        return None
    return elapsed / steps


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """What the host copies into ReplicaView for one replica."""

    waiting: int                          # scraped waiting + runs sent since that scrape (still in flight)
    running: int                          # scraped active
    kv_used_blocks: int                   # scraped used blocks
    in_flight: int                        # this router's runs sent and not finished
    kv_capacity_blocks: int | None        # scraped max blocks (None before the first scrape)
    block_size: int | None                # scraped tokens per block (None before the first scrape)
    start_time: float = 0.0               # scraped start time (0.0 when unknown)
    host_kv_capacity_blocks: int = 0      # scraped host tier size (0: none, or not scraped yet)
    host_block_cost: float = 0.0          # scraped copy-back over prefill time of a block
    step_time_s: float = 0.0              # smoothed seconds per engine step while busy (0.0 unknown)


class LoadTracker:
    """Scrapes plus this router's own sends, per replica. Pure: the host does the HTTP."""

    def __init__(self) -> None:
        self._snapshots: dict[str, LoadSnapshot] = {}
        self._sent_since_scrape: dict[str, int] = {}
        self._in_flight: dict[str, int] = {}
        self._versions: dict[str, int] = {}     # per replica, bumped on every change (hosts cache views)
        self._scraped_at: dict[str, float] = {}
        self._step_time: dict[str, float] = {}

    def version(self, replica: str) -> int:
        """Changes whenever load(replica) may have changed."""
        return self._versions.get(replica, 0)

    def _changed(self, replica: str) -> None:
        self._versions[replica] = self._versions.get(replica, 0) + 1

    def on_scrape(self, replica: str, snapshot: LoadSnapshot, now: float | None = None) -> bool:
        """Record a scrape taken at `now` (a monotonic clock; None: no step-time estimate); True
        when it reveals a restart (then call policy.on_replica_restarted)."""
        previous = self._snapshots.get(replica)
        was_restarted = restarted(previous, snapshot)
        previous_at = self._scraped_at.get(replica)
        if was_restarted:
            self._step_time.pop(replica, None)
        elif previous is not None and previous_at is not None and now is not None:
            step = step_time_between(previous, previous_at, snapshot, now)
            if step is not None:
                known = self._step_time.get(replica)
                self._step_time[replica] = step if known is None else (
                    known + STEP_TIME_SMOOTHING * (step - known))
        if now is not None:
            self._scraped_at[replica] = now
        self._snapshots[replica] = snapshot
        self._sent_since_scrape[replica] = 0
        self._changed(replica)
        return was_restarted

    def on_sent(self, replica: str) -> None:
        self._sent_since_scrape[replica] = self._sent_since_scrape.get(replica, 0) + 1
        self._in_flight[replica] = self._in_flight.get(replica, 0) + 1
        self._changed(replica)

    def on_finished(self, replica: str) -> None:
        count = self._in_flight.get(replica, 0)
        if count > 0:
            self._in_flight[replica] = count - 1
            self._changed(replica)

    def forget(self, replica: str) -> None:
        self._snapshots.pop(replica, None)
        self._sent_since_scrape.pop(replica, None)
        self._in_flight.pop(replica, None)
        self._scraped_at.pop(replica, None)
        self._step_time.pop(replica, None)
        self._changed(replica)

    def snapshot(self, replica: str) -> LoadSnapshot | None:
        return self._snapshots.get(replica)

    def load(self, replica: str) -> ReplicaLoad:
        scraped = self._snapshots.get(replica)
        in_flight = self._in_flight.get(replica, 0)
        # Runs sent since the scrape that are still running: at most all runs in flight. Without
        # the cap, a replica that is never scraped would look loaded by every run it ever served.
        sent = min(self._sent_since_scrape.get(replica, 0), in_flight)
        if scraped is None:
            return ReplicaLoad(waiting=sent, running=0, kv_used_blocks=0, in_flight=in_flight,
                               kv_capacity_blocks=None, block_size=None)
        return ReplicaLoad(
            waiting=scraped.waiting + sent, running=scraped.active, kv_used_blocks=scraped.kv_used_blocks,
            in_flight=in_flight,
            kv_capacity_blocks=scraped.kv_max_blocks or None,
            block_size=scraped.kv_tokens_per_block or None,
            start_time=scraped.start_time or 0.0,
            host_kv_capacity_blocks=scraped.host_max_blocks, host_block_cost=scraped.host_block_cost,
            step_time_s=self._step_time.get(replica, 0.0),
        )

    def loads(self) -> Mapping[str, ReplicaLoad]:
        names = set(self._snapshots) | set(self._in_flight) | set(self._sent_since_scrape)
        return {name: self.load(name) for name in sorted(names)}


def record_scrape(tracker: LoadTracker, policy: RoutingPolicy, replica: str,
                  metrics_text: str, now: float | None = None) -> LoadSnapshot:
    """What a host does with each scrape of a replica's /metrics: parse it, record it (taken at
    `now`, monotonic; None: the tracker's clock), and if it reveals a restart tell the policy,
    which forgets the replica's cached prefixes."""
    snapshot = parse_metrics(metrics_text)
    if tracker.on_scrape(replica, snapshot, time.monotonic() if now is None else now):
        policy.on_replica_restarted(replica)
    return snapshot
