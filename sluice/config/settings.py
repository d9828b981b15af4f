"""Sluice's settings: one frozen, typed object parsed once per process.

Sources, later ones winning key by key:
  1. the packaged defaults, `sluice/config/sluice.toml`;
  2. the file SLUICE_CONFIG names, if any (a partial file: it overrides only the keys it sets;
     a list such as [[replicas]] replaces the default list whole);
  3. the environment: SLUICE_<SECTION>__<KEY> for one key (SLUICE_KAFKA__BOOTSTRAP=host:port),
     SLUICE_REPLICAS for the replica list as a JSON array of tables.

Every section forbids keys it does not know, so a typo in a file or in an override
(SLUICE_KAFKA__BOOTSRAP) stops start-up, as does a wrong type (`lease_seconds = "abc"`) or an
out-of-range value; the message names the key and where it came from. Secrets are read from the
environment only (SLUICE_DATABASE__PASSWORD): a file that sets one is refused.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)
from pydantic_settings.sources.utils import parse_env_vars

# The defaults ship inside the package, found beside this module.
DEFAULT_CONFIG_PATH = Path(__file__).resolve().parent / "sluice.toml"
ENV_PREFIX = "SLUICE_"
CONFIG_FILE_VARIABLE = "SLUICE_CONFIG"
SECRET_KEYS = (("database", "password"),)   # environment only, never a file

Port = Annotated[int, Field(ge=0, le=65535)]
Positive = Annotated[float, Field(gt=0)]
NonNegative = Annotated[float, Field(ge=0)]
PositiveInt = Annotated[int, Field(ge=1)]


# Hosts a plaintext listener may use without [tls].plaintext_off_loopback (gateway, Routing API, replicas).
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1")


class ConfigError(ValueError):
    """The configuration is malformed; the message names each offending key and its source."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _listen_address(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    return value


class PathsSection(Section):
    data_dir: str = ".sluice"          # all local state: postgres, kafka, logs


class DatabaseSection(Section):
    port: Port = 54329
    dsn: str = "postgresql+asyncpg://sluice@127.0.0.1:54329/sluice"
    password: SecretStr | None = None  # SLUICE_DATABASE__PASSWORD; replaces the DSN's password
    # The unix socket directory of the PostgreSQL on this machine: a DSN to a loopback host connects
    # through the socket there when the server has one for the DSN's port (through_local_socket).
    # Unset: {paths.data_dir}/pg/run, where infra/postgres.sh puts it; "": always as the DSN says.
    socket_dir: str | None = None

    @property
    def url(self) -> str:
        """The DSN with the password from the environment, when one is set, through the local
        server's unix socket when it has one (socket_dir)."""
        dsn = self.dsn
        if self.password is not None:
            from sqlalchemy.engine import make_url

            dsn = make_url(dsn).set(password=self.password.get_secret_value()).render_as_string(
                hide_password=False)
        return through_local_socket(dsn, self.socket_dir)


def through_local_socket(dsn: str, socket_dir: str | None) -> str:
    """`dsn` through the unix socket in `socket_dir` (relative: from the working directory) when it
    names a loopback host and a server listens there on its port (.s.PGSQL.<port>; only the server
    bound to that port on this machine can have it) and asks for no TLS (a socket carries none);
    otherwise `dsn` unchanged. One statement's transport costs ~35% less CPU over the socket than
    over loopback TCP, client and backend alike (a microbenchmark; in the platform the statements'
    own work dwarfs it: README, issue 9)."""
    if not socket_dir:
        return dsn
    from sqlalchemy.engine import URL, make_url

    url = make_url(dsn)
    if url.host not in LOOPBACK_HOSTS or _asks_for_tls(url.query):
        return dsn
    port = url.port or 5432
    directory = Path(socket_dir).absolute()
    if not (directory / f".s.PGSQL.{port}").exists():
        return dsn
    # asyncpg and SQLAlchemy's asyncpg dialect both take a socket directory as the `host` query
    # parameter, and only while the URL itself names no host.
    return URL.create(url.drivername, url.username, url.password, None, None, url.database,
                      {**url.query, "host": str(directory), "port": str(port)}
                      ).render_as_string(hide_password=False)


