"""A prompt's token ids as `runs.prompt_token_ids` stores them: 4-byte big-endian signed integers,
back to back (migration 0014).

Why bytes and not int4[] (issue 9, seed 002's ~2,000-token prompts): asyncpg encodes an int4[]
parameter one element at a time, with Python-level type checks on each (~0.3 us a token: ~0.6 ms of
the gateway's CPU per 2,000-token Submit, more than the rest of its write), and PostgreSQL parses
every element again; as bytes the ids cross both as one copy, converted here in C (array). Big-endian
is PostgreSQL's own int4send order, so SQL can still read them (the migration converts with int4send).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable

_INT32 = "i"
assert array(_INT32).itemsize == 4, "array('i') is not 4 bytes on this platform"
_SWAP = sys.byteorder == "little"
NOT_WHOLE_IDS = "stored token ids must be a whole number of 4-byte integers, got {size} bytes"


def pack(ids: Iterable[int]) -> bytes:
    """The stored form of `ids`. OverflowError for an id outside a signed 32-bit integer (what the
    int4[] column refused), TypeError for anything not an int."""
    packed = array(_INT32, ids)
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


def count(stored: bytes) -> int:
    """How many ids `stored` holds, without unpacking them."""
    if len(stored) % 4:
        raise ValueError(NOT_WHOLE_IDS.format(size=len(stored)))
    return len(stored) // 4


def unpack(stored: bytes) -> tuple[int, ...]:
    """The ids `pack` stored, as the routing path keeps them (a tuple: built once, never copied again)."""
    if len(stored) % 4:
        raise ValueError(NOT_WHOLE_IDS.format(size=len(stored)))
    ids = array(_INT32)
    ids.frombytes(stored)
    if _SWAP:
        ids.byteswap()
    return tuple(ids)
