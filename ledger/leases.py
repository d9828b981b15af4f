"""Lease arithmetic shared by the routing worker's claims and the run-finishing code."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import ColumnElement, func, literal


def lease_until(lease_seconds: float) -> ColumnElement[dt.datetime]:
    """The database clock plus `lease_seconds`: one clock for every worker's leases."""
    return func.now() + func.make_interval(0, 0, 0, 0, 0, 0, literal(float(lease_seconds)))
