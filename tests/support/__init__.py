"""Shared test machinery: real servers, factories, the routing stack."""

from pathlib import Path

# The checkout the tests run from: example briefs and alembic.ini live here, never in the package.
REPO_ROOT = Path(__file__).resolve().parents[2]
