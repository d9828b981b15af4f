"""`sizing.precision`: precision searched with the replica count (weights and KV alike), and fixed
when the brief does not ask.

First principles for examples/briefs/precision-auto.yaml (Llama-3-8B, 8.03e9 params, one H100 per
replica, 70% of 3.35 TB/s achieved, 3 ms scheduling per step, p95 ITL SLO 8 ms): every decode step
reads all the weights whatever the replica count, so a step is at least weights ÷ bandwidth.
  bf16: 8.03e9 × 2 B = 16.06 GB ÷ 2.345 TB/s = 6.85 ms + 3 ms = 9.85 ms > 8 ms: no count meets it;
  fp8:  8.03e9 × 1 B =  8.03 GB ÷ 2.345 TB/s = 3.42 ms + 3 ms = 6.42 ms < 8 ms: room for a batch.
"""

import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from sluice.planner import BriefError, Plan, parse_brief, plan

BRIEF = Path(__file__).resolve().parents[1] / "examples" / "briefs" / "precision-auto.yaml"
PARAMS, BANDWIDTH, SCHEDULING, ITL_SLO = 8.03e9, 3.35e12 * 0.7, 0.003, 0.008


def brief_data(**sizing: object) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(BRIEF.read_text())
    data["sizing"].update(sizing)
    data["sizing"] = {key: value for key, value in data["sizing"].items() if value is not None}
    return data


def weight_floor(bytes_per_weight: float) -> float:
    return PARAMS * bytes_per_weight / BANDWIDTH + SCHEDULING


@pytest.fixture(scope="module")
def searched() -> Plan:
    return plan(parse_brief(brief_data()))


def test_auto_picks_fp8_because_bf16_weights_alone_break_the_itl_slo(searched: Plan) -> None:
    assert weight_floor(2.0) > ITL_SLO > weight_floor(1.0)
    assert math.isinf(searched.figure("memory.precision.bf16").value)
    assert "no replica count meets the brief" in searched.figure("memory.precision.bf16").formula
    assert searched.figure("memory.precision_search").label.endswith("fp8")
    assert searched.architecture[1] == "fp8 weights, fp8 KV"
    assert searched.meets_slo


def test_the_chosen_precision_is_planned_exactly_as_if_the_brief_had_fixed_it(searched: Plan) -> None:
    data = brief_data(precision=None)
    data["model"]["weights"] = "fp8"
    fixed = plan(parse_brief(data))
    assert searched.figure("memory.precision.fp8").value == fixed.gpus == searched.gpus
    assert searched.figure("replicas.needed").value == fixed.figure("replicas.needed").value


def test_without_the_option_the_brief_precision_is_kept_and_nothing_is_searched() -> None:
    fixed = plan(parse_brief(brief_data(precision=None)))
    keys = {figure.key for section in fixed.sections for figure in section.figures}
    assert not {key for key in keys if key.startswith("memory.precision")}
    assert fixed.architecture[1] == "bf16 weights, bf16 KV"
    assert not fixed.meets_slo   # bf16's weight read breaks the ITL SLO (module docstring)


def test_ties_go_to_the_wider_precision() -> None:
    # A loose ITL SLO (50 ms) and few users: one replica (+1 spare) serves in either precision.
    data = brief_data()
    data["slo"]["itl_p95_ms"] = 50
    data["demand"]["users"] = 10
    tied = plan(parse_brief(data))
    assert tied.figure("memory.precision.bf16").value == tied.figure("memory.precision.fp8").value == 2
    assert tied.architecture[1] == "bf16 weights, bf16 KV"


def test_a_list_drops_what_the_gpu_cannot_run_and_refuses_when_nothing_is_left() -> None:
    data = brief_data(precision=["bf16", "fp8"])
    data["hardware"]["preset"] = "a100-80g"
    a100 = plan(parse_brief(data))
    keys = {figure.key for section in a100.sections for figure in section.figures}
    assert "memory.precision.fp8" not in keys and "memory.precision.bf16" in keys
    data["sizing"]["precision"] = ["fp8"]
    with pytest.raises(BriefError) as caught:
        parse_brief(data)
    assert caught.value.field == "sizing.precision"
    with pytest.raises(BriefError) as unknown:
        parse_brief(brief_data(precision=["fp9"]))
    assert unknown.value.field == "sizing.precision"
