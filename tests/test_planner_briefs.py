"""Bad briefs fail with one clear error that names the field to change."""

from pathlib import Path
from typing import Any

import pytest
import yaml

from sluice.engine.profiles import HARDWARE_PRESETS, MODEL_PRESETS
from sluice.planner import BriefError, parse_brief, plan
from sluice.planner.errors import (
    BUDGET_NOT_A_MULTIPLE,
    DUTY_OR_READ_TIME,
    MISSING_FIELD,
    MODEL_FITS_NO_GPU_COUNT,
    NEGATIVE,
    NOT_A_FRACTION,
    NOT_A_NUMBER,
    NOT_POSITIVE,
    TP_TOO_SMALL,
    UNKNOWN_FIELD,
    UNKNOWN_HARDWARE_PRESET,
    UNKNOWN_MODEL_PRESET,
    UNKNOWN_PRECISION,
    UNKNOWN_REFERENCE_FIGURE,
)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "briefs"


def seed003() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((EXAMPLES / "seed003.yaml").read_text())
    return data


def error_for(data: dict[str, Any]) -> BriefError:
    with pytest.raises(BriefError) as caught:
        plan(parse_brief(data))
    return caught.value


def test_an_unknown_model_preset_names_the_field_and_the_known_presets() -> None:
    data = seed003()
    data["model"]["preset"] = "gpt-5"
    error = error_for(data)
    assert error.field == "model.preset"
    assert str(error) == UNKNOWN_MODEL_PRESET.format(field="model.preset", value="gpt-5",
                                                     known=", ".join(MODEL_PRESETS))


def test_an_unknown_hardware_preset_names_the_field_and_the_known_presets() -> None:
    data = seed003()
    data["hardware"]["preset"] = "b200"
    error = error_for(data)
    assert error.field == "hardware.preset"
    assert str(error) == UNKNOWN_HARDWARE_PRESET.format(field="hardware.preset", value="b200",
                                                        known=", ".join(HARDWARE_PRESETS))


def test_an_unknown_precision_is_refused() -> None:
    data = seed003()
    data["model"]["weights"] = "fp4"
    error = error_for(data)
    assert error.field == "model.weights"
    assert str(error).startswith(UNKNOWN_PRECISION.format(field="model.weights", value="fp4", known="")[:-1])


def test_a_model_that_fits_no_gpu_count_in_a_node_says_how_much_each_gpu_would_hold() -> None:
    data = seed003()
    data["model"].update(preset="llama-3.1-405b", weights="bf16", kv_cache="bf16")
    error = error_for(data)
    assert error.field == "model"
    assert str(error) == MODEL_FITS_NO_GPU_COUNT.format(
        field="model", model="llama-3.1-405b", precision="bf16", weights_gb=811.8, gpus_per_node=8,
        hardware="h100-sxm", usable_gb=72, fraction=0.9, reserve_gb=5, per_gpu_gb=811.8 / 8,
        # 811.8 GB ÷ 16 = 50.7 GB + 5 ≤ 72; in fp8, 405.9 ÷ 8 = 50.7 GB + 5 ≤ 72 at one node.
        smallest="TP 16 (2 nodes, crossing InfiniBand) at bf16 weights, or fp8 weights at TP 8")


def test_a_tensor_parallel_degree_below_the_smallest_that_fits_is_refused() -> None:
    data = seed003()
    data["model"].update(weights="bf16", kv_cache="bf16")
    data["sizing"]["tp"] = 1
    error = error_for(data)
    assert error.field == "sizing.tp"
    # 0.9 × 80 = 72 GB: 141.2 ÷ 2 = 70.6 GB + 5 GB reserve does not fit, 141.2 ÷ 4 + 5 does.
    assert str(error) == TP_TOO_SMALL.format(field="sizing.tp", value=1, weights_gb=141.2, usable_gb=72,
                                             hbm_gb=80, min_tp=4)


def test_a_budget_that_is_not_whole_replicas_is_refused() -> None:
    data = seed003()
    data["sizing"]["gpus"] = 60
    error = error_for(data)
    assert error.field == "sizing.gpus"
    assert str(error) == BUDGET_NOT_A_MULTIPLE.format(field="sizing.gpus", value=60, tp=8)


