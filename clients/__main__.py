"""`python -m sluice_client ...` runs the `sluice` CLI."""

import sys

from sluice_client.cli import main

sys.exit(main())
