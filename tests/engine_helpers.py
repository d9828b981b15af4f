"""Shared factories for the engine tests: tiny pools, short prompts, readable requests."""

from __future__ import annotations

from sluice.engine.core import EngineCore
from sluice.engine.cost_model import CostModel
from sluice.engine.profiles import get_hardware, get_model
from sluice.engine.sampling import LengthDistribution, TokenSpace, tokens_between
from sluice.engine.types import EngineConfig, EngineRequest, RequestOutput, SchedulerPolicy

END_ID = 2
SPACE = TokenSpace(vocab_size=1000, first_normal_id=4)
COST = CostModel(get_model("llama-3-8b"), get_hardware("h100-sxm"))


def make_config(*, block_size: int = 4, num_blocks: int = 16, max_num_seqs: int = 4, max_num_tokens: int = 16,
                policy: SchedulerPolicy = "guaranteed_no_evict", chunked: bool = True, reuse: bool = True,
                output_length: LengthDistribution | None = None, stream_tokens: bool = True) -> EngineConfig:
    return EngineConfig(block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                        max_num_tokens=max_num_tokens, policy=policy, enable_chunked_context=chunked,
                        enable_prefix_reuse=reuse, output_length=output_length, tokens=SPACE,
                        stream_tokens=stream_tokens)


def make_engine(config: EngineConfig | None = None) -> EngineCore:
    return EngineCore(config if config is not None else make_config(), COST)


def prompt(length: int, start: int = 100) -> tuple[int, ...]:
    """`length` distinct prompt tokens; two prompts with the same start share their prefix."""
    return tuple(range(start, start + length))


def request(request_id: str, tokens: tuple[int, ...], max_output: int = 4, *, end_id: int | None = None,
            seed: int | None = None) -> EngineRequest:
    return EngineRequest(request_id=request_id, prompt_token_ids=tokens, max_output_tokens=max_output,
                         end_id=end_id, seed=seed if seed is not None else hash(request_id) & 0xFFFF)


def expected_tokens(req: EngineRequest, length: int) -> list[int]:
    return tokens_between(SPACE, req.seed, 0, length)


def run_to_completion(engine: EngineCore, max_steps: int = 10_000) -> list[RequestOutput]:
    outputs: list[RequestOutput] = []
    for _ in range(max_steps):
        if not engine.has_work():
            return outputs
        outputs.extend(engine.step().outputs)
    raise AssertionError("engine did not drain")


def streams(outputs: list[RequestOutput]) -> dict[str, list[int]]:
    by_request: dict[str, list[int]] = {}
    for output in outputs:
        by_request.setdefault(output.request_id, []).extend(output.new_token_ids)
    return by_request


def assert_nothing_leaked(engine: EngineCore) -> None:
    pool = engine.pool
    assert pool.num_free == pool.num_blocks
    assert all(pool.ref_count(block) == 0 for block in range(pool.num_blocks))
    assert engine.scheduler.running == [] and not engine.scheduler.waiting

