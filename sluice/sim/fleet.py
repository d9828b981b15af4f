"""Discrete-event fleet simulator: N engine cores on one virtual clock.

Each replica is an `engine.core.EngineCore` in counting mode (no per-token
outputs) priced by the same `CostModel` the Triton replica uses. Events sit in
one heap ordered by (time, insertion order):

    arrival(turn)     route it through the RoutingPolicy, queue it on the replica
    wake(replica)     the replica's step (or decode run) ended: deliver first
                      tokens and finishes, then start the next step

A step's state change is applied when it starts and its outputs are delivered
when it ends, so a request arriving mid-step joins at the next step boundary,
as in an inflight-batching engine.

Decode runs. When a replica has only decodes to do and nothing it could
admit, its next k steps (until the first request finishes) are *planned*:
their durations are known, nothing is applied yet, and one wake is set at the
end. If a request arrives at that replica during the plan, the steps that have
started by then are applied (EngineCore.run_decode) and a wake is set at the
end of the one in progress, where the newcomer is admitted. This keeps the
work per replica proportional to arrivals + finishes + context steps rather
than to tokens.

Routing sees `ReplicaView`s built from each replica's state as last applied
(a replica in a planned run reports its state at the run's start), which is
what a live router sees too: scraped gauges lag by a scrape interval.

Oracle hook. `Fleet.cached_tokens(replica, token_ids)` returns the prompt
tokens a replica has cached right now (EngineCore.cached_prefix_tokens); pass
it to `router.factory.make_policy("oracle", cached_tokens=fleet.cached_tokens)`,
or give `run_fleet` a policy name and it does so.
"""

from __future__ import annotations

import heapq
import math
import time
from bisect import bisect_right
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from sluice.engine.core import EngineCore
from sluice.engine.cost_model import CostFactors, CostModel
from sluice.engine.profiles import HardwareProfile, ModelProfile, get_hardware, get_model
from sluice.engine.types import (
    DecodeRun,
    EngineConfig,
    EngineRequest,
    EngineRequestError,
    EngineStats,
    RequestOutput,
)
from sluice.router.factory import make_policy
from sluice.router.policy import ReplicaView, RouteRequest, RoutingPolicy
from sluice.sim.canary import CanaryHost, CanaryReplay
from sluice.sim.metrics import (
    SLO,
    Distribution,
    FleetReport,
    ItlRecorder,
    ReplicaSummary,
    RequestRecord,
    hit_timeline,
    meets_slo,
)
from sluice.sim.scaling import Autoscaling, ScalingHost
from sluice.sim.traffic import TrafficHost, TrafficPolicy
from sluice.sim.workload import END_ID, Conversation, Turn, Workload, WorkloadConfig

UNKNOWN_REPLICA = "the policy chose {name!r}, which is not a replica of this fleet"
DOWN_REPLICA = "the policy chose {name!r}, which is down and was not among the candidates"

_WAKE, _ARRIVAL, _DOWN, _UP, _SCALE, _READY, _PROMOTED, _TRAFFIC = range(8)
_CONTROL_KINDS = {"scale": _SCALE, "ready": _READY, "promoted": _PROMOTED, "traffic": _TRAFFIC}
_CONTROL_NAMES = {code: name for name, code in _CONTROL_KINDS.items()}


@dataclass(frozen=True, slots=True)
class ReplicaRestart:
    """Replica `replica` (index) dies at `at_s` and is serving again, with an empty cache, `down_s` later.
    Its in-flight requests end INTERRUPTED and their users resend them at once (a new submit)."""

    at_s: float
    replica: int
    down_s: float = 60.0



