"""Routing against its peers: every policy on every workload, side by side on the fleet simulator.

    .venv/bin/python -m bench.bench_routing                  # the whole suite (make bench-routing)
    .venv/bin/python -m bench.bench_routing --quick          # 2 workloads, short runs (a smoke check)
    .venv/bin/python -m bench.bench_routing --workloads rag,slow --loads 0.8

Policies: Sluice's round_robin, least_loaded and prefix_aware; the peers of
sluice/router/peers.py (SGLang's cache_aware, llm-d's default and precise
profiles, Dynamo's KV router); the oracle (Sluice's cost over each replica's
exact cache) as the reference.

Fleet: seed 003's 8 x Llama-3-70B FP8 TP8 on H100, with each replica's KV pool
cut to 30,000 blocks of 32 tokens (~1M tokens) so that caches compete (the full
pool, ~3.2M tokens, never evicts in two simulated minutes).

Workloads (fixed seeds, open-loop arrivals of new conversations):
  chat     multi-turn chat, 1,000-token system prompt, ~5 turns, 5 s think
  rag      256 shared 6,000-token documents (1.5M tokens: more than one replica's KV pool holds,
           less than the fleet's), one short question each, short answers
  agent    2,000-token tool preamble, ~12 steps of tool output (~400 tokens) and short calls, 2 s think
  bursty   chat shape, arrivals on for 15 s at twice the rate, off for 15 s
  restart  chat, replica r3 dies at 1/2 of the run (runs of at least 90 s) and comes back cold 10 s later
  slow     chat, replica r0's GPUs throttled to 60% (seed 000's slow replica)
Load: 50% and 80% of the fleet's capacity for that workload, capacity being the
oracle's highest completed request rate as the offered rate grows by 1.5x steps
until the fleet saturates: p95 TTFT past 2 s or completions under 80% of
arrivals (measured first, printed).

Every row runs once per workload seed (--seeds, default 11,12,13) and gives
the median of each figure over them, with the p95 TTFT's lowest-highest over
the seeds beside it: one draw's p95 moves by 10-20% with the arrivals alone.

Figures per row: prompt-cache hit rate, p95 TTFT, "late p95" (the p95 TTFT of
requests arriving in the second half of the measured window: rag's cold start,
256 documents x 6,000 tokens prefilled while questions keep arriving, is still
being worked off at the end of a short warm-up third, and its tail then decides
the whole window's p95 by the seed's luck: rag at 80%, 30 s, seed 12, p50 TTFT
330 ms in the first 2 s after warm-up, 9-16 ms from 2 s on), p95 ITL, goodput at seed
000's SLOs (TTFT <= 500 ms and TPOT <= 50 ms), load CoV (across replicas, of
the time-averaged running batch), and for restart the time until the fleet's
hit rate is back within 95% of its level before the restart; for slow, the
slow replica's share of requests against its fair share (its speed over the
fleet's total speed). A table per workload and load, a PNG per workload, and
the comparison of prefix_aware with the best peer. It never fails on a figure.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from sluice.engine.sampling import GeometricLength, LogNormalLength
from sluice.router.factory import make_policy
from sluice.router.peers import PEER_POLICIES, make_peer_policy
from sluice.router.policy import RoutingPolicy
from sluice.sim.fleet import Fleet, FleetConfig, ReplicaRestart
from sluice.sim.metrics import SLO, FleetReport
from sluice.sim.workload import WorkloadConfig

OURS = "prefix_aware"
SLUICE_POLICIES = ("round_robin", "least_loaded", OURS)
POLICIES = (*SLUICE_POLICIES, *PEER_POLICIES, "oracle")
SEED000_SLO = SLO(ttft_s=0.5, tpot_s=0.05)
KV_BLOCKS = 30_000
LOADS = (0.5, 0.8)
CAPACITY_GUESS_RPS = 150.0           # the capacity sweep's first offered rate
CAPACITY_STEP = 1.5
SATURATED_TTFT_S = 2.0               # p95 TTFT this far past seed 000's 500 ms SLO: the queue is growing
SATURATED_COMPLETION = 0.8
RESTART_REPLICA, RESTART_DOWN_S = 3, 10.0
# The restart happens at half the run, after a third of warm-up: under 90 s there are too few
# 5-second hit-rate windows before it for a baseline, or after it to see the recovery.
RESTART_MIN_DURATION_S = 90.0
SLOW_REPLICA, SLOW_SPEED = 0, 0.6
RECOVERED_AT = 0.95                  # of the hit rate before the restart
DEFAULT_SEEDS = (11, 12, 13)
MATCH_WITHIN = 0.95                  # ours / best peer at or above this on p95 TTFT and goodput: a match
TARGET_WIN = 0.20                    # beat the best peer by this much on at least two workloads


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    shape: WorkloadConfig            # duration, rate and seed are set per run
    fleet: FleetConfig


def _fleet(**changes: object) -> FleetConfig:
    base = FleetConfig()
    return replace(base, engine=replace(base.engine, num_blocks=KV_BLOCKS), **changes)  # type: ignore[arg-type]


# Think times are short so that a conversation's turns reach their steady rate within the warm-up third
# of a run (5 turns x (5 s think + the answer) ~ 40 s): the offered rate is then the rate asked for.
CHAT = WorkloadConfig(arrival="poisson", think_time_s=5.0, system_prompt_tokens=1000,
                      turns=GeometricLength(5.0))
WORKLOADS: dict[str, Workload] = {
    "chat": Workload("chat", CHAT, _fleet()),
    "rag": Workload("rag", WorkloadConfig(
        arrival="poisson", system_prompt_tokens=6000, num_system_prompts=256, turns=GeometricLength(1.0),
        user_tokens=LogNormalLength.from_mean_p95(40, 120),
        output_tokens=LogNormalLength.from_mean_p95(150, 400)),
        _fleet()),
    "agent": Workload("agent", WorkloadConfig(
        arrival="poisson", think_time_s=2.0, system_prompt_tokens=2000, turns=GeometricLength(12.0),
        user_tokens=LogNormalLength.from_mean_p95(400, 1500),
        output_tokens=LogNormalLength.from_mean_p95(120, 400)),
        _fleet()),
    "bursty": Workload("bursty", replace(CHAT, arrival="bursty", burst_on_s=15.0, burst_off_s=15.0),
                       _fleet()),
    "restart": Workload("restart", CHAT, _fleet()),
    "slow": Workload("slow", CHAT, _fleet(slow_replicas=((SLOW_REPLICA, SLOW_SPEED),))),
}


@dataclass(frozen=True, slots=True)
class Row:
    workload: str
    load: float
    policy: str
    offered: float                   # requests / s arriving in the measured window
    hit_rate: float
    ttft_p95_s: float
    itl_p95_s: float
    goodput: float                   # requests / s meeting seed 000's SLOs
    load_cov: float
    ttft_p95_range_s: tuple[float, float]  # lowest and highest p95 TTFT over the seeds
    ttft_late_p95_s: float           # p95 TTFT, second half of the measured window (FleetReport.ttft_late)
    recovery_s: float | None         # restart only; inf when never recovered
    slow_share: float | None         # slow only: share of requests routed to the slow replica
    fair_share: float | None
    seeds: int
    sim_s: float


def policy_for(name: str, fleet: Fleet) -> RoutingPolicy:
    if name in PEER_POLICIES:
        return make_peer_policy(name, cached_tokens=fleet.cached_tokens)
    return make_policy(name, cached_tokens=fleet.cached_tokens)


def run(workload: Workload, policy: str, request_rate: float, duration_s: float,
        seed: int = 11) -> FleetReport:
    shape = workload.shape
    # "bursty" arrives at its rate only half the time: twice the rate while on keeps the mean.
    duty = shape.burst_on_s / (shape.burst_on_s + shape.burst_off_s) if shape.arrival == "bursty" else 1.0
    config = replace(shape, duration_s=duration_s, warmup_s=duration_s / 3, seed=seed,
                     conversation_rate=request_rate / shape.turns.mean() / duty)
    fleet_config = workload.fleet
    if workload.name == "restart":
        fleet_config = replace(fleet_config, restarts=(
            ReplicaRestart(at_s=duration_s / 2, replica=RESTART_REPLICA, down_s=RESTART_DOWN_S),))
    fleet = Fleet(fleet_config, config)
    return fleet.run(policy_for(policy, fleet), SEED000_SLO)


def workload_duration(name: str, duration_s: float) -> float:
    """Simulated seconds of each of the workload's runs, its capacity sweep's included."""
    return max(duration_s, RESTART_MIN_DURATION_S) if name == "restart" else duration_s


@dataclass(frozen=True, slots=True)
class Capacity:
    requests_per_s: float            # the oracle's highest completed rate
    arrival_ratio: float             # offered rate measured / conversation-derived rate asked for (< 1:
                                     # conversations cut short by the context limit, turns still ramping)

    def rate_for(self, load: float) -> float:
        """The rate to ask for so that `load` x capacity is what arrives."""
        return load * self.requests_per_s / self.arrival_ratio


def capacity(workload: Workload, duration_s: float) -> Capacity:
    """The oracle's highest completed request rate over offered rates growing by CAPACITY_STEP until
    the fleet is saturated."""
    rate, best, ratio = CAPACITY_GUESS_RPS, 0.0, 0.0
    while True:
        report = run(workload, "oracle", rate, duration_s)
        print(f"  {workload.name} capacity sweep: asked {rate:.0f} req/s, {report.offered_rate:.1f} arrived "
              f"(ratio {report.offered_rate / rate:.3f}), {report.request_throughput:.1f} completed",
              flush=True)
        ratio = ratio or report.offered_rate / rate
        best = max(best, report.request_throughput)
        # Saturated: queues build (p95 TTFT past SATURATED_TTFT_S) or completions fall well short of
        # arrivals (a short window always ends with some runs in flight, hence not 0.9).
        saturated = (report.ttft.p95 > SATURATED_TTFT_S
                     or report.request_throughput < SATURATED_COMPLETION * report.offered_rate)
        if saturated or rate > 100 * CAPACITY_GUESS_RPS:
            return Capacity(best, ratio)
        rate *= CAPACITY_STEP


def coefficient_of_variation(values: Sequence[float]) -> float:
    mean = statistics.fmean(values)
    return statistics.pstdev(values) / mean if mean > 0 else 0.0


def recovery_time(report: FleetReport, restart_at: float, warmup_s: float) -> float:
    """Seconds from the restart until the windowed hit rate is back within RECOVERED_AT of its mean
    before the restart and stays there for two more windows; inf if it never is."""
    before = [hit for start, hit in report.hit_timeline if warmup_s <= start < restart_at - 5.0]
    if not before:
        return math.nan
    floor = RECOVERED_AT * statistics.fmean(before)
    after = [(start, hit) for start, hit in report.hit_timeline if start >= restart_at]
    for index, (start, _) in enumerate(after):
        if all(hit >= floor for _, hit in after[index:index + 3]):
            return start - restart_at
    return math.inf


def make_row(workload: Workload, load: float, policy: str, rate: float, duration_s: float,
             seeds: Sequence[int] = DEFAULT_SEEDS) -> Row:
    """The policy on `workload` once per seed (each seed draws other conversations and arrival
    times), every figure the median over the seeds. One seed's p95 TTFT moves by 10-20% with the
    arrival draw alone (agent at 50%: 58/63/61 ms for seeds 11/12/13), as much as the gaps between
    the better policies, so a verdict from one draw is a coin toss."""
    started = time.perf_counter()
    reports = [run(workload, policy, rate, duration_s, seed=seed) for seed in seeds]
    recovery = (statistics.median(recovery_time(report, duration_s / 2, duration_s / 3) for report in reports)
                if workload.name == "restart" else None)
    slow_share = fair = None
    if workload.fleet.slow_replicas:
        routed = [sum(report.per_replica[index].requests for report in reports)
                  for index in range(len(reports[0].per_replica))]
        slow_share = routed[SLOW_REPLICA] / sum(routed) if sum(routed) else 0.0
        speeds = [dict(workload.fleet.slow_replicas).get(index, 1.0) for index in range(len(routed))]
        fair = speeds[SLOW_REPLICA] / sum(speeds)
    ttfts = [report.ttft.p95 for report in reports]

    def median(figure: Callable[[FleetReport], float]) -> float:
        return statistics.median(figure(report) for report in reports)

    return Row(workload=workload.name, load=load, policy=policy,
               offered=median(lambda report: report.offered_rate),
               hit_rate=median(lambda report: report.cache_hit_rate),
               ttft_p95_s=statistics.median(ttfts), ttft_p95_range_s=(min(ttfts), max(ttfts)),
               ttft_late_p95_s=median(lambda report: report.ttft_late.p95),
               itl_p95_s=median(lambda report: report.itl.p95), goodput=median(lambda report: report.goodput),
               load_cov=median(lambda report: coefficient_of_variation(
                   [replica.mean_batch for replica in report.per_replica])),
               recovery_s=recovery, slow_share=slow_share, fair_share=fair, seeds=len(reports),
               sim_s=time.perf_counter() - started)


def format_row(row: Row, width: int) -> str:
    extra = ""
    if row.recovery_s is not None:
        if math.isnan(row.recovery_s):
            extra = "  no baseline before the restart"
        elif math.isfinite(row.recovery_s):
            extra = f"  hit recovered in {row.recovery_s:.0f} s"
        else:
            extra = "  never recovered"
    if row.slow_share is not None and row.fair_share is not None:
        extra = f"  slow replica {row.slow_share:.1%} of requests (fair {row.fair_share:.1%})"
    low, high = row.ttft_p95_range_s
    spread = f"{low * 1e3:.0f}-{high * 1e3:.0f}" if row.seeds > 1 else ""
    return (f"{row.policy:<{width}}{row.offered:>8.1f}{row.hit_rate:>8.1%}{row.ttft_p95_s * 1e3:>10.0f}ms"
            f"{spread:>10}{row.ttft_late_p95_s * 1e3:>8.0f}ms{row.itl_p95_s * 1e3:>8.1f}ms"
            f"{row.goodput:>9.1f}{row.load_cov:>8.3f}"
            f"{row.sim_s:>7.1f}{extra}")


def print_table(rows: Sequence[Row], workload: str, load: float, capacity_rps: float) -> None:
    width = max(len(p) for p in POLICIES) + 2
    print(f"\n{workload} at {load:.0%} of capacity ({capacity_rps:.1f} req/s measured with the oracle)")
    print(f"{'policy':<{width}}{'req/s':>8}{'hit':>8}{'TTFT p95':>12}{'(range)':>10}{'late p95':>10}"
          f"{'ITL p95':>10}"
          f"{'goodput':>9}{'CoV':>8}{'sim s':>7}")
    for row in rows:
        print(format_row(row, width), flush=True)


@dataclass(frozen=True, slots=True)
class Verdict:
    workload: str
    load: float
    best_peer: str
    ttft_ratio: float                # best peer's p95 TTFT / ours (> 1: ours is faster)
    goodput_ratio: float             # ours / best peer's goodput (> 1: ours serves more within SLO)
    late_ratio: float                # lowest late p95 TTFT among the peers / ours (not part of the verdict)

    @property
    def matches(self) -> bool:
        # Both figures: a policy that keeps goodput by letting its tail grow does not match.
        return self.ttft_ratio >= MATCH_WITHIN and self.goodput_ratio >= MATCH_WITHIN

    @property
    def wins(self) -> bool:
        return self.matches and (self.ttft_ratio >= 1 + TARGET_WIN or self.goodput_ratio >= 1 + TARGET_WIN)


def verdict(rows: Sequence[Row]) -> Verdict:
    """Ours against the best peer on each figure separately: the peer with the lowest p95 TTFT for
    the TTFT ratio, the one with the most goodput for the goodput ratio (the best peer by goodput
    alone once named a peer 40% slower than the fastest one as the one to beat)."""
    by_policy = {row.policy: row for row in rows}
    ours = by_policy[OURS]
    peers = [by_policy[name] for name in PEER_POLICIES if name in by_policy]
    fastest = min(peers, key=lambda row: (row.ttft_p95_s, -row.goodput))
    most = max(peers, key=lambda row: (row.goodput, -row.ttft_p95_s))
    best = fastest.policy if fastest is most else f"{fastest.policy}/{most.policy}"
    late = min(row.ttft_late_p95_s for row in peers)
    return Verdict(workload=ours.workload, load=ours.load, best_peer=best,
                   late_ratio=late / ours.ttft_late_p95_s if ours.ttft_late_p95_s > 0 else math.inf,
                   ttft_ratio=fastest.ttft_p95_s / ours.ttft_p95_s if ours.ttft_p95_s > 0 else math.inf,
                   goodput_ratio=ours.goodput / most.goodput if most.goodput > 0 else math.inf)


def print_verdicts(verdicts: Sequence[Verdict], rows: Sequence[Row]) -> None:
    print(f"\n{OURS} against the best peer on each figure (lowest p95 TTFT / most goodput):")
    for v in verdicts:
        state = "WINS" if v.wins else ("matches" if v.matches else "LOSES")
        print(f"  {v.workload:<8}{v.load:>4.0%}  best peer {v.best_peer:<32} "
              f"p95 TTFT peer/ours {v.ttft_ratio:6.2f}x  goodput ours/peer {v.goodput_ratio:5.2f}x  {state}"
              f"  (late p95 peer/ours {v.late_ratio:5.2f}x)")
    won = sorted({v.workload for v in verdicts if v.wins})
    lost = sorted({f"{v.workload}@{v.load:.0%}" for v in verdicts if not v.matches})
    print(f"  workloads won by >= {TARGET_WIN:.0%}: {', '.join(won) or 'none'} (target: at least two)")
    print(f"  workload/loads where a peer is ahead: {', '.join(lost) or 'none'}")
    slow = [row for row in rows if row.slow_share is not None and row.policy in SLUICE_POLICIES]
    for row in slow:
        fair = row.fair_share or 0.0
        mark = "within" if row.slow_share is not None and row.slow_share <= fair else "OVER"
        print(f"  slow replica, {row.policy:<13} at {row.load:.0%}: {row.slow_share:.1%} of requests, "
              f"fair share {fair:.1%} ({mark})")


def plot(rows: Sequence[Row], workload: str, out_dir: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  (matplotlib not installed: no plot)")
        return None
    chosen = [row for row in rows if row.workload == workload]
    loads = sorted({row.load for row in chosen})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    width = 0.8 / max(len(loads), 1)
    # Bars by policy name, so that a load missing some policy's row (--policies, a merged table)
    # leaves a gap under the right label instead of shifting the others.
    names = [name for name in POLICIES if any(row.policy == name for row in chosen)]
    for offset, load in enumerate(loads):
        at_load = [row for row in chosen if row.load == load]
        xs = [names.index(row.policy) + offset * width for row in at_load]
        panels: tuple[tuple[Callable[[Row], float], str], ...] = (
            (lambda row: row.ttft_p95_s * 1e3, "p95 TTFT (ms, log)"),
            (lambda row: row.goodput, "goodput (req/s within SLO)"),
            (lambda row: row.hit_rate * 100, "prompt cache hit rate (%)"))
        for axis, (value, title) in zip(axes, panels, strict=True):
            axis.bar(xs, [value(row) for row in at_load], width=width, label=f"{load:.0%} load")
            axis.set_title(title)
            axis.set_xticks([index + width * (len(loads) - 1) / 2 for index in range(len(names))])
            axis.set_xticklabels(names, rotation=40, ha="right", fontsize=8)
    axes[0].set_yscale("log")
    axes[0].legend()
    fig.suptitle(f"{workload}: Sluice's policies, its peers and the oracle (70B FP8 TP8 replicas, simulated)")
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"routing-{workload}.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--loads", default=",".join(str(load) for load in LOADS))
    parser.add_argument("--duration", type=float, default=120.0, help="simulated seconds per run")
    parser.add_argument("--replicas", type=int, default=8, help="replicas in the fleet (seed 003: 8)")
    parser.add_argument("--capacity", type=float, default=None,
                        help="skip the sweep: capacity (req/s) an earlier run measured for the workload")
    parser.add_argument("--arrival-ratio", type=float, default=1.0,
                        help="with --capacity: the arrival ratio that run printed (arrived / asked)")
    parser.add_argument("--seeds", default=",".join(str(seed) for seed in DEFAULT_SEEDS),
                        help="workload seeds per row; every figure is the median over them")
    parser.add_argument("--quick", action="store_true",
                        help="chat and slow only, 60 s runs, 80%% load, one seed")
    parser.add_argument("--plots", default=".sluice/bench/routing", help="folder for the PNGs ('' for none)")
    args = parser.parse_args(argv)
    if args.quick:
        args.workloads, args.duration, args.loads, args.seeds = "chat,slow", 60.0, "0.8", "11"
    policies = args.policies.split(",")
    seeds = [int(seed) for seed in args.seeds.split(",")]
    if OURS not in policies:
        policies.append(OURS)
    rows: list[Row] = []
    verdicts: list[Verdict] = []
    for name in args.workloads.split(","):
        workload = WORKLOADS[name]
        workload = replace(workload, fleet=replace(workload.fleet, replicas=args.replicas))
        duration = workload_duration(name, args.duration)
        # Capacity in runs as long as the rows' own: a longer run has more conversations mid-way
        # (restart's 90 s offered 181-185 requests/s at "80%" of a 162 measured in 30 s runs).
        measured = (Capacity(args.capacity, args.arrival_ratio) if args.capacity is not None
                    else capacity(workload, duration))
        for load in (float(value) for value in args.loads.split(",")):
            at_load = [make_row(workload, load, policy, measured.rate_for(load), duration, seeds)
                       for policy in policies]
            print_table(at_load, name, load, measured.requests_per_s)
            rows += at_load
            if any(row.policy in PEER_POLICIES for row in at_load):
                verdicts.append(verdict(at_load))
        if args.plots:
            path = plot(rows, name, Path(args.plots))
            if path is not None:
                print(f"  plot: {path}")
    if verdicts:
        print_verdicts(verdicts, rows)


if __name__ == "__main__":
    main()
