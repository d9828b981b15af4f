"""`python -m clients ...` runs the `sluice` CLI."""

import sys

from clients.cli import main

sys.exit(main())
