"""A tenant's GPU-memory budget: a cap on the KV tokens its running runs hold at once.

A run holds, from the moment a routing worker claims it until it ends, KV for at most its prompt
plus its output cap (the worst case it can grow to), on whichever replica it runs. The cap bounds
the sum over the tenant's claimed, unfinished runs across the whole pool (seed 002: "tenant cost,
token, latency and GPU-memory budgets"):

    held(tenant) = Σ (input_tokens + max_output_tokens) over its QUEUED and RUNNING runs
    a run may be claimed only if held(tenant) + its own kv_tokens <= kv_token_budget

It is enforced at dispatch, not at admission: a run over the cap is admitted (its token budget
reserved), then waits ACCEPTED until the tenant's earlier runs finish, and is claimed within its
deadline; a run whose deadline passes while it waits ends EXPIRED saying so. A run larger than the
whole cap could never be claimed, so admission refuses it (RESOURCE_EXHAUSTED, the cap that fits).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


def kv_tokens(input_tokens: int, max_output_tokens: int) -> int:
    """The KV tokens a run may hold at its largest: prompt + output cap."""
    return input_tokens + max_output_tokens


def never_fits(needed: int, budget: int | None) -> bool:
    """True when a run of `needed` KV tokens exceeds the tenant's whole budget (None: no cap)."""
    return budget is not None and needed > budget


@dataclass(frozen=True, slots=True)
class Candidate:
    """A waiting run a routing worker might claim, in claim order."""

    key: str                     # the run id
    tenant: str
    kv_tokens: int


def claimable(candidates: Sequence[Candidate], held: Mapping[str, int],
              budgets: Mapping[str, int | None]) -> list[str]:
    """The keys of `candidates` that fit their tenant's budget when taken in order.

    Each one taken adds its KV tokens to its tenant's held total, so a later one of the same tenant
    sees them. One that does not fit waits, and so do the tenant's later runs in this pass: a
    tenant's runs start in their claim order, so a large run is never starved by smaller ones that
    would keep slipping past it. Tenants missing from `budgets` (or None) have no cap.
    """
    taken: list[str] = []
    holding = dict(held)
    blocked: set[str] = set()
    for run in candidates:
        budget = budgets.get(run.tenant)
        now = holding.get(run.tenant, 0)
        if run.tenant in blocked or (budget is not None and now + run.kv_tokens > budget):
            blocked.add(run.tenant)
            continue
        holding[run.tenant] = now + run.kv_tokens
        taken.append(run.key)
    return taken
