"""PostgreSQL NOTIFY channels the ledger's writers emit, named once for every listener.

A notification is a wake-up hint only: it is delivered at COMMIT (never for a rolled-back
transaction) and lost while a listener reconnects, so listeners still poll the ledger as the
fallback and never take a payload as the state itself.
"""

from __future__ import annotations

# Admission, in the Submit transaction that commits a NEW run (never for a deduplicated retry or a
# refusal). Payload: the model's worker_pool, so a routing worker may ignore pools it does not serve.
RUNS_ACCEPTED_CHANNEL = "sluice_runs_accepted"
