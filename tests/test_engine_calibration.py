"""The engine core, at the cost model's default efficiency factors, reproduces TensorRT-LLM's
published max-throughput output tok/s (perf overview, FP8, H100 SXM) within ±10%.

The expected values are the published figures themselves; the prediction runs the engine
core on trtllm-bench's scenario (identical requests all queued at once). Out-of-sample rows
(H200, 405B, other lengths) are printed by `python -m sluice.planner.calibration`.
"""

import pytest

from sluice.planner.calibration import FITTED, TOLERANCE, PublishedRow, predict


@pytest.mark.parametrize("row", FITTED, ids=lambda r: f"{r.model}-tp{r.tp}-{r.isl}/{r.osl}")
def test_published_max_throughput_within_10_percent(row: PublishedRow) -> None:
    got = predict(row)
    print(f"\n{row.model} {row.hardware} TP{row.tp} {row.isl}/{row.osl}: published {row.tok_per_s:,.0f} "
          f"tok/s, predicted {got.tok_per_s:,.0f}, ratio {got.ratio:.3f}")
    assert abs(got.ratio - 1) <= TOLERANCE