def _asks_for_tls(query: Mapping[str, Any]) -> bool:
    """A DSN query that wants TLS (asyncpg's `ssl`, libpq's `sslmode`), anything but disable/false."""
    wanted = [query.get(name) for name in ("ssl", "sslmode") if query.get(name) is not None]
    return any(str(value).lower() not in ("disable", "false", "0", "off") for value in wanted)


class KafkaSection(Section):
    bootstrap: str = "127.0.0.1:19092"
    controller_port: Port = 19093
    events_topic: str = Field(default="sluice.run-events", min_length=1)
    partitions: PositiveInt = 4
    retention_ms: PositiveInt = 604_800_000
    coalesce_ms: NonNegative = 200.0
    coalesce_max_tokens: Annotated[int, Field(ge=0)] = 32
    coalesce_aligned: bool = True
    producer_linger_ms: Annotated[int, Field(ge=0)] = 20
    brokers: Literal[1, 3] = 1         # 1: the single broker; 3: infra/kafka_cluster.sh's cluster
    cluster_bootstrap: str = "127.0.0.1:19111,127.0.0.1:19121,127.0.0.1:19131"
    cluster_controller_ports: str = "19112,19122,19132"

    @field_validator("brokers", mode="before")
    @classmethod
    def _brokers_from_text(cls, value: object) -> object:
        # The environment gives text ("3"), which a Literal of ints never equals.
        return int(value) if isinstance(value, str) and value.strip().isdigit() else value


class ListenSection(Section):
    listen: str

    _check_listen = field_validator("listen")(_listen_address)


class AdmissionSection(ListenSection):
    listen: str = "127.0.0.1:50051"
    default_deadline_ms: PositiveInt = 600_000
    max_request_key_chars: PositiveInt = 128
    max_input_bytes: PositiveInt = 1_048_576
    max_deadline_ms: PositiveInt = 86_400_000
    max_backlog_per_pool: PositiveInt = 1_000
    pool_drain_runs_per_s: Positive = 50.0
    expected_ms_per_output_token: NonNegative = 7.0
    expected_ms_per_prompt_token: NonNegative = 0.03


class GatewaySection(Section):
    """How gateway processes (`services.main --role gateway`) run."""

    reuse_port: bool = False                         # several gateway processes share each address
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"
    metrics_port: Port = 50065                       # Prometheus /metrics of the gateway; 0 = not served
    grpc_server: Literal["h2", "aio"] = "h2"         # h2: services/h2server.py (plaintext; TLS stays aio)
    # The event-log partitions this process places the runs it admits on, and so follows (eventlog/
    # partitioning.py); empty: one chosen by process id. Give a box's gateways disjoint sets.
    event_partitions: tuple[Annotated[int, Field(ge=0)], ...] = ()


class RunsSection(ListenSection):
    listen: str = "127.0.0.1:50052"


class UsageSection(ListenSection):
    listen: str = "127.0.0.1:50053"


class HttpSection(ListenSection):
    """The HTTP edge the gateway serves (services/edge)."""

    enabled: bool = True
    listen: str = "127.0.0.1:8080"
    max_body_bytes: PositiveInt = 4 * 1024 * 1024
    default_max_tokens: PositiveInt = 256
    model_card_ttl_s: NonNegative = 5.0


class TlsSection(Section):
    """TLS on every gRPC listener (gateway, Routing API): PEM files; a client CA makes it mutual."""

    cert_file: str = ""               # server certificate chain; "" = plaintext
    key_file: str = ""
    client_ca_file: str = ""          # set: clients must present a certificate this CA signed
    plaintext_off_loopback: bool = False   # allow plaintext on a non-loopback address (not advised)

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)

    def model_post_init(self, context: Any) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("tls.cert_file and tls.key_file go together")
        if self.client_ca_file and not self.cert_file:
            raise ValueError("tls.client_ca_file needs tls.cert_file and tls.key_file")


