"""The boundary between the Triton host and an engine.

The host (replica/serve.py) owns time, Triton and metrics; an engine owns
scheduling and token generation and is pure: no clock, no I/O. The host loop
is, per iteration:

    host: add_request / abort from Triton callables (between steps)
    result = engine.step()                 # schedule -> execute -> postprocess
    host: sleep result.duration_s          # the engine's modelled step time
    host: deliver result.outputs to the waiting streams

so one step's tokens reach clients after the step's (modelled) time, and any
engine that meets this Protocol (the simple generator here, the inflight
batching core in engine/) can sit behind the same host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

FinishReason = Literal["length", "end_id", "stop_words", "aborted"]


class EngineRequestError(ValueError):
    """The caller asked the engine for something it cannot do (duplicate id, bad sizes)."""


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    request_id: str                      # unique among the engine's live requests
    prompt_ids: tuple[int, ...]          # tokenized prompt, at least one token
    max_new_tokens: int                  # output cap (request_output_len), at least 1
    end_id: int | None = None            # stop token; None means "run to the cap"
    seed: int = 0                        # drives sampling deterministically (fake or real)
    # Sampling, honoured by a real model (the fake engines draw ids from the seed alone).
    temperature: float = 0.0             # 0: greedy
    top_p: float = 1.0                   # nucleus mass; 1 keeps every id
    stop_sequences: tuple[tuple[int, ...], ...] = ()   # stop_words_list: the output ends after one
    cache_salt: int = 0                  # trust scope of the prompt's KV blocks (TensorRT-LLM's
                                         #   cache_salt_id); 0 = none


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: tuple[int, ...]       # tokens generated in this step (may be empty, e.g. during prefill)
    finished: bool                       # no more outputs will come for this request
    finish_reason: FinishReason | None   # set when finished
    num_input_tokens: int                # prompt length as the engine accounted it
    kv_cache_reused_blocks: int          # prompt KV blocks served from the prefix cache


@dataclass(frozen=True, slots=True)
class StepResult:
    outputs: tuple[StepOutput, ...]
    duration_s: float                    # modelled wall time of the step; the host sleeps this long


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Gauges the host exports as nv_trt_llm_* metrics."""

    active: int                          # requests admitted and not finished
    waiting: int                         # requests queued, not yet admitted
    scheduled: int                       # requests in the last step's batch
    context: int                         # requests in the last step doing prefill
    max_requests: int                    # batch capacity
    kv_max_blocks: int
    kv_free_blocks: int
    kv_used_blocks: int
    kv_tokens_per_block: int
    kv_reused_blocks: int                # cumulative prefix-cache block hits
    # TensorRT-LLM's inflight-batcher gauges (nv_trt_llm_inflight_batcher_metrics) and step counter.
    generation: int = 0                  # requests in the last step's batch doing generation (decode)
    paused: int = 0                      # of `waiting`, requests paused to free KV (max_utilization)
    total_context_tokens: int = 0        # prompt tokens computed in the last step
    iterations: int = 0                  # steps executed since start (general_type="iteration_counter")
    kv_alloc_total_blocks: int = 0       # cumulative blocks handed to requests, new + reused (alloc_total)
    kv_alloc_new_blocks: int = 0         # cumulative blocks taken from the free pool (alloc_new)
    # The host-memory KV tier (sluice_kv_host_tier_metrics; TensorRT-LLM's Triton metrics have none).
    kv_host_max_blocks: int = 0          # host tier size in blocks (0: no tier)
    kv_host_used_blocks: int = 0
    kv_blocks_offloaded: int = 0         # cumulative: evicted blocks copied to host memory
    kv_blocks_onboarded: int = 0         # cumulative: host blocks copied back on a prefix hit
    kv_host_evicted_blocks: int = 0      # cumulative: host entries dropped (LRU)
    kv_host_tier_hits: int = 0           # cumulative: admissions that found part of their prefix there
    kv_host_block_cost: float = 0.0      # modelled copy-back time of a block over its prefill time

    @property
    def kv_fraction(self) -> float:
        """Used share of the KV pool (kv_cache_block_type="fraction")."""
        return self.kv_used_blocks / self.kv_max_blocks if self.kv_max_blocks else 0.0


class Engine(Protocol):
    def add_request(self, request: GenerationRequest) -> None:
        """Queue a request; raises EngineRequestError for a duplicate id or invalid sizes."""
        ...

    def abort(self, request_id: str) -> bool:
        """Drop a live request and free what it holds; False when the id is unknown (already done)."""
        ...

    def has_work(self) -> bool:
        """True while a step would make progress."""
        ...

    def step(self) -> StepResult:
        ...

    def stats(self) -> EngineStats:
        ...