@dataclass(frozen=True, slots=True)
class FleetConfig:
    replicas: int = 8
    model: ModelProfile = field(default_factory=lambda: get_model("llama-3-70b", weights="fp8", kv="fp8"))
    hardware: HardwareProfile = field(default_factory=lambda: get_hardware("h100-sxm"))
    tp: int = 8
    efficiency: CostFactors = field(default_factory=CostFactors)
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(
        block_size=32, max_num_seqs=160, max_num_tokens=2048, stream_tokens=False))
    long_context_replicas: int = 0          # the last N replicas report long_context=True to the router
    name_prefix: str = "r"
    decode_runs: bool = True                # False: every step is its own event (the reference the
                                            # fast path is tested against)
    restarts: tuple[ReplicaRestart, ...] = ()
    # (replica index, speed): that replica's GPUs run at this fraction of their peak bandwidth and
    # FLOP/s (a throttled or degraded GPU: seed 000's slow replica that least-loaded routing hides)
    slow_replicas: tuple[tuple[int, float], ...] = ()
    # An autoscaler over `replicas` slots (sim/scaling.py); None: every replica serves throughout.
    autoscaling: Autoscaling | None = None
    # A canary split between two groups of replicas, under guardrails (sim/canary.py); None: no split.
    canary: CanaryReplay | None = None
    # Batch work and the degradation ladder (sim/traffic.py); None: interactive traffic only.
    traffic: TrafficPolicy | None = None

    def cost_model(self, replica: int | None = None) -> CostModel:
        speed = dict(self.slow_replicas).get(replica, 1.0) if replica is not None else 1.0
        hardware = self.hardware if speed == 1.0 else throttled(self.hardware, speed)
        return CostModel(self.model, hardware, self.tp, self.efficiency)


def throttled(hardware: HardwareProfile, speed: float) -> HardwareProfile:
    """The GPU at `speed` times its peak memory bandwidth and tensor-core FLOP/s."""
    assert 0.0 < speed <= 1.0, "a throttled GPU runs at a fraction (0, 1] of its peak"
    flops = {dtype: peak * speed for dtype, peak in hardware.dense_flops_per_s.items()}
    return replace(hardware, name=f"{hardware.name}@{speed:.0%}",
                   hbm_bandwidth_bytes_per_s=hardware.hbm_bandwidth_bytes_per_s * speed,
                   dense_flops_per_s=flops)


OFF, STARTING, WARM, SERVING, DRAINING = "off", "starting", "warm", "serving", "draining"


class SimReplica:
    """One engine core plus what the host knows about it: its plan, wake version and gauges."""

    __slots__ = ("name", "engine", "long_context", "version", "busy", "plan_start", "plan_ends",
                 "pending", "in_flight", "routed", "kv_area", "kv_peak", "gen_tokens", "gen_steps",
                 "paused", "down", "start_time", "retired", "state", "step_time_s", "host_block_cost",
                 "prefill_tokens_per_s")

    def __init__(self, name: str, engine: EngineCore, long_context: bool) -> None:
        self.name = name
        self.engine = engine
        self.long_context = long_context
        self.version = 0                       # bumps when a planned wake is replaced
        self.busy = False
        self.plan_start = 0.0
        self.plan_ends: list[float] = []       # end time of each planned decode step (unapplied)
        self.pending: tuple[RequestOutput, ...] = ()
        self.in_flight = 0
        self.routed = 0
        self.kv_area = 0.0                     # ∫ used blocks dt
        self.kv_peak = 0
        self.gen_tokens = 0
        self.gen_steps = 0
        self.paused = 0
        self.down = False
        self.start_time = 0.0                  # changes at a restart, as the replica's gauge does
        self.retired: list[EngineStats] = []   # final stats of engines lost to restarts
        self.state = SERVING                   # autoscaling: off | starting | warm | serving | draining
        # What the replica reports as its step time: the modelled decode step at a nominal batch
        # (a live replica's measured one moves with load too; the simulator keeps the intrinsic part)
        cost = engine.cost_model
        self.step_time_s = cost.decode_step_s(8, 2048) if cost is not None else 0.0
        has_tier = cost is not None and engine.pool.host.num_blocks > 0
        self.host_block_cost = cost.host_block_cost() if cost is not None and has_tier else 0.0
        self.prefill_tokens_per_s = cost.prefill_tokens_per_s() if cost is not None else 0.0

    def view(self, pool: str) -> ReplicaView:
        engine = self.engine
        return ReplicaView(name=self.name, pool=pool, block_size=engine.pool.block_size,
                           kv_capacity_blocks=engine.pool.num_blocks, long_context=self.long_context,
                           waiting=engine.num_waiting, running=engine.num_running,
                           kv_used_blocks=engine.pool.num_used, in_flight=self.in_flight,
                           start_time=self.start_time, step_time_s=self.step_time_s,
                           host_kv_capacity_blocks=engine.pool.host.num_blocks,
                           host_block_cost=self.host_block_cost,
                           prefill_tokens_per_s=self.prefill_tokens_per_s)


