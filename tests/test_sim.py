"""The fleet simulator: metric definitions, the decode-run fast path, routing hooks, workloads."""

from collections.abc import Sequence
from dataclasses import replace

import pytest

from sluice.engine.profiles import get_model
from sluice.engine.sampling import FixedLength, GeometricLength
from sluice.engine.types import EngineConfig
from sluice.router.factory import make_policy
from sluice.router.policy import ReplicaView, RouteDecision, RouteRequest
from sluice.sim import (
    SLO,
    Distribution,
    Fleet,
    FleetConfig,
    FleetReport,
    ReplicaRestart,
    WorkloadConfig,
    run_fleet,
)
from sluice.sim.workload import UNKNOWN_ARRIVAL, Workload

SMALL_FLEET = FleetConfig(replicas=2, tp=1, model=get_model("llama-3-8b"),
                          engine=EngineConfig(block_size=16, max_num_seqs=32, max_num_tokens=512,
                                              stream_tokens=False))
CHAT = WorkloadConfig(duration_s=60.0, users=120, think_time_s=5.0, system_prompt_tokens=200,
                      model_version="llama-3-8b", seed=3)


def single_request(output_tokens: int) -> WorkloadConfig:
    return WorkloadConfig(duration_s=60.0, arrival="trace", trace_arrivals=(1.0,), turns=FixedLength(1),
                          system_prompt_tokens=0, user_tokens=FixedLength(100),
                          output_tokens=FixedLength(output_tokens), model_version="llama-3-8b")


def latencies(report: FleetReport) -> tuple[object, ...]:
    return (report.requests_completed, report.ttft, report.tpot, report.itl, report.e2e,
            report.cache_hit_rate, report.output_token_throughput)


# --- metric definitions -----------------------------------------------------------------------


def test_one_request_has_ttft_of_its_context_step_and_tpot_of_its_decode_steps() -> None:
    fleet = replace(SMALL_FLEET, replicas=1)
    report = run_fleet(fleet, single_request(5), "round_robin")
    cost = fleet.cost_model()
    context = cost.step_time_totals_s(100, 0, 0, 100)
    decodes = [cost.step_time_s(0, [context_len]) for context_len in (101, 102, 103, 104)]
    end_step = cost.step_time_s(0, [105])                  # samples end_id: the request ends here
    assert report.ttft.p50 == pytest.approx(context)
    assert report.e2e.p50 == pytest.approx(context + sum(decodes) + end_step)
    assert report.tpot.p50 == pytest.approx((sum(decodes) + end_step) / 4)
    assert report.itl.count == 4 and report.itl.mean == pytest.approx(sum(decodes) / 4)
    assert (report.mean_input_tokens, report.mean_output_tokens) == (100, 5)


def test_weighted_percentiles_count_each_sample_by_its_weight() -> None:
    distribution = Distribution.of([3.0, 1.0, 2.0], [2, 1, 1])
    assert (distribution.count, distribution.p50, distribution.p90) == (4, 2.0, 3.0)
    assert distribution.mean == pytest.approx(9 / 4)


def test_goodput_counts_requests_meeting_every_slo() -> None:
    fleet = replace(SMALL_FLEET, replicas=1)
    relaxed = run_fleet(fleet, single_request(5), "round_robin", slo=SLO(ttft_s=1.0))
    strict = run_fleet(fleet, single_request(5), "round_robin", slo=SLO(ttft_s=0.001))
    assert relaxed.slo_attainment == 1.0 and relaxed.goodput == pytest.approx(1 / 60)
    assert strict.slo_attainment == 0.0 and strict.goodput == 0.0


