"""Scheduler invariants: admission policies, pausing, chunked context under the token budget."""

import random
from collections.abc import Callable

import pytest

from sluice.engine.core import EngineCore
from sluice.engine.sampling import UniformLength
from sluice.engine.types import EngineRequest, SchedulerPolicy, StepResult
from tests.engine_helpers import (
    END_ID,
    assert_nothing_leaked,
    expected_tokens,
    make_config,
    make_engine,
    prompt,
    request,
    streams,
)


def random_requests(count: int, seed: int, max_prompt: int = 20, max_output: int = 12) -> list[EngineRequest]:
    rng = random.Random(seed)
    shared = prompt(8, start=1000)           # a system prompt half of them share
    requests = []
    for index in range(count):
        body = tuple(rng.randrange(4, 999) for _ in range(rng.randrange(1, max_prompt)))
        tokens = shared + body if index % 2 else body
        requests.append(request(f"r{index}", tokens, rng.randrange(1, max_output), end_id=END_ID, seed=index))
    return requests


def outstanding_reservation(engine: EngineCore) -> int:
    scheduler = engine.scheduler
    return sum(scheduler.reserve_blocks(seq) - len(seq.block_ids) for seq in scheduler.running)


Check = Callable[[EngineCore, StepResult], None]


def drive(engine: EngineCore, requests: list[EngineRequest], per_step: int,
          check: Check | None = None) -> list[StepResult]:
    """Feed `per_step` requests before each step until all are in, then drain; returns all outputs."""
    pending = list(requests)
    outputs: list[StepResult] = []
    for _ in range(100_000):
        for _ in range(min(per_step, len(pending))):
            engine.add_request(pending.pop(0))
        if not engine.has_work() and not pending:
            return outputs
        if engine.has_work():
            result = engine.step()
            outputs.append(result)
            if check is not None:
                check(engine, result)
    raise AssertionError("did not drain")


# --- guaranteed_no_evict ----------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_guaranteed_no_evict_never_over_commits_and_never_pauses(seed: int) -> None:
    engine = make_engine(make_config(num_blocks=24, max_num_seqs=6, max_num_tokens=12,
                                     output_length=UniformLength(1, 12)))

    def check(engine: EngineCore, result: StepResult) -> None:
        assert outstanding_reservation(engine) <= engine.pool.num_free
        assert engine.scheduler.num_paused_waiting == 0
        assert all(seq.times_paused == 0 for seq in engine.scheduler.running)

    results = drive(engine, random_requests(40, seed), per_step=2, check=check)
    assert sum(result.num_paused for result in results) == 0
    assert_nothing_leaked(engine)


def test_guaranteed_no_evict_waits_for_the_whole_reservation() -> None:
    # 16 blocks of 4: a reserves ceil((8 + 40) / 4) = 12, so b (needs ceil(20 / 4) = 5) must wait.
    engine = make_engine(make_config(num_blocks=16))
    engine.add_request(request("a", prompt(8), max_output=40))
    engine.add_request(request("b", prompt(4, start=500), max_output=16))
    engine.step()
    assert [seq.request_id for seq in engine.scheduler.running] == ["a"]
    assert engine.stats().waiting == 1


def test_the_queue_head_blocks_those_behind_it() -> None:
    engine = make_engine(make_config(num_blocks=16))
    engine.add_request(request("a", prompt(8), max_output=40))
    engine.add_request(request("big", prompt(8, start=300), max_output=40))
    engine.add_request(request("small", prompt(2, start=600), max_output=1))
    engine.step()
    assert [seq.request_id for seq in engine.scheduler.waiting] == ["big", "small"]


def test_max_num_seqs_caps_the_batch() -> None:
    engine = make_engine(make_config(num_blocks=64, max_num_seqs=2))
    for index in range(4):
        engine.add_request(request(f"r{index}", prompt(3, start=100 * index), max_output=5))
    engine.step()
    assert engine.stats().active == 2 and engine.stats().waiting == 2


