"""`python -m sluice.planner BRIEF.yaml [--json] [--simulate]`."""

import sys

from sluice.planner.cli import main

sys.exit(main(sys.argv[1:]))
