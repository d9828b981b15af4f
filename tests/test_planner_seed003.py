"""Seed 003's brief (70B FP8, 10,000 users, 64 × H100) reproduces its consistent figures.

Tolerances, and why: the planner does not bend a formula to a printed number.
Seed 003 multiplies a rounded 55.6 req/s (so its token rates are 0.08% high),
adds its KV read as 20 KB where the KV is 20 KiB (+1.3% bytes per step) and
prices prefill with 2 × 70e9 FLOPs at 990 TFLOP/s where the model has 70.6e9
parameters and H100 989 TFLOP/s (−1% prefill). Its capacities are therefore
pinned within 1%, its shares within half a point, and the failure rows — which
multiply those shares by up to 2 — within one or two points of the seed.
"""

import math
from pathlib import Path

import pytest

from sluice.planner import Plan, load_brief, plan
from sluice.planner.fleet import FITS, OVERLOADED

SEED003 = Path(__file__).resolve().parents[1] / "examples" / "briefs" / "seed003.yaml"
KIB = 1024

# First principles, from the brief's inputs (the brief prices matmuls at bf16, as the seed does):
INPUT_TOK_S = 10_000 / 180 * 1200
OUTPUT_TOK_S = 10_000 / 180 * 350
# 8 × 989 TFLOP/s × 0.5 ÷ (2 × 70.6e9), and every TP8 step (prefill too) pays the 20% all-reduce.
PREFILL_PER_NODE = 8 * 989e12 * 0.5 / (2 * 70.6e9) * (1 - 0.2)
STEP_AT_100 = (70.6e9 / 8 + 100 * 4000 * 20 * KIB) / (3.35e12 * 0.7) / (1 - 0.2)
PREFILL_SHARE = INPUT_TOK_S / (8 * PREFILL_PER_NODE)
DECODE_SHARE = OUTPUT_TOK_S / (8 * 100 / STEP_AT_100)


@pytest.fixture(scope="module")
def seed003() -> Plan:
    return plan(load_brief(SEED003))


def value(result: Plan, key: str) -> float:
    return result.figure(key).value


def scenario(result: Plan, key: str) -> float:
    return next(row for row in result.scenarios if row.key == key).utilization


def test_800_sequences_generate_at_once(seed003: Plan) -> None:
    assert value(seed003, "demand.generating_sequences") == pytest.approx(800)
    assert seed003.figure("demand.generating_sequences").formula == "10,000 users × 0.08 = 800 sequences"


def test_55_6_requests_per_second(seed003: Plan) -> None:
    assert value(seed003, "demand.requests_per_s") == pytest.approx(55.6, abs=0.05)


def test_19460_output_and_66720_input_tokens_per_second(seed003: Plan) -> None:
    assert value(seed003, "demand.decode_tok_per_s") == pytest.approx(19_460, rel=0.001)
    assert value(seed003, "demand.input_tok_per_s") == pytest.approx(66_720, rel=0.001)
    # Its own arithmetic, unrounded: 10,000 ÷ 180 × 350 and × 1,200.
    assert value(seed003, "demand.decode_tok_per_s") == pytest.approx(10_000 / 180 * 350)
    assert value(seed003, "demand.input_tok_per_s") == pytest.approx(10_000 / 180 * 1200)


def test_the_stated_8_percent_duty_is_flagged_as_rounding_14_s_of_180(seed003: Plan) -> None:
    assert "7.8%" in seed003.figure("demand.duty_cycle").note


def test_weights_are_8_825_gb_per_gpu_at_tp8(seed003: Plan) -> None:
    assert value(seed003, "memory.tp") == 8
    # One memory rule: the engine gets 0.9 × 80 GB = 72 GB; 70.6 GB + 5 GB reserve does not fit one card.
    assert value(seed003, "memory.min_tp") == 2
    assert value(seed003, "memory.weight_bytes_per_gpu") == pytest.approx(70.6e9 / 8)


def test_kv_is_20_kib_per_token_per_gpu(seed003: Plan) -> None:
    assert value(seed003, "memory.kv_bytes_per_token_per_gpu") == 20 * KIB


def test_710_sequences_fit_per_node_at_4000_context_in_the_engines_90_percent(seed003: Plan) -> None:
    # The seed sizes KV from the whole 80 GB (806); the engine it configures gets 0.90 of it.
    pool = 0.9 * 80e9 - 70.6e9 / 8 - 5e9
    assert value(seed003, "memory.kv_pool_bytes_per_gpu") == pytest.approx(pool)
    assert value(seed003, "memory.sequences_per_replica") == pool // (20 * KIB * 4000) == 710
    assert value(seed003, "memory.fleet_sequences") == 8 * 710
    check = next(c for c in seed003.reference_checks if c.key == "memory.sequences_per_replica")
    assert "0.90" in check.why


