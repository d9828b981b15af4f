"""Caller identity at the RPC edge: API key from gRPC metadata → tenant.

The key travels as `x-api-key: <key>` or `authorization: Bearer <key>`. Only its sha256 is
looked up; the key itself is never logged or stored.
"""

from __future__ import annotations

from collections.abc import Iterable

from sluice.ledger.repositories import TenantInfo, TenantRepository
from sluice.services.errors import MISSING_API_KEY, UNKNOWN_API_KEY, Unauthenticated
from sqlalchemy.ext.asyncio import AsyncSession

API_KEY_HEADER = "x-api-key"
AUTHORIZATION_HEADER = "authorization"
BEARER_PREFIX = "bearer "

Metadata = Iterable[tuple[str, str | bytes]] | None


def api_key_from_metadata(metadata: Metadata) -> str:
    """The caller's API key; raises Unauthenticated when none is sent."""
    for key, value in metadata or ():
        text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
        name = key.lower()
        if name == API_KEY_HEADER and text.strip():
            return text.strip()
        if name == AUTHORIZATION_HEADER and text[: len(BEARER_PREFIX)].lower() == BEARER_PREFIX:
            token = text[len(BEARER_PREFIX):].strip()
            if token:
                return token
    raise Unauthenticated(MISSING_API_KEY)


async def authenticate(session: AsyncSession, metadata: Metadata) -> TenantInfo:
    """The tenant owning the caller's key; raises Unauthenticated for a missing, unknown or revoked key."""
    tenant = await TenantRepository(session).by_api_key(api_key_from_metadata(metadata))
    if tenant is None:
        raise Unauthenticated(UNKNOWN_API_KEY)
    return tenant
