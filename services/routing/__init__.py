"""Routing service: claims accepted runs from the ledger, drives them on Triton replicas,
appends their sequenced events to the event log, and reaps runs whose driver died.

    claims.py    ledger statements (claim, lease, RUNNING, terminal bookkeeping)
    replicas.py  the replica registry (from config, editable over the Routing API)
    driver.py    one run on one replica: stream → coalesced events → terminal
    finish.py    terminal = settle in Postgres, then publish the TERMINAL event
    worker.py    the process: claim loop, lease keeper, cancel listener, reaper
    servicer.py  Routing gRPC API (ListReplicas, UpsertReplica, RemoveReplica, Explain)
"""
