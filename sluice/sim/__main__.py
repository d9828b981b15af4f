"""python -m sluice.sim --preset seed003 [--policy NAME] [--duration S] [--users N] [--replicas N]
[--seed N] [--host-tier]"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace

from sluice.sim.fleet import run_fleet
from sluice.sim.presets import PRESETS, get_preset


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sluice.sim",
                                     description="Simulate a fleet of engine replicas.")
    parser.add_argument("--preset", default="seed003", choices=sorted(PRESETS))
    parser.add_argument("--policy", help="routing policy (round_robin, least_loaded, prefix_aware, oracle)")
    parser.add_argument("--duration", type=float, help="simulated seconds")
    parser.add_argument("--users", type=int, help="concurrent users (closed loop)")
    parser.add_argument("--replicas", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--host-tier", action="store_true",
                        help="give every replica the host-memory KV tier of its GPU profile")
    args = parser.parse_args(argv)
    preset = get_preset(args.preset)
    workload, fleet = preset.workload, preset.fleet
    if args.duration is not None:
        warmup = min(workload.warmup_s, args.duration / 10)
        workload = replace(workload, duration_s=args.duration, warmup_s=warmup)
    if args.users is not None:
        workload = replace(workload, users=args.users)
    if args.seed is not None:
        workload = replace(workload, seed=args.seed)
    if args.replicas is not None:
        fleet = replace(fleet, replicas=args.replicas)
    if args.host_tier:
        fleet = replace(fleet, engine=replace(fleet.engine, host_num_blocks=None))
    report = run_fleet(fleet, workload, args.policy or preset.policy, slo=preset.slo)
    print(report.format())


if __name__ == "__main__":
    main()
