"""Seed 000's sizing chain for 2,000 users on a 70B bf16 model, step by step.

Seed 000 writes the KV per token as 320 KB (it is 320 KiB = 327,680 B), so its
bytes per step, step time and ceiling are pinned within 1%; everything else in
the chain follows exactly.
"""

from pathlib import Path

import pytest
import yaml

from sluice.planner import Plan, load_brief, parse_brief, plan

SEED000 = Path(__file__).resolve().parents[1] / "examples" / "briefs" / "seed000.yaml"


@pytest.fixture(scope="module")
def seed000() -> Plan:
    return plan(load_brief(SEED000))


def value(result: Plan, key: str) -> float:
    return result.figure(key).value


def test_a_15_s_answer_and_45_s_of_reading_is_a_25_percent_duty_cycle(seed000: Plan) -> None:
    assert value(seed000, "demand.answer_s") == pytest.approx(15)        # 300 tokens × 50 ms
    assert value(seed000, "demand.turn_period_s") == pytest.approx(60)
    assert value(seed000, "demand.duty_cycle") == pytest.approx(0.25)


def test_10000_decode_tokens_per_second(seed000: Plan) -> None:
    assert value(seed000, "demand.decode_tok_per_s") == pytest.approx(10_000)
    assert "= 2,000 users × 0.25 × 20 tok/s" in seed000.figure("demand.decode_tok_per_s").formula


def test_about_17000_prefill_tokens_per_second(seed000: Plan) -> None:
    assert value(seed000, "demand.prefill_tok_per_s") == pytest.approx(2000 / 60 * 500)
    assert value(seed000, "demand.prefill_tok_per_s") == pytest.approx(17_000, rel=0.02)


def test_141_gb_of_bf16_weights_so_a_replica_is_tp8(seed000: Plan) -> None:
    assert value(seed000, "memory.weight_bytes") == pytest.approx(141.2e9)
    # 0.9 × 80 = 72 GB per card for the engine: 70.6 GB + 5 GB reserve does not fit two, 35.3 + 5 fits four.
    assert value(seed000, "memory.min_tp") == 4
    assert value(seed000, "memory.tp") == 8           # the group fills the NVSwitch domain


def test_182_gb_per_step_and_6_8_ms_at_batch_64_and_2000_context(seed000: Plan) -> None:
    assert value(seed000, "decode.ceiling_bytes_per_step") == pytest.approx(141.2e9 + 64 * 327_680 * 2000)
    assert value(seed000, "decode.ceiling_bytes_per_step") == pytest.approx(182e9, rel=0.01)
    assert value(seed000, "decode.ceiling_step_s") == pytest.approx(6.8e-3, rel=0.01)


def test_about_9400_tokens_per_second_decode_ceiling(seed000: Plan) -> None:
    assert value(seed000, "decode.ceiling_tok_per_s") == pytest.approx(9_400, rel=0.01)


def test_5_then_8_then_9_replicas_at_2000_tokens_per_second_of_goodput(seed000: Plan) -> None:
    assert value(seed000, "replicas.decode_only") == pytest.approx(5)
    assert value(seed000, "replicas.with_prefill") == 8        # 5 ÷ 0.7 = 7.14 → 8
    assert value(seed000, "replicas.fleet") == 9               # N+1
    assert seed000.replicas == 9


def test_72_h100s_at_180_dollars_per_hour(seed000: Plan) -> None:
    assert seed000.gpus == 72
    assert value(seed000, "cost.per_hour") == 180
    assert value(seed000, "cost.per_month") == 180 * 730


def test_the_cost_model_shows_the_measured_goodput_is_the_conservative_input(seed000: Plan) -> None:
    assert value(seed000, "replicas.analytical_goodput") > 2000
    assert value(seed000, "replicas.analytical_prefill_share") < 0.30


def test_without_a_prefix_cache_there_is_no_hit_rate_to_fall(seed000: Plan) -> None:
    assert [row.key for row in seed000.scenarios] == [
        "traffic_doubles", "inputs_double", "one_node_lost", "two_nodes_lost"]


def test_ten_thousand_users_at_the_same_ratios_is_37_replicas_not_the_seeds_45() -> None:
    # 50,000 ÷ 2,000 = 25 → ÷ 0.7 = 35.7 → 36 → + 1 spare = 37. Seed 000's "about 45" is 5 × 9:
    # it multiplies the spare along with the serving replicas.
    data = yaml.safe_load(SEED000.read_text())
    del data["reference"]
    data["demand"]["users"] = 10_000
    assert plan(parse_brief(data)).replicas == 37
