"""Users-only sizing (seed 000's chain, goodput from the engine model) and TP search, solved.

First principles for 70B bf16 on H100 (TP8, 0.9 × 80 GB, 5 GB reserve, 70% of 3.35 TB/s, 20%
all-reduce at TP8): 2,000 users, 300-token answers at 50 ms = 15 s, a turn every 60 s.
"""

import math
from pathlib import Path

import pytest

from sluice.planner import Plan, load_brief, plan

BRIEF = Path(__file__).resolve().parents[1] / "examples" / "briefs" / "seed000-users.yaml"
KIB = 1024
KV_PER_GPU = 320 * KIB / 8
CONTEXT = 2000
GENERATING = 2000 * 15 / 60            # 500 sequences
DECODE_TOK_S = 2000 / 60 * 300         # 10,000 tok/s
PREFILL_TOK_S = 2000 / 60 * 500        # 16,667 tok/s
PREFILL_PER_REPLICA = 8 * 989e12 * 0.5 / 141.2e9 * (1 - 0.2)


def step(batch: int) -> float:
    return (141.2e9 / 8 + batch * CONTEXT * KV_PER_GPU) / (3.35e12 * 0.7) / (1 - 0.2)


def utilization(replicas: int) -> float:
    batch = math.ceil(GENERATING / replicas)
    return PREFILL_TOK_S / (replicas * PREFILL_PER_REPLICA) + DECODE_TOK_S / (replicas * batch / step(batch))


@pytest.fixture(scope="module")
def users() -> Plan:
    return plan(load_brief(BRIEF))


def test_goodput_at_the_tpot_slo_comes_from_the_engine_model(users: Plan) -> None:
    fit = int((0.9 * 80e9 - 141.2e9 / 8 - 5e9) // (KV_PER_GPU * CONTEXT))    # 602 sequences
    largest = max(b for b in range(1, fit + 1) if step(b) <= 0.050 - 0.003)
    assert largest == fit == 602
    assert users.figure("replicas.goodput_at_itl_slo").value == pytest.approx(largest / step(largest))


def test_two_serving_replicas_are_the_smallest_that_fit_so_three_with_the_spare(users: Plan) -> None:
    # One replica: 136.8% (prefill 74% + decode 62.5% at batch 500); two: 77.8% ≤ 85%.
    assert utilization(1) > 1.0 and utilization(2) <= 0.85
    assert users.figure("replicas.needed").value == 2
    assert users.replicas == 3 and users.gpus == 24
    assert users.meets_slo


def test_tp_auto_picks_the_tp_that_needs_the_fewest_gpus(users: Plan) -> None:
    assert users.figure("memory.tp").value == 8
    assert "TP4: 32, TP8: 24" in users.figure("memory.tp_search").formula
