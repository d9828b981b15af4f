"""Priority classes and the degradation ladder on the fleet simulator (issue 14 points 4 and 6).

    python -m bench.bench_traffic [--quick]      (make bench-traffic)

1. Trough filling (seed 003: "run batch/offline workloads in the trough"). Two replicas of
   Llama-3-8B bf16 on one H100 each (64 batch slots), interactive chat at a trough rate, once alone
   and once with an unlimited batch backlog (200-token prompts, 1,000-token outputs) dispatched only
   under the headroom rule, for several batch-slot thresholds. Printed for each: interactive p95 and
   p50 TTFT with and without batch and the change, interactive p95 TPOT, batch output tokens/s
   added, mean running batch per step. The same seed drives both runs; interactive figures count
   interactive requests only.

2. A traffic step (seed 000: "traffic doubles in five minutes"; here 12x over 60 s, past what the
   pool serves) with a batch stream: the ladder's steps in the order they are first taken, how
   often each acted, and the last shed's retry-after from the measured drain rate beside what the
   configured rate alone would have said.

Figures, not assertions: nothing here fails on a number.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time

from sluice.engine.profiles import get_model
from sluice.engine.types import EngineConfig
from sluice.sim.fleet import FleetConfig, run_fleet
from sluice.sim.metrics import FleetReport
from sluice.sim.traffic import BatchWork, LadderSim, TrafficPolicy, ladder_for
from sluice.sim.workload import WorkloadConfig
from sluice.traffic.ladder import retry_after_ms
from sluice.traffic.priority import Headroom

TROUGH_RATE = 1.5          # new conversations / s (~3.5 requests running per replica: a trough)
SLOT_THRESHOLDS = (0.1, 0.25, 0.5)
CONFIGURED_DRAIN = 50.0    # [admission].pool_drain_runs_per_s


def trough_fleet(slots: int = 64) -> FleetConfig:
    return FleetConfig(replicas=2, tp=1, model=get_model("llama-3-8b"),
                       engine=EngineConfig(block_size=32, max_num_seqs=slots, max_num_tokens=2048,
                                           stream_tokens=False))


def trough_workload(duration_s: float, seed: int) -> WorkloadConfig:
    return WorkloadConfig(duration_s=duration_s, arrival="poisson", conversation_rate=TROUGH_RATE,
                          think_time_s=20.0, warmup_s=30.0, model_version="llama-3-8b", seed=seed)


def with_batch(fleet: FleetConfig, slot_threshold: float) -> FleetConfig:
    batch = BatchWork(backlog=1_000_000, prompt_tokens=200, output_tokens=1_000,
                      headroom=Headroom(max_slot_utilization=slot_threshold))
    return dataclasses.replace(fleet, traffic=TrafficPolicy(batch=batch))


def mean_batch(report: FleetReport) -> float:
    return sum(r.mean_batch for r in report.per_replica) / len(report.per_replica)


def change(after: float, before: float) -> str:
    return f"{(after / before - 1) * 100:+.1f}%" if before > 0 and not math.isnan(after) else "n/a"


def trough(duration_s: float, seeds: tuple[int, ...]) -> None:
    print(f"\n## 1. Trough filling: 2 x Llama-3-8B/H100, {TROUGH_RATE} conversations/s, "
          f"{duration_s:.0f} simulated s, seeds {seeds}")
    print("batch slots | seed | TTFT p95 alone -> with batch (change) | TTFT p50 alone -> with | "
          "TPOT p95 alone -> with | batch tok/s | interactive tok/s | mean batch alone -> with | sim s")
    fleet = trough_fleet()
    alone = {seed: run_fleet(fleet, trough_workload(duration_s, seed), "round_robin") for seed in seeds}
    for threshold in SLOT_THRESHOLDS:
        for seed in seeds:
            started = time.process_time()
            base = alone[seed]
            filled = run_fleet(with_batch(fleet, threshold), trough_workload(duration_s, seed),
                               "round_robin")
            traffic = filled.traffic
            assert traffic is not None
            print(f"{threshold:>11.2f} | {seed:>4} | {base.ttft.p95 * 1e3:6.1f} -> "
                  f"{filled.ttft.p95 * 1e3:6.1f} ms ({change(filled.ttft.p95, base.ttft.p95)}) | "
                  f"{base.ttft.p50 * 1e3:5.1f} -> {filled.ttft.p50 * 1e3:5.1f} ms | "
                  f"{base.tpot.p95 * 1e3:4.1f} -> {filled.tpot.p95 * 1e3:4.1f} ms"
                  f" | {traffic.batch_output_tokens / filled.duration_s:8.0f} | "
                  f"{base.output_token_throughput:8.0f} | "
                  f"{mean_batch(base):4.1f} -> {mean_batch(filled):4.1f}"
                  f" | {time.process_time() - started:5.1f}", flush=True)


def traffic_step(duration_s: float) -> None:
    fleet = dataclasses.replace(
        trough_fleet(slots=16),
        traffic=TrafficPolicy(
            batch=BatchWork(backlog=0, rate_per_s=1.0, prompt_tokens=200, output_tokens=1_000,
                            headroom=Headroom(max_slot_utilization=0.25)),
            ladder=LadderSim(ladder_for(120, CONFIGURED_DRAIN), fallback_share=0.5)))
    workload = WorkloadConfig(duration_s=duration_s, arrival="poisson", conversation_rate=1.0,
                              ramp_factor=12.0, ramp_start_s=30.0, ramp_s=60.0, think_time_s=20.0,
                              model_version="llama-3-8b", seed=3)
    report = run_fleet(fleet, workload, "round_robin")
    traffic = report.traffic
    assert traffic is not None
    thresholds = ladder_for(120, CONFIGURED_DRAIN)
    print("\n## 2. Traffic step: 2 x Llama-3-8B/H100 (16 slots), 1 -> 12 conversations/s over 60 s from"
          f" t=30 s, batch 1/s; ladder at interactive backlog {thresholds.shed_batch_backlog} (shed batch), "
          f"{thresholds.fallback_backlog} (fallbacks, half the tenants permit one), "
          f"{thresholds.shed_backlog} (shed interactive)")
    print("step              first taken at")
    for label, at in traffic.steps_first_at:
        print(f"{label:<17} {at:7.1f} s")
    print("actions: " + ", ".join(f"{label} {count}" for label, count in traffic.actions))
    configured = retry_after_ms(thresholds.shed_backlog, CONFIGURED_DRAIN, thresholds.max_retry_after_ms)
    print(f"last shed: retry-after {traffic.last_retry_after_ms} ms from the "
          f"{'measured' if traffic.last_drain_measured else 'configured'} drain rate "
          f"(the configured {CONFIGURED_DRAIN:g} runs/s alone would say {configured} ms for "
          f"{thresholds.shed_backlog})")
    print(f"batch: {traffic.batch_submitted} submitted, {traffic.batch_shed} shed, {traffic.batch_completed} "
          f"completed, {traffic.batch_waiting_at_end} still waiting; dispatched past a waiting interactive "
          f"request: {traffic.batch_dispatched_past_interactive}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="shorter runs, one seed")
    args = parser.parse_args(argv)
    if args.quick:
        trough(150.0, (3,))
        traffic_step(150.0)
    else:
        trough(240.0, (3, 4))
        traffic_step(180.0)


if __name__ == "__main__":
    main()
