"""The simple engine: deterministic fake tokens, one per live request per step.

Pure and clock-free. Token i of a request is a hash of (seed, i) folded into
the normal id range [first_normal_id, vocab_size), so it never emits a special
id and a test can compute the exact stream. How long a request runs is drawn
from the same hash once, when it is added:

- "cap":     always the full request_output_len;
- "uniform": uniform in [ceil(min_fraction * cap), cap]; a request drawn
             shorter than its cap stops "by producing end_id" (the end token
             itself is not streamed, as TensorRT-LLM does not stream it), so a
             request without end_id always runs to its cap.

The step duration is the configured token delay; every live request gets one
token per step, so many requests are in flight together and a step costs the
same whatever the batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from sluice.engine.sampling import splitmix64
from sluice.replica.engine_api import (
    EngineRequestError,
    EngineStats,
    FinishReason,
    GenerationRequest,
    StepOutput,
    StepResult,
)

OUTPUT_LENGTH_MODES = ("cap", "uniform")
_MASK64 = (1 << 64) - 1
_LENGTH_DRAW_POSITION = -1   # hash position reserved for the output-length draw

ERR_DUPLICATE_ID = "request id {!r} is already live on this engine"
ERR_EMPTY_PROMPT = "prompt must have at least one token"
ERR_BAD_CAP = "max_new_tokens must be at least 1, got {}"
ERR_BAD_MODE = "output_length must be one of " + ", ".join(OUTPUT_LENGTH_MODES) + ", got {!r}"


def mix(seed: int, position: int) -> int:
    """A 64-bit hash of (seed, position); the only source of 'randomness' here."""
    return splitmix64(splitmix64(seed & _MASK64) ^ (position & _MASK64))


def prompt_seed(prompt_ids: Iterable[int]) -> int:
    """The seed a request gets when it carries none: a hash of its prompt."""
    h = 0
    for token in prompt_ids:
        h = mix(h, token)
    return h


@dataclass(frozen=True, slots=True)
class GeneratorConfig:
    vocab_size: int = 4096
    first_normal_id: int = 5             # ids below are special (models/tiny-chat: 0..4): never generated
    output_length: str = "cap"           # "cap" | "uniform"
    min_fraction: float = 0.25           # uniform mode: shortest output as a fraction of the cap
    token_delay_s: float = 0.02          # modelled time of one step
    max_batch: int = 256                 # reported as the request capacity
    kv_tokens_per_block: int = 16        # only for the KV gauges
    kv_max_blocks: int = 65536

    def __post_init__(self) -> None:
        if self.output_length not in OUTPUT_LENGTH_MODES:
            raise ValueError(ERR_BAD_MODE.format(self.output_length))
        assert 0 <= self.first_normal_id < self.vocab_size, "normal id range must be non-empty"
        assert 0.0 <= self.min_fraction <= 1.0, "min_fraction must be within [0, 1]"


def token_at(config: GeneratorConfig, seed: int, position: int) -> int:
    """The token a request with `seed` produces at output position `position` (0-based)."""
    span = config.vocab_size - config.first_normal_id
    return config.first_normal_id + mix(seed, position) % span


def output_length(config: GeneratorConfig, seed: int, max_new_tokens: int, end_id: int | None) -> int:
    """How many tokens a request streams before it finishes."""
    if config.output_length == "cap" or end_id is None:
        return max_new_tokens
    shortest = max(1, math.ceil(config.min_fraction * max_new_tokens))
    return shortest + mix(seed, _LENGTH_DRAW_POSITION) % (max_new_tokens - shortest + 1)


def expected_tokens(config: GeneratorConfig, request: GenerationRequest) -> list[int]:
    """The complete stream a request gets when nothing aborts it."""
    n = output_length(config, request.seed, request.max_new_tokens, request.end_id)
    return [token_at(config, request.seed, i) for i in range(n)]


@dataclass(slots=True)
class _Live:
    request: GenerationRequest
    length: int                          # tokens it will stream in total
    produced: int = 0

    @property
    def finish_reason(self) -> FinishReason:
        return "length" if self.length == self.request.max_new_tokens else "end_id"


@dataclass(slots=True)
class SimpleGenerator:
    """The Engine Protocol's simplest implementation (see replica.engine_api)."""

    config: GeneratorConfig = field(default_factory=GeneratorConfig)
    _live: dict[str, _Live] = field(default_factory=dict)   # insertion order = arrival order
    _last_scheduled: int = 0
    _last_context: int = 0
    _last_context_tokens: int = 0
    _steps: int = 0

    def add_request(self, request: GenerationRequest) -> None:
        if request.request_id in self._live:
            raise EngineRequestError(ERR_DUPLICATE_ID.format(request.request_id))
        if not request.prompt_ids:
            raise EngineRequestError(ERR_EMPTY_PROMPT)
        if request.max_new_tokens < 1:
            raise EngineRequestError(ERR_BAD_CAP.format(request.max_new_tokens))
        length = output_length(self.config, request.seed, request.max_new_tokens, request.end_id)
        self._live[request.request_id] = _Live(request, length)

    def abort(self, request_id: str) -> bool:
        return self._live.pop(request_id, None) is not None

    def has_work(self) -> bool:
        return bool(self._live)

    def step(self) -> StepResult:
        outputs = []
        self._last_context = self._last_context_tokens = 0
        for live in list(self._live.values()):
            if live.produced == 0:
                self._last_context += 1
                self._last_context_tokens += len(live.request.prompt_ids)
            token = token_at(self.config, live.request.seed, live.produced)
            live.produced += 1
            finished = live.produced >= live.length
            if finished:
                del self._live[live.request.request_id]
            outputs.append(StepOutput(
                request_id=live.request.request_id,
                new_token_ids=(token,),
                finished=finished,
                finish_reason=live.finish_reason if finished else None,
                num_input_tokens=len(live.request.prompt_ids),
                kv_cache_reused_blocks=0,
            ))
        self._last_scheduled = len(outputs)
        self._steps += 1 if outputs else 0
        return StepResult(tuple(outputs), self.config.token_delay_s if outputs else 0.0)

    def stats(self) -> EngineStats:
        per_block = self.config.kv_tokens_per_block
        used = sum(-(-(len(x.request.prompt_ids) + x.produced) // per_block) for x in self._live.values())
        return EngineStats(
            active=len(self._live),
            waiting=0,
            scheduled=self._last_scheduled,
            context=self._last_context,
            max_requests=self.config.max_batch,
            kv_max_blocks=self.config.kv_max_blocks,
            kv_free_blocks=max(0, self.config.kv_max_blocks - used),
            kv_used_blocks=used,
            kv_tokens_per_block=per_block,
            kv_reused_blocks=0,
            generation=self._last_scheduled - self._last_context,
            total_context_tokens=self._last_context_tokens,
            iterations=self._steps,
        )
