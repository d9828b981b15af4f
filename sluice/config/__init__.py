"""One config file with environment overrides, read once per process.

The file is TOML (the packaged `sluice/config/sluice.toml` unless SLUICE_CONFIG names another).
`SLUICE_<SECTION>__<KEY>` overrides a scalar; `SLUICE_REPLICAS` replaces the
replica list with a JSON array of tables. Values from the environment are
parsed as JSON when they parse (numbers, booleans), else kept as strings.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# The defaults ship inside the package (sluice/config/sluice.toml), found beside this module.
DEFAULT_CONFIG_PATH = Path(__file__).resolve().parent / "sluice.toml"
ENV_PREFIX = "SLUICE_"


class ConfigError(ValueError):
    """The configuration file or an override is malformed."""


def _parse_env_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def apply_env_overrides(config: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """Return a copy of `config` with SLUICE_* variables applied."""
    merged: dict[str, Any] = {k: (dict(v) if isinstance(v, dict) else v) for k, v in config.items()}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or name == "SLUICE_CONFIG":
            continue
        key = name[len(ENV_PREFIX):].lower()
        if key == "replicas":
            replicas = _parse_env_value(raw)
            if not isinstance(replicas, list):
                raise ConfigError("SLUICE_REPLICAS must be a JSON array of replica tables")
            merged["replicas"] = replicas
            continue
        section, sep, field = key.partition("__")
        if not sep or not field:
            continue
        table = merged.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{name}: [{section}] is not a table")
        table[field] = _parse_env_value(raw)
    return merged


def load_config(path: str | os.PathLike[str] | None = None,
                environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Read the config file and apply environment overrides."""
    env = os.environ if environ is None else environ
    chosen = Path(path or env.get("SLUICE_CONFIG") or DEFAULT_CONFIG_PATH)
    try:
        with chosen.open("rb") as handle:
            raw = tomllib.load(handle)
    except FileNotFoundError as exc:
        raise ConfigError(f"config file not found: {chosen}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {chosen} is not valid TOML: {exc}") from exc
    return apply_env_overrides(raw, env)


def data_dir(config: Mapping[str, Any]) -> Path:
    """The one folder holding every local server's state; a relative path is taken from the
    working directory (the repository root for `make` targets), never from where the package lives."""
    path = Path(config.get("paths", {}).get("data_dir", ".sluice"))
    return path if path.is_absolute() else Path.cwd() / path
