# Shared helpers for the infra scripts; sourced, never run.
# Every path and port comes from config/sluice.toml (with SLUICE_<SECTION>__<KEY> overrides),
# read through sluice.config so the scripts and the services can never disagree.

set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The settings need pydantic-settings: the venv python (infra/setup.sh makes it first) reads them;
# a bare python3.11 only works where those packages are installed.
if [[ -x "$REPO_ROOT/.venv/bin/python" ]]; then
  PY="$REPO_ROOT/.venv/bin/python"
else
  PY="$(command -v python3.11 || command -v python3)"
fi

say() { printf '[%s] %s\n' "${SCRIPT_TAG:-infra}" "$*"; }
die() { printf '[%s] ERROR: %s\n' "${SCRIPT_TAG:-infra}" "$*" >&2; exit 1; }

# config_get section.key [default] -> prints the value (after env overrides).
config_get() {
  (cd "$REPO_ROOT" && "$PY" - "$1" "${2-}" <<'PYEOF'
import sys
from sluice.config import ConfigError, load_settings
dotted, default = sys.argv[1], sys.argv[2]
try:
    settings = load_settings()
except ConfigError as exc:
    raise SystemExit(str(exc)) from None
if dotted == "paths.data_dir":
    print(settings.data_dir()); raise SystemExit
section, key = dotted.split(".", 1)
value = getattr(getattr(settings, section, None), key, default)
if value in ("", None):
    raise SystemExit(f"config key {dotted} is missing and has no default")
print(value)
PYEOF
  )
}

DATA_DIR="$(config_get paths.data_dir)"
LOG_DIR="$DATA_DIR/logs"

# port_listener PORT -> prints the `ss` line of whoever listens on 127.0.0.1/any:PORT, if any.
port_listener() {
  ss -ltnpH "sport = :$1" 2>/dev/null || true
}

# wait_for_port PORT SECONDS -> 0 once something accepts TCP connections on 127.0.0.1:PORT.
wait_for_port() {
  local port="$1" deadline=$((SECONDS + $2))
  while (( SECONDS < deadline )); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then return 0; fi
    sleep 0.5
  done
  return 1
}

# proc_alive PID -> 0 if the process exists and is not a zombie. A server killed with SIGKILL stays
# a zombie until init reaps it (about 2 s here), and `kill -0` alone would call it running.
proc_alive() {
  local state
  state="$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" || return 1
  [[ -n "$state" && "$state" != "Z" ]]
}

# wait_gone PID SECONDS -> 0 once PID no longer exists at all (not even as a zombie).
wait_gone() {
  local deadline=$((SECONDS + $2))
  while [[ -e "/proc/$1" ]] && (( SECONDS < deadline )); do sleep 0.2; done
  [[ ! -e "/proc/$1" ]]
}

# write_kafka_log4j CONF LOGFILE [REQUEST_LEVEL] -> a log4j2 config for a Kafka node logging to LOGFILE
# (rolled at 50 MB, 3 kept; state-change chatter at warn, the request logger at REQUEST_LEVEL, default
# warn: debug writes a line per request, which is how bench_platform --request-log counts them).
# Shared by kafka.sh and kafka_cluster.sh.
write_kafka_log4j() {
  cat >"$1" <<XML
<?xml version="1.0" encoding="UTF-8"?>
<Configuration status="WARN">
  <Appenders>
    <RollingFile name="file" fileName="$2" filePattern="$2.%i">
      <PatternLayout pattern="[%d] %p %m (%c)%n"/>
      <SizeBasedTriggeringPolicy size="50 MB"/>
      <DefaultRolloverStrategy max="3"/>
    </RollingFile>
  </Appenders>
  <Loggers>
    <Logger name="kafka.request.logger" level="${3:-warn}"/>
    <Logger name="state.change.logger" level="warn"/>
    <Logger name="org.apache.kafka.controller" level="info"/>
    <Root level="info"><AppenderRef ref="file"/></Root>
  </Loggers>
</Configuration>
XML
}

# kafka_replication_properties RF MIN_ISR -> the server.properties lines that set how every topic,
# the internal ones included, is replicated (1 1 for the single broker, 3 2 for the cluster).
kafka_replication_properties() {
  cat <<PROPS
default.replication.factor=$1
min.insync.replicas=$2
offsets.topic.replication.factor=$1
transaction.state.log.replication.factor=$1
transaction.state.log.min.isr=$2
share.coordinator.state.topic.replication.factor=$1
share.coordinator.state.topic.min.isr=$2
PROPS
}
