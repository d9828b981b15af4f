"""Discrete-event fleet simulator: the engine core on a virtual clock, behind the shared router.

    from sluice.sim import FleetConfig, WorkloadConfig, run_fleet
    report = run_fleet(FleetConfig(), WorkloadConfig(), "prefix_aware")
    print(report.format())

`python -m sluice.sim --preset seed003` runs seed 003's fleet and prints the report.
"""

from sluice.sim.fleet import Fleet, FleetConfig, ReplicaRestart, SimReplica, run_fleet
from sluice.sim.metrics import SLO, Distribution, FleetReport, ReplicaSummary
from sluice.sim.workload import WorkloadConfig

__all__ = ["Fleet", "FleetConfig", "ReplicaRestart", "SimReplica", "run_fleet", "SLO", "Distribution",
           "FleetReport", "ReplicaSummary", "WorkloadConfig"]
