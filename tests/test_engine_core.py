"""The engine core end to end: tokens, end_id, validation, step durations, the decode fast path."""

import math

import pytest

from sluice.engine.core import EngineCore
from sluice.engine.sampling import (
    INFEASIBLE_LOGNORMAL,
    FixedLength,
    GeometricLength,
    LogNormalLength,
    UniformLength,
    draw_output_length,
    uniform,
)
from sluice.engine.types import (
    BAD_OUTPUT_LEN,
    CONTEXT_OVER_BUDGET,
    DUPLICATE_REQUEST,
    EMPTY_PROMPT,
    REQUEST_TOO_LARGE,
    EngineConfig,
    EngineRequestError,
    RequestOutput,
    SchedulerPolicy,
)
from tests.engine_helpers import (
    COST,
    END_ID,
    SPACE,
    assert_nothing_leaked,
    expected_tokens,
    make_config,
    make_engine,
    prompt,
    request,
    run_to_completion,
    streams,
)


def test_tokens_are_deterministic_from_the_seed() -> None:
    req = request("a", prompt(5), max_output=6, seed=42)
    outputs = []
    for _ in range(2):
        engine = make_engine()
        engine.add_request(req)
        outputs.append(run_to_completion(engine))
    assert outputs[0] == outputs[1]
    assert streams(outputs[0])["a"] == expected_tokens(req, 6)


def test_generated_tokens_avoid_special_ids() -> None:
    engine = make_engine(make_config(num_blocks=64))
    engine.add_request(request("a", prompt(3), max_output=200))
    assert min(streams(run_to_completion(engine))["a"]) >= SPACE.first_normal_id


def test_a_request_without_end_id_runs_to_its_cap() -> None:
    engine = make_engine(make_config(output_length=FixedLength(2)))
    engine.add_request(request("a", prompt(5), max_output=6))
    outputs = run_to_completion(engine)
    assert (outputs[-1].num_output_tokens, outputs[-1].finish_reason) == (6, "length")


def test_end_id_stops_at_the_drawn_length_without_streaming_the_end_token() -> None:
    engine = make_engine(make_config(output_length=FixedLength(3)))
    engine.add_request(request("a", prompt(5), max_output=6, end_id=END_ID))
    outputs = run_to_completion(engine)
    assert [len(output.new_token_ids) for output in outputs] == [1, 1, 1, 0]
    last = outputs[-1]
    assert (last.finished, last.finish_reason, last.num_output_tokens) == (True, "end_id", 3)
    assert engine.stats().num_steps == 4                 # the step that sampled end_id still ran


def test_the_drawn_length_is_capped_by_request_output_len() -> None:
    engine = make_engine(make_config(output_length=FixedLength(50)))
    engine.add_request(request("a", prompt(5), max_output=4, end_id=END_ID))
    outputs = run_to_completion(engine)
    assert (outputs[-1].num_output_tokens, outputs[-1].finish_reason) == (4, "length")


def test_output_lengths_follow_the_configured_distribution() -> None:
    distribution = UniformLength(10, 20)
    draws = [draw_output_length(distribution, seed, cap=15) for seed in range(2000)]
    assert min(draws) == 10 and max(draws) == 15
    assert draws.count(15) / len(draws) == pytest.approx(6 / 11, abs=0.04)


def test_every_response_carries_input_length_and_reused_blocks() -> None:
    engine = make_engine()
    engine.add_request(request("a", prompt(9), max_output=2))
    first = run_to_completion(engine)
    engine.add_request(request("b", prompt(9), max_output=2))
    second = run_to_completion(engine)
    assert {(o.num_input_tokens, o.kv_cache_reused_blocks) for o in first} == {(9, 0)}
    assert {(o.num_input_tokens, o.kv_cache_reused_blocks, o.num_cached_tokens) for o in second} == {
        (9, 2, 8)}


def test_the_first_output_is_marked() -> None:
    engine = make_engine()
    engine.add_request(request("a", prompt(3), max_output=3))
    assert [o.first_token for o in run_to_completion(engine)] == [True, False, False]