# --- the fast path ----------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["round_robin", "max_utilization"])
def test_decode_runs_give_the_same_report_as_single_steps(policy: str) -> None:
    fleet = SMALL_FLEET
    if policy == "max_utilization":
        fleet = replace(fleet, engine=replace(fleet.engine, policy="max_utilization", num_blocks=600))
    fast = run_fleet(fleet, CHAT, "round_robin")
    slow = run_fleet(replace(fleet, decode_runs=False), CHAT, "round_robin")
    assert fast.requests_completed > 100
    assert latencies(fast) == latencies(slow)
    assert fast.events < slow.events / 3


def test_the_same_seed_gives_the_same_report() -> None:
    first = run_fleet(SMALL_FLEET, CHAT, "round_robin")
    second = run_fleet(SMALL_FLEET, CHAT, "round_robin")
    assert latencies(first) == latencies(second)


def test_max_utilization_pauses_under_kv_pressure_and_still_completes_requests() -> None:
    tight = replace(SMALL_FLEET, engine=replace(SMALL_FLEET.engine, policy="max_utilization", num_blocks=300))
    report = run_fleet(tight, CHAT, "round_robin")
    assert sum(replica.paused for replica in report.per_replica) > 0
    assert report.requests_completed > 100


# --- routing hooks ----------------------------------------------------------------------------


class Recorder:
    """A policy that sends everything to r1 and keeps what the host told it."""

    name = "recorder"

    def __init__(self) -> None:
        self.views: list[tuple[ReplicaView, ...]] = []
        self.routed = 0
        self.finished = 0
        self.output_tokens: dict[str, int] = {}

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView],
               now: float) -> RouteDecision | None:
        self.views.append(tuple(replicas))
        return RouteDecision(replica="r1", outcome="pinned")

    def on_routed(self, request: RouteRequest, decision: RouteDecision, now: float) -> None:
        self.routed += 1

    def on_finished(self, request: RouteRequest, replica: str, now: float, output_tokens: int = 0) -> None:
        self.finished += 1
        self.output_tokens[request.request_id] = output_tokens

    def on_replica_restarted(self, replica: str) -> None:
        return None


def test_policies_see_replica_views_and_hear_about_every_finish() -> None:
    policy = Recorder()
    report = Fleet(SMALL_FLEET, CHAT).run(policy)
    assert policy.routed == report.requests_arrived - report.requests_rejected
    assert policy.finished == report.requests_completed
    views = policy.views[-1]
    assert [view.name for view in views] == ["r0", "r1"]
    assert views[0].block_size == 16 and views[0].kv_capacity_blocks > 0
    assert views[0].in_flight == 0 and views[1].in_flight > 0
    assert report.per_replica[0].requests == 0
    assert dict(report.routing_outcomes) == {"pinned": report.requests_arrived}


def test_the_policy_hears_how_many_tokens_each_finished_run_generated() -> None:
    policy = Recorder()
    report = Fleet(replace(SMALL_FLEET, replicas=2), single_request(5)).run(policy)
    assert report.requests_completed == 1
    assert list(policy.output_tokens.values()) == [5]     # the answer the next turn sends back as history


def test_the_oracle_probe_reports_each_replicas_exact_cache() -> None:
    config = single_request(5)
    fleet = Fleet(replace(SMALL_FLEET, replicas=1), config)
    fleet.run(make_policy("round_robin"))
    # Replay the workload's draws to get the conversation the replica served.
    workload = Workload(config)
    ((_, conversation),) = workload.initial_arrivals()
    turn = workload.next_turn(conversation)
    assert turn is not None
    workload.answer_finished(turn, 5)
    # 100 prompt + 5 answer tokens computed (the 5th before end_id) = 105 → 6 full blocks of 16.
    assert fleet.cached_tokens("r0", tuple(conversation.history) + (7,)) == 96
    assert fleet.cached_tokens("r0", turn.prompt[:40]) == 32
    assert fleet.cached_tokens("r0", (5, 6, 7)) == 0
    assert fleet.cached_tokens("r0", ()) == 0


