"""Priority classes and the degradation ladder on the simulator's clock (issue 14 points 4 and 6),
deciding with the same pure rules the live platform uses (sluice/traffic/).

Batch work (seed 003: "run batch/offline workloads in the trough"): batch requests are submitted
into a gateway backlog (`BatchWork.backlog` at the start, then Poisson at `rate_per_s`) and are
dispatched to a replica only while no interactive request waits and the pool is below every
headroom threshold (priority.has_headroom: queue depth, KV utilization, batch-slot use), checked
whenever the pool's state changes (an arrival, a step's end). Interactive requests go straight to
the replicas as before, and their latency figures (FleetReport) count interactive requests only;
batch work shows in the replicas' busy time and KV use and in `TrafficSummary`.

The ladder (`LadderSim`): at each arrival the pool's signals are taken (interactive requests waiting
at the replicas as the backlog, the headroom rule, first tokens over the last `window_s` as the
measured drain) and ladder.climb gives the step:
    defer batch       batch is not dispatched (as above)
    shed batch        a batch submission is refused
    fallbacks         an interactive request whose tenant permits a fallback (`fallback_share` of
                      them) is served by the fallback pool, which is not simulated: its user carries
                      on after a think, as if answered
    shed interactive  an interactive request is refused with the retry-after of the measured drain
                      rate; its user comes back after it
Each step's first entry and every action are recorded, so a traffic step shows them in order.

Batch requests on a replica that restarts are lost with it (restarts and batch are not combined in
any scenario here).
"""

from __future__ import annotations

import random
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sluice.engine.types import EngineRequest, EngineRequestError, RequestOutput
from sluice.router.policy import RouteRequest
from sluice.traffic.ladder import LadderThresholds, PoolSignals, Rung, Step, climb
from sluice.traffic.priority import Headroom, PoolLoad, ReplicaLoad, has_headroom

if TYPE_CHECKING:
    from sluice.sim.fleet import SimReplica, _Run
    from sluice.sim.workload import Turn


@dataclass(frozen=True, slots=True)
class BatchWork:
    backlog: int = 0                        # batch requests already submitted at t = 0
    rate_per_s: float = 0.0                 # further submissions, Poisson
    prompt_tokens: int = 1000
    output_tokens: int = 300
    headroom: Headroom = field(default_factory=Headroom)
    seed: int = 1


@dataclass(frozen=True, slots=True)
class LadderSim:
    thresholds: LadderThresholds
    fallback_share: float = 0.5             # interactive requests whose tenant permits a fallback
    window_s: float = 10.0                  # the measured drain rate's window


@dataclass(frozen=True, slots=True)
class TrafficPolicy:
    batch: BatchWork | None = None
    ladder: LadderSim | None = None


@dataclass(frozen=True, slots=True)
class TrafficSummary:
    batch_submitted: int
    batch_shed: int
    batch_dispatched: int
    batch_completed: int
    batch_output_tokens: int
    batch_waiting_at_end: int
    # Dispatches made while an interactive request was waiting at a replica: 0 by construction (the
    # claim order); counted so a test can show it.
    batch_dispatched_past_interactive: int
    batch_peak: int                                   # most batch requests the pool held at once
    interactive_fell_back: int
    interactive_shed: int
    steps_first_at: tuple[tuple[str, float], ...]    # each step the ladder entered, with the first time
    actions: tuple[tuple[str, int], ...]              # how often each step acted (defer_batch: each time
                                                      # the backlog found the pool without room)
    last_retry_after_ms: int                          # the last shed's retry-after
    last_drain_measured: bool                         # ... and whether its rate was measured


@dataclass(slots=True)
class _Batch:
    request_id: str
    prompt: tuple[int, ...]
    submitted_s: float


