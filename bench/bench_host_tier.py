"""Seed 003's fleet with and without the host-memory KV tier: multi-turn chat, 3-minute think times.

    .venv/bin/python -m bench.bench_host_tier            # make bench-host-tier (~ several minutes)
    .venv/bin/python -m bench.bench_host_tier --quick    # 2 replicas, a quarter of the users

"Host memory offload lets a paused session come back without a re-prefill" (seed 000). A chat user
reads and types for ~3 minutes between turns; meanwhile other conversations push the session's
blocks out of the GPU pool. Without the tier they are dropped and the next turn prefills its whole
history again; with it they wait in host memory and come back over PCIe at ~56x less than their
prefill (engine.cost_model, "Host tier").

Fleet: seed 003's (8 x H100 TP8 nodes, Llama-3-70B FP8 weights and KV, max_num_seqs 160, 2,048-token
steps, 32-token blocks; sim.presets), the prefix_aware router. Host tier: the GPU profile's (DGX H100:
2 TB for 8 GPUs, half pinned for KV: 6.25M tokens a replica against 2.84M in HBM), PCIe Gen5.

Two workloads, each run without and with the tier:
- seed 003: 10,000 users, the brief's lengths (mean input 1,200 with history), think 180 s. Its
  verdict says memory is not the constraint, and this shows how much that holds for the cache.
- long histories: the same users with 5x longer messages (mean 600 tokens, p95 2,000) and 6
  turns on average, so live histories pass the fleet's HBM and the GPU pool must evict.
The table gives the cache hit rate (cached / prompt tokens), prompt tokens prefilled per second,
TTFT p50 / p95 / p99, and the host tier's traffic (blocks onboarded, admissions that hit it).
The simulated fleet starts with cold caches, so the default runs 30 minutes (ten thinks): in the
first ten the GPU pools are still filling and the tier has nothing to hold.

Measured (--quick: 2 replicas, 2,500 users, seed 003's users per replica; 1,800 s; 13 min wall on
a loaded 2-core machine):

    workload        host tier  hit rate  prefill tok/s  TTFT p50  p95    p99    onboarded  host hits
    seed 003              off     82.8%          2,839      13ms  28ms   74ms           0          0
    seed 003               on     84.2%          2,613      13ms  25ms   66ms      13,930        362
    long histories        off     64.2%         11,663      21ms  149ms  197ms          0          0
    long histories         on     77.3%          7,457      17ms  89ms   164ms    228,957      2,520
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, replace

from sluice.engine.sampling import GeometricLength, LogNormalLength
from sluice.router.factory import make_policy
from sluice.sim.fleet import Fleet, FleetConfig
from sluice.sim.metrics import FleetReport
from sluice.sim.presets import get_preset
from sluice.sim.workload import WorkloadConfig

THINK_S = 180.0


@dataclass(frozen=True, slots=True)
class Row:
    workload: str
    tier: bool
    report: FleetReport
    onboarded_blocks: int
    host_hits: int
    prefilled_tok_per_s: float


def run(name: str, fleet: FleetConfig, workload: WorkloadConfig, tier: bool) -> Row:
    engine = replace(fleet.engine, host_num_blocks=None if tier else 0)
    sim = Fleet(replace(fleet, engine=engine), workload)
    preset = get_preset("seed003")
    report = sim.run(make_policy("prefix_aware"), preset.slo)
    kv = [replica.engine.stats().kv for replica in sim.replicas]
    prefilled = report.mean_input_tokens * (1.0 - report.cache_hit_rate) * report.request_throughput
    return Row(name, tier, report, sum(s.blocks_onboarded for s in kv), sum(s.host_tier_hits for s in kv),
               prefilled)


def workloads(users: int, duration_s: float) -> list[tuple[str, WorkloadConfig]]:
    base = replace(get_preset("seed003").workload, users=users, think_time_s=THINK_S, duration_s=duration_s,
                   warmup_s=min(60.0, duration_s / 10))
    long = replace(base, user_tokens=LogNormalLength.from_mean_p95(600, 2000), turns=GeometricLength(6.0))
    return [("seed 003", base), ("long histories", long)]


def format_rows(rows: Sequence[Row]) -> str:
    lines = [f"{'workload':<16}{'host tier':>10}{'hit rate':>10}{'prefill tok/s':>15}{'TTFT p50':>10}"
             f"{'p95':>9}{'p99':>9}{'onboarded':>11}{'host hits':>11}{'completed':>11}"]
    for row in rows:
        r = row.report
        lines.append(f"{row.workload:<16}{'on' if row.tier else 'off':>10}{r.cache_hit_rate:>10.1%}"
                     f"{row.prefilled_tok_per_s:>15,.0f}{r.ttft.p50 * 1e3:>8.0f}ms{r.ttft.p95 * 1e3:>7.0f}ms"
                     f"{r.ttft.p99 * 1e3:>7.0f}ms{row.onboarded_blocks:>11,}{row.host_hits:>11,}"
                     f"{r.requests_completed:>11,}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_host_tier",
                                     description="seed 003's chat with and without the host KV tier")
    parser.add_argument("--quick", action="store_true", help="2 replicas and 2,500 users (seed 003's ratio)")
    parser.add_argument("--duration", type=float, default=1800.0,
                        help="simulated seconds (the fleet starts cold: the tier matters once HBM is full)")
    args = parser.parse_args(argv)
    fleet = get_preset("seed003").fleet
    users = 10_000
    if args.quick:
        fleet, users = replace(fleet, replicas=2), 2_500
    rows = [run(name, fleet, workload, tier)
            for name, workload in workloads(users, args.duration) for tier in (False, True)]
    print(f"seed 003's fleet ({fleet.replicas} x {fleet.tp} x {fleet.hardware.name}), {users:,} users, "
          f"think {THINK_S:.0f} s, {args.duration:.0f} s simulated, prefix_aware")
    print(format_rows(rows))


if __name__ == "__main__":
    main()
