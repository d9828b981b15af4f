"""[http] settings: where the edge listens and the limits it applies before admission."""

from __future__ import annotations

from dataclasses import dataclass

from sluice.config import Settings


@dataclass(frozen=True, slots=True)
class HttpSettings:
    enabled: bool                    # serve the edge from the gateway process
    host: str
    port: int                        # 0: a free port (tests)
    max_body_bytes: int              # larger bodies get 413 before they are read
    default_max_tokens: int          # output cap of a chat or responses request that names none
    model_card_ttl_s: float          # how long a model's chat template is reused before re-reading it

    @classmethod
    def from_config(cls, config: Settings) -> HttpSettings:
        section = config.http
        host, _, port = section.listen.rpartition(":")
        return cls(enabled=section.enabled, host=host or "127.0.0.1", port=int(port),
                   max_body_bytes=section.max_body_bytes, default_max_tokens=section.default_max_tokens,
                   model_card_ttl_s=section.model_card_ttl_s)
