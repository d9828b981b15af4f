#!/usr/bin/env bash
# mypy resolves modules from folders, not from the editable install's package-dir mapping, so
# lint type-checks a tree of links that spells the import root out: build/typecheck/sluice holds
# the package's own folders plus services/, ledger/ and migrations/; sluice_client is clients/.
set -euo pipefail
cd "$(dirname "$0")/.."
tree=build/typecheck
rm -rf "$tree" && mkdir -p "$tree/sluice"
for entry in sluice/*; do ln -s "$PWD/$entry" "$tree/sluice/$(basename "$entry")"; done
for folder in services ledger migrations; do ln -s "$PWD/$folder" "$tree/sluice/$folder"; done
ln -s "$PWD/clients" "$tree/sluice_client"
echo "$tree"