class Fleet:
    """The replicas of one run. Build it, make a policy (with `cached_tokens` for the oracle), `run`."""

    def __init__(self, config: FleetConfig, workload: WorkloadConfig) -> None:
        self.config = config
        self.workload_config = workload
        self._costs = [config.cost_model(index) for index in range(config.replicas)]
        self._engine_config = replace(config.engine, output_length=workload.output_tokens,
                                      tokens=workload.tokens, stream_tokens=False)
        first_long = config.replicas - config.long_context_replicas
        self.replicas = [SimReplica(f"{config.name_prefix}{index}", self.fresh_engine(index),
                                    long_context=index >= first_long)
                         for index in range(config.replicas)]
        self._by_name = {replica.name: replica for replica in self.replicas}

    def fresh_engine(self, index: int) -> EngineCore:
        return EngineCore(self._engine_config, self._costs[index])

    def replica(self, name: str) -> SimReplica | None:
        return self._by_name.get(name)

    def cached_tokens(self, replica: str, token_ids: Sequence[int]) -> int:
        """The oracle's probe: prompt tokens `replica` has cached right now."""
        return self._by_name[replica].engine.cached_prefix_tokens(token_ids)

    def run(self, policy: RoutingPolicy, slo: SLO | None = None) -> FleetReport:
        return _Run(self, policy, slo if slo is not None else SLO()).execute()


def run_fleet(config: FleetConfig, workload: WorkloadConfig, policy: RoutingPolicy | str,
              slo: SLO | None = None, **policy_options: float) -> FleetReport:
    """Simulate `workload` on the fleet under `policy` (an object, or a name for make_policy;
    the name "oracle" gets the fleet's exact-cache probe)."""
    fleet = Fleet(config, workload)
    if isinstance(policy, str):
        policy = make_policy(policy, cached_tokens=fleet.cached_tokens, **policy_options)
    return fleet.run(policy, slo)


