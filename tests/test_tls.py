"""TLS and mutual TLS on the gateway's gRPC listener ([tls]), and the SDK over it.

Certificates are made in the test with the openssl CLI (tests/support/pki.py): a CA, a server
certificate for 127.0.0.1 and a client certificate, all signed by that CA.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import grpc.aio
import pytest
from sluice.services.admission import add_admission_servicer
from sluice.services.main import PLAINTEXT_OFF_LOOPBACK, _bind
from sluice.services.usage import add_usage_servicer
from sluice_client import cli
from sluice_client.sdk import SluiceClient, SluiceError

from sluice.config import Settings, load_settings
from sluice.config.settings import TlsSection
from tests.support.ledger_factories import DEFAULT_MODEL, add_model, add_tenant, prompt_of
from tests.support.replica_proc import free_ports

pytest_plugins = ["tests.support.pki"]

MODEL = DEFAULT_MODEL.alias or DEFAULT_MODEL.version


def tls_settings(pki: Path, mutual: bool) -> Settings:
    return load_settings().updated(tls={"cert_file": str(pki / "server.pem"),
                                        "key_file": str(pki / "server.key"),
                                        "client_ca_file": str(pki / "ca.pem") if mutual else ""})


@contextlib.asynccontextmanager
async def serve_admission(sessionmaker, word_tokenizer: str, config: Settings,
                          also: Callable[..., object] | None = None) -> AsyncIterator[str]:
    """Admission (and `also`'s service) bound with `config`'s [tls]; yields the address."""
    async with sessionmaker() as session, session.begin():
        await add_model(session, word_tokenizer)
    server = grpc.aio.server()
    admission = add_admission_servicer(server, sessionmaker, config)
    if also is not None:
        also(server, sessionmaker, config)
    address = f"127.0.0.1:{free_ports(1)[0]}"
    _bind(server, [address], config.tls)
    await server.start()
    try:
        yield address
    finally:
        await server.stop(None)
        await admission.close()


@pytest.fixture
async def api_key(sessionmaker) -> str:
    async with sessionmaker() as session, session.begin():
        return (await add_tenant(session, f"acme-{uuid.uuid4().hex[:6]}")).api_key


def credentials(pki: Path, client_certificate: bool) -> grpc.ChannelCredentials:
    if not client_certificate:
        return grpc.ssl_channel_credentials((pki / "ca.pem").read_bytes())
    return grpc.ssl_channel_credentials((pki / "ca.pem").read_bytes(), (pki / "client.key").read_bytes(),
                                        (pki / "client.pem").read_bytes())


@pytest.mark.integration
async def test_a_tls_only_gateway_refuses_plaintext_and_serves_the_sdk_with_the_ca(
        sessionmaker, word_tokenizer, api_key, pki):
    async with serve_admission(sessionmaker, word_tokenizer, tls_settings(pki, mutual=False)) as address:
        async with SluiceClient(address, api_key, credentials=credentials(pki, False)) as client:
            run = await client.submit(prompt_of(10), model=MODEL, max_output_tokens=4)
            assert run.run_id
        async with SluiceClient(address, api_key) as plaintext:
            with pytest.raises(SluiceError) as refused:
                await plaintext.submit(prompt_of(10), model=MODEL, max_output_tokens=4)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.integration
async def test_mutual_tls_admits_only_clients_with_a_certificate_the_ca_signed(
        sessionmaker, word_tokenizer, api_key, pki):
    async with serve_admission(sessionmaker, word_tokenizer, tls_settings(pki, mutual=True)) as address:
        async with SluiceClient(address, api_key, credentials=credentials(pki, True)) as client:
            assert (await client.submit(prompt_of(10), model=MODEL, max_output_tokens=4)).run_id
        async with SluiceClient(address, api_key, credentials=credentials(pki, False)) as anonymous:
            with pytest.raises(SluiceError) as refused:
                await anonymous.submit(prompt_of(10), model=MODEL, max_output_tokens=4)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_plaintext_is_refused_off_loopback_unless_accepted():
    with pytest.raises(SystemExit) as refused:
        _bind(grpc.aio.server(), ["0.0.0.0:0"], TlsSection())
    assert str(refused.value) == PLAINTEXT_OFF_LOOPBACK.format(address="0.0.0.0:0")
    with pytest.raises(ValueError, match="tls.cert_file and tls.key_file go together"):
        TlsSection(cert_file="server.pem")


def run_cli(address: str, api_key: str, *tls: str) -> int:
    """`sluice usage` against `address` (cli.main runs its own event loop: call it in a thread)."""
    return cli.main(["usage", "--address", address, "--api-key", api_key, *tls], out=io.StringIO())


@pytest.mark.integration
@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
async def test_the_cli_talks_to_a_tls_gateway_with_ca_and_a_mutual_one_with_cert_and_key(
        sessionmaker, word_tokenizer, api_key, pki, capsys, mutual):
    with_ca = ("--ca", str(pki / "ca.pem"))
    client_certificate = ("--cert", str(pki / "client.pem"), "--key", str(pki / "client.key"))
    async with serve_admission(sessionmaker, word_tokenizer, tls_settings(pki, mutual),
                               also=add_usage_servicer) as address:
        assert await asyncio.to_thread(run_cli, address, api_key) == cli.EXIT_RPC_ERROR   # plaintext
        assert "UNAVAILABLE" in capsys.readouterr().err
        ca_only = await asyncio.to_thread(run_cli, address, api_key, *with_ca)
        assert ca_only == (cli.EXIT_RPC_ERROR if mutual else cli.EXIT_OK)
        both = await asyncio.to_thread(run_cli, address, api_key, *with_ca, *client_certificate)
        assert both == cli.EXIT_OK


def test_the_cli_takes_its_tls_files_from_the_environment_and_refuses_a_cert_without_a_key(monkeypatch, pki):
    monkeypatch.setenv(cli.CA_FILE_ENV, str(pki / "ca.pem"))
    args = cli._parser().parse_args(["usage"])
    assert isinstance(cli.credentials(args), grpc.ChannelCredentials)
    monkeypatch.delenv(cli.CA_FILE_ENV)
    assert cli.credentials(args) is None
    with pytest.raises(SystemExit, match="--cert and --key go together"):
        cli.credentials(cli._parser().parse_args(["usage", "--cert", "c.pem"]))
