"""The planner's KV-tier section on seed 003's brief, worked out by hand.

Seed 003: 10,000 users, 800 generating, 4,000 tokens of context each, 8 replicas of 8 × H100 (one
spare: 7 serve), Llama-3-70B with FP8 KV (20 KiB a token per GPU), 78% expected prefix hit rate.
"""

from pathlib import Path

import pytest

from sluice.planner import load_brief, plan

SEED003 = Path(__file__).resolve().parents[1] / "examples" / "briefs" / "seed003.yaml"
KV_PER_TOKEN_PER_GPU = 320 * 1024 / 2 / 8                            # 20 KiB
POOL_TOKENS = int((80e9 * 0.9 - 70.6e9 / 8 - 5e9) // KV_PER_TOKEN_PER_GPU)
HOST_TOKENS = int(256e9 * 0.5 // KV_PER_TOKEN_PER_GPU)               # DGX H100: 2 TB over 8 GPUs
IDLE = (10_000 - 800) / 7 * 4000
ROOM = POOL_TOKENS - 800 / 7 * 4000


def test_seed003_needs_the_host_tier_to_keep_every_paused_history() -> None:
    result = plan(load_brief(SEED003))
    figure = result.figure
    assert figure("kv_tier.idle_history_tokens").value == pytest.approx(IDLE)
    assert figure("kv_tier.gpu_room_tokens").value == pytest.approx(ROOM)
    assert figure("kv_tier.host_tokens").value == HOST_TOKENS
    on_gpu = ROOM / IDLE                                               # ~45%: HBM alone keeps under half
    assert figure("kv_tier.on_gpu").value == pytest.approx(on_gpu)
    assert figure("kv_tier.in_host").value == pytest.approx(1 - on_gpu)    # the host tier holds the rest
    assert figure("kv_tier.hit_rate_without").value == pytest.approx(0.78 * on_gpu)
    assert figure("kv_tier.hit_rate_with").value == pytest.approx(0.78)
    # 4,000 tokens back over PCIe Gen5 at 80% of 64 GB/s.
    assert figure("kv_tier.onboard_s").value == pytest.approx(4000 * KV_PER_TOKEN_PER_GPU / (64e9 * 0.8))
