"""[http] settings: where the edge listens and the limits it applies before admission."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_LISTEN = "127.0.0.1:8080"
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024    # far above any prompt a 128k-context model takes (~0.5 MB)
DEFAULT_MAX_TOKENS = 256                    # chat/responses cap when a request names none
MODEL_CARD_TTL_S = 5.0


@dataclass(frozen=True, slots=True)
class HttpSettings:
    enabled: bool                    # serve the edge from the gateway process
    host: str
    port: int                        # 0: a free port (tests)
    max_body_bytes: int              # larger bodies get 413 before they are read
    default_max_tokens: int          # output cap of a chat or responses request that names none
    model_card_ttl_s: float          # how long a model's chat template is reused before re-reading it

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> HttpSettings:
        section = config.get("http", {})
        host, _, port = str(section.get("listen", DEFAULT_LISTEN)).rpartition(":")
        return cls(
            enabled=bool(section.get("enabled", True)),
            host=host or "127.0.0.1",
            port=int(port),
            max_body_bytes=int(section.get("max_body_bytes", DEFAULT_MAX_BODY_BYTES)),
            default_max_tokens=int(section.get("default_max_tokens", DEFAULT_MAX_TOKENS)),
            model_card_ttl_s=float(section.get("model_card_ttl_s", MODEL_CARD_TTL_S)),
        )