# --- validation -------------------------------------------------------------------------------


def test_a_duplicate_live_id_is_rejected() -> None:
    engine = make_engine()
    engine.add_request(request("a", prompt(3)))
    with pytest.raises(EngineRequestError) as error:
        engine.add_request(request("a", prompt(3)))
    assert str(error.value) == DUPLICATE_REQUEST.format(request_id="a")


def test_an_id_can_be_reused_after_it_finished() -> None:
    engine = make_engine()
    engine.add_request(request("a", prompt(3), max_output=1))
    run_to_completion(engine)
    engine.add_request(request("a", prompt(3), max_output=1))


@pytest.mark.parametrize(("tokens", "max_output", "message"), [
    ((), 4, EMPTY_PROMPT),
    ((5, 6), 0, BAD_OUTPUT_LEN.format(value=0)),
    (prompt(60), 8, REQUEST_TOO_LARGE.format(request_id="x", needed=17, tokens=68, capacity=16)),
])
def test_requests_the_engine_can_never_serve_are_rejected(tokens: tuple[int, ...], max_output: int,
                                                         message: str) -> None:
    engine = make_engine()
    with pytest.raises(EngineRequestError) as error:
        engine.add_request(request("x", tokens, max_output))
    assert str(error.value) == message
    assert not engine.has_work()


def test_an_unchunked_context_over_the_token_budget_is_rejected() -> None:
    engine = make_engine(make_config(max_num_tokens=8, chunked=False))
    with pytest.raises(EngineRequestError) as error:
        engine.add_request(request("x", prompt(9)))
    assert str(error.value) == CONTEXT_OVER_BUDGET.format(tokens=9, budget=8)


def test_an_unknown_policy_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unknown scheduler policy 'fifo'"):
        EngineConfig(policy="fifo")  # type: ignore[arg-type]


def test_the_pool_size_defaults_to_the_cost_model_capacity() -> None:
    engine = EngineCore(EngineConfig(block_size=32), COST)
    assert engine.pool.num_blocks == COST.kv_capacity_blocks(32)


# --- step durations ---------------------------------------------------------------------------


def test_a_step_lasts_what_the_cost_model_says() -> None:
    engine = make_engine()
    engine.add_request(request("a", prompt(10), max_output=3))
    engine.add_request(request("b", prompt(4, start=500), max_output=3))
    first = engine.step()
    assert first.duration_s == COST.step_time_totals_s(14, 0, 0, 14)
    second = engine.step()          # both decode: contexts 10 + 1 and 4 + 1
    assert second.duration_s == COST.step_time_s(0, [11, 5])


def test_stats_describe_the_last_step() -> None:
    engine = make_engine(make_config(max_num_seqs=2))
    for index in range(3):
        engine.add_request(request(f"r{index}", prompt(3, start=100 * index), max_output=5))
    result = engine.step()
    stats = engine.stats()
    assert (stats.active, stats.waiting, stats.scheduled, stats.context, stats.generation) == (2, 1, 2, 2, 0)
    assert stats.total_context_tokens == 6
    assert stats.busy_s == result.duration_s
    assert (stats.kv.used_blocks, stats.kv.max_blocks, stats.max_requests) == (2, 16, 2)


# --- counting mode and decode runs (the simulator's fast path) -------------------------------


def test_counting_mode_reports_only_first_tokens_and_finishes() -> None:
    engine = make_engine(make_config(stream_tokens=False))
    engine.add_request(request("a", prompt(3), max_output=5))
    outputs = run_to_completion(engine)
    assert [(o.first_token, o.finished, o.new_token_ids) for o in outputs] == [
        (True, False, ()), (False, True, ())]


def run_with_decode_runs(engine: EngineCore) -> tuple[list[RequestOutput], int]:
    outputs: list[RequestOutput] = []
    runs = 0
    while engine.has_work():
        limit = engine.decode_run_limit()
        if limit > 1:
            outputs.extend(engine.run_decode(limit).outputs)
            runs += 1
        else:
            outputs.extend(engine.step().outputs)
    return outputs, runs


