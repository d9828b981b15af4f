"""Sluice clients: the async Python SDK (sdk.py) and the `sluice` CLI (cli.py)."""