def test_a_decode_step_at_batch_100_reads_17_02_gb_and_takes_9_07_ms(seed003: Plan) -> None:
    step_bytes = 70.6e9 / 8 + 100 * 4000 * 20 * KIB
    assert value(seed003, "decode.batch") == 100
    assert value(seed003, "decode.bytes_per_step_per_gpu") == pytest.approx(step_bytes)
    assert value(seed003, "decode.step_s") == pytest.approx(step_bytes / 3.35e12 / 0.7 / 0.8)
    assert "20 KB" in seed003.figure("decode.bytes_per_step_per_gpu").note


def test_88888_decode_tokens_per_second_across_8_nodes(seed003: Plan) -> None:
    assert value(seed003, "decode.tok_per_s") == pytest.approx(88_888, rel=0.01)


def test_prefill_is_the_seeds_226000_less_the_allreduce_share_it_leaves_out(seed003: Plan) -> None:
    assert value(seed003, "prefill.tok_per_s") == pytest.approx(8 * PREFILL_PER_NODE)
    assert value(seed003, "prefill.tok_per_s") == pytest.approx(226_000 * 0.8, rel=0.01)
    assert "bf16" in seed003.figure("prefill.replica_flops").note   # 990 TFLOP/s is the bf16 peak
    assert "all-reduce" in seed003.figure("prefill.tok_per_s_per_replica").formula


def test_prefill_37_2_plus_decode_22_0_is_59_2_percent(seed003: Plan) -> None:
    # The seed's 29.5% + 21.9% = 51.4% leaves prefill's all-reduce out (and rounds).
    prefill, decode = value(seed003, "utilization.prefill"), value(seed003, "utilization.decode")
    assert prefill == pytest.approx(PREFILL_SHARE)
    assert decode == pytest.approx(DECODE_SHARE)
    assert (round(prefill, 3), round(decode, 3)) == (0.372, 0.220)
    assert value(seed003, "utilization.total") == pytest.approx(prefill + decode)


def test_ttft_queues_behind_prefill_work_only(seed003: Plan) -> None:
    # The prefill server runs at what decode leaves: C × (1 − d); its load is p ÷ (1 − d).
    rate = PREFILL_PER_NODE * (1 - DECODE_SHARE)
    rho, service = PREFILL_SHARE / (1 - DECODE_SHARE), 1200 / rate
    p95_wait = service / (1 - rho) * math.log(rho / 0.05)
    assert value(seed003, "latency.queue_wait_p95_s") == pytest.approx(p95_wait)
    fixed = (25 + 12 + 4 + 2 + 6) / 1e3
    assert value(seed003, "latency.ttft_p95_s") == pytest.approx(fixed + p95_wait + 880 / rate)


def step(batch: int, context: int = 4000, weights: float = 70.6e9, kv: float = 20 * KIB) -> float:
    """A TP8 decode step from first principles: weights ÷ 8 + the batch's KV, at 70% of 3.35 TB/s,
    stretched by the 20% all-reduce."""
    return (weights / 8 + batch * context * kv) / (3.35e12 * 0.7) / (1 - 0.2)


def shares(replicas: int, traffic: float = 1, inputs: float = 1, context: int = 4000,
           weights: float = 70.6e9, kv: float = 20 * KIB) -> float:
    """Utilization of `replicas` re-priced at their own batch: prefill's share plus decode's."""
    batch = math.ceil(800 * traffic / replicas)
    prefill = INPUT_TOK_S * traffic * inputs / (replicas * PREFILL_PER_NODE)
    decode = OUTPUT_TOK_S * traffic / (replicas * batch / step(batch, context, weights, kv))
    return prefill + decode


def test_failure_rows_are_re_priced_at_their_own_batch_not_scaled(seed003: Plan) -> None:
    # Scaling (seed 003's method) would give 2 × 59.2%; at batch 200 the weights are shared by twice
    # the tokens, so decode's share grows less than 2×.
    assert scenario(seed003, "traffic_doubles") == pytest.approx(shares(8, traffic=2))
    assert scenario(seed003, "traffic_doubles") < 2 * (PREFILL_SHARE + DECODE_SHARE)
    assert scenario(seed003, "inputs_double") == pytest.approx(shares(8, inputs=2, context=5200))
    assert scenario(seed003, "one_node_lost") == pytest.approx(shares(7))      # batch ⌈800 ÷ 7⌉ = 115
    assert scenario(seed003, "two_nodes_lost") == pytest.approx(shares(6))     # batch 134


