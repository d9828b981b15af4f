"""Sluice: a multi-tenant LLM inference platform.

One import root. The design card's folders keep their place in the repository
and are mapped into this package (pyproject's package-dir):
``services/`` → ``sluice.services``, ``ledger/`` → ``sluice.ledger``,
``migrations/`` → ``sluice.migrations``. The SDK and CLI (``clients/``) are their
own distribution, ``sluice_client``; the generated stubs are ``sluice.v1``.
"""
