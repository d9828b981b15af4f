"""A prompt's token ids as the ledger stores them (ledger/token_ids.py, migration 0014): 4-byte
big-endian signed integers, back to back. The expected bytes are written out by hand here."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
from sluice.ledger import token_ids
from sqlalchemy import bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.types import Integer

IDS = [1, 256, 2**31 - 1, -1, 0, 49151]
# Each id as its four bytes, most significant first.
STORED = (b"\x00\x00\x00\x01" + b"\x00\x00\x01\x00" + b"\x7f\xff\xff\xff" + b"\xff\xff\xff\xff"
          + b"\x00\x00\x00\x00" + b"\x00\x00\xbf\xff")
MIGRATION = Path(__file__).resolve().parents[1] / "migrations" / "versions" / "0014_token_ids_as_bytes.py"


def test_ids_are_stored_as_big_endian_int32s_back_to_back():
    assert token_ids.pack(IDS) == STORED
    assert token_ids.pack(tuple(IDS)) == STORED
    assert token_ids.unpack(STORED) == tuple(IDS)
    assert token_ids.count(STORED) == len(IDS)
    assert token_ids.pack([]) == b"" and token_ids.unpack(b"") == () and token_ids.count(b"") == 0


def test_what_an_int4_column_refused_is_refused():
    with pytest.raises(OverflowError):
        token_ids.pack([2**31])
    with pytest.raises(OverflowError):
        token_ids.pack([-(2**31) - 1])
    with pytest.raises(TypeError):
        token_ids.pack(["7"])  # type: ignore[list-item]


def test_stored_bytes_that_are_not_whole_ids_are_an_error():
    with pytest.raises(ValueError, match="6 bytes"):
        token_ids.unpack(STORED[:6])
    with pytest.raises(ValueError, match="6 bytes"):
        token_ids.count(STORED[:6])


def _migration() -> ModuleType:
    spec = importlib.util.spec_from_file_location("migration_0014", MIGRATION)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.integration
async def test_the_migration_converts_existing_ids_both_ways_on_postgresql(engine):
    migration = _migration()
    async with engine.connect() as connection:
        await connection.execute(text(migration.TO_BYTES))
        await connection.execute(text(migration.TO_ARRAY))
        to_bytes = text("SELECT pg_temp.sluice_token_ids_to_bytes(:ids)").bindparams(
            bindparam("ids", type_=ARRAY(Integer)))
        to_array = text("SELECT pg_temp.sluice_token_ids_to_array(:stored)")
        assert (await connection.execute(to_bytes, {"ids": IDS})).scalar_one() == STORED
        assert (await connection.execute(to_bytes, {"ids": []})).scalar_one() == b""
        assert (await connection.execute(to_array, {"stored": STORED})).scalar_one() == IDS
        assert (await connection.execute(to_array, {"stored": b""})).scalar_one() == []
        await connection.rollback()
