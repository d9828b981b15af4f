"""Prometheus gauges under TensorRT-LLM's metric names, on the replica's metrics port."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from replica.engine_api import EngineStats
from replica.protocol import MODEL_NAME


class ReplicaMetrics:
    def __init__(self, start_time: float) -> None:
        self.registry = CollectorRegistry()
        labels = ["model", "version"]
        self._requests = Gauge("nv_trt_llm_request_metrics", "TRT-LLM request metrics",
                               labels + ["request_type"], registry=self.registry)
        self._kv = Gauge("nv_trt_llm_kv_cache_block_metrics", "TRT-LLM KV cache block metrics",
                         labels + ["kv_cache_block_type"], registry=self.registry)
        start = Gauge("sluice_replica_start_time_seconds",
                      "Unix time this replica process started; a change means a restart (empty cache)",
                      registry=self.registry)
        start.set(start_time)
        self._label = {"model": MODEL_NAME, "version": "1"}

    def serve(self, port: int, address: str = "127.0.0.1") -> None:
        start_http_server(port, addr=address, registry=self.registry)

    def update(self, stats: EngineStats) -> None:
        for request_type, value in (("active", stats.active), ("waiting", stats.waiting),
                                    ("scheduled", stats.scheduled), ("context", stats.context),
                                    ("max", stats.max_requests)):
            self._requests.labels(request_type=request_type, **self._label).set(value)
        for block_type, value in (("max", stats.kv_max_blocks), ("free", stats.kv_free_blocks),
                                  ("used", stats.kv_used_blocks), ("tokens_per", stats.kv_tokens_per_block),
                                  ("reused", stats.kv_reused_blocks)):
            self._kv.labels(kv_cache_block_type=block_type, **self._label).set(value)
