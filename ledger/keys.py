"""API key material: generation, the stored hash, and how a presented key is matched.

A key reads `sk-<12 hex>_<43 url-safe base64 chars>`: 256 bits from the OS CSPRNG (`secrets`),
after a public prefix `sk-<12 hex>` that names the key in listings and audit rows and finds its
row. Only sha256(salt || key) is stored, with a random 16-byte salt of its own per key, so two
stored hashes never reveal that two keys are equal and a leaked table cannot be matched against
a precomputed list. sha256 (not a slow KDF) is enough: the secret has 256 bits of entropy, and
authentication runs on every Submit.

Keys made before salting (the seeded demo keys) store sha256(key) with no salt and still work.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

KEY_ID_HEX = 12  # hex digits of the public id: 48 bits, unique by construction
SECRET_BYTES = 32
SALT_BYTES = 16
_SALTED_KEY = re.compile(rf"^(sk-[0-9a-f]{{{KEY_ID_HEX}}})_[A-Za-z0-9_-]{{20,}}$")


@dataclass(frozen=True, slots=True)
class NewKey:
    secret: str  # the whole key: shown once to its creator, never stored
    prefix: str  # public: "sk-" + 12 hex
    salt: str  # hex
    key_hash: str  # sha256(salt || key), hex


def unsalted_hash(key: str) -> str:
    """sha256 hex of a key: how keys made before salting are stored."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def salted_hash(salt_hex: str, key: str) -> str:
    return hashlib.sha256(bytes.fromhex(salt_hex) + key.encode("utf-8")).hexdigest()


def generate_key() -> NewKey:
    prefix = "sk-" + secrets.token_hex(KEY_ID_HEX // 2)
    secret = f"{prefix}_{secrets.token_urlsafe(SECRET_BYTES)}"
    salt = secrets.token_hex(SALT_BYTES)
    return NewKey(secret=secret, prefix=prefix, salt=salt, key_hash=salted_hash(salt, secret))


def salted_prefix(key: str) -> str | None:
    """The public prefix of a key in the salted format, or None (an unsalted or malformed key)."""
    match = _SALTED_KEY.match(key)
    return match.group(1) if match else None


def matches(key: str, key_hash: str, salt_hex: str | None) -> bool:
    """Whether `key` is the key stored as (`key_hash`, `salt_hex`); constant-time comparison."""
    expected = unsalted_hash(key) if salt_hex is None else salted_hash(salt_hex, key)
    return hmac.compare_digest(expected, key_hash)
