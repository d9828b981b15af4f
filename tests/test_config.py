"""Typed settings: parsed once from the packaged defaults, SLUICE_CONFIG and SLUICE_* overrides;
anything unknown, mistyped or out of range stops start-up with the key named."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from pydantic import ValidationError

from sluice.config import DEFAULT_CONFIG_PATH, ConfigError, Settings, load_settings
from sluice.config.bootstrap import EXIT_BAD_CONFIG
from tests.support import REPO_ROOT


def refusal(environ: dict[str, str], path: Path | None = None) -> str:
    with pytest.raises(ConfigError) as caught:
        load_settings(path, environ=environ)
    return str(caught.value)


def test_the_packaged_defaults_parse_into_the_values_the_file_states():
    packaged = tomllib.loads(DEFAULT_CONFIG_PATH.read_text())
    settings = load_settings(environ={})
    assert settings.routing.lease_seconds == packaged["routing"]["lease_seconds"]
    assert settings.kafka.bootstrap == packaged["kafka"]["bootstrap"]
    assert [entry.name for entry in settings.replicas] == [table["name"] for table in packaged["replicas"]]
    assert settings.replica.max_num_seqs == packaged["replica"]["max_num_seqs"]


def test_an_override_is_typed_and_wins_over_the_file():
    settings = load_settings(environ={"SLUICE_ROUTING__LEASE_SECONDS": "2.5",
                                      "SLUICE_REPLICA__PREFIX_REUSE": "false",
                                      "SLUICE_REPLICAS": '[{"name": "x", "grpc_address": "10.0.0.1:9"}]'})
    assert settings.routing.lease_seconds == 2.5
    assert settings.replica.prefix_reuse is False
    assert [(entry.name, entry.grpc_address) for entry in settings.replicas] == [("x", "10.0.0.1:9")]


def test_a_typo_in_an_override_is_refused_naming_the_variable():
    assert "kafka.bootsrap: unknown key (from SLUICE_KAFKA__BOOTSRAP)" in refusal(
        {"SLUICE_KAFKA__BOOTSRAP": "127.0.0.1:1"})


def test_an_override_of_a_section_that_does_not_exist_is_refused():
    assert "SLUICE_KAFKAA__BOOTSTRAP: unknown section (no [kafkaa])" in refusal(
        {"SLUICE_KAFKAA__BOOTSTRAP": "127.0.0.1:1"})


def test_a_wrong_type_in_a_file_is_refused_naming_the_key_and_the_file(tmp_path: Path):
    override = tmp_path / "site.toml"
    override.write_text('[routing]\nlease_seconds = "abc"\n')
    message = refusal({"SLUICE_CONFIG": str(override)})
    assert "routing.lease_seconds: Input should be a valid number" in message
    assert str(override) in message


def test_an_unknown_key_in_a_file_is_refused(tmp_path: Path):
    override = tmp_path / "site.toml"
    override.write_text("[admission]\nmax_backlog_per_pol = 5\n")
    assert "admission.max_backlog_per_pol: unknown key" in refusal({}, override)


@pytest.mark.parametrize(("variable", "value", "key"), [
    ("SLUICE_ROUTING__LEASE_SECONDS", "0", "routing.lease_seconds"),
    ("SLUICE_ROUTING__MAX_ATTEMPTS", "0", "routing.max_attempts"),
    ("SLUICE_KAFKA__PARTITIONS", "-1", "kafka.partitions"),
    ("SLUICE_ROUTING__METRICS_PORT", "70000", "routing.metrics_port"),
    ("SLUICE_ADMISSION__LISTEN", "nowhere", "admission.listen"),
    ("SLUICE_ROUTING__POLICY", "fastest", "routing.policy"),
])
def test_an_out_of_range_value_is_refused_naming_the_key(variable: str, value: str, key: str):
    assert f"{key}: " in refusal({variable: value})


def test_a_site_file_overrides_only_the_keys_it_sets(tmp_path: Path):
    override = tmp_path / "site.toml"
    override.write_text('[kafka]\nbootstrap = "kafka-1:9092"\n')
    settings = load_settings(override, environ={})
    assert settings.kafka.bootstrap == "kafka-1:9092"
    assert settings.kafka.events_topic == load_settings(environ={}).kafka.events_topic


def test_a_secret_comes_from_the_environment_never_from_a_file(tmp_path: Path):
    override = tmp_path / "site.toml"
    override.write_text('[database]\npassword = "hunter2"\n')
    assert "database.password: a secret is read from the environment (SLUICE_DATABASE__PASSWORD)" in \
        refusal({}, override)
    settings = load_settings(environ={"SLUICE_DATABASE__DSN": "postgresql+asyncpg://app@db:5432/sluice",
                                      "SLUICE_DATABASE__PASSWORD": "s3cret"})
    assert settings.database.url == "postgresql+asyncpg://app:s3cret@db:5432/sluice"
    assert "s3cret" not in repr(settings)


def test_the_settings_are_frozen():
    settings = Settings()
    with pytest.raises(ValidationError):
        settings.routing.lease_seconds = 1.0  # type: ignore[misc]
    assert settings.updated(routing={"lease_seconds": 1.0}).routing.lease_seconds == 1.0
    assert settings.routing.lease_seconds == 5.0


@pytest.mark.parametrize("module", ["sluice.services.main", "sluice.services.routing",
                                    "sluice.replica.serve"])
def test_every_role_refuses_to_start_on_a_bad_key_and_names_it(module: str):
    args = ["--name", "r0"] if module == "sluice.replica.serve" else []
    result = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=60,
                            env={"PATH": "/usr/bin:/bin", "SLUICE_KAFKA__BOOTSRAP": "x"})
    assert result.returncode == EXIT_BAD_CONFIG, result.stderr
    assert "kafka.bootsrap: unknown key (from SLUICE_KAFKA__BOOTSRAP)" in result.stderr


def test_a_replica_entrys_own_engine_keys_are_checked_like_the_section():
    entry = '[{"name": "m", "grpc_address": "127.0.0.1:9", "replica": {"executor": "model"}}]'
    settings = load_settings(environ={"SLUICE_REPLICAS": entry})
    assert settings.replica_section_for(settings.replicas[0]).executor == "model"
    assert settings.replica.executor == "timing"
    typo = '[{"name": "m", "grpc_address": "127.0.0.1:9", "replica": {"exector": "model"}}]'
    assert "replicas.0.replica.exector: unknown key (from SLUICE_REPLICAS)" in \
        refusal({"SLUICE_REPLICAS": typo})
