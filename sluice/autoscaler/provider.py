"""What the autoscaler acts on: a Provider starts, stops and lists one pool's replicas.

    local       sluice.autoscaler.local.LocalProcessProvider: `python -m sluice.replica.serve`
                processes on this host, with their real start-up time
    kubernetes  documented, not coded: deploy/k8s/README.md maps start/stop/list onto a
                Deployment's replica count (and a warm Deployment)

A provider knows processes, not routing: it never touches the replica registry. The autoscaler
(sluice.autoscaler.service) registers a started replica as warm, promotes it, drains it, and only
then asks the provider to stop it, so a provider's stop() is never the thing that ends a run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class ReplicaHandle:
    """A replica a provider started and that answers: what the registry needs to route to it."""

    name: str                   # unique in the registry (the provider chooses it)
    pool: str                   # model version served
    grpc_address: str           # Triton gRPC host:port
    metrics_url: str            # its Prometheus endpoint (KV use, engine queue)
    block_size: int             # KV tokens per block (the replica's metrics report it too)
    kv_capacity_blocks: int


class ProviderError(RuntimeError):
    """A replica could not be started (or stopped); the message says which and why."""


class Provider(Protocol):
    async def start(self, pool: str) -> ReplicaHandle:
        """Start one replica of `pool` and return once it is loaded and answers (the cold start);
        raises ProviderError when it cannot."""
        ...

    async def stop(self, name: str) -> None:
        """Stop the replica (it has no runs left: the autoscaler drained it). Idempotent."""
        ...

    def list(self, pool: str) -> list[ReplicaHandle]:
        """The replicas of `pool` this provider started that are still up (a crashed one is not)."""
        ...

    async def close(self) -> None:
        """Stop everything this provider still runs (process exit)."""
        ...
