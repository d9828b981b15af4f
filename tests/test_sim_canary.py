"""The simulator replays a canary with the live platform's split and guardrails (sim/canary.py):
a slower candidate trips the guardrail and the split goes to 0; an equal one keeps its share."""

from __future__ import annotations

from dataclasses import replace

from sluice.sim.canary import CanaryReplay
from sluice.sim.fleet import run_fleet
from sluice.sim.metrics import FleetReport
from sluice.sim.presets import get_preset
from sluice.traffic.canary import Verdict


def replay(speed: float, duration_s: float = 60.0) -> FleetReport:
    """The 'small' preset on 4 replicas, the last one the candidate at `speed` of the baseline's GPU."""
    preset = get_preset("small")
    fleet = replace(preset.fleet, replicas=4, slow_replicas=((3, speed),) if speed < 1 else (),
                    canary=CanaryReplay(candidate_replicas=(3,), share_bp=2_000))
    workload = replace(preset.workload, duration_s=duration_s, warmup_s=5.0, users=600)
    return run_fleet(fleet, workload, "least_loaded", slo=preset.slo)


def test_a_slower_candidate_trips_the_guardrail_and_the_split_goes_to_0():
    outcome = replay(speed=0.5).canary
    assert outcome is not None and outcome.rolled_back_at_s is not None
    breach = next(tick for tick in outcome.ticks if tick.verdict is Verdict.BREACH)
    assert breach.at_s == outcome.rolled_back_at_s
    assert breach.candidate_runs >= 50 and breach.baseline_runs >= 50      # the minimum samples
    assert "vs baseline" in outcome.reason
    # Before the breach the split held its share; from it on, no guard pass finds it above 0.
    assert all(tick.share_bp == 2_000 for tick in outcome.ticks if tick.at_s < breach.at_s)
    assert all(tick.share_bp == 0 for tick in outcome.ticks if tick.at_s >= breach.at_s)


def test_an_equal_candidate_keeps_its_share_and_gets_about_a_fifth_of_the_turns():
    outcome = replay(speed=1.0).canary
    assert outcome is not None and outcome.rolled_back_at_s is None
    assert {tick.verdict for tick in outcome.ticks} <= {Verdict.HOLD, Verdict.PASS}
    assert Verdict.PASS in {tick.verdict for tick in outcome.ticks}
    share = outcome.routed_candidate / (outcome.routed_candidate + outcome.routed_baseline)
    assert 0.1 < share < 0.3, share     # conversations split 20%; turns follow their conversations