class TrafficHost:
    """The gateway's batch backlog and ladder inside one simulation run."""

    def __init__(self, run: _Run, policy: TrafficPolicy) -> None:
        self.run = run
        self.policy = policy
        self.batch = policy.batch
        self.ladder = policy.ladder
        self._rng = random.Random(self.batch.seed if self.batch else 0)
        self._queue: deque[_Batch] = deque()
        self._in_flight: dict[str, tuple[_Batch, RouteRequest, SimReplica]] = {}
        self._first_tokens: deque[float] = deque()   # interactive first tokens in the drain window
        self._counter = 0
        self.submitted = self.shed_batch = self.dispatched = self.completed = self.output_tokens = 0
        self.past_interactive = self.fell_back = self.shed_interactive = 0
        self.peak = 0                                # most batch requests in flight at once
        self.first_at: dict[Step, float] = {}
        self.actions: Counter[str] = Counter()
        self.last_rung: Rung | None = None

    # --- events -----------------------------------------------------------------------------

    def start(self) -> None:
        if self.batch is None:
            return
        for _ in range(self.batch.backlog):
            self._queue.append(self._new_batch(0.0))
        self.submitted += self.batch.backlog
        self._schedule_next_batch(0.0)

    def _schedule_next_batch(self, at: float) -> None:
        if self.batch is not None and self.batch.rate_per_s > 0:
            self.run.push_control(at + self._rng.expovariate(self.batch.rate_per_s), None, "traffic")

    def on_batch_arrival(self, at: float) -> None:
        """A batch submission arrives: shed at step 2 and above, else it joins the backlog."""
        self._schedule_next_batch(at)
        self.submitted += 1
        rung = self._climb(at)
        if rung is not None and rung.step >= Step.SHED_BATCH:
            self.shed_batch += 1
            self.actions[Step.SHED_BATCH.label] += 1
            return
        self._queue.append(self._new_batch(at))
        self.pump(at)

    def admit_interactive(self, turn: Turn, at: float) -> bool:
        """False when the ladder took the request away from the pool (fallback or shed)."""
        rung = self._climb(at)
        if rung is None or rung.step < Step.FALLBACK:
            return True
        assert self.ladder is not None
        if rung.step >= Step.SHED_INTERACTIVE:
            self.shed_interactive += 1
            self.actions[Step.SHED_INTERACTIVE.label] += 1
            self.run.rejected += 1
            # The user comes back after the retry-after it was told, with the same turn.
            self.run.push_arrival(at + rung.retry_after_ms / 1000, self.run.workload.resend(turn))
            return False
        if self._rng.random() < self.ladder.fallback_share:
            self.fell_back += 1
            self.actions[Step.FALLBACK.label] += 1
            self.run.push_arrival(at + self.run.workload.think_time(), turn.conversation)
            return False
        return True

    def interactive_first_token(self, at: float) -> None:
        self._first_tokens.append(at)

    # --- dispatch ---------------------------------------------------------------------------

    def pump(self, at: float) -> None:
        """Dispatch waiting batch requests while nothing interactive waits and the pool has headroom."""
        if self.batch is None or not self._queue:
            return
        while self._queue:
            if self._interactive_waiting() > 0 or not has_headroom(self._pool_load(), self.batch.headroom):
                self.actions[Step.DEFER_BATCH.label] += 1
                return
            if not self._dispatch(self._queue[0], at):
                return
            self._queue.popleft()

    def _dispatch(self, work: _Batch, at: float) -> bool:
        assert self.batch is not None
        run = self.run
        request = RouteRequest(request_id=work.request_id, model_version=run.pool, token_ids=work.prompt,
                               max_output_tokens=self.batch.output_tokens, conversation_id=None)
        views = [replica.view(run.pool) for replica in run.serving()]
        decision = run.policy.choose(request, views, at)
        if decision is None:
            return False
        replica = run.fleet.replica(decision.replica)
        assert replica is not None, f"policy chose unknown replica {decision.replica}"
        run.policy.on_routed(request, decision, at)
        run.settle_plan(replica, at)
        if self._interactive_waiting() > 0:
            self.past_interactive += 1
        try:   # end_id None: a batch request runs to its cap
            replica.engine.add_request(EngineRequest(
                request_id=work.request_id, prompt_token_ids=work.prompt,
                max_output_tokens=self.batch.output_tokens, end_id=None, seed=self._counter))
        except EngineRequestError:
            run.policy.on_finished(request, replica.name, at)
            return False
        replica.in_flight += 1
        replica.routed += 1
        self.dispatched += 1
        self._in_flight[work.request_id] = (work, request, replica)
        self.peak = max(self.peak, self._batch_held())
        if not replica.busy:
            run.start(replica, at)
        return True

    def owns(self, request_id: str) -> bool:
        return request_id in self._in_flight

    def deliver(self, replica: SimReplica, output: RequestOutput, at: float) -> None:
        if not output.finished:
            return
        _, request, _ = self._in_flight.pop(output.request_id)
        replica.in_flight -= 1
        self.completed += 1
        self.output_tokens += output.num_output_tokens
        self.run.policy.on_finished(request, replica.name, at, output_tokens=output.num_output_tokens)

    # --- signals ----------------------------------------------------------------------------

    def _new_batch(self, at: float) -> _Batch:
        assert self.batch is not None
        self._counter += 1
        tokens = self.run.workload.config.tokens
        base = tokens.first_normal_id
        span = tokens.vocab_size - base
        # A distinct prompt per request (offline documents share no prefix with the chat traffic).
        prompt = tuple(base + (self._counter * 7919 + i * 104_729) % span
                       for i in range(self.batch.prompt_tokens))
        return _Batch(f"batch-{self._counter}", prompt, at)

    def _pool_load(self) -> PoolLoad:
        return PoolLoad.of([
            ReplicaLoad(waiting=replica.engine.num_waiting, running=replica.engine.num_running,
                        kv_used_blocks=replica.engine.pool.num_used,
                        kv_capacity_blocks=replica.engine.pool.num_blocks,
                        max_slots=replica.engine.config.max_num_seqs)
            for replica in self.run.serving()])

    def _batch_held(self) -> int:
        """Batch requests the engines hold now (queued or running; not one that finished in a step
        whose outputs are still to be delivered)."""
        batch = self._in_flight
        return sum(1 for replica in self.run.serving()
                   for seq in (*replica.engine.scheduler.running, *replica.engine.scheduler.waiting)
                   if seq.request_id in batch)

    def _interactive_waiting(self) -> int:
        """Interactive requests queued at the replicas, not yet admitted to a running batch."""
        batch = self._in_flight
        return sum(1 for replica in self.run.serving() for seq in replica.engine.scheduler.waiting
                   if seq.request_id not in batch)

    def _climb(self, at: float) -> Rung | None:
        if self.ladder is None:
            return None
        window = self.ladder.window_s
        while self._first_tokens and self._first_tokens[0] < at - window:
            self._first_tokens.popleft()
        headroom = has_headroom(self._pool_load(), self.batch.headroom) if self.batch else None
        rung = climb(PoolSignals(interactive_backlog=self._interactive_waiting(), headroom=headroom,
                                 drained_runs=len(self._first_tokens), window_s=min(window, at)),
                     self.ladder.thresholds)
        self.first_at.setdefault(rung.step, at)
        self.last_rung = rung
        return rung

    def summary(self) -> TrafficSummary:
        rung = self.last_rung
        return TrafficSummary(
            batch_submitted=self.submitted, batch_shed=self.shed_batch, batch_dispatched=self.dispatched,
            batch_completed=self.completed, batch_output_tokens=self.output_tokens,
            batch_waiting_at_end=len(self._queue), batch_dispatched_past_interactive=self.past_interactive,
            batch_peak=self.peak,
            interactive_fell_back=self.fell_back, interactive_shed=self.shed_interactive,
            steps_first_at=tuple((step.label, self.first_at[step]) for step in sorted(self.first_at)),
            actions=tuple(sorted(self.actions.items())),
            last_retry_after_ms=rung.retry_after_ms if rung is not None else 0,
            last_drain_measured=rung.measured if rung is not None else False,
        )


def ladder_for(max_backlog: int, drain_runs_per_s: float, shed_batch_fraction: float = 0.25,
               fallback_fraction: float = 0.5) -> LadderThresholds:
    """The live defaults' fractions over a simulated pool's backlog bound."""
    return LadderThresholds.from_fractions(max_backlog, shed_batch_fraction, fallback_fraction,
                                           drain_runs_per_s)


