"""A typed, path-aware reader over the nested mapping a YAML brief parses into.

Each accessor validates one field and, on failure, raises `BriefError` naming the
field in dotted form. Unknown keys are refused (a typo such as `demand.user`
must not silently fall back to a default). Defaults are recorded with the reason
they were chosen, so the plan can state every assumption it made on the
author's behalf.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from sluice.planner.errors import (
    MISSING_FIELD,
    NEGATIVE,
    NOT_A_BOOL,
    NOT_A_FRACTION,
    NOT_A_MAPPING,
    NOT_A_NUMBER,
    NOT_AN_INTEGER,
    NOT_POSITIVE,
    NOT_TEXT,
    TOO_LARGE,
    UNKNOWN_CHOICE,
    UNKNOWN_FIELD,
    BriefError,
)

_REQUIRED = object()
# Bounds that keep the arithmetic finite (no brief means 10¹⁸ of anything): numbers, and counts
# (users, GPUs, tokens) that the planner loops or rounds over.
_LARGEST = 1e18
_LARGEST_COUNT = 1e9


class Reader:
    """One mapping of the brief, at `path` (e.g. "workload.input_tokens")."""

    def __init__(self, data: object, path: str, defaults: list[str], known: tuple[str, ...]) -> None:
        if not isinstance(data, Mapping):
            raise BriefError(path, NOT_A_MAPPING.format(field=path, value=data))
        self._data: Mapping[object, object] = data
        self._path = path
        self._defaults = defaults
        for key in data:
            if key not in known:
                field = self.field(str(key))
                raise BriefError(field, UNKNOWN_FIELD.format(field=field, known=", ".join(known)))

    @property
    def path(self) -> str:
        return self._path

    def field(self, key: str) -> str:
        return f"{self._path}.{key}" if self._path else key

    def has(self, key: str) -> bool:
        return self._data.get(key) is not None

    def section(self, key: str, known: tuple[str, ...], required: bool = True) -> Reader:
        raw = self._data.get(key)
        if raw is None:
            if required:
                raise BriefError(self.field(key), MISSING_FIELD.format(field=self.field(key)))
            raw = {}
        return Reader(raw, self.field(key), self._defaults, known)

    def raw(self, key: str) -> object:
        return self._data.get(key)

    def note_default(self, key: str, value: str, why: str) -> None:
        self._defaults.append(f"{self.field(key)} = {value} ({why})")

    def _get(self, key: str, default: object, why: str) -> object:
        value = self._data.get(key)
        if value is not None:
            return value
        if default is _REQUIRED:
            raise BriefError(self.field(key), MISSING_FIELD.format(field=self.field(key)))
        if why:
            self.note_default(key, str(default), why)
        return default

    def number(self, key: str, default: object = _REQUIRED, why: str = "", *,
               allow_zero: bool = False, maximum: float = _LARGEST) -> float:
        value = _yaml_exponent(self._get(key, default, why))
        field = self.field(key)
        # bool is an int subclass: `users: yes` must not read as 1 user.
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
            raise BriefError(field, NOT_A_NUMBER.format(field=field, value=value))
        if value > maximum:
            raise BriefError(field, TOO_LARGE.format(field=field, value=value, maximum=maximum))
        if value < 0:
            raise BriefError(field, NEGATIVE.format(field=field, value=value))
        if value == 0 and not allow_zero:
            raise BriefError(field, NOT_POSITIVE.format(field=field, value=value))
        return float(value)

    def optional_number(self, key: str) -> float | None:
        return self.number(key) if self.has(key) else None

    def integer(self, key: str, default: object = _REQUIRED, why: str = "", *,
                allow_zero: bool = False, maximum: float = _LARGEST_COUNT) -> int:
        number = self.number(key, default, why, allow_zero=allow_zero, maximum=maximum)
        if not number.is_integer():
            field = self.field(key)
            raise BriefError(field, NOT_AN_INTEGER.format(field=field, value=self._data.get(key)))
        return int(number)

    def optional_integer(self, key: str, maximum: float = _LARGEST_COUNT) -> int | None:
        return self.integer(key, maximum=maximum) if self.has(key) else None

    def fraction(self, key: str, default: object = _REQUIRED, why: str = "") -> float:
        """A share in [0, 1): hit rates, duty cycles, efficiency losses."""
        value = self.number(key, default, why, allow_zero=True)
        if value >= 1.0:
            field = self.field(key)
            raise BriefError(field, NOT_A_FRACTION.format(field=field, value=self._data.get(key)))
        return value

    def text(self, key: str, default: object = _REQUIRED, why: str = "") -> str:
        value = self._get(key, default, why)
        if not isinstance(value, str):
            field = self.field(key)
            raise BriefError(field, NOT_TEXT.format(field=field, value=value))
        return value

    def choice(self, key: str, choices: tuple[str, ...], default: object = _REQUIRED, why: str = "") -> str:
        value = self.text(key, default, why)
        if value not in choices:
            field = self.field(key)
            raise BriefError(field, UNKNOWN_CHOICE.format(field=field, known=", ".join(choices), value=value))
        return value

    def flag(self, key: str, default: bool, why: str = "") -> bool:
        value = self._get(key, default, why)
        if not isinstance(value, bool):
            field = self.field(key)
            raise BriefError(field, NOT_A_BOOL.format(field=field, value=value))
        return value


def _yaml_exponent(value: object) -> object:
    """PyYAML follows YAML 1.1, which reads 70.6e9 (no sign after the e) as a string."""
    if isinstance(value, str) and "e" in value.lower():
        try:
            return float(value)
        except ValueError:
            return value
    return value
