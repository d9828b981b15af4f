#!/usr/bin/env bash
# Stop the local Kafka and PostgreSQL (data is kept; use `<script> reset` to wipe one).
set -uo pipefail
INFRA="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
status=0
"$INFRA/kafka.sh" stop || status=$?
"$INFRA/postgres.sh" stop || status=$?
exit "$status"