def test_a_negative_number_names_the_field() -> None:
    data = seed003()
    data["demand"]["users"] = -10_000
    error = error_for(data)
    assert (error.field, str(error)) == ("demand.users", NEGATIVE.format(field="demand.users", value=-10_000))


def test_zero_users_is_not_a_demand() -> None:
    data = seed003()
    data["demand"]["users"] = 0
    assert str(error_for(data)) == NOT_POSITIVE.format(field="demand.users", value=0)


def test_a_missing_number_names_the_field() -> None:
    data = seed003()
    del data["workload"]["output_tokens"]["mean"]
    error = error_for(data)
    assert error.field == "workload.output_tokens.mean"
    assert str(error) == MISSING_FIELD.format(field="workload.output_tokens.mean")


def test_a_missing_section_names_the_section() -> None:
    data = seed003()
    del data["slo"]
    assert str(error_for(data)) == MISSING_FIELD.format(field="slo")


def test_text_where_a_number_belongs_is_refused() -> None:
    data = seed003()
    data["hardware"]["price_per_gpu_hour"] = "cheap"
    assert str(error_for(data)) == NOT_A_NUMBER.format(field="hardware.price_per_gpu_hour", value="cheap")


def test_true_is_not_a_number_of_users() -> None:
    data = seed003()
    data["demand"]["users"] = True
    assert str(error_for(data)) == NOT_A_NUMBER.format(field="demand.users", value=True)


def test_a_hit_rate_of_one_or_more_is_not_a_fraction() -> None:
    data = seed003()
    data["workload"]["prefix_hit_rate"] = 1.2
    assert str(error_for(data)) == NOT_A_FRACTION.format(field="workload.prefix_hit_rate", value=1.2)


def test_a_misspelt_field_is_refused_rather_than_defaulted() -> None:
    data = seed003()
    data["efficiency"]["achieved_bandwith_fraction"] = 0.8
    error = error_for(data)
    assert error.field == "efficiency.achieved_bandwith_fraction"
    assert str(error).startswith(UNKNOWN_FIELD.format(field="efficiency.achieved_bandwith_fraction",
                                                      known="")[:-1])


def test_a_demand_needs_a_duty_cycle_with_a_turn_period_or_a_read_time() -> None:
    data = seed003()
    del data["demand"]["turn_period_s"]
    assert str(error_for(data)) == DUTY_OR_READ_TIME.format(field="demand")


def test_a_reference_figure_the_plan_does_not_have_is_refused() -> None:
    data = seed003()
    data["reference"]["figures"] = {"decode.warp_speed": 9}
    error = error_for(data)
    assert error.field == "reference.figures.decode.warp_speed"
    assert str(error).startswith(UNKNOWN_REFERENCE_FIGURE.format(
        field="reference.figures.decode.warp_speed", value="decode.warp_speed", known="")[:-1])


def test_a_model_can_be_given_by_its_shape_instead_of_a_preset() -> None:
    data = seed003()
    del data["reference"]
    data["model"] = {"name": "my-70b", "num_params": 70.6e9, "num_layers": 80, "hidden_size": 8192,
                     "num_attention_heads": 64, "num_kv_heads": 8, "weights": "fp8"}
    custom = plan(parse_brief(data))
    assert custom.figure("memory.kv_bytes_per_token_per_gpu").value == 20 * 1024
    assert "model.kv_cache = fp8 (follows the weights)" in custom.assumptions
    assert "model.head_dim = 128 (hidden_size ÷ num_attention_heads)" in custom.assumptions


def test_every_default_taken_is_stated_with_its_source() -> None:
    data = seed003()
    del data["efficiency"]
    brief = parse_brief(data)
    assert "efficiency.achieved_bandwidth_fraction = 0.7 (seed 003)" in brief.defaults
    assert brief.factors.compute_dtype == "auto"   # resolved per GPU: fp8 matmuls for fp8 weights on H100
    assert plan(brief).figure("prefill.replica_flops").value == pytest.approx(8 * 1979e12 * 0.5)
