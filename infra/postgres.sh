#!/usr/bin/env bash
# Local PostgreSQL 15 cluster for Sluice: loopback TCP on [database].port, socket inside .sluice
# (the services connect through the socket: [database].socket_dir; the role logs in with its
# password there as on TCP).
# Usage: infra/postgres.sh {start|wait|stop|status|restart|reset}
#   restart: a fast restart of a running server (pg_ctl -m fast restart), for the fault suite
#
# We run as root and postgres refuses to run as root, so initdb/pg_ctl run as the `postgres`
# OS user on a data dir chowned to it.
#
# Durability: fsync=off is set for dev speed on a shared 2-core box. It only matters if the
# whole machine (kernel) crashes; killing the postgres process still loses nothing committed,
# because synchronous_commit stays at its default (on) and WAL is written before COMMIT returns.
# Crash tests in this project kill processes, never the kernel, so their semantics hold.
SCRIPT_TAG=postgres
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

PG_BIN="${PG_BIN:-/usr/lib/postgresql/15/bin}"
PG_PORT="$(config_get database.port 54329)"
PG_ROOT="$DATA_DIR/pg"
PG_DATA="$PG_ROOT/data"
PG_SOCK="$PG_ROOT/run"
PG_LOG="$LOG_DIR/postgres.log"
PG_OS_USER=postgres
DB_NAME=sluice
DB_USER=sluice
DB_PASSWORD=sluice

as_pg() { runuser -u "$PG_OS_USER" -- "$@"; }

require_binaries() {
  [[ -x "$PG_BIN/postgres" && -x "$PG_BIN/pg_ctl" ]] \
    || die "PostgreSQL 15 server binaries missing in $PG_BIN (run infra/setup.sh, or: apt-get install -y postgresql-15)"
  id "$PG_OS_USER" >/dev/null 2>&1 || die "OS user '$PG_OS_USER' missing (it comes with the postgresql-15 package)"
}

# The postgres user must be able to walk down to the data dir: give o+x to any parent lacking it.
ensure_traversable() {
  local dir="$PG_ROOT"
  while [[ "$dir" != "/" ]]; do
    dir="$(dirname "$dir")"
    if ! as_pg test -x "$dir" 2>/dev/null; then
      say "granting o+x on $dir so the postgres user can reach its data dir"
      chmod o+x "$dir"
    fi
  done
}

postmaster_pid() { head -n1 "$PG_DATA/postmaster.pid" 2>/dev/null || true; }

is_running() {
  local pid; pid="$(postmaster_pid)"
  [[ -n "$pid" ]] && proc_alive "$pid" && as_pg "$PG_BIN/pg_ctl" -D "$PG_DATA" status >/dev/null 2>&1
}

psql_admin() { as_pg "$PG_BIN/psql" -X -q -v ON_ERROR_STOP=1 -h "$PG_SOCK" -p "$PG_PORT" -d postgres "$@"; }

init_cluster() {
  say "initdb in $PG_DATA"
  mkdir -p "$PG_ROOT" "$PG_SOCK" "$LOG_DIR"
  ensure_traversable
  chown "$PG_OS_USER": "$PG_ROOT" "$PG_SOCK"
  rm -rf "$PG_DATA"
  as_pg "$PG_BIN/initdb" -D "$PG_DATA" -U postgres --encoding=UTF8 --locale=C.UTF-8 \
      --auth-local=peer --auth-host=scram-sha-256 >"$LOG_DIR/initdb.log" 2>&1 \
    || { tail -n 20 "$LOG_DIR/initdb.log" >&2; die "initdb failed (full log: $LOG_DIR/initdb.log)"; }
  cat >>"$PG_DATA/postgresql.conf" <<CONF

# --- Sluice local dev settings (infra/postgres.sh) ---
listen_addresses = '127.0.0.1'
port = $PG_PORT
unix_socket_directories = '$PG_SOCK'
max_connections = 200
fsync = off                 # dev speed; see the durability note in infra/postgres.sh
full_page_writes = off      # only protects against torn pages on an OS crash, like fsync
# synchronous_commit stays on (default): a COMMIT that returned is in the WAL.
log_min_messages = warning
CONF
}

# The app role logs in with its password on the unix socket too (initdb's `local all all peer` would
# ask for an OS user of its name): services on this machine connect through the socket, where a
# statement's transport costs less CPU than on loopback TCP ([database].socket_dir; README, issue 9,
# for what it measured). Run on every start, before the server starts or (a cluster created before
# this line) followed by a reload.
HBA_SOCKET_LINE="local   all             $DB_USER                                  scram-sha-256"

allow_password_on_socket() {
  local hba="$PG_DATA/pg_hba.conf"
  grep -qxF "$HBA_SOCKET_LINE" "$hba" && return 1
  # pg_hba.conf is read top down, first match wins: the line goes before initdb's peer line.
  { echo "# Sluice (infra/postgres.sh): the app role with its password on the unix socket"
    echo "$HBA_SOCKET_LINE"
    cat "$hba"; } >"$hba.new"
  chown "$PG_OS_USER": "$hba.new"; chmod 600 "$hba.new"
  mv "$hba.new" "$hba"
  say "pg_hba.conf: $DB_USER logs in with its password on the unix socket"
}

