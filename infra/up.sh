#!/usr/bin/env bash
# Start the local PostgreSQL and Kafka and wait until both serve. Idempotent.
# Usage: infra/up.sh [--setup]   (--setup first runs infra/setup.sh)
set -euo pipefail
INFRA="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ "${1:-}" == "--setup" ]]; then "$INFRA/setup.sh"; fi
# [kafka].brokers = 3 selects the local three-node cluster instead of the single broker.
source "$INFRA/lib.sh"
KAFKA="$INFRA/kafka.sh"
if [[ "$(config_get kafka.brokers 1)" == 3 ]]; then KAFKA="$INFRA/kafka_cluster.sh"; fi
# Start both before waiting on either: the JVM boots while PostgreSQL initialises.
"$INFRA/postgres.sh" start
"$KAFKA" start
"$INFRA/postgres.sh" wait
"$KAFKA" wait
