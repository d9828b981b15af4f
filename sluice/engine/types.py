"""Values that cross the engine core's boundary: config, requests, outputs, stats."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from sluice.engine.kv_cache import KVCacheStats
from sluice.engine.sampling import LengthDistribution, TokenSpace

SchedulerPolicy = Literal["guaranteed_no_evict", "max_utilization"]
SCHEDULER_POLICIES: tuple[SchedulerPolicy, ...] = ("guaranteed_no_evict", "max_utilization")
FinishReason = Literal["length", "end_id", "stop_words", "stopped"]

UNKNOWN_POLICY = "unknown scheduler policy {name!r}; known: guaranteed_no_evict, max_utilization"
DUPLICATE_REQUEST = "request id {request_id!r} is already live on this engine"
EMPTY_PROMPT = "the prompt must have at least one token"
BAD_OUTPUT_LEN = "request_output_len must be at least 1, got {value}"
REQUEST_TOO_LARGE = ("request {request_id!r} needs {needed} KV blocks ({tokens} tokens) but the pool has "
                     "{capacity}; shorten the prompt or request_output_len")
CONTEXT_OVER_BUDGET = ("a context of {tokens} tokens exceeds max_num_tokens {budget} and chunked context "
                       "is off; enable chunked context or shorten the prompt")


class EngineRequestError(ValueError):
    """Caller misuse: a request the engine can never serve, or a duplicate id."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Scheduler and KV-pool settings, named after TensorRT-LLM's executor options."""

    block_size: int = 32                       # tokens_per_block
    num_blocks: int | None = None              # KV pool size; None derives it from the cost model
    max_num_seqs: int = 256                    # max_batch_size: requests in flight at once
    max_num_tokens: int = 8192                 # per-step token budget (decode tokens + context chunks)
    policy: SchedulerPolicy = "guaranteed_no_evict"
    enable_chunked_context: bool = True
    enable_prefix_reuse: bool = True           # enable_block_reuse
    # Host-memory KV tier in blocks (TensorRT-LLM's host_cache_size, in blocks): 0 = none (evicted
    # blocks are dropped), None = the GPU profile's (CostModel.host_kv_capacity_blocks).
    host_num_blocks: int | None = 0
    output_length: LengthDistribution | None = None   # None: every request runs to request_output_len
    tokens: TokenSpace = field(default_factory=TokenSpace)
    # True: an output per streamed token with its id (the Triton host). False: outputs only for
    # first tokens and finishes, token counts instead of ids (the simulator's fast path).
    stream_tokens: bool = True

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULER_POLICIES:
            raise ValueError(UNKNOWN_POLICY.format(name=self.policy))
        assert self.block_size > 0 and self.max_num_seqs > 0, "block_size and max_num_seqs must be positive"
        assert self.max_num_tokens >= self.max_num_seqs, "max_num_tokens must cover one token per sequence"


@dataclass(frozen=True, slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_output_tokens: int           # request_output_len: the cap on streamed tokens
    end_id: int | None = None        # None: the request runs to its cap
    seed: int = 0                    # drives token ids and the output-length draw (and a model's sampler)
    # Sampling, used by a model executor (the timing executor's ids come from the seed alone).
    temperature: float = 0.0         # 0: greedy
    top_p: float = 1.0               # nucleus: sample among the smallest set of ids holding this mass
    stop_sequences: tuple[tuple[int, ...], ...] = ()   # stop_words_list: end once the output ends with one
    cache_salt: int = 0              # trust scope (kv_cache.salted_root); 0 = unsalted


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step (or one decode run) produced for one request."""

    request_id: str
    new_token_ids: tuple[int, ...]   # streamed ids; empty in counting mode and on the end_id step
    num_new_tokens: int              # tokens streamed by this output (counted in both modes)
    num_output_tokens: int           # tokens streamed so far, this output included
    first_token: bool                # this output carries the request's first token
    finished: bool
    finish_reason: FinishReason | None
    num_input_tokens: int            # prompt length
    kv_cache_reused_blocks: int      # prompt blocks served from the prefix cache at first admission
    num_cached_tokens: int           # = reused blocks × block size


@dataclass(frozen=True, slots=True)
class StepResult:
    duration_s: float                # modelled duration from the cost model
    num_context_requests: int        # requests that ran a context chunk
    num_context_tokens: int
    num_generation_requests: int     # requests that decoded one token (each an ITL gap of duration_s)
    num_paused: int                  # requests paused to make room (max_utilization)
    outputs: tuple[RequestOutput, ...]


@dataclass(frozen=True, slots=True)
class DecodeRun:
    """`len(step_durations)` pure-decode steps applied at once (see EngineCore.decode_run_limit)."""

    step_durations: tuple[float, ...]
    batch_size: int                  # sequences decoding in every step of the run
    tokens_in_last_step: int         # batch_size less the requests whose last step sampled end_id
    outputs: tuple[RequestOutput, ...]   # the requests that finished at the run's last step


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Gauges behind nv_trt_llm_request_metrics / kv_cache_block_metrics / inflight_batcher_metrics."""

    active: int                      # admitted, not finished (context + generation)
    waiting: int                     # queued for admission, paused ones included
    paused: int                      # of `waiting`, requests paused by max_utilization
    scheduled: int                   # requests in the last step
    context: int                     # of those, context (prefill) requests
    generation: int                  # of those, generation requests
    max_requests: int                # max_num_seqs
    total_context_tokens: int        # context tokens in the last step
    kv: KVCacheStats
    num_steps: int                   # steps executed so far
    finished_requests: int
    busy_s: float                    # sum of modelled step durations
