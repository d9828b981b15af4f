"""Prometheus gauges under TensorRT-LLM's metric names, on the replica's metrics port.

The names, labels and help texts are those of tensorrtllm_backend (inflight
batcher), so a router that scrapes a real TensorRT-LLM Triton server reads
these the same way (router/load.py):

    nv_trt_llm_request_metrics{request_type=active|waiting|scheduled|context|max}
    nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=
        max|free|used|tokens_per|reused|fraction|alloc_total|alloc_new}
    nv_trt_llm_inflight_batcher_metrics{inflight_batcher_specific_metric=
        total_context_tokens|generation_requests|micro_batch_id|paused_requests}
    nv_trt_llm_general_metrics{general_type=iteration_counter|timestamp}   (timestamp in µs, as v0.19.0)
    nv_trt_llm_runtime_memory_metrics{memory_type=cpu|gpu|pinned}           (0 here: no device memory)
    nv_llm_input_token_len / nv_llm_output_token_len{response_metric_type=total_input_tokens|
        total_output_tokens}: histograms, buckets 10, 50, 100, 500, 1000, one sample per finished request

(tensorrtllm_backend v0.19.0, inflight_batcher_llm/src/custom_metrics_reporter; its
nv_trt_llm_disaggregated_serving_metrics counters are left out: no disaggregated serving here),
plus what TensorRT-LLM's Triton metrics lack: sluice_replica_start_time_seconds
(a change tells the router the replica restarted with an empty prefix cache)
and the host-memory KV tier (engine.kv_cache.HostPool), which TensorRT-LLM
has (host_cache_size) but does not count in Triton metrics:

    sluice_kv_host_tier_metrics{kv_host_tier_type=max|used|offloaded|onboarded|evicted|hits|block_cost}

in blocks (offloaded, onboarded, evicted and hits cumulative); block_cost is a
block's copy-back time over its prefill time, the router's price of a host hit. Every value
comes from the engine's EngineStats, set by the host after each step and on
every submit/abort, so a scrape shows the state as of the last step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, Histogram

from sluice.replica.engine_api import EngineStats
from sluice.replica.metrics_server import serve_metrics
from sluice.replica.protocol import MODEL_NAME

REQUEST_METRIC = "nv_trt_llm_request_metrics"
KV_METRIC = "nv_trt_llm_kv_cache_block_metrics"
BATCHER_METRIC = "nv_trt_llm_inflight_batcher_metrics"
GENERAL_METRIC = "nv_trt_llm_general_metrics"
MEMORY_METRIC = "nv_trt_llm_runtime_memory_metrics"
INPUT_LEN_METRIC = "nv_llm_input_token_len"
OUTPUT_LEN_METRIC = "nv_llm_output_token_len"
TOKEN_LEN_BUCKETS = (10.0, 50.0, 100.0, 500.0, 1000.0)
START_TIME_METRIC = "sluice_replica_start_time_seconds"
HOST_TIER_METRIC = "sluice_kv_host_tier_metrics"

Reading = Callable[[EngineStats], float]
Rows = tuple[tuple[str, Reading], ...]          # (label value, how to read it from the stats)

_REQUESTS: Rows = (
    ("active", lambda s: s.active), ("waiting", lambda s: s.waiting), ("scheduled", lambda s: s.scheduled),
    ("context", lambda s: s.context), ("max", lambda s: s.max_requests),
)
_KV_BLOCKS: Rows = (
    ("max", lambda s: s.kv_max_blocks), ("free", lambda s: s.kv_free_blocks),
    ("used", lambda s: s.kv_used_blocks), ("tokens_per", lambda s: s.kv_tokens_per_block),
    ("reused", lambda s: s.kv_reused_blocks), ("fraction", lambda s: s.kv_fraction),
    ("alloc_total", lambda s: s.kv_alloc_total_blocks), ("alloc_new", lambda s: s.kv_alloc_new_blocks),
)
_HOST_TIER: Rows = (
    ("max", lambda s: s.kv_host_max_blocks), ("used", lambda s: s.kv_host_used_blocks),
    ("offloaded", lambda s: s.kv_blocks_offloaded), ("onboarded", lambda s: s.kv_blocks_onboarded),
    ("evicted", lambda s: s.kv_host_evicted_blocks), ("hits", lambda s: s.kv_host_tier_hits),
    ("block_cost", lambda s: s.kv_host_block_cost),
)
_BATCHER: Rows = (
    ("total_context_tokens", lambda s: s.total_context_tokens),
    ("generation_requests", lambda s: s.generation),
    ("micro_batch_id", lambda s: 0),            # no pipeline parallelism: always micro-batch 0
    ("paused_requests", lambda s: s.paused),
)


class ReplicaMetrics:
    def __init__(self, start_time: float, clock: Callable[[], float] = time.time) -> None:
        self.registry = CollectorRegistry()
        labels = {"model": MODEL_NAME, "version": "1"}

        def family(name: str, help_text: str, label: str, rows: Rows) -> list[tuple[Gauge, Reading]]:
            gauge = Gauge(name, help_text, ["model", "version", label], registry=self.registry)
            # Children bound once: update() runs every engine step.
            return [(gauge.labels(**labels, **{label: key}), value) for key, value in rows]

        self._rows = (
            family(REQUEST_METRIC, "TRT LLM request metrics", "request_type", _REQUESTS)
            + family(KV_METRIC, "TRT LLM KV cache block metrics", "kv_cache_block_type", _KV_BLOCKS)
            + family(BATCHER_METRIC, "TRT LLM inflight_batcher-specific metrics",
                     "inflight_batcher_specific_metric", _BATCHER)
            + family(HOST_TIER_METRIC, "Sluice host-memory KV tier metrics", "kv_host_tier_type", _HOST_TIER)
        )
        general = Gauge(GENERAL_METRIC, "General TRT LLM metrics", ["model", "version", "general_type"],
                        registry=self.registry)
        self._iterations = general.labels(**labels, general_type="iteration_counter")
        self._timestamp = general.labels(**labels, general_type="timestamp")
        self._clock = clock
        memory = Gauge(MEMORY_METRIC, "TRT LLM runtime memory metrics", ["model", "version", "memory_type"],
                       registry=self.registry)
        for kind in ("cpu", "gpu", "pinned"):
            memory.labels(**labels, memory_type=kind).set(0)

        def lengths(name: str, kind: str) -> Any:
            histogram = Histogram(name, "TRT LLM response metrics",
                                  ["model", "version", "response_metric_type"],
                                  buckets=TOKEN_LEN_BUCKETS, registry=self.registry)
            return histogram.labels(**labels, response_metric_type=kind)

        self._input_len = lengths(INPUT_LEN_METRIC, "total_input_tokens")
        self._output_len = lengths(OUTPUT_LEN_METRIC, "total_output_tokens")
        start = Gauge(START_TIME_METRIC,
                      "Unix time this replica process started; a change means a restart (empty cache)",
                      registry=self.registry)
        start.set(start_time)

    def serve(self, port: int, address: str = "127.0.0.1") -> None:
        """On HTTP/1.1 with keep-alive (metrics_server.py): the router scrapes four times a second."""
        serve_metrics(self.registry, port, address)

    def update(self, stats: EngineStats) -> None:
        for child, value in self._rows:
            child.set(value(stats))
        self._iterations.set(stats.iterations)
        # When these stats were taken, in µs since the epoch as v0.19.0 reports its iteration stats.
        self._timestamp.set(self._clock() * 1e6)

    def request_finished(self, input_tokens: int, output_tokens: int) -> None:
        """One finished request's lengths (the backend observes them when it sends the final response)."""
        self._input_len.observe(input_tokens)
        self._output_len.observe(output_tokens)
