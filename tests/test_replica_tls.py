"""TLS on the gateway/worker -> Triton hop ([replica_tls]): a real replica serving gRPC with a
certificate refuses a plaintext client and serves a run to a client that verifies it with the CA.
The certificates come from tests/support/pki.py (openssl)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from sluice.services import replica_client
from sluice.services.main import replica_credentials

from sluice.config import load_settings
from sluice.config.settings import ReplicaTlsSection, env_overrides
from sluice.replica.serve import ERR_PLAINTEXT_OFF_LOOPBACK, StartupError, settings_from_config
from tests.support.replica_proc import ReplicaProcess, start_replica, stop_replica
from tests.support.routing_stack import REPLICA_SETTINGS

pytest_plugins = ["tests.support.pki"]

TOKENS = 5


@pytest.fixture(scope="module")
def tls_replica(pki: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplicaProcess]:
    env = env_overrides("replica_tls", {"cert_file": str(pki / "server.pem"),
                                        "key_file": str(pki / "server.key")})
    replica = start_replica("tls", tmp_path_factory.mktemp("replica-tls"), REPLICA_SETTINGS, extra_env=env)
    yield replica
    stop_replica(replica)


@pytest.fixture(scope="module")
def mutual_tls_replica(pki: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplicaProcess]:
    env = env_overrides("replica_tls", {"cert_file": str(pki / "server.pem"),
                                        "key_file": str(pki / "server.key"),
                                        "client_ca_file": str(pki / "ca.pem")})
    replica = start_replica("mtls", tmp_path_factory.mktemp("replica-mtls"), REPLICA_SETTINGS, extra_env=env)
    yield replica
    stop_replica(replica)


@pytest.fixture
async def plaintext_afterwards() -> Iterator[None]:
    yield
    replica_client.use_tls(None)
    await replica_client.close_channels()


async def generate(address: str) -> list[int]:
    tokens: list[int] = []
    async for chunk in replica_client.stream_generate(address, "tls-run", [5, 6, 7], TOKENS,
                                                      first_token_timeout_s=10):
        tokens.extend(chunk.token_ids)
    return tokens


@pytest.mark.integration
async def test_a_tls_replica_refuses_plaintext_and_serves_a_run_with_the_ca(
        tls_replica: ReplicaProcess, pki: Path, plaintext_afterwards: None):
    address = tls_replica.grpc_address
    replica_client.use_tls(None)
    assert not await replica_client.is_ready(address, timeout_s=3)
    with pytest.raises(replica_client.ReplicaError):
        await generate(address)
    await replica_client.close_channels()

    replica_client.use_tls(replica_credentials(ReplicaTlsSection(ca_file=str(pki / "ca.pem"))))
    assert await replica_client.is_ready(address, timeout_s=10)
    assert len(await generate(address)) == TOKENS


@pytest.mark.integration
async def test_a_mutual_tls_replica_serves_only_a_client_with_a_certificate_the_ca_signed(
        mutual_tls_replica: ReplicaProcess, pki: Path, plaintext_afterwards: None):
    address = mutual_tls_replica.grpc_address
    replica_client.use_tls(replica_credentials(ReplicaTlsSection(ca_file=str(pki / "ca.pem"))))
    assert not await replica_client.is_ready(address, timeout_s=3)
    await replica_client.close_channels()

    replica_client.use_tls(replica_credentials(ReplicaTlsSection(
        ca_file=str(pki / "ca.pem"), client_cert_file=str(pki / "client.pem"),
        client_key_file=str(pki / "client.key"))))
    assert await replica_client.is_ready(address, timeout_s=10)
    assert len(await generate(address)) == TOKENS


def test_replica_credentials_follow_the_section(pki: Path):
    assert replica_credentials(ReplicaTlsSection()) is None
    assert isinstance(replica_credentials(ReplicaTlsSection(ca_file=str(pki / "ca.pem"))),
                      grpc.ChannelCredentials)
    with pytest.raises(ValueError, match="client_cert_file needs replica_tls.ca_file"):
        ReplicaTlsSection(client_cert_file="c.pem", client_key_file="c.key")


def test_a_replica_refuses_plaintext_off_loopback_unless_accepted():
    entry = {"name": "r9", "pool": "p", "grpc_address": "10.0.0.9:18001", "http_port": 1, "metrics_port": 2}
    config = load_settings().updated(replicas=[entry])
    with pytest.raises(StartupError) as refused:
        settings_from_config(config, "r9")
    assert str(refused.value) == ERR_PLAINTEXT_OFF_LOOPBACK.format(address="10.0.0.9:18001")
    accepted = settings_from_config(config.updated(tls={"plaintext_off_loopback": True}), "r9")
    assert accepted.tls == {}
    tls = {"cert_file": "s.pem", "key_file": "s.key"}
    served = settings_from_config(config.updated(replica_tls=tls), "r9")
    assert served.tls == {"grpc_use_ssl": True, "grpc_server_cert": Path("s.pem"),
                          "grpc_server_key": Path("s.key")}
