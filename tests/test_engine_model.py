"""The real SmolLM2 behind the engine core: KV reuse proven by outputs, not counters.

Greedy decoding is a pure function of the prompt. So the same prompt must give the same
ids however its KV got into the blocks: computed in one chunk or several, taken from the
prefix cache, or recomputed after a pause. And the cached (paged) forward must agree with a
full recompute that never touches the pool. Few tokens each: the model is loaded once per
session (tests/model_helpers.py).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from sluice.engine.llama.forward import LlamaModel, SeqInput
from tests.model_helpers import (
    END_OF_TURN,
    chat_prompt,
    decode,
    generate,
    ids_of,
    model_engine,
    request,
    weights,
)

RIVERS = "Why do rivers meander?"
COLOUR = "Name a colour."
TOKENS = 6


@functools.cache
def cold_greedy(question: str) -> tuple[int, ...]:
    """The answer from an empty cache, whole prompt in one chunk."""
    outputs = generate(model_engine(), request("cold", chat_prompt(question), TOKENS))["cold"]
    assert outputs[0].kv_cache_reused_blocks == 0
    return tuple(ids_of(outputs))


def test_the_cold_answer_reads_as_english() -> None:
    assert decode(list(cold_greedy(RIVERS))).startswith("Rivers meander")


def test_a_warm_prefix_cache_gives_the_same_ids_and_really_serves_blocks() -> None:
    engine = model_engine(block_size=16)
    prompt = chat_prompt(RIVERS)
    first = generate(engine, request("first", prompt, TOKENS))["first"]
    second = generate(engine, request("second", prompt, TOKENS))["second"]
    assert ids_of(first) == ids_of(second) == list(cold_greedy(RIVERS))
    # Every full prompt block but the one holding the last prompt token comes from the cache.
    assert second[0].kv_cache_reused_blocks == (len(prompt) - 1) // 16 > 0


def test_a_cache_serving_wrong_blocks_changes_the_answer() -> None:
    """The guard for the test above: reuse is really read, so corrupt blocks show in the ids."""
    engine = model_engine(block_size=16)
    prompt = chat_prompt(RIVERS)
    generate(engine, request("first", prompt, TOKENS))
    model = engine.executor.model       # type: ignore[attr-defined]
    rng = np.random.default_rng(0)
    model.k_pool[:] = rng.standard_normal(model.k_pool.shape, dtype=np.float32)
    second = generate(engine, request("second", prompt, TOKENS))["second"]
    assert second[0].kv_cache_reused_blocks > 0
    assert ids_of(second) != list(cold_greedy(RIVERS))


@pytest.mark.parametrize("chunk", [16, 32])
def test_chunked_prefill_of_any_size_gives_the_same_ids(chunk: int) -> None:
    engine = model_engine(block_size=16, max_num_tokens=chunk)
    outputs = generate(engine, request("chunked", chat_prompt(RIVERS), TOKENS))["chunked"]
    assert ids_of(outputs) == list(cold_greedy(RIVERS))


def test_a_paused_and_resumed_request_gives_the_same_ids() -> None:
    # Blocks of 8 in a pool of 10: the prompts (36 and 34 tokens) take 5 each. Rivers' fifth
    # decode writes position 40, a sixth block: max_utilization pauses colour (the newest) until
    # rivers is done; colour then recomputes prompt + streamed ids (its own full blocks found by
    # hash) and goes on.
    engine = model_engine(block_size=8, num_blocks=10, policy="max_utilization")
    rivers, colour = chat_prompt(RIVERS), chat_prompt(COLOUR)
    assert (len(rivers), len(colour)) == (36, 34)
    paused = 0
    for req in (request("rivers", rivers, TOKENS), request("colour", colour, TOKENS)):
        engine.add_request(req)
    outputs: dict[str, list[int]] = {"rivers": [], "colour": []}
    while engine.has_work():
        result = engine.step()
        paused += result.num_paused
        for output in result.outputs:
            outputs[output.request_id].extend(output.new_token_ids)
    assert paused == 1
    assert outputs == {"rivers": list(cold_greedy(RIVERS)), "colour": list(cold_greedy(COLOUR))}


def test_the_cached_path_agrees_with_a_full_recompute_on_the_logits() -> None:
    model = LlamaModel(weights())
    model.allocate_kv(num_blocks=8, block_size=16)
    prompt = list(chat_prompt(RIVERS))
    blocks = [5, 2, 7, 0]                                      # any blocks: slots follow the table
    cached = [model.forward([SeqInput(prompt[:16], 0, blocks, False)])]   # no sampler: no rows
    assert cached[0].shape == (0, 49152)
    cached = [model.forward([SeqInput(prompt[16:], 16, blocks, True)])[0]]
    tokens = prompt + [int(np.argmax(cached[0]))]
    for _ in range(2):
        cached.append(model.forward([SeqInput(tokens[-1:], len(tokens) - 1, blocks, True)])[0])
        tokens.append(int(np.argmax(cached[-1])))
    reference = model.reference_logits(tokens)[len(prompt) - 1:len(tokens) - 1]
    np.testing.assert_allclose(np.stack(cached), reference, atol=2e-3, rtol=0)
    assert np.abs(reference).max() > 10       # logits of real scale, not a vacuous match


def test_the_end_of_turn_token_ends_the_answer_without_being_streamed() -> None:
    question = "Is the sky blue? Answer yes or no."
    outputs = generate(model_engine(), request("short", chat_prompt(question), 12))
    last = outputs["short"][-1]
    ids = ids_of(outputs["short"])
    assert (last.finish_reason, END_OF_TURN in ids) == ("end_id", False)
    assert 0 < len(ids) < 12 and last.num_output_tokens == len(ids)


def test_a_stop_sequence_ends_the_answer_after_it() -> None:
    expected = list(cold_greedy(RIVERS))
    stop = tuple(expected[1:3])
    outputs = generate(model_engine(), request("stop", chat_prompt(RIVERS), TOKENS, stop_sequences=(stop,)))
    assert ids_of(outputs["stop"]) == expected[:3]
    assert outputs["stop"][-1].finish_reason == "stop_words"


def test_sampling_is_deterministic_per_seed_and_batch_independent() -> None:
    prompt = chat_prompt(RIVERS)
    hot = {"temperature": 1.2, "top_p": 0.95}
    together = generate(model_engine(), request("a", prompt, TOKENS, seed=7, **hot),
                        request("b", prompt, TOKENS, seed=8, **hot))
    alone = generate(model_engine(), request("a", prompt, TOKENS, seed=7, **hot))
    assert ids_of(together["a"]) == ids_of(alone["a"])
    assert ids_of(together["a"]) != ids_of(together["b"])
    assert ids_of(together["a"]) != list(cold_greedy(RIVERS))


def test_a_tiny_top_p_keeps_only_the_most_likely_id() -> None:
    outputs = generate(model_engine(), request("p", chat_prompt(RIVERS), TOKENS, temperature=1.0, top_p=1e-6,
                                               seed=3))
    assert ids_of(outputs["p"]) == list(cold_greedy(RIVERS))