class ReplicaTlsSection(Section):
    """TLS on the gateway/worker -> Triton hop. One section for both ends of it: a replica host
    serves with cert_file/key_file, a routing worker verifies replicas with ca_file; client_ca_file
    (replica) and client_cert_file/client_key_file (worker) make it mutual."""

    ca_file: str = ""                 # clients: connect to replicas with TLS, verifying this CA
    cert_file: str = ""               # replica hosts: serve gRPC with this certificate chain
    key_file: str = ""
    client_ca_file: str = ""          # replica hosts: require client certificates this CA signed
    client_cert_file: str = ""        # clients: the certificate presented to a mutual-TLS replica
    client_key_file: str = ""

    def model_post_init(self, context: Any) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("replica_tls.cert_file and replica_tls.key_file go together")
        if bool(self.client_cert_file) != bool(self.client_key_file):
            raise ValueError("replica_tls.client_cert_file and replica_tls.client_key_file go together")
        if self.client_ca_file and not self.cert_file:
            raise ValueError("replica_tls.client_ca_file needs replica_tls.cert_file and key_file")
        if self.client_cert_file and not self.ca_file:
            raise ValueError("replica_tls.client_cert_file needs replica_tls.ca_file")


class RoutingSection(ListenSection):
    listen: str = "127.0.0.1:50054"
    policy: Literal["prefix_aware", "least_loaded", "round_robin"] = "prefix_aware"
    policy_options: dict[str, float] = Field(default_factory=dict)
    lease_seconds: Positive = 5.0
    poll_interval_ms: Positive = 50.0
    max_runs_per_worker: PositiveInt = 64
    first_token_timeout_s: Positive = 30.0
    max_attempts: PositiveInt = 2
    scrape_interval_ms: NonNegative = 250.0
    metrics_port: Port = 50064
    canary_check_interval_s: NonNegative = 5.0


class TrafficSection(Section):
    """Priority classes, batch headroom and the degradation ladder (sluice/traffic/; sluice.toml)."""

    batch_max_queue_depth: Positive = 1.0
    batch_max_kv_utilization: Annotated[float, Field(gt=0, le=1)] = 0.7
    batch_max_slot_utilization: Annotated[float, Field(gt=0, le=1)] = 0.1
    max_batch_backlog_per_pool: PositiveInt = 10_000
    default_batch_deadline_ms: PositiveInt = 21_600_000
    max_batch_deadline_ms: PositiveInt = 259_200_000
    shed_batch_backlog_fraction: Annotated[float, Field(gt=0, le=1)] = 0.25
    fallback_backlog_fraction: Annotated[float, Field(gt=0, le=1)] = 0.5
    drain_window_s: Positive = 10.0
    min_drained_to_measure: PositiveInt = 10
    max_retry_after_ms: PositiveInt = 60_000


class TelemetrySection(Section):
    exporter: Literal["none", "console", "memory", "otlp"] = "none"
    endpoint: str = "http://127.0.0.1:4317"          # otlp: the collector (http/protobuf: http://host:4318)
    protocol: Literal["grpc", "http/protobuf"] = "grpc"
    sampling: Annotated[float, Field(ge=0, le=1)] = 1.0   # fraction of runs traced
    metrics_interval_ms: NonNegative = 10_000.0      # otlp: metrics pushed this often; 0 = not pushed
    ttft_slo_ms: Positive = 500.0
    tpot_slo_ms: Positive = 50.0


class ReplicaSection(Section):
    """One replica host's engine (sluice.replica.serve); sluice.toml documents every key."""

    model_version: str = "tiny-chat-v1"
    engine: Literal["core", "simple"] = "core"
    interface: Literal["tensorrt_llm", "legacy"] = "tensorrt_llm"
    cache_salt_id: bool = True
    vocab_size: PositiveInt = 4096
    first_normal_id: Annotated[int, Field(ge=0)] = 5
    output_length: Literal["cap", "lognormal", "fixed", "uniform"] = "cap"
    executor: Literal["timing", "model"] = "timing"
    model_path: str = ""
    model: str = "llama-3-8b"
    weights: str = "bf16"
    kv: str = ""
    hardware: str = "h100-sxm"
    tp: PositiveInt = 1
    time_scale: Positive = 1.0
    fixed_overhead_ms: NonNegative = 0.0
    block_size: PositiveInt = 32
    num_blocks: Annotated[int, Field(ge=0)] = 0
    max_num_seqs: PositiveInt = 256
    max_num_tokens: PositiveInt = 8192
    scheduler_policy: Literal["guaranteed_no_evict", "max_utilization"] = "guaranteed_no_evict"
    chunked_context: bool = True
    prefix_reuse: bool = True
    host_kv_blocks: Annotated[int, Field(ge=-1)] = 0
    output_mean: Positive = 350.0
    output_p95: Positive = 1200.0
    output_tokens: PositiveInt = 64
    token_delay_ms: NonNegative = 20.0
    max_batch: PositiveInt = 256
    min_fraction: Annotated[float, Field(gt=0, le=1)] = 0.25


