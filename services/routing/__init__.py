"""Routing service: claims accepted runs from the ledger, drives them on Triton replicas,
appends their sequenced events to the event log, and reaps runs whose driver died.

    claims.py    ledger statements (claim, lease, RUNNING, terminal bookkeeping)
    app.py       a routing process assembled from config (+ tracing, /metrics, gc.freeze)
    driver.py    one run: stream → coalesced events → terminal; retried elsewhere before its first token
    early_call.py  a routed run's replica call, sent while its claim commits, held until its driver takes it
    finish.py    terminal = settle in Postgres, then publish the TERMINAL event
    worker.py    the process: claim loop, lease keeper, cancel listener, reaper, replica scrapes
    observability.py  its Prometheus metrics and span attributes (services/telemetry.py: the plumbing)
    servicer.py  Routing gRPC API (ListReplicas, UpsertReplica, RemoveReplica, Explain)
"""