def test_multi_turn_conversations_reuse_their_history_on_one_replica() -> None:
    one = replace(SMALL_FLEET, replicas=1)
    report = run_fleet(one, replace(CHAT, turns=GeometricLength(4.0)), "round_robin")
    assert report.cache_hit_rate > 0.6


def test_the_oracle_policy_runs_in_the_simulator() -> None:
    report = run_fleet(SMALL_FLEET, CHAT, "oracle")
    assert report.policy == "oracle" and report.requests_completed > 100


# --- workloads --------------------------------------------------------------------------------


def test_poisson_conversations_arrive_at_the_configured_rate() -> None:
    workload = Workload(WorkloadConfig(arrival="poisson", conversation_rate=5.0, duration_s=200.0))
    assert len(workload.initial_arrivals()) == pytest.approx(1000, rel=0.1)


def test_turns_carry_the_whole_history_and_the_answer() -> None:
    workload = Workload(WorkloadConfig(turns=FixedLength(2), system_prompt_tokens=10,
                                       user_tokens=FixedLength(3)))
    conversation = workload.new_conversation(user=0)
    first = workload.next_turn(conversation)
    assert first is not None and len(first.prompt) == 13
    workload.answer_finished(first, 4)
    second = workload.next_turn(conversation)
    assert second is not None and len(second.prompt) == 20
    assert second.prompt[:13] == first.prompt
    assert workload.next_turn(conversation) is None


def test_a_conversation_ends_when_the_context_is_full() -> None:
    workload = Workload(WorkloadConfig(turns=FixedLength(5), system_prompt_tokens=10,
                                       user_tokens=FixedLength(3), max_context_tokens=14))
    conversation = workload.new_conversation(user=0)
    turn = workload.next_turn(conversation)
    assert turn is not None and turn.max_output_tokens == 1
    workload.answer_finished(turn, 1)
    assert workload.next_turn(conversation) is None


def test_an_unknown_arrival_mode_is_a_value_error() -> None:
    with pytest.raises(ValueError) as error:
        WorkloadConfig(arrival="burst")  # type: ignore[arg-type]
    assert str(error.value) == UNKNOWN_ARRIVAL.format(mode="burst")


def test_the_cli_runs_a_preset_and_prints_the_report(capsys: pytest.CaptureFixture[str]) -> None:
    from sluice.sim.__main__ import main

    main(["--preset", "small", "--duration", "20", "--users", "40"])
    printed = capsys.readouterr().out
    assert printed.startswith("policy round_robin: 2 replicas, 18 s measured")
    for label in ("TTFT", "TPOT", "ITL", "E2E", "goodput", "KV cache   hit rate", "simulated in"):
        assert label in printed


def test_an_unknown_preset_names_the_known_ones() -> None:
    from sluice.sim.presets import UNKNOWN_PRESET, get_preset

    with pytest.raises(ValueError) as error:
        get_preset("seed999")
    assert str(error.value) == UNKNOWN_PRESET.format(name="seed999", known="seed003, small")


def test_a_restarted_replica_interrupts_its_runs_comes_back_cold_and_the_policy_hears_of_it() -> None:
    restarts: list[str] = []

    class Watching(Recorder):
        def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView],
                   now: float) -> RouteDecision | None:
            self.views.append(tuple(replicas))
            return RouteDecision(replica=replicas[-1].name, outcome="last")

        def on_replica_restarted(self, replica: str) -> None:
            restarts.append(replica)

    policy = Watching()
    fleet = replace(SMALL_FLEET, restarts=(ReplicaRestart(at_s=20.0, replica=1, down_s=10.0),))
    report = Fleet(fleet, CHAT).run(policy)
    assert report.requests_interrupted > 0
    assert restarts == ["r1"]
    names_seen = [tuple(view.name for view in views) for views in policy.views]
    assert ("r0",) in names_seen                          # while r1 was down only r0 was offered
    assert policy.views[-1][-1].start_time == 30.0        # r1's new start time after the restart
    assert policy.finished == report.requests_completed + report.requests_interrupted
