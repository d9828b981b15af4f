#!/usr/bin/env bash
# Start the local PostgreSQL and Kafka and wait until both serve. Idempotent.
# Usage: infra/up.sh [--setup]   (--setup first runs infra/setup.sh)
set -euo pipefail
INFRA="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ "${1:-}" == "--setup" ]]; then "$INFRA/setup.sh"; fi
# Start both before waiting on either: the JVM boots while PostgreSQL initialises.
"$INFRA/postgres.sh" start
"$INFRA/kafka.sh" start
"$INFRA/postgres.sh" wait
"$INFRA/kafka.sh" wait
