"""The replicas a router routes over, grouped into pools by model version.

Seeded from config (``[[replicas]]`` tables) and changeable at run time
(``upsert`` / ``remove``). ``views`` joins each member's static facts with its
health (router.health) and load (router.load) into the ``ReplicaView`` values
every policy takes, so a host builds a decision's input in one call::

    views = registry.views(request.model_version, now, health, loads)
    decision = policy.choose(request, views, now)

Config table keys: name, pool (model version; "" serves every model),
grpc_address (host:port), metrics_url or metrics_port (on the gRPC host),
block_size (tokens per KV block), kv_capacity_blocks, long_context, state. The block
size and capacity a replica reports in its metrics win over the configured
ones once scraped: the replica knows its own KV pool.

State (written by the autoscaler, sluice/autoscaler): only a ``serving`` replica
takes new runs. A ``warm`` one is loaded and registered (health-checked and
scraped) but routed nothing until promoted; a ``draining`` one takes no new run
while the runs it holds finish. Neither appears in ``views``, so neither a first
choice nor a retry lands on it; a run already streaming from it is untouched.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sluice.router.health import HealthBook
from sluice.router.load import LoadTracker
from sluice.router.policy import ReplicaView

DEFAULT_BLOCK_SIZE = 16
DEFAULT_KV_CAPACITY_BLOCKS = 4096
MISSING_KEY = "replica table {index} lacks {key!r}"
DUPLICATE_NAME = "replica {name!r} is configured twice"
BAD_VALUE = "replica {name!r}: {key} must be a positive integer, got {value!r}"
BAD_STATE = "replica {name!r}: state must be one of {states}, got {value!r}"
SERVING, WARM, DRAINING = "serving", "warm", "draining"
STATES = (SERVING, WARM, DRAINING)


class RegistryError(ValueError):
    """A replica table is malformed."""


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    name: str
    pool: str                           # model version served ("" = every model)
    grpc_address: str                   # Triton gRPC host:port
    metrics_url: str = ""               # Prometheus endpoint ("" = not scraped)
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_capacity_blocks: int = DEFAULT_KV_CAPACITY_BLOCKS
    long_context: bool = False          # member of the long-context pool
    # Its tensorrt_llm model declares the trust scope's cache_salt_id input (Sluice's replica does;
    # tensorrtllm_backend's does not: deploy/triton/README.md). False: requests go unsalted.
    cache_salt_id: bool = True
    state: str = SERVING                # SERVING takes new runs; WARM and DRAINING do not

    @classmethod
    def from_table(cls, table: Mapping[str, object], index: int = 0) -> ReplicaSpec:
        for key in ("name", "grpc_address"):
            if not table.get(key):
                raise RegistryError(MISSING_KEY.format(index=index, key=key))
        name = str(table["name"])
        grpc_address = str(table["grpc_address"])
        metrics_url = str(table.get("metrics_url") or "")
        metrics_port = table.get("metrics_port")
        if not metrics_url and metrics_port:
            host = grpc_address.rsplit(":", 1)[0]
            metrics_url = f"http://{host}:{metrics_port}/metrics"
        return cls(
            name=name, pool=str(table.get("pool", "")), grpc_address=grpc_address, metrics_url=metrics_url,
            block_size=_positive(table, "block_size", DEFAULT_BLOCK_SIZE, name),
            kv_capacity_blocks=_positive(table, "kv_capacity_blocks", DEFAULT_KV_CAPACITY_BLOCKS, name),
            long_context=bool(table.get("long_context", False)),
            cache_salt_id=bool(table.get("cache_salt_id", True)),
            state=_state(table, name),
        )


def _state(table: Mapping[str, object], name: str) -> str:
    value = str(table.get("state") or SERVING)
    if value not in STATES:
        raise RegistryError(BAD_STATE.format(name=name, states=", ".join(STATES), value=value))
    return value


def _positive(table: Mapping[str, object], key: str, default: int, name: str) -> int:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | str) or not str(value).isdigit() \
            or int(value) <= 0:
        raise RegistryError(BAD_VALUE.format(name=name, key=key, value=value))
    return int(value)


class ReplicaRegistry:
    def __init__(self, specs: Sequence[ReplicaSpec] = ()) -> None:
        self._specs: dict[str, ReplicaSpec] = {}
        # Decision-path caches: views() runs once per routing decision over every member of a pool,
        # and rebuilding 64 frozen views each time cost ~230 us, more than the policy's choice.
        self._members: dict[str, list[ReplicaSpec]] = {}
        self._views: dict[str, tuple[ReplicaSpec, str, LoadTracker | None, int, ReplicaView]] = {}
        for spec in specs:
            if spec.name in self._specs:
                raise RegistryError(DUPLICATE_NAME.format(name=spec.name))
            self._specs[spec.name] = spec

    @classmethod
    def from_config(cls, config: Mapping[str, object]) -> ReplicaRegistry:
        tables = config.get("replicas", [])
        assert isinstance(tables, list), "config['replicas'] must be a list of tables"
        return cls([ReplicaSpec.from_table(table, index) for index, table in enumerate(tables)])

    def upsert(self, spec: ReplicaSpec) -> ReplicaSpec | None:
        """Add or replace; returns the spec it replaced (None when new)."""
        previous = self._specs.get(spec.name)
        self._specs[spec.name] = spec
        self._members.clear()
        return previous

    def remove(self, name: str) -> ReplicaSpec | None:
        self._members.clear()
        self._views.pop(name, None)
        return self._specs.pop(name, None)

    def get(self, name: str) -> ReplicaSpec | None:
        return self._specs.get(name)

    def specs(self) -> list[ReplicaSpec]:
        return [self._specs[name] for name in sorted(self._specs)]

    def members(self, pool: str) -> list[ReplicaSpec]:
        """Replicas serving `pool`, including those that serve every model."""
        members = self._members.get(pool)
        if members is None:
            members = self._members[pool] = [spec for spec in self.specs() if spec.pool in (pool, "")]
        return list(members)

    def pools(self) -> dict[str, list[str]]:
        grouped: dict[str, list[str]] = {}
        for spec in self.specs():
            grouped.setdefault(spec.pool, []).append(spec.name)
        return grouped

    def views(self, pool: str, now: float, health: HealthBook | None = None,
              loads: LoadTracker | None = None) -> list[ReplicaView]:
        """Healthy members of `pool` with their current load, ready for policy.choose().

        A member's view is rebuilt only when its spec or its load (``loads.version``) changed."""
        views: list[ReplicaView] = []
        cache = self._views
        for spec in self._members.get(pool) or self.members(pool):
            name = spec.name
            if spec.state != SERVING:
                continue
            if health is not None and not health.is_healthy(name, now):
                continue
            version = loads.version(name) if loads is not None else -1
            cached = cache.get(name)
            if cached is not None and cached[0] is spec and cached[1] == pool and cached[2] is loads \
                    and cached[3] == version:
                views.append(cached[4])
                continue
            view = _view(spec, pool, loads)
            cache[name] = (spec, pool, loads, version, view)
            views.append(view)
        return views


def _view(spec: ReplicaSpec, pool: str, loads: LoadTracker | None) -> ReplicaView:
    if loads is None:
        return ReplicaView(name=spec.name, pool=spec.pool or pool, block_size=spec.block_size,
                           kv_capacity_blocks=spec.kv_capacity_blocks, long_context=spec.long_context)
    load = loads.load(spec.name)
    return ReplicaView(
        name=spec.name, pool=spec.pool or pool,
        block_size=load.block_size or spec.block_size,
        kv_capacity_blocks=load.kv_capacity_blocks or spec.kv_capacity_blocks,
        long_context=spec.long_context, waiting=load.waiting, running=load.running,
        kv_used_blocks=load.kv_used_blocks, in_flight=load.in_flight,
        start_time=load.start_time, host_kv_capacity_blocks=load.host_kv_capacity_blocks,
        host_block_cost=load.host_block_cost, step_time_s=load.step_time_s,
    )
