"""Trust scopes of the prefix cache (DESIGN.md "Trust scopes"): who may reuse whose KV blocks.

A run's scope is fixed at admission from its tenant: by default the tenant alone
(`tenant:<tenant id>`), or the shared scope the tenant opted into for public system prompts
(`shared:<name>`, tenants.shared_cache_scope). Opting in shares every prefix of the tenant's
prompts with the other members of that scope, so it suits tenants whose prompts start with a
public system prompt; without it another tenant's identical prompt finds nothing cached.

The scope travels as a 64-bit salt, the shape TensorRT-LLM's `cache_salt_id` has: the engine mixes
it into the root of the block-hash chain (engine/kv_cache.salted_root), the router into the root of
its prefix index chain (router/prefix_index), and the replica receives it as the request's
`cache_salt_id` tensor. A stable digest, not Python's hash(): every process must agree on it.
"""

from __future__ import annotations

import hashlib
import uuid

TENANT_SCOPE = "tenant:{tenant_id}"
SHARED_SCOPE = "shared:{name}"


def scope_of(tenant_id: uuid.UUID, shared_cache_scope: str | None) -> str:
    """The scope a run of this tenant caches its prompt in."""
    if shared_cache_scope:
        return SHARED_SCOPE.format(name=shared_cache_scope)
    return TENANT_SCOPE.format(tenant_id=tenant_id)


def cache_salt(scope: str) -> int:
    """The scope's salt: the first 8 bytes of its BLAKE2b digest, never 0 (0 means unsalted)."""
    digest = int.from_bytes(hashlib.blake2b(scope.encode("utf-8"), digest_size=8).digest(), "big")
    return digest or 1