def test_traffic_doubling_overloads_the_fleet_and_needs_15_replicas(seed003: Plan) -> None:
    row = next(row for row in seed003.scenarios if row.key == "traffic_doubles")
    assert row.verdict == OVERLOADED and row.utilization > 1
    # 14 serving replicas: batch ⌈1,600 ÷ 14⌉ = 115; 13 leave p95 TTFT above 500 ms; + 1 spare.
    assert row.replicas_needed == 15


def test_one_node_lost_fits_and_two_put_ttft_at_risk(seed003: Plan) -> None:
    one = next(row for row in seed003.scenarios if row.key == "one_node_lost")
    two = next(row for row in seed003.scenarios if row.key == "two_nodes_lost")
    assert one.verdict == FITS
    assert two.verdict == "at risk" and two.utilization < 0.85 and two.ttft_p95_s > 0.5


def test_reverting_fp8_to_bf16_doubles_the_weight_read_but_not_the_seeds_95_percent(seed003: Plan) -> None:
    row = next(row for row in seed003.scenarios if row.key == "precision_reverted")
    # Matmuls were already bf16 in this brief, so prefill is unchanged; decode reads twice the bytes.
    assert row.prefill_fraction == pytest.approx(PREFILL_SHARE)
    assert row.utilization == pytest.approx(shares(8, weights=141.2e9, kv=40 * KIB))
    assert row.utilization < 0.95
    assert "counting decode three times" in row.note


def test_a_20_percent_prefix_hit_rate_leaves_utilization_but_not_ttft(seed003: Plan) -> None:
    row = next(row for row in seed003.scenarios if row.key == "prefix_hit_rate_falls")
    assert row.utilization == pytest.approx(PREFILL_SHARE + DECODE_SHARE)   # the sizing never counted on it
    rate = PREFILL_PER_NODE * (1 - DECODE_SHARE)
    rho, service = PREFILL_SHARE / (1 - DECODE_SHARE), 1200 / rate
    p95_wait = service / (1 - rho) * math.log(rho / 0.05)
    assert row.ttft_p95_s == pytest.approx(0.049 + p95_wait + 4000 * 0.8 / rate)   # 3,200 new tokens
    assert "cannot reach 78%" in row.note


def test_160_dollars_per_hour(seed003: Plan) -> None:
    assert value(seed003, "cost.per_hour") == 160
    assert value(seed003, "cost.per_year") == 1_401_600


def test_4_48_per_million_only_with_the_seeds_0_51_ratio_which_the_plan_flags(seed003: Plan) -> None:
    assert value(seed003, "cost.per_million_output") == pytest.approx(4.48, abs=0.005)
    millions_per_peak_hour = 10_000 / 180 * 350 * 3600 / 1e6
    assert value(seed003, "cost.per_million_output_at_peak") == pytest.approx(160 / millions_per_peak_hour)
    check = next(c for c in seed003.reference_checks if c.key == "cost.per_million_output")
    assert "peak utilization" in check.why


def test_engine_configuration_keeps_every_step_within_the_itl_slo(seed003: Plan) -> None:
    assert seed003.setting("max_model_len").value == 8192
    assert seed003.setting("max_num_seqs").value == 144   # ⌈800 ÷ 7⌉ × 1.2 → multiple of 16
    assert seed003.setting("max_num_tokens").value == 768
    assert seed003.setting("memory_fraction").value == 0.9
    assert value(seed003, "latency.itl_p95_s") <= 0.040


def test_the_plan_meets_the_slo_and_survives_two_nodes_lost(seed003: Plan) -> None:
    assert seed003.meets_slo
    assert seed003.gpus == 64 and seed003.replicas == 8
    assert "Within the ceiling with 1 node lost" in seed003.verdict
    assert seed003.dependencies[0].startswith("traffic × 2: utilization 107.0% (overloaded; 15 replicas")


def test_seven_serving_replicas_are_needed_because_six_miss_the_ttft_slo(seed003: Plan) -> None:
    # At 6: p = 37.2% × 8/6, d at batch 134; the prefill queue's p95 wait breaks 500 ms.
    p = INPUT_TOK_S / (6 * PREFILL_PER_NODE)
    d = OUTPUT_TOK_S / (6 * 134 / step(134))
    rate = PREFILL_PER_NODE * (1 - d)
    rho, service = p / (1 - d), 1200 / rate
    ttft_at_6 = 0.049 + service / (1 - rho) * math.log(rho / 0.05) + 880 / rate
    assert ttft_at_6 > 0.5 and shares(6) < 0.85
    assert value(seed003, "replicas.needed") == 7
    assert value(seed003, "replicas.needed_with_spares") == 8


def test_every_printed_figure_is_either_matched_or_explained(seed003: Plan) -> None:
    unexplained = [c.key for c in seed003.reference_checks if not c.matches and not c.why]
    assert unexplained == []