class AutoscalerPoolTable(Section):
    """One pool's `[autoscaler.pools.<pool>]` table: sluice.autoscaler.control.ScalerConfig's knobs
    (sluice.toml documents each) and the `replica = {…}` keys of the replicas it starts."""

    runs_per_replica: Positive = 8.0
    min_replicas: Annotated[int, Field(ge=0)] = 1
    max_replicas: PositiveInt = 4
    warm_pool: Annotated[int, Field(ge=0)] = 1
    target_utilization: Annotated[float, Field(gt=0, le=1)] = 0.8
    scale_in_utilization: Annotated[float, Field(gt=0, le=1)] = 0.5
    target_kv_utilization: Annotated[float, Field(gt=0, le=1)] = 0.85
    ttft_headroom: Annotated[float, Field(gt=0, le=1)] = 0.8
    cold_start_s: Positive = 10.0
    scale_out_cooldown_s: NonNegative = 15.0
    scale_in_cooldown_s: NonNegative = 120.0
    replica: dict[str, Any] = Field(default_factory=dict)

    @field_validator("replica")
    @classmethod
    def _known_replica_keys(cls, value: dict[str, Any]) -> dict[str, Any]:
        ReplicaSection.model_validate(value)
        return value


class KubernetesSection(Section):
    """`[autoscaler.kubernetes]`: where the kubernetes provider finds the pool's Deployment
    (sluice.autoscaler.k8s). Empty api_url/token_file/ca_file/namespace: the pod's service account."""

    api_url: str = ""                  # "": https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT
    token_file: str = ""               # "": <service account>/token (re-read per request: it rotates)
    ca_file: str = ""                  # "": <service account>/ca.crt
    namespace: str = ""                # "": <service account>/namespace
    deployment: str = "{pool}"         # the pool's Deployment ({pool} is replaced by the pool's name)
    selector: str = ""                 # its pods' label selector; "": the scale subresource's
    port: int = Field(default=8001, ge=1, le=65535)           # Triton gRPC port on each pod
    metrics_port: int = Field(default=8002, ge=1, le=65535)   # Triton metrics port on each pod
    poll_s: Positive = 2.0             # pod listing interval while a start or stop waits


class AutoscalerSection(Section):
    """`python -m sluice.autoscaler --pool P` (one process per pool): the control loop's timing."""

    interval_s: Positive = 5.0
    window_s: Positive = 30.0
    slope_windows: PositiveInt = 3
    drain_settle_s: NonNegative = 2.0
    start_timeout_s: Positive = 300.0
    stop_grace_s: Positive = 10.0
    provider: Literal["local", "kubernetes"] = "local"
    kubernetes: KubernetesSection = KubernetesSection()
    pools: dict[str, AutoscalerPoolTable] = Field(default_factory=dict)


