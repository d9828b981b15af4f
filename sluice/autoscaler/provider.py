"""What the autoscaler acts on: a Provider starts, stops and lists one pool's replicas.

    local       sluice.autoscaler.local.LocalProcessProvider: `python -m sluice.replica.serve`
                processes on this host, with their real start-up time
    kubernetes  sluice.autoscaler.k8s.KubernetesProvider: the pods of the pool's Deployment, scaled
                through its scale subresource (deploy/k8s/README.md)

A provider knows processes, not routing: it never touches the replica registry. The autoscaler
(sluice.autoscaler.service) registers a started replica as warm, promotes it, drains it, and only
then asks the provider to stop it, so a provider's stop() is never the thing that ends a run.
Replica names are `<pool>-as-<suffix>` (OWNED_INFIX): the autoscaler owns registry rows of that form.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from sluice.config import Settings
from sluice.config.settings import ReplicaSection

OWNED_INFIX = "-as-"               # a provider's replica names: <pool>-as-<suffix>
DEFAULT_KV_BLOCKS = 4096           # registered KV capacity when the pool's replica keys set no num_blocks


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
    # True when the replicas keep serving after the autoscaler exits (Kubernetes pods): its exit then
    # neither drains nor stops them, and its successor adopts them. False: they die with it.
    outlives_autoscaler: bool

    async def refresh(self, pool: str) -> None:
        """Read what list() and adopt() answer from (once per tick); nothing to read for local processes."""
        ...

    async def adopt(self, pool: str) -> list[ReplicaHandle]:
        """Replicas up and ready that this provider did not start (pods left by a previous autoscaler, or
        scaled by hand), held from now on like started ones."""
        ...

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


def replica_section(config: Settings, replica: Mapping[str, Any]) -> ReplicaSection:
    """The started replicas' [replica] settings: the pool's `replica = {…}` keys over the shared section."""
    return ReplicaSection.model_validate({**config.replica.model_dump(), **replica})
