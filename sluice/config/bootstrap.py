"""The one start-up every Sluice process goes through (gateway, routing worker, replica host).

Logging is configured first, then the settings are parsed once; a configuration error stops the
process before it binds a port or opens a connection, with a message naming each bad key.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import TextIO

from sluice.config.settings import ConfigError, Settings, load_settings

EXIT_BAD_CONFIG = 78   # EX_CONFIG (sysexits.h): supervisors tell a bad config from a crash
QUIET_LOGGERS = ("aiokafka",)   # it logs every consumer assignment at INFO


def start_process(role: str, *, level: int = logging.INFO, stream: TextIO | None = None,
                  environ: Mapping[str, str] | None = None) -> Settings:
    """Configure logging and parse the settings for a process of `role`; exits on a bad config."""
    logging.basicConfig(level=level, stream=stream or sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(max(level, logging.WARNING))
    try:
        return load_settings(environ=environ)
    except ConfigError as exc:
        print(f"sluice {role}: refusing to start: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_BAD_CONFIG) from None