class _Run:
    """One simulation: the event loop and its bookkeeping."""

    def __init__(self, fleet: Fleet, policy: RoutingPolicy, slo: SLO) -> None:
        self.fleet = fleet
        self.policy = policy
        self.slo = slo
        self.config = fleet.workload_config
        self.workload = Workload(self.config)
        self.pool = self.config.model_version
        # (time, insertion order, kind, replica, its version then, turn): arrivals carry the turn,
        # the other kinds the replica
        self.heap: list[tuple[float, int, int, SimReplica | None, int, Conversation | Turn | None]] = []
        self.counter = 0
        self.records: dict[str, RequestRecord] = {}
        self.turns: dict[str, tuple[Turn, RouteRequest, SimReplica]] = {}
        self.itl = ItlRecorder()
        self.rejected = 0
        self.interrupted = 0
        self.arrived = 0
        self.arrived_measured = 0
        self.outcomes: Counter[str] = Counter()
        self.events = 0
        settings = fleet.config.autoscaling
        self.scaling = ScalingHost(self, settings) if settings is not None else None
        replay = fleet.config.canary
        self.canary = CanaryHost(replay, [r.name for r in fleet.replicas]) if replay is not None else None
        traffic = fleet.config.traffic
        self.traffic = TrafficHost(self, traffic) if traffic is not None else None

    # --- event plumbing ---------------------------------------------------------------------

    def push_wake(self, at: float, replica: SimReplica) -> None:
        replica.version += 1
        self.counter += 1
        heapq.heappush(self.heap, (at, self.counter, _WAKE, replica, replica.version, None))

    def push_arrival(self, at: float, what: Conversation | Turn) -> None:
        """A conversation's next turn (drawn when it arrives, so only requests in flight hold a
        prompt) or a ready-made turn (a resend)."""
        self.counter += 1
        heapq.heappush(self.heap, (at, self.counter, _ARRIVAL, None, 0, what))

    def push_control(self, at: float, replica: SimReplica | None, kind: str) -> None:
        """An autoscaling event (sim/scaling.py): its control tick, a cold start done, a promotion done."""
        self.counter += 1
        heapq.heappush(self.heap, (at, self.counter, _CONTROL_KINDS[kind], replica, 0, None))

    def push_restart(self, restart: ReplicaRestart) -> None:
        replica = self.fleet.replicas[restart.replica]
        for at, kind in ((restart.at_s, _DOWN), (restart.at_s + restart.down_s, _UP)):
            self.counter += 1
            heapq.heappush(self.heap, (at, self.counter, kind, replica, 0, None))

    def execute(self) -> FleetReport:
        cpu, wall = time.process_time(), time.perf_counter()
        for at, conversation in self.workload.initial_arrivals():
            self.push_arrival(at, conversation)
        for restart in self.fleet.config.restarts:
            self.push_restart(restart)
        if self.scaling is not None:
            self.scaling.place_initial(self.fleet.replicas)
        if self.traffic is not None:
            self.traffic.start()
        end = self.config.duration_s
        heap = self.heap
        while heap and heap[0][0] <= end:
            at, _, kind, replica, version, arriving = heapq.heappop(heap)
            self.events += 1
            if kind == _ARRIVAL and arriving is not None:
                turn = arriving if isinstance(arriving, Turn) else self.draw_turn(arriving)
                if turn is not None:
                    self.arrive(turn, at)
            elif kind == _TRAFFIC and self.traffic is not None:
                self.traffic.on_batch_arrival(at)
            elif kind in _CONTROL_NAMES and self.scaling is not None:
                self.scaling.on_control(_CONTROL_NAMES[kind], replica, at)
            elif replica is None:
                continue
            elif kind == _WAKE:
                if version == replica.version:     # else a wake that settle_plan or a restart replaced
                    self.wake(replica, at)
            elif kind == _DOWN:
                self.replica_down(replica, at)
            else:
                self.replica_up(replica, at)
        for replica in self.fleet.replicas:
            self.flush_plan(replica, end)
        return self.report(time.process_time() - cpu, time.perf_counter() - wall)

    def draw_turn(self, conversation: Conversation) -> Turn | None:
        """The conversation's next turn; when it is over, a closed-loop user opens a new one."""
        turn = self.workload.next_turn(conversation)
        if turn is None and conversation.user >= 0 and conversation.turn > 0:
            turn = self.workload.next_turn(self.workload.new_conversation(conversation.user))
        return turn

    # --- arrivals ---------------------------------------------------------------------------

    def arrive(self, turn: Turn, at: float) -> None:
        self.arrived += 1
        if at >= self.config.warmup_s:
            self.arrived_measured += 1
        request = RouteRequest(request_id=turn.request_id, model_version=self.pool, token_ids=turn.prompt,
                               max_output_tokens=turn.max_output_tokens,
                               conversation_id=turn.conversation.conversation_id)
        if self.scaling is not None and self.scaling.shed(turn, at):
            return
        if self.traffic is not None and not self.traffic.admit_interactive(turn, at):
            return
        views = [replica.view(self.pool) for replica in self.serving()]
        if self.canary is not None:
            views = self.canary.views(turn.request_id, turn.conversation.conversation_id, views, at)
        decision = self.policy.choose(request, views, at)
        if decision is None:
            self.reject(turn, at)
            return
        replica = self.fleet.replica(decision.replica)
        if replica is None:
            raise ValueError(UNKNOWN_REPLICA.format(name=decision.replica))
        if replica.down:
            raise ValueError(DOWN_REPLICA.format(name=decision.replica))
        self.policy.on_routed(request, decision, at)
        self.outcomes[decision.outcome] += 1
        self.settle_plan(replica, at)
        try:
            replica.engine.add_request(EngineRequest(
                request_id=turn.request_id, prompt_token_ids=turn.prompt,
                max_output_tokens=turn.max_output_tokens, end_id=END_ID, seed=turn.seed))
        except EngineRequestError:
            self.policy.on_finished(request, replica.name, at)    # refused: generated nothing
            self.reject(turn, at)
            return
        replica.in_flight += 1
        replica.routed += 1
        self.records[turn.request_id] = RequestRecord(
            request_id=turn.request_id, replica=replica.name, arrival_s=at, input_tokens=len(turn.prompt))
        self.turns[turn.request_id] = (turn, request, replica)
        if not replica.busy:
            self.start(replica, at)

    def serving(self) -> list[SimReplica]:
        return [replica for replica in self.fleet.replicas if not replica.down and replica.state == SERVING]

    def reject(self, turn: Turn, at: float) -> None:
        self.rejected += 1
        turn.conversation.turns_left = 0          # the user gives up on this conversation
        self.push_arrival(at + self.workload.think_time(), turn.conversation)

    # --- restarts ---------------------------------------------------------------------------

    def replica_down(self, replica: SimReplica, at: float) -> None:
        """The replica dies: its runs end INTERRUPTED (tokens so far stay consumed, nothing is
        regenerated), each user resends its turn as a new request, the cache is gone."""
        self.flush_plan(replica, at)
        replica.down = True
        replica.busy = False
        replica.pending = ()
        replica.version += 1                      # its pending wake is void
        replica.retired.append(replica.engine.stats())
        lost = [request_id for request_id, (_, _, held) in self.turns.items() if held is replica]
        for request_id in lost:
            turn, request, _ = self.turns.pop(request_id)
            self.records[request_id].finish_reason = "interrupted"
            self.interrupted += 1
            # Its cache died with it, so the tokens it streamed leave nothing to credit: 0.
            self.policy.on_finished(request, replica.name, at)
            self.push_arrival(at, self.workload.resend(turn))
        replica.in_flight = 0

    def replica_up(self, replica: SimReplica, at: float) -> None:
        replica.engine = self.fleet.fresh_engine(self.fleet.replicas.index(replica))
        replica.down = False
        replica.start_time = at
        self.policy.on_replica_restarted(replica.name)

    # --- replica steps ----------------------------------------------------------------------

    def settle_plan(self, replica: SimReplica, at: float) -> None:
        """A request is about to join `replica`: apply the planned steps that have started by `at`
        and move the wake to the end of the one in progress."""
        ends = replica.plan_ends
        if not ends:
            return
        started = min(bisect_right(ends, at) + 1, len(ends))
        if started == len(ends):
            return                                # the plan ends as planned; the wake applies it
        run = self.apply_plan(replica, started, ends[started - 1])
        assert not run.outputs, "a plan stops at its first finish, so a cut plan finishes nobody"
        replica.pending = ()
        self.push_wake(ends[started - 1], replica)

    def flush_plan(self, replica: SimReplica, end: float) -> None:
        """At the end of the run, apply the planned steps that started by `end`, as single steps
        would have been; what they would deliver after `end` is not delivered."""
        ends = replica.plan_ends
        if ends:
            started = min(bisect_right(ends, end) + 1, len(ends))
            self.apply_plan(replica, started, ends[started - 1])

    def apply_plan(self, replica: SimReplica, steps: int, until: float) -> DecodeRun:
        """Apply the first `steps` planned decode steps, which hold the replica's KV from the plan's
        start to `until` (the end of the last of them), and clear the plan."""
        replica.kv_area += replica.engine.pool.num_used * (until - replica.plan_start)
        run = replica.engine.run_decode(steps)
        self.record_run(replica, run.step_durations, run.batch_size, run.tokens_in_last_step)
        replica.plan_ends = []
        return run

    def wake(self, replica: SimReplica, at: float) -> None:
        if replica.plan_ends:
            outputs = self.apply_plan(replica, len(replica.plan_ends), at).outputs
        else:
            outputs, replica.pending = replica.pending, ()
        replica.busy = False
        for output in outputs:
            self.deliver(replica, output, at)
        self.start(replica, at)
        if self.traffic is not None:
            self.traffic.pump(at)

    def start(self, replica: SimReplica, at: float) -> None:
        engine = replica.engine
        if not engine.has_work():
            return
        used = engine.pool.num_used
        replica.kv_peak = max(replica.kv_peak, used)
        limit = engine.decode_run_limit() if self.fleet.config.decode_runs else 0
        if limit >= 2:
            durations = engine.decode_run_durations(limit)
            ends: list[float] = []
            clock = at
            for duration in durations:
                clock += duration
                ends.append(clock)
            replica.plan_start = at
            replica.plan_ends = ends
            finish = ends[-1]               # KV use is accounted when the plan is applied
        else:
            result = engine.step()
            ended_by_end_id = sum(1 for o in result.outputs
                                  if o.finished and o.num_new_tokens == 0 and not o.first_token)
            self.record_step(replica, result.duration_s, result.num_generation_requests - ended_by_end_id)
            replica.paused += result.num_paused
            replica.pending = result.outputs
            finish = at + result.duration_s
            if result.duration_s <= 0.0 and not result.outputs:
                return                            # nothing could run; the next arrival restarts it
            replica.kv_area += used * result.duration_s
        replica.busy = True
        self.push_wake(finish, replica)

    def record_step(self, replica: SimReplica, duration: float, generation_tokens: int) -> None:
        if generation_tokens > 0:
            replica.gen_tokens += generation_tokens
            replica.gen_steps += 1
            self.itl.add(duration, generation_tokens)

    def record_run(self, replica: SimReplica, durations: Sequence[float], batch: int, last: int) -> None:
        replica.gen_tokens += batch * (len(durations) - 1) + last
        replica.gen_steps += len(durations)
        self.itl.add_run(durations, batch, last)

    def deliver(self, replica: SimReplica, output: RequestOutput, at: float) -> None:
        if self.traffic is not None and self.traffic.owns(output.request_id):
            self.traffic.deliver(replica, output, at)
            return
        record = self.records[output.request_id]
        if output.first_token:
            if self.traffic is not None:
                self.traffic.interactive_first_token(at)
            record.first_token_s = at
            record.cached_tokens = output.num_cached_tokens
            if self.scaling is not None:
                self.scaling.first_token(at, at - record.arrival_s)
        if not output.finished:
            return
        record.finish_s = at
        record.output_tokens = output.num_output_tokens
        record.finish_reason = output.finish_reason or ""
        if self.canary is not None:
            self.canary.finished(record, at)
        turn, request, _ = self.turns.pop(output.request_id)
        replica.in_flight -= 1
        self.policy.on_finished(request, replica.name, at, output_tokens=output.num_output_tokens)
        if self.scaling is not None:
            self.scaling.finished(replica, at)
        self.workload.answer_finished(turn, output.num_output_tokens)
        self.push_arrival(at + self.workload.think_time(), turn.conversation)

    # --- the report -------------------------------------------------------------------------

    def report(self, cpu_s: float, wall_s: float) -> FleetReport:
        config, slo = self.config, self.slo
        start, end = config.warmup_s, config.duration_s
        window = max(end - start, 1e-9)
        measured = [r for r in self.records.values()
                    if r.arrival_s >= start and r.finish_reason != "interrupted"]
        done = [r for r in measured if not math.isnan(r.finish_s)]
        ttft = [r.first_token_s - r.arrival_s for r in done]
        late = (start + end) / 2
        ttft_late = [r.first_token_s - r.arrival_s for r in done if r.arrival_s >= late]
        e2e = [r.finish_s - r.arrival_s for r in done]
        tpot = [(r.finish_s - r.first_token_s) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
        good = sum(1 for r in done if meets_slo(r, slo))
        inputs = sum(r.input_tokens for r in done)
        outputs = sum(r.output_tokens for r in done)
        cached = sum(r.cached_tokens for r in done)
        summaries = tuple(self.summarize(replica, end) for replica in self.fleet.replicas)
        kv_means = [s.kv_utilization_mean for s in summaries]
        return FleetReport(
            policy=self.policy.name, duration_s=window, replicas=len(summaries),
            requests_arrived=self.arrived, requests_completed=len(done), requests_rejected=self.rejected,
            requests_unfinished=sum(1 for r in self.records.values()
                                    if math.isnan(r.finish_s) and r.finish_reason != "interrupted"),
            requests_interrupted=self.interrupted,
            ttft=Distribution.of(ttft), tpot=Distribution.of(tpot), itl=self.itl.distribution(),
            e2e=Distribution.of(e2e), request_throughput=len(done) / window,
            output_token_throughput=outputs / window, total_token_throughput=(inputs + outputs) / window,
            goodput=good / window, slo=slo, slo_attainment=good / len(done) if done else 0.0,
            mean_input_tokens=inputs / len(done) if done else 0.0,
            mean_output_tokens=outputs / len(done) if done else 0.0,
            cache_hit_rate=cached / inputs if inputs else 0.0,
            kv_utilization_mean=sum(kv_means) / len(kv_means) if kv_means else 0.0,
            kv_utilization_peak=max((s.kv_utilization_peak for s in summaries), default=0.0),
            routing_outcomes=tuple(sorted(self.outcomes.items())), per_replica=summaries,
            sim_cpu_s=cpu_s, sim_wall_s=wall_s, events=self.events,
            hit_timeline=hit_timeline(list(self.records.values())),
            offered_rate=self.arrived_measured / window,
            requests_shed=self.scaling.shed_total if self.scaling is not None else 0,
            scaling=tuple(self.scaling.samples) if self.scaling is not None else (),
            canary=self.canary.outcome() if self.canary is not None else None,
            traffic=self.traffic.summary() if self.traffic is not None else None,
            ttft_late=Distribution.of(ttft_late),
        )

    def summarize(self, replica: SimReplica, end: float) -> ReplicaSummary:
        lives = [*replica.retired, replica.engine.stats()]
        blocks = lives[-1].kv.max_blocks
        reused = sum(stats.kv.reused_blocks for stats in lives)
        looked_up = reused + sum(stats.kv.missed_blocks for stats in lives)
        return ReplicaSummary(
            name=replica.name, requests=replica.routed,
            busy_fraction=min(1.0, sum(stats.busy_s for stats in lives) / end),
            mean_batch=replica.gen_tokens / replica.gen_steps if replica.gen_steps else 0.0,
            kv_utilization_mean=replica.kv_area / end / blocks, kv_utilization_peak=replica.kv_peak / blocks,
            cache_hit_rate=reused / looked_up if looked_up else 0.0, paused=replica.paused,
            steps=sum(stats.num_steps for stats in lives),
        )

