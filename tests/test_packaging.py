"""The two distributions, built as wheels and installed outside the checkout.

- `sluice-client` (clients/): sluice_client, the sluice.v1 stubs generated at build time, py.typed,
  grpcio + protobuf only, the `sluice` CLI (which imports no platform module);
- `sluice` (the platform): config defaults, migrations and tokenizers as package resources, the
  replica host's Triton behind the `replica` extra, no build or test tools.

Building the wheels and reading them is quick and runs in `make test`. Installing them into fresh
virtual environments, talking to a running stack and type-checking an example against the
installed SDK takes a minute or two: `make test-packaging` (SLUICE_PACKAGING=1).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import venv
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

from tests.support import REPO_ROOT
from tests.support.routing_stack import Stack

FULL = os.environ.get("SLUICE_PACKAGING") == "1"
full_only = pytest.mark.skipif(not FULL, reason="installs into fresh venvs: make test-packaging")


def build_wheels(into: Path) -> dict[str, Path]:
    """Both wheels, built with this venv's setuptools and grpcio-tools (no download). setuptools
    builds in the tree and never deletes from its build folder, so a stale one is removed first."""
    for stale in (REPO_ROOT / "clients" / "build", REPO_ROOT / "build" / "lib"):
        shutil.rmtree(stale, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "-w", str(into), str(REPO_ROOT / "clients"),
                    str(REPO_ROOT)],
                   check=True, cwd=into, timeout=300)
    wheels = {path.name.split("-")[0]: path for path in into.glob("*.whl")}
    assert set(wheels) == {"sluice", "sluice_client"}, wheels
    return wheels


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_wheels(tmp_path_factory.mktemp("wheels"))


def names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


def requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(name for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
        return Parser().parsestr(archive.read(metadata).decode()).get_all("Requires-Dist") or []


def test_the_client_wheel_holds_the_sdk_the_generated_stubs_and_py_typed(wheels: dict[str, Path]):
    files = names(wheels["sluice_client"])
    stubs = {Path(proto).stem for proto in os.listdir(REPO_ROOT / "protos" / "sluice" / "v1")}
    for stem in stubs:
        assert {f"sluice/v1/{stem}_pb2.py", f"sluice/v1/{stem}_pb2.pyi",
                f"sluice/v1/{stem}_pb2_grpc.py"} <= files
    assert {"sluice_client/sdk.py", "sluice_client/cli.py", "sluice_client/py.typed",
            "sluice/v1/py.typed"} <= files
    # Nothing of the platform, not even the `sluice` package's own __init__ (it stays a namespace).
    assert not {name for name in files if name.startswith("sluice/") and not name.startswith("sluice/v1/")}
    assert "sluice_client/setup.py" not in files
    assert sorted(req.split(">")[0].split("<")[0].split(";")[0].strip() for req in
                  requirements(wheels["sluice_client"])) == ["grpcio", "protobuf"]


def test_the_platform_wheel_ships_its_resources_and_keeps_triton_behind_an_extra(wheels: dict[str, Path]):
    files = names(wheels["sluice"])
    assert {"sluice/config/sluice.toml", "sluice/models/tiny-chat/tokenizer.json",
            "sluice/migrations/env.py", "sluice/services/main.py", "sluice/ledger/models.py"} <= files
    assert any(name.startswith("sluice/migrations/versions/0001") for name in files)
    assert not any(name.startswith("sluice/v1/") for name in files)     # the client's
    required = requirements(wheels["sluice"])
    always = [req for req in required if "extra ==" not in req]
    assert "sluice-client" in always
    assert not [req for req in always
                if req.startswith(("nvidia-pytriton", "grpcio-tools", "pytest", "mypy"))]
    assert "tritonclient[grpc]" in always       # the replica client; [http] pulled gevent and is unused
    assert 'nvidia-pytriton; extra == "replica"' in required


def fresh_venv(where: Path) -> Path:
    venv.EnvBuilder(with_pip=True, clear=True).create(where)
    return where / "bin" / "python"


def run(python: Path | str, *args: str, cwd: Path, env: dict[str, str] | None = None,
        check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(python), *args], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=600)
    if check:
        assert result.returncode == 0, f"{args}: {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def client_venv(wheels: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sluice-client alone, with its declared dependencies (pinned by the lock; pip's cache serves them)."""
    home = tmp_path_factory.mktemp("client-venv")
    python = fresh_venv(home / "venv")
    run(python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "-c",
        str(REPO_ROOT / "requirements.lock"), str(wheels["sluice_client"]), cwd=home)
    return python


