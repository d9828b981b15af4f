"""A canary replayed on the simulator: the same sticky split and the same guardrails as the live
platform (sluice/traffic/canary.py), on the fleet's virtual clock.

Some replicas form the candidate pool (give them a slower GPU with FleetConfig.slow_replicas to
stand for a slower candidate version/runtime), the rest the baseline pool. Each arriving turn goes
to the candidate's replicas when its conversation's split point is below the share, else to the
baseline's, and the routing policy picks among those. Every `check_every_s` the guardrails judge
the runs that finished within their window, exactly as services/canary_guard.py judges run rows;
a breach sets the share to 0 from then on and keeps the reason and the time.

    python -m sluice.sim.replay_canary               # a candidate at 60% speed: the guardrail trips
    python -m sluice.sim.replay_canary --speed 1.0   # an equal candidate: it holds
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from sluice.router.policy import ReplicaView
from sluice.sim.metrics import RequestRecord
from sluice.traffic.canary import (
    Guardrails,
    RunSample,
    Verdict,
    judge,
    split_point,
    summarize,
    takes_candidate,
)


@dataclass(frozen=True, slots=True)
class CanaryReplay:
    candidate_replicas: tuple[int, ...]      # fleet indices serving the candidate; the rest: the baseline
    share_bp: int = 2_000                    # 20% of conversations
    guardrails: Guardrails = field(default_factory=lambda: Guardrails(window_s=60.0, min_samples=50))
    check_every_s: float = 5.0               # the guard's interval
    alias: str = "chat"                      # salts the split, as the live alias does


@dataclass(frozen=True, slots=True)
class CanaryTick:
    """One guard pass: the share after it and what each arm looked like."""

    at_s: float
    share_bp: int
    verdict: Verdict
    candidate_runs: int
    baseline_runs: int
    candidate_ttft_p95_s: float | None
    baseline_ttft_p95_s: float | None
    candidate_tpot_p95_s: float | None
    baseline_tpot_p95_s: float | None


@dataclass(frozen=True, slots=True)
class CanaryOutcome:
    ticks: tuple[CanaryTick, ...]
    rolled_back_at_s: float | None           # None: the guardrails held throughout
    reason: str                              # the breach, as the live guard records it
    routed_candidate: int                    # turns the split sent to the candidate
    routed_baseline: int

    def format(self) -> str:
        def ms(value: float | None) -> str:
            return "-" if value is None else f"{value * 1e3:.0f}"

        lines = [" t (s)  share  verdict  runs c/b   p95 TTFT c/b ms   p95 TPOT c/b ms"]
        for tick in self.ticks:
            lines.append(f"{tick.at_s:6.0f}  {tick.share_bp / 100:4.0f}%  {tick.verdict.value:7}  "
                         f"{tick.candidate_runs:4}/{tick.baseline_runs:<5} "
                         f"{ms(tick.candidate_ttft_p95_s):>7}/{ms(tick.baseline_ttft_p95_s):<8} "
                         f"{ms(tick.candidate_tpot_p95_s):>7}/{ms(tick.baseline_tpot_p95_s)}")
        total = self.routed_candidate + self.routed_baseline
        lines.append(f"routed to the candidate: {self.routed_candidate} of {total} turns")
        if self.rolled_back_at_s is None:
            lines.append("guardrails held: the split stayed")
        else:
            lines.append(f"rolled back to 0% at t={self.rolled_back_at_s:.0f} s: {self.reason}")
        return "\n".join(lines)


class CanaryHost:
    """The canary's state during one simulation (fleet.py calls it on arrivals and finishes)."""

    def __init__(self, replay: CanaryReplay, replica_names: Sequence[str]) -> None:
        self.replay = replay
        self.share_bp = replay.share_bp
        self._candidates = {replica_names[index] for index in replay.candidate_replicas}
        self._arm: dict[str, bool] = {}                      # request id → on the candidate
        self._finished: deque[tuple[float, bool, RunSample]] = deque()
        self._next_check = replay.check_every_s
        self._ticks: list[CanaryTick] = []
        self._rolled_back_at: float | None = None
        self._reason = ""
        self._routed = {True: 0, False: 0}

    def views(self, request_id: str, conversation_id: str, views: Sequence[ReplicaView],
              at: float) -> list[ReplicaView]:
        """The replicas of the arm this turn's conversation is on."""
        self.check_until(at)
        candidate = takes_candidate(split_point(self.replay.alias, conversation_id), self.share_bp)
        self._arm[request_id] = candidate
        self._routed[candidate] += 1
        return [view for view in views if (view.name in self._candidates) == candidate]

    def finished(self, record: RequestRecord, at: float) -> None:
        candidate = self._arm.pop(record.request_id, None)
        if candidate is None:
            return
        ttft = None if math.isnan(record.first_token_s) else record.first_token_s - record.arrival_s
        tpot = ((record.finish_s - record.first_token_s) / (record.output_tokens - 1)
                if ttft is not None and record.output_tokens > 1 else None)
        failed = record.finish_reason == "interrupted"
        self._finished.append((at, candidate, RunSample(ttft, tpot, failed)))
        self.check_until(at)

    def check_until(self, at: float) -> None:
        """Run every guard pass due by `at` (the guard's clock ticks whether or not runs finish)."""
        while self._next_check <= at:
            self._check(self._next_check)
            self._next_check += self.replay.check_every_s

    def _check(self, now: float) -> None:
        if self.share_bp == 0:
            return
        limits = self.replay.guardrails
        while self._finished and self._finished[0][0] < now - limits.window_s:
            self._finished.popleft()
        window = [entry for entry in self._finished if entry[0] <= now]
        candidate = summarize(sample for _, on, sample in window if on)
        baseline = summarize(sample for _, on, sample in window if not on)
        judgment = judge(candidate, baseline, limits)
        if judgment.verdict is Verdict.BREACH:
            self.share_bp = 0
            self._rolled_back_at = now
            self._reason = judgment.reason
        self._ticks.append(CanaryTick(
            at_s=now, share_bp=self.share_bp, verdict=judgment.verdict, candidate_runs=candidate.runs,
            baseline_runs=baseline.runs, candidate_ttft_p95_s=candidate.ttft_p95_s,
            baseline_ttft_p95_s=baseline.ttft_p95_s, candidate_tpot_p95_s=candidate.tpot_p95_s,
            baseline_tpot_p95_s=baseline.tpot_p95_s))

    def outcome(self) -> CanaryOutcome:
        return CanaryOutcome(ticks=tuple(self._ticks), rolled_back_at_s=self._rolled_back_at,
                             reason=self._reason, routed_candidate=self._routed[True],
                             routed_baseline=self._routed[False])

