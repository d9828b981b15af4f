"""Suite-wide fixtures: the real-server fixtures live in tests/support and are registered here once.

- tests.support.db: a fresh migrated PostgreSQL database per test (template migrated once)
- tests.support.ledger_services: Admission + Usage served in-process on a free port
- tests.support.routing_stack: real Triton replicas, the Kafka event log and routing workers
- tests.support.edge_stack: the HTTP edge served over the routing stack
- tests.support.chaos: the fault suite's invariants and the table `make chaos` prints
- tests.support.admin_services: a gateway with the Admin API and an admin-scoped key
"""

import os

pytest_plugins = [
    "tests.support.db",
    "tests.support.ledger_services",
    "tests.support.routing_stack",
    "tests.support.edge_stack",
    "tests.support.chaos",
    "tests.support.admin_services",
]

if os.environ.get("SLUICE_TEST_GRPC_SERVER") == "h2":
    # Every in-process gRPC server the suite builds through grpc.aio.server() is then served by
    # services/h2server.py instead (TLS tests excepted: it serves plaintext only). With
    # SLUICE_GATEWAY__GRPC_SERVER=h2 the gateway processes tests start do the same.
    import grpc.aio
    from sluice.services.h2server import H2Server

    grpc.aio.server = lambda *args, **kwargs: H2Server(  # type: ignore[assignment]
        reuse_port=bool(dict(kwargs.get("options") or ()).get("grpc.so_reuseport", 0)))
