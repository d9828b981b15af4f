"""PostgreSQL NOTIFY channels the ledger's writers emit, named once for every listener.

A notification is a wake-up hint only: it is delivered at COMMIT (never for a rolled-back
transaction) and lost while a listener reconnects, so listeners still poll the ledger as the
fallback and never take a payload as the state itself.
"""

from __future__ import annotations

# Admission, in the Submit transaction that commits a NEW run (never for a deduplicated retry or a
# refusal). Payload: the model's worker_pool, so a routing worker may ignore pools it does not serve.
RUNS_ACCEPTED_CHANNEL = "sluice_runs_accepted"

# Runs.Cancel, in the transaction that records a cancel intent. Payload: the run id.
CANCEL_CHANNEL = "sluice_run_cancel"    # NOTIFY payload: the run id whose cancel was requested
# The routing worker, when a run's event-log start is recorded. Payload: the run id.
EVENTS_CHANNEL = "sluice_run_events"    # NOTIFY payload: a run id whose event-log start was recorded
# The Admin API, in the transaction that writes a row of the durable replica registry. Payload: the
# replica's name. Routing processes re-read the registry (services/routing/registry_sync.py).
REPLICAS_CHANNEL = "sluice_replicas_changed"