@pytest.mark.parametrize("policy", ["guaranteed_no_evict", "max_utilization"])
def test_decode_runs_match_single_steps(policy: SchedulerPolicy) -> None:
    def fresh() -> EngineCore:
        config = make_config(num_blocks=40, max_num_seqs=3, policy=policy,
                             output_length=UniformLength(2, 30), stream_tokens=False)
        engine = make_engine(config)
        for index in range(8):
            engine.add_request(request(f"r{index}", prompt(3 + index, start=50 * index), max_output=30,
                                       end_id=END_ID, seed=index))
        return engine

    stepped, fast = fresh(), fresh()
    single = run_to_completion(stepped)
    batched, runs = run_with_decode_runs(fast)
    assert runs > 0
    def finishes(outputs: list[RequestOutput]) -> list[tuple[str, int, str | None]]:
        return sorted((o.request_id, o.num_output_tokens, o.finish_reason) for o in outputs if o.finished)

    assert finishes(single) == finishes(batched)
    assert fast.stats().num_steps == stepped.stats().num_steps
    assert fast.stats().busy_s == pytest.approx(stepped.stats().busy_s, rel=1e-12)
    assert fast.stats().kv.cached_blocks == stepped.stats().kv.cached_blocks
    assert_nothing_leaked(fast)


def test_no_decode_run_while_a_context_is_in_flight_or_the_queue_head_fits() -> None:
    engine = make_engine(make_config(stream_tokens=False, max_num_tokens=8, num_blocks=40))
    engine.add_request(request("a", prompt(12), max_output=20))
    assert engine.decode_run_limit() == 0                 # nothing running yet
    engine.step()                                         # first chunk of 8
    assert engine.decode_run_limit() == 0                 # a still in context
    engine.step()
    assert engine.decode_run_limit() == 19                # until a's last sample
    engine.add_request(request("b", prompt(3, start=500), max_output=5))
    assert engine.decode_run_limit() == 0                 # b can be admitted next step


def test_a_decode_run_reports_every_step_duration() -> None:
    engine = make_engine(make_config(stream_tokens=False))
    engine.add_request(request("a", prompt(3), max_output=5))
    engine.step()
    run = engine.run_decode(engine.decode_run_limit())
    assert run.step_durations == tuple(COST.step_time_s(0, [context]) for context in (4, 5, 6, 7))
    assert (run.batch_size, run.tokens_in_last_step) == (1, 1)
    assert [(o.finished, o.num_output_tokens) for o in run.outputs] == [(True, 5)]


def test_the_oracle_sees_exactly_the_cached_prefix() -> None:
    engine = make_engine()
    engine.add_request(request("a", prompt(12), max_output=1))
    run_to_completion(engine)
    assert engine.cached_prefix_tokens(prompt(12) + (1,)) == 12
    assert engine.cached_prefix_tokens(prompt(12)) == 8    # one token is always computed
    assert engine.cached_prefix_tokens(prompt(5, start=101)) == 0


# --- length distributions ---------------------------------------------------------------------


def test_lognormal_fits_seed_003s_output_mean_and_p95() -> None:
    fitted = LogNormalLength.from_mean_p95(350, 1200)
    assert fitted.mean() == pytest.approx(350)
    assert fitted.quantile(0.95) == pytest.approx(1200, abs=1)
    draws = sorted(fitted.quantile(uniform(seed)) for seed in range(20_000))
    assert sum(draws) / len(draws) == pytest.approx(350, rel=0.05)


def test_an_infeasible_lognormal_says_why() -> None:
    with pytest.raises(ValueError) as error:
        LogNormalLength.from_mean_p95(1200, 6000)
    assert str(error.value) == INFEASIBLE_LOGNORMAL.format(mean=1200, p95=6000)


def test_geometric_counts_have_the_requested_mean() -> None:
    draws = [GeometricLength(4.0).quantile(uniform(seed)) for seed in range(20_000)]
    assert min(draws) == 1
    assert sum(draws) / len(draws) == pytest.approx(4.0, rel=0.05)
    assert math.isclose(GeometricLength(0.5).mean(), 1.0)
