"""Seed 000's traffic step on the simulator: the autoscaler with and without a warm pool.

    .venv/bin/python -m bench.bench_autoscaler            # make bench-autoscaler: x2 and x3 (~4 min CPU)
    .venv/bin/python -m bench.bench_autoscaler --quick    # shorter, smaller
    .venv/bin/python -m bench.bench_autoscaler --scenarios 3:60 --warm-pools 2,1,0

"Traffic doubles in five minutes: the autoscaler is a minute behind, the warm pool absorbs the first
step, and beyond that the gateway rejects with a retry-after." (seed 000)

Fleet: seed 000's replicas, Llama-3-70B bf16 on 8 x H100 (TP8), cold start 90 s (weights and warm-
up; "a minute or more"), promotion of a warm replica 5 s. Workload: chat with seed 000's shape
(1,000-token system prompt, ~500-token messages, ~300-token answers, 45 s to read and type), new
conversations Poisson at ~24 requests/s, doubling linearly over five minutes from t = 300 s
(scenario "2:300"), then tripling over one minute (scenario "3:60": a step faster than a cold start,
which a warm pool absorbs or the gateway sheds). Each
replica takes 16 sequences (max_num_seqs): that keeps the simulation cheap on a small machine and
scales every count down together; the shape (the scaler a cold start behind, the warm pool absorbing
the first step, shedding beyond it) does not depend on it. The control loop
(sluice/autoscaler/control.py) runs every 5 s on 30 s windows; the gateway sheds when the predicted
queue wait passes 5 s. Each configuration starts with the replicas the base load needs and runs to
900 s; each scenario prints a table (p95 TTFT per minute, serving replicas, runs shed) and writes a
PNG (the first to --plot, the others beside it as autoscaler-x3.png, ...).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from sluice.autoscaler.control import ScalerConfig
from sluice.engine.profiles import get_hardware, get_model
from sluice.engine.sampling import GeometricLength, LogNormalLength
from sluice.engine.types import EngineConfig
from sluice.router.factory import make_policy
from sluice.sim.fleet import Fleet, FleetConfig
from sluice.sim.metrics import FleetReport
from sluice.sim.scaling import Autoscaling
from sluice.sim.workload import WorkloadConfig

SLOTS = 16                     # replica slots (GPU nodes) the pool may use
BASE_SERVING = 5
COLD_START_S = 90.0
MINUTE = 60.0
DEFAULT_SCENARIOS = "2:300,3:60"


@dataclass(frozen=True, slots=True)
class Scenario:
    duration_s: float = 900.0
    ramp_start_s: float = 300.0
    ramp_s: float = 300.0
    conversations_per_s: float = 6.0        # ~24 req/s: what 5 replicas serve at 3/4 of 16 sequences each
    step: float = 2.0                       # the traffic multiplies by this over the ramp


def fleet(warm_pool: int) -> FleetConfig:
    scaler = ScalerConfig(runs_per_replica=16, min_replicas=BASE_SERVING, max_replicas=SLOTS,
                          warm_pool=warm_pool, target_utilization=0.75, scale_in_utilization=0.4,
                          cold_start_s=COLD_START_S,
                          scale_out_cooldown_s=15.0, scale_in_cooldown_s=180.0)
    return FleetConfig(
        replicas=SLOTS, model=get_model("llama-3-70b", weights="bf16", kv="bf16"),
        hardware=get_hardware("h100-sxm"), tp=8,
        engine=EngineConfig(block_size=32, max_num_seqs=16, max_num_tokens=4096, stream_tokens=False),
        autoscaling=Autoscaling(scaler=scaler, initial_serving=BASE_SERVING, initial_warm=warm_pool,
                                shed_queue_wait_s=5.0))


def workload(scenario: Scenario) -> WorkloadConfig:
    return WorkloadConfig(
        duration_s=scenario.duration_s, arrival="poisson", conversation_rate=scenario.conversations_per_s,
        think_time_s=45.0, turns=GeometricLength(4.0), system_prompt_tokens=1000,
        user_tokens=LogNormalLength.from_mean_p95(500, 1500),
        output_tokens=LogNormalLength.from_mean_p95(300, 900),
        ramp_factor=scenario.step, ramp_start_s=scenario.ramp_start_s, ramp_s=scenario.ramp_s,
        warmup_s=120.0, seed=5)


def run(scenario: Scenario, warm_pool: int) -> FleetReport:
    simulated = Fleet(fleet(warm_pool), workload(scenario))
    return simulated.run(make_policy("prefix_aware"))


def per_minute(report: FleetReport) -> list[tuple[float, float, int, int]]:
    """(minute start, worst p95 TTFT of its ticks, most serving replicas, runs shed) per minute."""
    minutes: dict[int, list[tuple[float, int, int]]] = {}
    for sample in report.scaling:
        minutes.setdefault(int(sample.at_s // MINUTE), []).append(
            (sample.ttft_p95_s, sample.serving, sample.shed_in_interval))
    rows = []
    for minute in sorted(minutes):
        ticks = minutes[minute]
        ttfts = [ttft for ttft, _, _ in ticks if not math.isnan(ttft)]
        rows.append((minute * MINUTE, max(ttfts) if ttfts else math.nan, max(s for _, s, _ in ticks),
                     sum(shed for _, _, shed in ticks)))
    return rows


def print_comparison(reports: dict[int, FleetReport], scenario: Scenario) -> None:
    print(f"\nTraffic x{scenario.step:g} from t = {scenario.ramp_start_s:.0f} s over "
          f"{scenario.ramp_s:.0f} s; cold "
          f"start {COLD_START_S:.0f} s. Per minute: worst p95 TTFT (30 s windows), serving replicas, "
          "runs shed")
    header = "minute" + "".join(f"   warm pool {pool}: p95 TTFT  serving  shed" for pool in reports)
    print(header)
    columns = {pool: per_minute(report) for pool, report in reports.items()}
    for index in range(max(len(rows) for rows in columns.values())):
        line = ""
        for rows in columns.values():
            if index < len(rows):
                _, ttft, serving, shed = rows[index]
                line += f"   {'':>12}{ttft * 1e3:>9.0f} ms {serving:>8} {shed:>5}"
        minute = next(rows[index][0] for rows in columns.values() if index < len(rows))
        print(f"{minute / MINUTE:>6.0f}{line}")
    for pool, report in reports.items():
        after = [sample.ttft_p95_s for sample in report.scaling
                 if sample.at_s >= scenario.ramp_start_s and not math.isnan(sample.ttft_p95_s)]
        peak = max(after) if after else math.nan
        print(f"warm pool {pool}: peak p95 TTFT after the step {peak * 1e3:,.0f} ms, {report.requests_shed} "
              f"runs shed with a retry-after, {report.requests_interrupted} interrupted, p95 TTFT overall "
              f"{report.ttft.p95 * 1e3:,.0f} ms, goodput {report.goodput:.1f} req/s")


def plot(reports: dict[int, FleetReport], scenario: Scenario, out: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ttft_axis, serving_axis, shed_axis) = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    for pool, report in reports.items():
        times = [sample.at_s for sample in report.scaling]
        ttft_axis.plot(times, [sample.ttft_p95_s * 1e3 for sample in report.scaling],
                       label=f"warm pool {pool}")
        serving_axis.step(times, [sample.serving for sample in report.scaling], where="post",
                          label=f"serving, warm pool {pool}")
        shed_axis.step(times, [sample.shed_in_interval for sample in report.scaling], where="post",
                       label=f"warm pool {pool}: {report.requests_shed:,} in all")
    ttft_axis.set_yscale("log")
    ttft_axis.set_ylabel("p95 TTFT, last 30 s (ms)")
    ttft_axis.axhline(500, color="grey", linestyle="--", linewidth=0.8)
    ttft_axis.legend()
    serving_axis.set_ylabel("serving replicas")
    serving_axis.legend()
    shed_axis.set_ylabel("runs shed per 5 s\n(retry-after)")
    ramp_end = scenario.ramp_start_s + scenario.ramp_s
    shed_axis.set_xlabel(f"simulated seconds (traffic x{scenario.step:g} from "
                         f"{scenario.ramp_start_s:.0f} s to {ramp_end:.0f} s)")
    shed_axis.legend()
    fig.suptitle(f"Seed 000: traffic x{scenario.step:g} in {scenario.ramp_s:.0f} s, 70B bf16 TP8, "
                 f"cold start {COLD_START_S:.0f} s")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def parse_scenarios(text: str, base: Scenario) -> list[Scenario]:
    """"2:300,3:60" -> traffic x2 over 300 s, then x3 over 60 s (both from base.ramp_start_s)."""
    scenarios = []
    for item in text.split(","):
        step, _, ramp = item.partition(":")
        scenarios.append(replace(base, step=float(step), ramp_s=float(ramp) if ramp else base.ramp_s))
    return scenarios


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="600 s, ramp from 120 s over 240 s")
    parser.add_argument("--warm-pools", default="2,0")
    parser.add_argument("--scenarios", default=DEFAULT_SCENARIOS,
                        help="STEP:RAMP_S,... traffic multiplied by STEP over RAMP_S seconds (seed 000: "
                             "x2 over 300 s; x3 over 60 s: a step past what the warm pool absorbs)")
    parser.add_argument("--plot", default=".sluice/bench/autoscaler.png",
                        help="PNG path; each scenario after the first gets -xSTEP before the suffix")
    args = parser.parse_args(argv)
    quick = replace(Scenario(), duration_s=600.0, ramp_start_s=120.0, ramp_s=240.0)
    for index, scenario in enumerate(parse_scenarios(args.scenarios, quick if args.quick else Scenario())):
        reports = {}
        for pool in (int(value) for value in args.warm_pools.split(",")):
            reports[pool] = run(scenario, pool)
            print(f"  x{scenario.step:g} over {scenario.ramp_s:.0f} s, warm pool {pool}: simulated in "
                  f"{reports[pool].sim_cpu_s:.0f} s CPU", flush=True)
        print_comparison(reports, scenario)
        out = Path(args.plot)
        if index:
            out = out.with_name(f"{out.stem}-x{scenario.step:g}{out.suffix}")
        if args.plot and (path := plot(reports, scenario, out)) is not None:
            print(f"plot: {path}")


if __name__ == "__main__":
    main()
