"""Seed 003 §9's variations give the direction the seed states."""

from pathlib import Path
from typing import Any

import pytest
import yaml

from sluice.planner import Plan, parse_brief, plan

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "briefs"


def seed003_with(**sections: dict[str, Any]) -> Plan:
    """Seed 003's brief with some sections' fields replaced, and without its reference figures."""
    data = yaml.safe_load((EXAMPLES / "seed003.yaml").read_text())
    del data["reference"]
    for section, fields in sections.items():
        data[section].update(fields)
    return plan(parse_brief(data))


def test_a_budget_of_32_gpus_overloads_the_fleet() -> None:
    half = seed003_with(sizing={"gpus": 32})
    assert not half.meets_slo
    assert half.figure("utilization.total").value > 0.85
    assert half.figure("latency.ttft_p95_s").value > 0.5
    assert half.figure("replicas.needed_with_spares").value > half.replicas
    assert half.verdict.startswith("Does not meet the SLO")


def test_a_405b_model_needs_about_four_times_the_gpus() -> None:
    base = seed003_with()
    big = seed003_with(model={"preset": "llama-3.1-405b"})
    assert big.figure("memory.weight_bytes_per_gpu").value == pytest.approx(50.6e9, rel=0.005)
    # Seed 003 §9 F: "only 25 GB for KV" from the whole 80 GB; the engine gets 0.9 × 80 GB.
    assert big.figure("memory.kv_pool_bytes_per_gpu").value == pytest.approx(0.9 * 80e9 - 405.9e9 / 8 - 5e9)
    assert big.figure("utilization.total").value > 1.0
    # Seed 003 §9 F: "~4x the GPUs or a smaller model". Solved, no count of TP8 replicas will do: its
    # prefill runs at 8 × 989 TFLOP/s × 0.5 ÷ 811.8 GFLOP × 0.8 = 3,898 tok/s per replica, so a step
    # carrying even a 240-token chunk takes 240 ÷ 3,898 = 62 ms > the 40 ms ITL SLO.
    assert base.figure("replicas.needed_with_spares").value == 8
    assert big.figure("replicas.needed_with_spares").value == float("inf")
    assert "65,536 replicas fail (p95 ITL" in big.figure("replicas.needed").formula
    assert not big.meets_slo


def test_a100s_decode_about_1_64_times_slower() -> None:
    # A100 has no FP8: both sides store int8 weights and KV (seed 003 §9 G: "INT8 instead").
    int8 = {"weights": "int8", "kv_cache": "int8"}
    h100 = seed003_with(model=int8)
    a100 = seed003_with(model=int8, hardware={"preset": "a100-80g"})
    slower = a100.figure("decode.step_s").value / h100.figure("decode.step_s").value
    assert slower == pytest.approx(3.35 / 2.039)
    assert slower == pytest.approx(1.64, abs=0.01)


def test_twice_the_gpus_halve_prefills_share() -> None:
    base, double = seed003_with(), seed003_with(sizing={"gpus": 128})
    half_share = base.figure("utilization.prefill").value / 2
    assert double.figure("utilization.prefill").value == pytest.approx(half_share)
