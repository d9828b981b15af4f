"""`sluice plan BRIEF --report plan.html`: a one-page design report with the plots, rendered in
headless Chromium (Debian package `chromium`; skipped, saying why, where it is not installed)."""

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from sluice.planner import load_brief, plan
from sluice.planner.cli import EXIT_MEETS, main
from sluice.planner.report import CURVE_RGB, SIM_RGB, SimPoint, to_html

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "briefs"
SECTIONS = ("Fleet architecture", "Utilization and p95 latency against load", "SLO budget",
            "Configuration, with reasons", "Failure table", "Critical dependencies", "Validation plan")
SMALL = """name: small 8B chat
model: {preset: llama-3-8b}
hardware: {preset: h100-sxm, gpus_per_node: 1, price_per_gpu_hour: 2.5}
sizing: {mode: fixed_budget, gpus: 2}
demand: {users: 200, read_and_type_s: 20, generation_tok_per_s: 40}
workload: {input_tokens: {mean: 600, p95: 1500}, output_tokens: {mean: 150, p95: 400}, prefix_hit_rate: 0.5}
slo: {ttft_p95_ms: 500, itl_p95_ms: 50}
"""


def test_the_report_has_every_section_and_three_plots_with_the_simulators_points() -> None:
    result = plan(load_brief(EXAMPLES / "seed003.yaml"))
    html = to_html(result, [SimPoint(1.0, 0.9, 0.3, 0.02), SimPoint(1.5, 0.95, 0.45, 0.03)])
    assert all(f"<h2>{title}</h2>" in html for title in SECTIONS)
    for plot in ("plot-utilization", "plot-ttft", "plot-itl", "architecture"):
        assert f'id="{plot}"' in html
    assert html.count('class="curve"') == 3 and html.count('class="sim"') == 3 * 2
    assert "<script" not in html   # self-contained, prints to PDF as is
    # The curves are the per-replica model: at 1× the utilization is the plan's own.
    at_today = next(p for p in result.curves if p.traffic == 1.0)
    assert at_today.utilization == pytest.approx(result.figure("utilization.total").value)


def _pixels_near(image: Any, rgb: tuple[int, int, int], tolerance: int = 40) -> int:
    return sum(count for count, pixel in image.getcolors(1 << 24)
               if all(abs(pixel[i] - rgb[i]) <= tolerance for i in range(3)))


def test_chromium_renders_the_plots_and_the_simulators_points(tmp_path: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("headless render needs Debian's `chromium` package (apt-get install chromium); "
                    "not installed on this machine")
    brief, report, shot = tmp_path / "small.yaml", tmp_path / "plan.html", tmp_path / "plan.png"
    brief.write_text(SMALL)
    assert main([str(brief), "--simulate", "--sim-seconds", "20", "--sim-loads", "0.5,1,1.5",
                 "--report", str(report)]) == EXIT_MEETS
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--screenshot={shot}", "--window-size=1050,800", report.as_uri()],
                   check=True, capture_output=True, timeout=120)
    image = Image.open(shot).convert("RGB")
    plots = image.crop((0, 250, 1050, 460))   # the plots' band, below the architecture
    # Three 2-px curves over ~250 px each, and 3 × 3 dots of radius 4 (~40 px each).
    assert _pixels_near(plots, CURVE_RGB) > 3 * 200
    assert _pixels_near(plots, SIM_RGB) > 9 * 25
    assert _pixels_near(image.crop((0, 0, 1050, 250)), CURVE_RGB) == 0   # nothing above the plots
