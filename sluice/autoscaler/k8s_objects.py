"""The Kubernetes objects the kubernetes provider reads, as frozen records. Pure: JSON in, records out.

    Scale   apps/v1 Deployment's scale subresource (an autoscaling/v1 Scale): spec.replicas is what
            the autoscaler sets, status.selector the label selector of the Deployment's pods
    Pod     core/v1 Pod: its IP, whether it is Ready (the readiness probe: Triton's /v2/health/ready,
            so Ready = engine loaded), whether it is on its way out

A pod is `alive` until it is terminating (deletionTimestamp set) or its phase is final; it is
`usable` (a replica that answers) when alive, Ready and given an IP.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The ReplicaSet controller, scaling down, removes the pod with the lowest cost among pods of equal
# readiness (KEP-2255; beta and on by default since Kubernetes 1.22). The annotation is an int32.
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
MIN_DELETION_COST = -(2**31)
FINAL_PHASES = ("Succeeded", "Failed")


@dataclass(frozen=True, slots=True)
class Scale:
    replicas: int               # spec.replicas: the pods the Deployment wants
    selector: str               # status.selector: its pods' label selector ("" until reported)
    resource_version: str       # optimistic concurrency: a patch carrying an older one gets 409

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> Scale:
        return cls(replicas=int(body.get("spec", {}).get("replicas") or 0),
                   selector=str(body.get("status", {}).get("selector") or ""),
                   resource_version=str(body["metadata"]["resourceVersion"]))


@dataclass(frozen=True, slots=True)
class Pod:
    name: str
    ip: str                     # status.podIP ("" until the pod is scheduled and started)
    ready: bool                 # condition Ready is True
    terminating: bool           # metadata.deletionTimestamp is set
    phase: str                  # Pending | Running | Succeeded | Failed | Unknown
    created: str                # metadata.creationTimestamp (RFC 3339 UTC: sorts as text)
    deletion_cost: int | None   # the pod-deletion-cost annotation, None when absent

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> Pod:
        metadata, status = body["metadata"], body.get("status", {})
        conditions = status.get("conditions") or []
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
        cost = (metadata.get("annotations") or {}).get(DELETION_COST)
        return cls(name=str(metadata["name"]), ip=str(status.get("podIP") or ""), ready=ready,
                   terminating=metadata.get("deletionTimestamp") is not None,
                   phase=str(status.get("phase") or "Pending"),
                   created=str(metadata.get("creationTimestamp") or ""),
                   deletion_cost=None if cost is None else int(cost))

    @property
    def alive(self) -> bool:
        return not self.terminating and self.phase not in FINAL_PHASES

    @property
    def usable(self) -> bool:
        return self.alive and self.ready and bool(self.ip)


def pods_of(body: Mapping[str, Any]) -> list[Pod]:
    """A PodList's pods, oldest first (the order in which unheld pods are taken)."""
    return sorted((Pod.of(item) for item in body.get("items") or []), key=lambda pod: (pod.created, pod.name))
