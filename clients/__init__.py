"""Sluice clients: the async Python SDK (sdk.py) and the `sluice` CLI (cli.py).

    from sluice_client import SluiceClient
"""

from sluice_client.sdk import Addresses, SluiceClient, SluiceError, StreamBroken

__all__ = ["Addresses", "SluiceClient", "SluiceError", "StreamBroken"]