# --- max_utilization --------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_max_utilization_pauses_and_paused_requests_still_finish_their_exact_streams(seed: int) -> None:
    engine = make_engine(make_config(num_blocks=14, max_num_seqs=6, max_num_tokens=12,
                                     policy="max_utilization", output_length=UniformLength(4, 24)))
    requests = random_requests(30, seed, max_output=24)
    results = drive(engine, requests, per_step=3)
    outputs = [output for result in results for output in result.outputs]
    finished = {output.request_id: output for output in outputs if output.finished}
    assert sum(result.num_paused for result in results) > 0
    assert set(finished) == {req.request_id for req in requests}
    got = streams(outputs)
    for req in requests:
        assert got.get(req.request_id, []) == expected_tokens(req, finished[req.request_id].num_output_tokens)
    assert_nothing_leaked(engine)


def test_max_utilization_pauses_the_newest_request() -> None:
    # 4 blocks of 4 tokens: a and b take 2 blocks each for their 5-token prompts; when both need
    # a third block for their 9th token, the newest (b) is paused.
    engine = make_engine(make_config(num_blocks=5, max_num_seqs=2, policy="max_utilization"))
    engine.add_request(request("a", prompt(5), max_output=10))
    engine.add_request(request("b", prompt(5, start=500), max_output=10))
    paused = 0
    for _ in range(6):
        paused += engine.step().num_paused
    assert paused == 1
    assert [seq.request_id for seq in engine.scheduler.running] == ["a"]
    assert [seq.request_id for seq in engine.scheduler.waiting] == ["b"]
    assert engine.stats().paused == 1


def test_max_utilization_admits_beyond_the_reservation_that_no_evict_would_keep() -> None:
    greedy = make_engine(make_config(num_blocks=16, policy="max_utilization"))
    greedy.add_request(request("a", prompt(8), max_output=40))
    greedy.add_request(request("b", prompt(4, start=500), max_output=16))
    greedy.step()
    assert [seq.request_id for seq in greedy.scheduler.running] == ["a", "b"]


# --- chunked context --------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["guaranteed_no_evict", "max_utilization"])
def test_chunked_context_never_exceeds_the_step_token_budget(policy: SchedulerPolicy) -> None:
    engine = make_engine(make_config(num_blocks=40, max_num_seqs=4, max_num_tokens=8, policy=policy,
                                     output_length=UniformLength(1, 10)))

    def check(engine: EngineCore, result: StepResult) -> None:
        assert result.num_context_tokens + result.num_generation_requests <= 8

    drive(engine, random_requests(20, 7, max_prompt=30), per_step=1, check=check)
    assert_nothing_leaked(engine)


def test_a_long_prompt_is_split_into_block_aligned_chunks() -> None:
    engine = make_engine(make_config(num_blocks=16, max_num_tokens=10))
    engine.add_request(request("long", prompt(23), max_output=1))
    chunks = [engine.step().num_context_tokens for _ in range(3)]
    assert chunks == [8, 8, 7]


def test_decodes_are_not_starved_by_a_long_prompt() -> None:
    engine = make_engine(make_config(num_blocks=40, max_num_tokens=8))
    engine.add_request(request("short", prompt(3), max_output=20))
    engine.step()                                         # short: context, first token
    engine.add_request(request("long", prompt(60, start=500), max_output=1))
    for _ in range(8):
        result = engine.step()
        assert result.num_generation_requests == 1        # short decodes every step
        assert 0 < result.num_context_tokens <= 7         # long takes what is left, in whole blocks
        assert [o.request_id for o in result.outputs if o.new_token_ids][0] == "short"


def test_without_chunking_a_context_runs_whole_or_waits() -> None:
    engine = make_engine(make_config(num_blocks=40, max_num_tokens=8, chunked=False))
    engine.add_request(request("a", prompt(6), max_output=3))
    engine.add_request(request("b", prompt(6, start=500), max_output=3))
    first = engine.step()
    assert first.num_context_tokens == 6                  # b does not fit beside a, and is not split
    second = engine.step()
    assert (second.num_generation_requests, second.num_context_tokens) == (1, 6)
