"""`sluice plan BRIEF.yaml [--json]` (planner.cli.main): markdown with the arithmetic, JSON, exit codes."""

import json
from pathlib import Path

import pytest
import yaml

from sluice.planner.cli import EXIT_BAD_BRIEF, EXIT_MEETS, EXIT_MISSES, main
from sluice.planner.errors import UNKNOWN_MODEL_PRESET

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "briefs"
SEED003 = str(EXAMPLES / "seed003.yaml")


def test_markdown_shows_each_step_with_its_numbers_substituted(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([SEED003]) == EXIT_MEETS
    out = capsys.readouterr().out
    assert out.startswith("# Capacity plan: seed 003")
    assert "10,000 users × 0.08 = 800 sequences" in out
    # 8 × 989 TFLOP/s × 0.5 ÷ 141.2 GFLOP × 0.8 all-reduce = 179,309 tok/s of prefill.
    assert "66,667 ÷ 179,309 = 37.2%" in out
    assert "## Against seed 003's printed figures" in out


def test_json_carries_every_figure_with_its_formula(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([SEED003, "--json"]) == EXIT_MEETS
    data = json.loads(capsys.readouterr().out)
    figures = {f["key"]: f for section in data["sections"] for f in section["figures"]}
    assert figures["demand.generating_sequences"]["value"] == pytest.approx(800)
    assert figures["demand.generating_sequences"]["formula"] == "10,000 users × 0.08 = 800 sequences"
    assert data["gpus"] == 64 and data["meets_slo"] is True
    assert {s["name"] for s in data["engine_config"]} == {
        "max_num_seqs", "max_num_tokens", "max_model_len", "memory_fraction"}


def test_a_fleet_with_no_replica_left_is_null_in_json_not_infinity(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = yaml.safe_load((EXAMPLES / "seed003.yaml").read_text())
    del data["reference"]
    data["sizing"]["gpus"] = 8
    brief = tmp_path / "one-node.yaml"
    brief.write_text(yaml.safe_dump(data))
    assert main([str(brief), "--json"]) == EXIT_MISSES
    rows = {row["key"]: row for row in json.loads(capsys.readouterr().out)["scenarios"]}
    assert rows["one_node_lost"]["utilization"] is None
    assert rows["one_node_lost"]["verdict"] == "overloaded"


def test_a_bad_brief_exits_2_with_the_field_on_stderr(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = yaml.safe_load((EXAMPLES / "seed003.yaml").read_text())
    data["model"]["preset"] = "gpt-5"
    brief = tmp_path / "bad.yaml"
    brief.write_text(yaml.safe_dump(data))
    assert main([str(brief)]) == EXIT_BAD_BRIEF
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("sluice plan: " + UNKNOWN_MODEL_PRESET.format(
        field="model.preset", value="gpt-5", known="")[:-1])


def test_a_missing_brief_file_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["/nonexistent/brief.yaml"]) == EXIT_BAD_BRIEF
    assert "cannot read /nonexistent/brief.yaml" in capsys.readouterr().err
