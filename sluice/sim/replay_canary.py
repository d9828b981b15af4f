"""python -m sluice.sim.replay_canary [--speed F] [--share PCT] [--duration S]: a canary replayed on
the simulator (sluice/sim/canary.py), its guard passes printed as a table."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace

from sluice.sim.canary import CanaryReplay
from sluice.sim.fleet import run_fleet
from sluice.sim.presets import get_preset


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sluice.sim.replay_canary",
                                     description="Replay a canary on the simulator (the 'small' preset, "
                                                 "4 replicas: the last is the candidate).")
    parser.add_argument("--speed", type=float, default=0.6,
                        help="the candidate replica's GPU speed, a fraction of the baseline's (default 0.6)")
    parser.add_argument("--share", type=float, default=20.0, help="percent of conversations (default 20)")
    parser.add_argument("--duration", type=float, default=180.0, help="simulated seconds")
    args = parser.parse_args(argv)
    preset = get_preset("small")
    fleet = replace(preset.fleet, replicas=4, slow_replicas=((3, args.speed),) if args.speed < 1 else (),
                    canary=CanaryReplay(candidate_replicas=(3,), share_bp=round(args.share * 100)))
    workload = replace(preset.workload, duration_s=args.duration, users=600)
    report = run_fleet(fleet, workload, "least_loaded", slo=preset.slo)
    assert report.canary is not None
    print(report.canary.format())


if __name__ == "__main__":
    main()
