"""A throwaway PKI made with the openssl CLI: a CA, a server certificate for 127.0.0.1/localhost
and a client certificate, all signed by that CA (ca.pem, server.pem/.key, client.pem/.key).

    pytest_plugins = ["tests.support.pki"]     # the module-scoped `pki` fixture: its folder
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_pki(home: Path) -> Path:
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
            "-days", "2", "-subj", "/CN=sluice test CA", cwd=home)
    (home / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, extension in (("server", ["-extfile", "server.ext"]), ("client", [])):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN=sluice {name}", cwd=home)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", "2", *extension, cwd=home)
    return home


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki"))
