"""`--simulate`: the planned fleet on the fleet simulator, beside the analytical figures.

A small brief (Llama-3-8B, 2 × H100 at TP1, 200 users, 30 simulated seconds) keeps
each run to about a second of CPU.
"""

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from sluice.planner import Plan, parse_brief, plan
from sluice.planner.cli import EXIT_MEETS, main
from sluice.planner.render import to_markdown
from sluice.planner.simulate import sim_inputs, simulate


def small_brief() -> dict[str, Any]:
    return {
        "name": "small 8B chat",
        "model": {"preset": "llama-3-8b"},
        "hardware": {"preset": "h100-sxm", "gpus_per_node": 1, "price_per_gpu_hour": 2.5},
        "sizing": {"mode": "fixed_budget", "gpus": 2},
        "demand": {"users": 200, "read_and_type_s": 20, "generation_tok_per_s": 40},
        "workload": {"input_tokens": {"mean": 600, "p95": 1500}, "output_tokens": {"mean": 150, "p95": 400},
                     "prefix_hit_rate": 0.5},
        "slo": {"ttft_p95_ms": 500, "itl_p95_ms": 50},
    }


@pytest.fixture(scope="module")
def small() -> tuple[Any, Plan]:
    brief = parse_brief(small_brief())
    return brief, plan(brief)


def test_the_workload_reproduces_the_briefs_mean_input_and_hit_rate(small: tuple[Any, Plan]) -> None:
    brief, result = small
    setup = sim_inputs(brief, result, seconds=30)
    new, system, turns = setup.new_tokens, setup.system_prompt, setup.mean_turns
    assert new == pytest.approx(300)                        # 600 × (1 − 0.5)
    assert system == 300                                    # min(cacheable 300, 400)
    assert turns == pytest.approx(1.0)                      # nothing left for history
    assert system + (turns - 1) * (new + 150) + new == pytest.approx(600)
    assert setup.think_time_s == 20
    assert setup.fleet.replicas == 2 and setup.fleet.tp == 1
    assert setup.fleet.engine.max_num_seqs == result.setting("max_num_seqs").value
    assert setup.fleet.efficiency.fixed_overhead_s == pytest.approx(0.003)   # the plan's scheduling budget


def test_history_supplies_what_the_system_prompt_cannot() -> None:
    data = small_brief()
    data["workload"]["prefix_hit_rate"] = 0.78
    data["workload"]["input_tokens"] = {"mean": 1200, "p95": 3000}
    data["workload"]["output_tokens"] = {"mean": 350, "p95": 1200}
    brief = parse_brief(data)
    setup = sim_inputs(brief, plan(brief), seconds=30)
    cacheable = 1200 - setup.new_tokens
    assert setup.system_prompt == 400
    assert setup.system_prompt + (setup.mean_turns - 1) * (setup.new_tokens + 350) == pytest.approx(cacheable)


def test_simulation_sets_p95_ttft_itl_and_busy_time_beside_the_analytical_figures(
        small: tuple[Any, Plan]) -> None:
    brief, result = small
    lines: list[str] = []
    simulation = simulate(brief, result, seconds=30, progress=lines.append)
    assert lines[0].startswith("simulating 30 s of peak traffic: 200 users on 2 × TP1 replicas")
    assert lines[1].startswith("simulated in ")
    labels = [figure.label for figure in simulation.figures]
    assert "p95 TTFT end to end (+ fixed network, gateway, tokenization, SSE)" in labels
    assert "p95 ITL" in labels
    by_label = {figure.label: figure for figure in simulation.figures}
    assert by_label["p95 ITL"].simulated > 0
    assert by_label["p95 TTFT end to end (+ fixed network, gateway, tokenization, SSE)"].simulated > 0.049
    assert simulation.requests > 0
    assert simulation.slo_holds
    markdown = to_markdown(replace(result, simulation=simulation))
    assert "**SLO holds** in simulation" in markdown


def test_cli_simulate_prints_progress_and_the_simulation_section(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    brief = tmp_path / "small.yaml"
    brief.write_text(yaml.safe_dump(small_brief()))
    assert main([str(brief), "--simulate", "--sim-seconds", "20"]) == EXIT_MEETS
    captured = capsys.readouterr()
    assert "simulating 20 s of peak traffic" in captured.err
    assert "## Simulation (" in captured.out
