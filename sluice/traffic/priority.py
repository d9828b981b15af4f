"""Priority classes and the headroom rule batch work is dispatched under.

Two classes, chosen per request and permitted per tenant:

    interactive   the default; claimed first, shed last
    batch         offline work (seed 003: "run batch/offline workloads in the trough"); admitted against
                  its own backlog, claimed only after every interactive run waiting for the same claim,
                  and only while the pool has headroom; the first class shed; may carry a deadline of
                  hours

Headroom is what lets batch fill a trough without touching interactive latency: a batch run is
dispatched only while the pool's queue depth, KV utilization and batch-slot use are all below their
thresholds. Below them an interactive arrival finds a free slot and free KV blocks at the replica's
next step, so the batch runs already running slow its steps a little but never make it wait for one
of them to finish.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class Priority(enum.StrEnum):
    """A run's class; stored as TEXT in runs.priority."""

    INTERACTIVE = "interactive"
    BATCH = "batch"


@dataclass(frozen=True, slots=True)
class Headroom:
    """Thresholds a pool must be strictly below for a batch run to be dispatched ([traffic])."""

    max_queue_depth: float = 1.0          # requests waiting per serving replica (1.0: nothing waits)
    max_kv_utilization: float = 0.7       # used / total KV blocks over the pool
    max_slot_utilization: float = 0.1     # (running + waiting) / batch slots over the pool (where known)

    def __post_init__(self) -> None:
        if self.max_queue_depth <= 0:
            raise ValueError(f"batch max_queue_depth must be positive (got {self.max_queue_depth})")
        for name in ("max_kv_utilization", "max_slot_utilization"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"batch {name} must be in (0, 1] (got {value})")


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One serving replica's load as the host last saw it."""

    waiting: int                          # queued at the replica, not yet admitted to its batch
    running: int                          # in its running batch
    kv_used_blocks: int
    kv_capacity_blocks: int
    max_slots: int = 0                    # its batch slot limit (0: not reported)


@dataclass(frozen=True, slots=True)
class PoolLoad:
    """A pool's load summed over its serving replicas."""

    replicas: int
    waiting: int
    running: int
    kv_used_blocks: int
    kv_capacity_blocks: int
    slots: int                            # 0: no replica reported its slot limit

    @classmethod
    def of(cls, loads: Sequence[ReplicaLoad]) -> PoolLoad:
        return cls(replicas=len(loads), waiting=sum(x.waiting for x in loads),
                   running=sum(x.running for x in loads),
                   kv_used_blocks=sum(x.kv_used_blocks for x in loads),
                   kv_capacity_blocks=sum(x.kv_capacity_blocks for x in loads),
                   slots=sum(x.max_slots for x in loads) if all(x.max_slots for x in loads) else 0)

    @property
    def queue_depth(self) -> float:
        """Requests waiting per serving replica."""
        return self.waiting / self.replicas if self.replicas else 0.0

    @property
    def kv_utilization(self) -> float:
        return self.kv_used_blocks / self.kv_capacity_blocks if self.kv_capacity_blocks else 0.0

    @property
    def slot_utilization(self) -> float:
        """(running + waiting) / slots: what will hold a batch slot at the replicas' next steps (a run
        just sent is still waiting; counting only the running ones would let each burst overshoot)."""
        return (self.running + self.waiting) / self.slots if self.slots else 0.0


def has_headroom(pool: PoolLoad, headroom: Headroom) -> bool:
    """May a batch run be dispatched to this pool now? No serving replica: no."""
    if pool.replicas == 0:
        return False
    return (pool.queue_depth < headroom.max_queue_depth
            and pool.kv_utilization < headroom.max_kv_utilization
            and pool.slot_utilization < headroom.max_slot_utilization)
