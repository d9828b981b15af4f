"""Caller identity at the RPC edge: API key from gRPC metadata → caller (key, scope, tenant).

The key travels as `x-api-key: <key>` or `authorization: Bearer <key>`. Only its hash is compared
(ledger/keys.py); the key itself is never logged or stored. Every request reads the key's row
(no cache), so a revoke or an expiry holds from the next request on every gateway.

Scopes (DESIGN.md "Keys and scopes"): a `tenant` key submits and reads its own tenant's runs and
usage; `finance` reads every tenant's usage; `admin` uses the Admin API. A key used outside its
scope is PERMISSION_DENIED (it is a valid key, for something else).
"""

from __future__ import annotations

from collections.abc import Iterable

from sluice.ledger.models import KeyScope
from sluice.ledger.repositories import ApiKeyRepository, Caller, TenantInfo
from sluice.services.errors import (
    KEY_SCOPE_NOT_ALLOWED,
    MISSING_API_KEY,
    TENANT_SUSPENDED,
    UNKNOWN_API_KEY,
    PermissionDenied,
    Unauthenticated,
)
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


async def identify(session: AsyncSession, metadata: Metadata) -> Caller:
    """The caller's key; raises Unauthenticated for a missing, unknown, revoked or expired key."""
    caller = await ApiKeyRepository(session).caller(api_key_from_metadata(metadata))
    if caller is None:
        raise Unauthenticated(UNKNOWN_API_KEY)
    return caller


def require_scope(caller: Caller, what: str, *allowed: KeyScope) -> None:
    require_scope_of(caller.scope, what, *allowed)


def require_scope_of(scope: KeyScope, what: str, *allowed: KeyScope) -> None:
    if scope not in allowed:
        raise PermissionDenied(KEY_SCOPE_NOT_ALLOWED.format(
            scope=scope.value, what=what, needed=" or ".join(repr(s.value) for s in allowed)))


async def authenticate(session: AsyncSession, metadata: Metadata) -> TenantInfo:
    """The tenant owning the caller's key, which must be tenant-scoped (runs and own usage)."""
    caller = await identify(session, metadata)
    require_scope(caller, "this tenant API", KeyScope.TENANT)
    assert caller.tenant is not None, f"tenant-scoped key {caller.key_prefix} has no tenant"
    return caller.tenant


def check_submitter(caller: Caller) -> TenantInfo:
    """The tenant a caller submits for: a tenant-scoped key of a tenant not suspended (suspension
    refuses new runs only; runs already accepted finish and stay readable)."""
    require_scope(caller, "this tenant API", KeyScope.TENANT)
    assert caller.tenant is not None, f"tenant-scoped key {caller.key_prefix} has no tenant"
    if caller.tenant.suspended:
        raise PermissionDenied(TENANT_SUSPENDED.format(tenant=caller.tenant.name))
    return caller.tenant