class ReplicaTable(Section):
    """One [[replicas]] entry: where a routing worker finds a replica (and a replica host its ports)."""

    name: str = Field(min_length=1)
    pool: str = ""
    grpc_address: str
    http_port: Port | None = None
    metrics_port: Port | None = None
    metrics_url: str | None = None
    block_size: PositiveInt | None = None
    kv_capacity_blocks: PositiveInt | None = None
    long_context: bool = False
    # This replica's own [replica] keys (e.g. executor = "model"), over the shared section.
    replica: dict[str, Any] = Field(default_factory=dict)

    _check_address = field_validator("grpc_address")(_listen_address)

    @field_validator("replica")
    @classmethod
    def _known_replica_keys(cls, value: dict[str, Any]) -> dict[str, Any]:
        ReplicaSection.model_validate(value)   # unknown keys, types and ranges, as in [replica]
        return value

    def as_table(self) -> dict[str, Any]:
        """The keys this entry sets (the form ReplicaRegistry.from_config and SLUICE_REPLICAS take)."""
        return self.model_dump(exclude_none=True)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(extra="forbid", frozen=True, env_prefix=ENV_PREFIX,
                                      env_nested_delimiter="__", case_sensitive=False)

    paths: PathsSection = PathsSection()
    database: DatabaseSection = DatabaseSection()
    kafka: KafkaSection = KafkaSection()
    admission: AdmissionSection = AdmissionSection()
    gateway: GatewaySection = GatewaySection()
    runs: RunsSection = RunsSection()
    usage: UsageSection = UsageSection()
    http: HttpSection = HttpSection()
    tls: TlsSection = TlsSection()
    replica_tls: ReplicaTlsSection = ReplicaTlsSection()
    routing: RoutingSection = RoutingSection()
    traffic: TrafficSection = TrafficSection()
    telemetry: TelemetrySection = TelemetrySection()
    replica: ReplicaSection = ReplicaSection()
    autoscaler: AutoscalerSection = AutoscalerSection()
    replicas: list[ReplicaTable] = Field(default_factory=list)

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings],
                                   init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        # load_settings() passes the already merged sources as init values; nothing is read here.
        return (init_settings,)

    @model_validator(mode="before")
    @classmethod
    def _local_socket_in_data_dir(cls, values: Any) -> Any:
        """[database].socket_dir unset: the socket infra/postgres.sh gives the server it runs."""
        if not isinstance(values, Mapping):
            return values
        database, paths = values.get("database", {}), values.get("paths", {})
        if not isinstance(database, Mapping) or "socket_dir" in database:
            return values
        # [paths] as a table or as a section already built (Settings(paths=PathsSection(...))).
        data_dir = paths.get("data_dir") if isinstance(paths, Mapping) else getattr(paths, "data_dir", None)
        if data_dir is None:
            data_dir = PathsSection().data_dir
        return {**values, "database": {**database, "socket_dir": str(Path(data_dir) / "pg" / "run")}}

    def updated(self, **changes: Any) -> Settings:
        """A validated copy with some sections changed: a mapping merges into its section,
        anything else (the replica list) replaces it. Tests and tools derive variants this way."""
        data = self.model_dump()
        for name, value in changes.items():
            if name not in type(self).model_fields:
                raise ConfigError(f"no section [{name}]")
            data[name] = {**data[name], **value} if isinstance(value, Mapping) else value
        return type(self).model_validate(data)

    def replica_section_for(self, entry: ReplicaTable) -> ReplicaSection:
        """[replica] with the entry's own `replica = {…}` keys over it, validated like the section."""
        try:
            return ReplicaSection.model_validate({**self.replica.model_dump(), **entry.replica})
        except ValidationError as exc:
            raise ConfigError(f"replicas entry {entry.name!r}: replica = {entry.replica}: {exc}") from None

    def replica_tables(self) -> list[dict[str, Any]]:
        return [entry.as_table() for entry in self.replicas]

    def data_dir(self) -> Path:
        """The one folder holding every local server's state; a relative path is taken from the
        working directory (the repository root for `make` targets), never from the package."""
        path = Path(self.paths.data_dir)
        return path if path.is_absolute() else Path.cwd() / path


