"""Sluice's configuration: typed, frozen settings parsed once per process (see settings.py).

`load_settings()` reads the packaged `sluice/config/sluice.toml`, the file SLUICE_CONFIG names and
the SLUICE_<SECTION>__<KEY> overrides; `start_process()` (bootstrap.py) is where every Sluice
process calls it.
"""

from sluice.config.settings import (
    DEFAULT_CONFIG_PATH,
    ConfigError,
    ReplicaSection,
    ReplicaTable,
    RoutingSection,
    Settings,
    load_settings,
)

__all__ = ["DEFAULT_CONFIG_PATH", "ConfigError", "ReplicaSection", "ReplicaTable", "RoutingSection",
           "Settings", "load_settings"]
