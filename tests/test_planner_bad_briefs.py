"""No brief crashes the planner: every field of seed 003's brief replaced by odd values gives a plan
(exit 0 or 1) or one error naming a field (exit 2), never a traceback; and the checks the issue
names (YAML syntax, heads ÷ TP, KV heads ≤ heads, precision on the GPU, turn ≥ answer)."""

from pathlib import Path
from typing import Any

import pytest
import yaml

from sluice.planner import BriefError, parse_brief, plan
from sluice.planner.cli import EXIT_BAD_BRIEF, EXIT_MEETS, EXIT_MISSES, main
from sluice.planner.errors import (
    KV_HEADS_ABOVE_HEADS,
    PRECISION_NOT_ON_GPU,
    TP_SPLITS_HEADS,
    TURN_SHORTER_THAN_ANSWER,
)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "briefs"
ODD_VALUES: tuple[object, ...] = (0, 1e-12, 1e30, "x")


def seed003() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((EXAMPLES / "seed003.yaml").read_text())
    del data["reference"]
    return data


def error_for(data: dict[str, Any]) -> BriefError:
    with pytest.raises(BriefError) as caught:
        plan(parse_brief(data))
    return caught.value


def leaf_paths(data: object, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if isinstance(data, dict):
        return [path for key, value in data.items() for path in leaf_paths(value, prefix + (key,))]
    return [prefix]


def replaced(data: dict[str, Any], path: tuple[str, ...], value: object) -> dict[str, Any]:
    copy: dict[str, Any] = yaml.safe_load(yaml.safe_dump(data))
    node = copy
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return copy


def test_a_yaml_syntax_error_exits_2_naming_the_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    brief = tmp_path / "broken.yaml"
    brief.write_text("name: x\nmodel: {preset: llama-3-70b\nhardware: [\n")
    assert main([str(brief)]) == EXIT_BAD_BRIEF
    err = capsys.readouterr().err
    assert err.startswith("sluice plan: brief is not valid YAML:") and "line" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("text", ["", "just text", "- a\n- list\n", "\xff\xfe"])
def test_a_file_that_is_not_a_mapping_of_sections_exits_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str) -> None:
    brief = tmp_path / "odd.yaml"
    brief.write_bytes(text.encode("latin-1"))
    assert main([str(brief)]) == EXIT_BAD_BRIEF
    assert capsys.readouterr().err.startswith("sluice plan: brief ")


def test_tp_6_does_not_split_32_heads_and_8_kv_heads() -> None:
    data = seed003()
    data["model"] = {"name": "custom-8b", "num_params": 8.03e9, "num_layers": 32, "hidden_size": 4096,
                     "num_attention_heads": 32, "num_kv_heads": 8, "weights": "fp8"}
    data["hardware"]["gpus_per_node"] = 6
    data["sizing"].update(gpus=48, tp=6)
    error = error_for(data)
    # Divisors of a 6-GPU node that divide 32 heads and split or replicate 8 KV heads: 1 and 2.
    assert (error.field, str(error)) == ("sizing.tp", TP_SPLITS_HEADS.format(
        field="sizing.tp", value=6, heads=32, kv_heads=8, known="1, 2"))


def test_more_kv_heads_than_heads_is_refused() -> None:
    data = seed003()
    data["model"] = {"name": "odd", "num_params": 8e9, "num_layers": 32, "hidden_size": 4096,
                     "num_attention_heads": 32, "num_kv_heads": 64}
    error = error_for(data)
    assert (error.field, str(error)) == ("model.num_kv_heads", KV_HEADS_ABOVE_HEADS.format(
        field="model.num_kv_heads", value=64, heads=32))


def test_fp8_weights_on_an_a100_are_refused() -> None:
    data = seed003()
    data["hardware"]["preset"] = "a100-80g"
    del data["efficiency"]["compute_dtype"]
    error = error_for(data)
    assert (error.field, str(error)) == ("model.weights", PRECISION_NOT_ON_GPU.format(
        field="model.weights", hardware="a100-80g", value="fp8", known="bf16, fp16, int8, int4"))


def test_a_turn_shorter_than_its_answer_is_refused() -> None:
    data = seed003()
    data["demand"]["turn_period_s"] = 10   # the answer is 350 tokens at 25 tok/s = 14 s
    error = error_for(data)
    assert (error.field, str(error)) == ("demand.turn_period_s", TURN_SHORTER_THAN_ANSWER.format(
        field="demand.turn_period_s", value=10, answer=14.0, tokens=350, rate=25))


def test_every_field_replaced_by_an_odd_value_plans_or_names_a_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = seed003()
    brief = tmp_path / "odd.yaml"
    outcomes: dict[int, int] = {}
    for path in leaf_paths(base):
        for value in ODD_VALUES:
            brief.write_text(yaml.safe_dump(replaced(base, path, value)))
            code = main([str(brief), "--json"])
            captured = capsys.readouterr()
            assert code in (EXIT_MEETS, EXIT_MISSES, EXIT_BAD_BRIEF), (path, value)
            if code == EXIT_BAD_BRIEF:
                assert captured.err.startswith("sluice plan: brief"), (path, value, captured.err)
            outcomes[code] = outcomes.get(code, 0) + 1
    assert outcomes[EXIT_BAD_BRIEF] > 0 and outcomes[EXIT_MEETS] + outcomes.get(EXIT_MISSES, 0) > 0


def test_70b_fp8_on_one_h100_is_refused_with_tp2_even_when_simulating(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = seed003()
    data["sizing"].update(gpus=1, tp=1)
    brief = tmp_path / "one-gpu.yaml"
    brief.write_text(yaml.safe_dump(data))
    # 0.9 × 80 GB = 72 GB: 70.6 GB of FP8 weights + 5 GB reserve leave no KV; at TP 2, 35.3 + 5 do.
    assert main([str(brief), "--simulate", "--sim-seconds", "5"]) == EXIT_BAD_BRIEF
    err = capsys.readouterr().err
    assert "smallest TP that fits is 2" in err and "Traceback" not in err


def test_simulate_skips_a_fleet_no_count_of_replicas_can_size(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = seed003()
    data["model"]["preset"] = "llama-3.1-405b"    # bf16 matmuls: no count of TP8 replicas meets 40 ms ITL
    data["sizing"] = {"mode": "users"}
    brief = tmp_path / "huge.yaml"
    brief.write_text(yaml.safe_dump(data))
    assert main([str(brief), "--simulate", "--sim-seconds", "5"]) == EXIT_MISSES
    err = capsys.readouterr().err
    assert "--simulate skipped" in err and "Traceback" not in err
