"""The simple engine (replica/generator.py): pure, deterministic, one token per request per step."""

import pytest

from sluice.replica.engine_api import EngineRequestError, GenerationRequest
from sluice.replica.generator import (
    ERR_BAD_CAP,
    ERR_BAD_MODE,
    ERR_DUPLICATE_ID,
    ERR_EMPTY_PROMPT,
    GeneratorConfig,
    SimpleGenerator,
    expected_tokens,
    output_length,
    prompt_seed,
    token_at,
)

TINY = GeneratorConfig(vocab_size=12, first_normal_id=4, token_delay_s=0.02)


def request(request_id: str = "a", cap: int = 3, end_id: int | None = None, seed: int = 7,
            prompt: tuple[int, ...] = (5, 6)) -> GenerationRequest:
    return GenerationRequest(request_id=request_id, prompt_ids=prompt, max_new_tokens=cap, end_id=end_id,
                             seed=seed)


def drain(engine: SimpleGenerator) -> dict[str, list[int]]:
    streams: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step().outputs:
            streams.setdefault(out.request_id, []).extend(out.new_token_ids)
    return streams


def test_tokens_are_a_pure_function_of_seed_and_position_and_never_special():
    tokens = [token_at(TINY, 7, i) for i in range(200)]
    assert tokens == [token_at(TINY, 7, i) for i in range(200)]
    assert all(4 <= t < 12 for t in tokens)
    assert set(tokens) == set(range(4, 12))          # the whole normal range is reachable
    assert tokens[:20] != [token_at(TINY, 8, i) for i in range(20)]


def test_prompt_seed_depends_on_order_and_content():
    assert prompt_seed([1, 2, 3]) == prompt_seed([1, 2, 3])
    assert prompt_seed([1, 2, 3]) != prompt_seed([3, 2, 1])
    assert prompt_seed([1, 2, 3]) != prompt_seed([1, 2])


def test_each_step_gives_every_live_request_one_token_and_costs_the_token_delay():
    engine = SimpleGenerator(TINY)
    engine.add_request(request("a", cap=2))
    engine.add_request(request("b", cap=3, seed=9))
    first = engine.step()
    assert first.duration_s == 0.02
    assert [(o.request_id, o.new_token_ids, o.finished) for o in first.outputs] == [
        ("a", (token_at(TINY, 7, 0),), False), ("b", (token_at(TINY, 9, 0),), False)]
    assert engine.stats().context == 2
    second = engine.step()
    assert [(o.request_id, o.finished, o.finish_reason) for o in second.outputs] == [
        ("a", True, "length"), ("b", False, None)]
    third = engine.step()
    assert [(o.request_id, o.finished) for o in third.outputs] == [("b", True)]
    assert not engine.has_work()
    assert engine.step().duration_s == 0.0


def test_cap_mode_streams_exactly_the_expected_tokens():
    engine = SimpleGenerator(TINY)
    engine.add_request(request("a", cap=5, end_id=2))
    assert drain(engine) == {"a": expected_tokens(TINY, request("a", cap=5, end_id=2))}
    assert len(expected_tokens(TINY, request("a", cap=5, end_id=2))) == 5


def test_uniform_mode_stops_early_only_when_the_request_has_an_end_id():
    config = GeneratorConfig(vocab_size=12, first_normal_id=4, output_length="uniform", min_fraction=0.5)
    lengths = {output_length(config, seed, 10, end_id=2) for seed in range(200)}
    assert lengths == set(range(5, 11))               # uniform over [ceil(0.5 * 10), 10]
    assert {output_length(config, seed, 10, end_id=None) for seed in range(50)} == {10}
    short_seed = next(s for s in range(200) if output_length(config, s, 10, end_id=2) < 10)
    engine = SimpleGenerator(config)
    engine.add_request(request("a", cap=10, end_id=2, seed=short_seed))
    outputs = []
    while engine.has_work():
        outputs.extend(engine.step().outputs)
    assert len(outputs) == output_length(config, short_seed, 10, end_id=2)
    assert outputs[-1].finish_reason == "end_id"
    assert all(2 not in o.new_token_ids for o in outputs)


def test_abort_drops_the_request_and_reports_whether_it_was_live():
    engine = SimpleGenerator(TINY)
    engine.add_request(request("a", cap=5))
    engine.step()
    assert engine.stats().active == 1
    assert engine.abort("a") is True
    assert engine.abort("a") is False
    assert not engine.has_work()
    assert engine.stats().kv_used_blocks == 0


def test_misuse_raises_domain_errors_with_shared_messages():
    engine = SimpleGenerator(TINY)
    engine.add_request(request("a"))
    with pytest.raises(EngineRequestError, match=ERR_DUPLICATE_ID.format("a").replace("'", ".")):
        engine.add_request(request("a"))
    with pytest.raises(EngineRequestError, match=ERR_EMPTY_PROMPT):
        engine.add_request(request("b", prompt=()))
    with pytest.raises(EngineRequestError, match=ERR_BAD_CAP.format(0)):
        engine.add_request(request("c", cap=0))
    with pytest.raises(ValueError, match="output_length must be one of"):
        GeneratorConfig(output_length="zipf")
    assert ERR_BAD_MODE.format("zipf").endswith("'zipf'")


def test_kv_gauges_count_blocks_of_prompt_plus_generated_tokens():
    config = GeneratorConfig(vocab_size=12, first_normal_id=4, kv_tokens_per_block=4, kv_max_blocks=10)
    engine = SimpleGenerator(config)
    engine.add_request(request("a", cap=5, prompt=(5, 6, 7)))
    engine.step()                                      # 3 prompt + 1 generated = 1 block
    assert (engine.stats().kv_used_blocks, engine.stats().kv_free_blocks) == (1, 9)
    engine.step()                                      # 5 tokens = 2 blocks
    assert engine.stats().kv_used_blocks == 2