# Bumped when bootstrap_roles gains a statement, so that an existing cluster runs it (idempotent).
BOOTSTRAP_STAMP="$PG_ROOT/.bootstrapped-2"

bootstrap_roles() {
  say "creating role $DB_USER and database $DB_NAME"
  psql_admin <<SQL
DO \$\$ BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '$DB_USER') THEN
    CREATE ROLE $DB_USER LOGIN CREATEDB PASSWORD '$DB_PASSWORD';
  END IF;
END \$\$;
-- The tests drop their databases WITH (FORCE). An autovacuum worker on that database has no
-- role, so without pg_signal_backend the drop fails now and then with "must be a member of the
-- role whose process is being terminated" (seen in test teardowns on a busy box).
GRANT pg_signal_backend TO $DB_USER;
SQL
  if [[ -z "$(psql_admin -tAc "SELECT 1 FROM pg_database WHERE datname = '$DB_NAME'")" ]]; then
    psql_admin -c "CREATE DATABASE $DB_NAME OWNER $DB_USER"
  fi
  touch "$BOOTSTRAP_STAMP"
}

wait_ready() {
  local deadline=$((SECONDS + ${1:-30}))
  while (( SECONDS < deadline )); do
    if "$PG_BIN/pg_isready" -q -h 127.0.0.1 -p "$PG_PORT"; then return 0; fi
    sleep 0.5
  done
  return 1
}

cmd_start() {
  require_binaries
  mkdir -p "$LOG_DIR"
  if is_running; then
    [[ -f "$BOOTSTRAP_STAMP" ]] || bootstrap_roles
    if allow_password_on_socket; then as_pg "$PG_BIN/pg_ctl" -D "$PG_DATA" reload >/dev/null; fi
    say "already running on 127.0.0.1:$PG_PORT"; return 0
  fi
  local holder; holder="$(port_listener "$PG_PORT")"
  [[ -z "$holder" ]] || die "port $PG_PORT is taken by something else: $holder"
  [[ -f "$PG_DATA/PG_VERSION" ]] || init_cluster
  # A postmaster killed with SIGKILL leaves its pid file; postgres itself refuses to start while
  # that pid still exists (a zombie not yet reaped), so wait for it to be gone.
  local stale; stale="$(postmaster_pid)"
  if [[ -n "$stale" ]] && ! wait_gone "$stale" 10; then
    die "an old postmaster (pid $stale) is still present; stop it first"
  fi
  ensure_traversable
  allow_password_on_socket || true
  touch "$PG_LOG"; chown "$PG_OS_USER": "$PG_LOG"
  say "starting on 127.0.0.1:$PG_PORT (data $PG_DATA, log $PG_LOG)"
  if ! as_pg "$PG_BIN/pg_ctl" -D "$PG_DATA" -l "$PG_LOG" -w -t 30 start >"$LOG_DIR/pg_ctl.out" 2>&1; then
    cat "$LOG_DIR/pg_ctl.out" >&2
    tail -n 20 "$PG_LOG" >&2
    die "PostgreSQL failed to start (log above: $PG_LOG)"
  fi
  [[ -f "$BOOTSTRAP_STAMP" ]] || bootstrap_roles
  say "up: postgresql://$DB_USER:$DB_PASSWORD@127.0.0.1:$PG_PORT/$DB_NAME"
}

cmd_wait() {
  require_binaries
  if wait_ready 30; then say "ready on 127.0.0.1:$PG_PORT"; return 0; fi
  [[ -f "$PG_LOG" ]] && tail -n 20 "$PG_LOG" >&2
  die "not ready on 127.0.0.1:$PG_PORT after 30 s"
}

cmd_stop() {
  if [[ -x "$PG_BIN/pg_ctl" ]] && is_running; then
    as_pg "$PG_BIN/pg_ctl" -D "$PG_DATA" -m fast -w -t 30 stop >/dev/null
    say "stopped"
  else
    say "not running"
  fi
}

cmd_restart() {
  require_binaries
  is_running || die "not running on 127.0.0.1:$PG_PORT"
  as_pg "$PG_BIN/pg_ctl" -D "$PG_DATA" -l "$PG_LOG" -m fast -w -t 30 restart >"$LOG_DIR/pg_ctl.out" 2>&1 \
    || { cat "$LOG_DIR/pg_ctl.out" >&2; die "restart failed (log: $PG_LOG)"; }
  say "restarted on 127.0.0.1:$PG_PORT"
}

cmd_status() {
  if is_running; then
    say "running on 127.0.0.1:$PG_PORT (pid $(postmaster_pid))"
  else
    say "not running"; return 3
  fi
}

cmd_reset() {
  cmd_stop
  rm -rf "$PG_ROOT"
  say "data removed ($PG_ROOT); next start creates a fresh cluster"
}

case "${1:-}" in
  start) cmd_start ;;
  wait) cmd_wait ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  restart) cmd_restart ;;
  reset) cmd_reset ;;
  *) echo "usage: $0 {start|wait|stop|status|restart|reset}" >&2; exit 2 ;;
esac