class _Environment(EnvSettingsSource):
    """SLUICE_* variables from a given mapping (the process environment unless a test passes one)."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        self._given = environ
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return parse_env_vars(self._given, self.case_sensitive, self.env_ignore_empty,
                              self.env_parse_none_str)


def _unknown_sections(environ: Mapping[str, str]) -> list[str]:
    """SLUICE_<SECTION>__… variables whose section does not exist (pydantic-settings skips them)."""
    sections = set(Settings.model_fields)
    return sorted(name for name in environ if name.upper().startswith(ENV_PREFIX) and "__" in name
                  and name[len(ENV_PREFIX):].split("__", 1)[0].lower() not in sections)


def _secrets_in_files(files: Sequence[Path], values: Mapping[str, Any]) -> list[str]:
    found = []
    for section, key in SECRET_KEYS:
        table = values.get(section)
        if isinstance(table, Mapping) and key in table:
            found.append(f"{section}.{key}: a secret is read from the environment "
                         f"({ENV_PREFIX}{section.upper()}__{key.upper()}), not from a file "
                         f"({', '.join(map(str, files))})")
    return found


def _origin(loc: tuple[int | str, ...], environ: Mapping[str, str], files: Sequence[Path]) -> str:
    upper = {name.upper() for name in environ}
    for depth in range(len(loc), 0, -1):
        name = ENV_PREFIX + "__".join(str(part) for part in loc[:depth]).upper()
        if name in upper:
            return name
    prefix = f"{ENV_PREFIX}{str(loc[0]).upper()}__" if loc else ENV_PREFIX
    section = sorted(name for name in upper if name.startswith(prefix))
    return ", ".join([*(str(path) for path in files), *section])


def _describe(error: ValidationError, environ: Mapping[str, str], files: Sequence[Path]) -> list[str]:
    lines = []
    for item in error.errors():
        loc = tuple(item["loc"])
        key = ".".join(str(part) for part in loc)
        message = "unknown key" if item["type"] == "extra_forbidden" else item["msg"]
        lines.append(f"{key}: {message} (from {_origin(loc, environ, files)})")
    return lines


def config_files(environ: Mapping[str, str], path: str | os.PathLike[str] | None = None) -> list[Path]:
    """The packaged defaults, then the file `path` or SLUICE_CONFIG names (if any)."""
    chosen = path or environ.get(CONFIG_FILE_VARIABLE)
    files = [DEFAULT_CONFIG_PATH]
    if chosen:
        override = Path(chosen)
        if not override.is_file():
            raise ConfigError(f"config file not found: {override}")
        if override.resolve() != DEFAULT_CONFIG_PATH:
            files.append(override)
    return files


def load_settings(path: str | os.PathLike[str] | None = None,
                  environ: Mapping[str, str] | None = None) -> Settings:
    """Parse the settings: packaged defaults, then SLUICE_CONFIG (or `path`), then SLUICE_* variables.
    Raises ConfigError naming every key that is unknown, mistyped or out of range."""
    env = dict(os.environ if environ is None else environ)
    files = config_files(env, path)
    problems = [f"{name}: unknown section (no [{name[len(ENV_PREFIX):].split('__', 1)[0].lower()}])"
                for name in _unknown_sections(env)]
    try:
        from_files = TomlConfigSettingsSource(Settings, toml_file=files, deep_merge=True)()
        from_env = _Environment(Settings, env)()
    except ValueError as exc:   # TOML syntax, or an environment value that is not the JSON it must be
        raise ConfigError(f"configuration unreadable: {exc}") from None
    problems += _secrets_in_files(files, from_files)
    merged = _deep_merge(from_files, from_env)
    try:
        settings = Settings(**merged)
    except ValidationError as exc:
        problems += _describe(exc, env, files)
        settings = None
    if problems or settings is None:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))
    return settings


def _deep_merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in top.items():
        below = merged.get(key)
        merged[key] = _deep_merge(below, value) if isinstance(below, Mapping) and isinstance(value, Mapping) \
            else value
    return merged


def env_value(value: object) -> str:
    """How a value is written into a SLUICE_<SECTION>__<KEY> variable: strings as they are,
    anything else as JSON (true, 3, 0.5, a list of tables)."""
    return value if isinstance(value, str) else json.dumps(value)


def env_overrides(section: str, values: Mapping[str, object]) -> dict[str, str]:
    """SLUICE_<SECTION>__<KEY> variables that set `values` in a child process's settings."""
    return {f"{ENV_PREFIX}{section.upper()}__{key.upper()}": env_value(value)
            for key, value in values.items()}