@full_only
def test_the_installed_cli_runs_outside_the_checkout_without_platform_modules(client_venv: Path,
                                                                              tmp_path: Path):
    sluice = client_venv.parent / "sluice"
    assert "usage: sluice" in run(sluice, "--help", cwd=tmp_path).stdout
    imported = run(client_venv, "-c", "import sys, sluice_client.cli; print(sorted(m for m in sys.modules"
                   " if m.split('.')[0] == 'sluice' and not m.startswith('sluice.v1')))", cwd=tmp_path)
    assert imported.stdout.strip() == "['sluice']"       # the namespace the stubs live in, nothing else
    refused = run(sluice, "plan", "brief.yaml", cwd=tmp_path, check=False)
    assert refused.returncode == 2
    assert "pip install sluice" in refused.stderr


TYPED_EXAMPLE = '''
    import asyncio

    from sluice_client import SluiceClient
    from sluice.v1 import common_pb2


    async def answer(address: str, api_key: str, prompt: str) -> tuple[str, int]:
        async with SluiceClient(address, api_key) as client:
            run = await client.submit(prompt, max_output_tokens=8)
            text: list[str] = []
            status = common_pb2.RUN_STATUS_UNSPECIFIED
            async for event in client.stream(run.run_id):
                text.append(event.text)
                status = event.status
            return "".join(text), int(status)


    if __name__ == "__main__":
        import sys

        words, status = asyncio.run(answer(sys.argv[1], sys.argv[2], "Why do rivers meander?"))
        print(status, len(words) > 0)
'''


@full_only
def test_mypy_passes_on_a_typed_example_against_the_installed_sdk(client_venv: Path, tmp_path: Path):
    example = tmp_path / "example.py"
    example.write_text(textwrap.dedent(TYPED_EXAMPLE))
    mypy = Path(sys.executable).parent / "mypy"
    command = [str(mypy), "--strict", "--no-incremental", "--python-executable", str(client_venv),
               str(example)]
    checked = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    example.write_text(textwrap.dedent(TYPED_EXAMPLE).replace("max_output_tokens=8", "max_output_tokens='8'"))
    wrong = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert wrong.returncode == 1 and "max_output_tokens" in wrong.stdout     # the SDK's types are read


@full_only
@pytest.mark.integration
async def test_the_installed_sdk_talks_to_a_running_stack(client_venv: Path, stack: Stack, tmp_path: Path):
    await stack.start_worker()
    example = tmp_path / "example.py"
    example.write_text(textwrap.dedent(TYPED_EXAMPLE))
    process = await asyncio.create_subprocess_exec(
        str(client_venv), str(example), stack.address, stack.tenant.api_key, cwd=tmp_path,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={"PATH": "/usr/bin:/bin"})
    out, err = await asyncio.wait_for(process.communicate(), 120)
    from sluice.v1 import common_pb2

    assert process.returncode == 0, err.decode()
    assert out.decode().split() == [str(common_pb2.RUN_STATUS_COMPLETED), "True"]


@full_only
def test_the_platform_wheel_runs_from_its_install_outside_the_checkout(wheels: dict[str, Path],
                                                                        tmp_path: Path):
    python = fresh_venv(tmp_path / "venv")
    run(python, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
        str(wheels["sluice"]), str(wheels["sluice_client"]), cwd=tmp_path)
    # The dependencies come from this checkout's venv (no second download of pytriton): on PYTHONPATH,
    # whose .pth files (the editable installs of the checkout) are not processed.
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": sysconfig.get_paths()["purelib"]}
    probe = run(python, "-c", textwrap.dedent('''
        import importlib.resources, sluice, sluice.services.main, sluice.replica.serve, sluice.v1.runs_pb2
        from sluice.config import load_settings
        from sluice.models import load_tokenizer
        settings = load_settings()
        versions = importlib.resources.files("sluice.migrations") / "versions"
        print(sluice.__file__)
        print(settings.kafka.events_topic, load_tokenizer("tiny-chat/tokenizer.json").get_vocab_size() > 0,
              any(p.name.startswith("0001") for p in versions.iterdir()))
    '''), cwd=tmp_path, env=env)
    where, facts = probe.stdout.strip().splitlines()
    assert where.startswith(str(tmp_path / "venv"))
    assert facts == "sluice.run-events True True"
    assert "--role" in run(python, "-m", "sluice.services.main", "--help", cwd=tmp_path, env=env).stdout
    refused = run(python, "-m", "sluice.services.main", cwd=tmp_path, check=False,
                  env={**env, "SLUICE_KAFKA__BOOTSRAP": "x"})
    assert "kafka.bootsrap: unknown key" in refused.stderr
    shutil.rmtree(tmp_path / "venv")
