"""Seed 003 §9's variations A–G as example briefs: each plans, and the figures the seed argues from
follow from first principles (70B FP8 on H100, TP8, 0.9 × 80 GB, 70% of 3.35 TB/s, 20% all-reduce)."""

import math
from pathlib import Path

import pytest

from sluice.planner import Plan, load_brief, plan

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "briefs"
KIB = 1024
INPUT_TOK_S, OUTPUT_TOK_S = 10_000 / 180 * 1200, 10_000 / 180 * 350
PREFILL_BF16 = 8 * 989e12 * 0.5 / 141.2e9 * 0.8


def run(name: str) -> Plan:
    return plan(load_brief(EXAMPLES / name))


def step(batch: int, weights: float = 70.6e9, kv: float = 20 * KIB, bandwidth: float = 3.35e12) -> float:
    return (weights / 8 + batch * 4000 * kv) / (bandwidth * 0.7) / 0.8


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_every_example_brief_plans(name: str) -> None:
    result = run(name)
    assert result.replicas >= 1 and result.verdict


def test_a_32_gpus_run_at_107_percent_and_need_64() -> None:
    a = run("seed003-a-32-gpus.yaml")
    batch = math.ceil(800 / 4)
    expected = INPUT_TOK_S / (4 * PREFILL_BF16) + OUTPUT_TOK_S / (4 * batch / step(batch))
    assert a.figure("utilization.total").value == pytest.approx(expected)
    assert round(expected, 3) == 1.070
    assert a.figure("replicas.needed_with_spares").value == 8 and not a.meets_slo


def test_b_a_200_ms_ttft_needs_more_prefill_not_more_decode() -> None:
    b = run("seed003-b-ttft-200ms.yaml")
    assert not b.meets_slo
    assert b.figure("latency.fixed_s").value == pytest.approx(0.049)
    assert b.figure("replicas.needed_with_spares").value > 8


def test_c_100_adapters_take_4_gb_and_10_percent() -> None:
    c = run("seed003-c-lora.yaml")
    assert c.figure("memory.lora_bytes").value == pytest.approx(100 * 0.04e9)
    pool = 0.9 * 80e9 - 70.6e9 / 8 - 5e9 - 4e9
    assert c.figure("memory.kv_pool_bytes_per_gpu").value == pytest.approx(pool)
    assert c.figure("utilization.prefill").value == pytest.approx(INPUT_TOK_S / (8 * PREFILL_BF16) * 1.1)


def test_d_the_largest_region_serves_its_users_and_half_its_neighbours() -> None:
    d = run("seed003-d-regions.yaml")
    assert d.figure("demand.generating_sequences").value == pytest.approx((5000 + 0.5 * 3000) * 0.08)
    assert d.meets_slo


def test_e_a_10x_spike_makes_each_token_cost_ten_times_the_peak_hour() -> None:
    e = run("seed003-e-spiky.yaml")
    peak = e.figure("cost.per_million_output_at_peak").value
    assert e.figure("cost.per_million_output").value == pytest.approx(peak / 0.10)


def test_f_405b_decode_never_steps_below_27_ms() -> None:
    f = run("seed003-f-405b.yaml")
    assert f.figure("memory.weight_bytes_per_gpu").value == pytest.approx(405.9e9 / 8)
    assert f.figure("memory.kv_pool_bytes_per_gpu").value == pytest.approx(0.9 * 80e9 - 405.9e9 / 8 - 5e9)
    base = run("seed003-g-h100.yaml")   # the 70B on H100 with the same fp8 matmuls, sized from users
    assert f.gpus > 4 * base.gpus       # the seed's "~4x the GPUs" is a floor, not the answer


def test_g_a100s_decode_1_64_times_slower_and_cost_more_per_token() -> None:
    a100, h100 = run("seed003-g-a100.yaml"), run("seed003-g-h100.yaml")
    ratio = step(1, kv=20 * KIB, bandwidth=2.039e12) / step(1)
    assert ratio == pytest.approx(3.35 / 2.039)
    assert a100.figure("prefill.replica_flops").value == pytest.approx(8 * 624e12 * 0.5)   # int8 matmuls
    assert h100.figure("prefill.replica_flops").value == pytest.approx(8 * 1979e12 * 0.5)  # fp8 matmuls
    assert a100.gpus > h100.gpus
    assert a100.figure("cost.per_million_output").value > h100.figure("cost.per_million_output").value
