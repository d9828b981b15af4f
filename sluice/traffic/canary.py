"""Canary: an alias sends a configured share of new runs to a candidate version, and guardrails
roll the share back to 0% when the candidate is worse than the baseline.

The split is sticky per conversation: a run's point on [0, 10,000) is a hash of the alias and its
conversation id (its request key when it has none), and it goes to the candidate when the point
is below the share in basis points. Raising the share keeps every conversation already on the
candidate there; dropping it to 0 sends every one back to the baseline.

    point = sha256(alias ‖ NUL ‖ conversation)[:8] mod 10,000        candidate ⇔ point < share_bp

The guardrails compare the two arms over a window of finished runs (the evaluator reads them
from the ledger; the simulator from its own clock):

    p95 TTFT   candidate ≤ baseline × max_ttft_ratio   (or within ttft_slack_s of it)
    p95 TPOT   candidate ≤ baseline × max_tpot_ratio   (or within tpot_slack_s of it)
    FAILED + INTERRUPTED rate   candidate ≤ baseline + max_failure_rate_increase

Each comparison is made only when both arms have `min_samples` values for it: with fewer the
guardrail holds (no verdict), because a p95 of a handful of runs is one unlucky run.
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

SHARE_SCALE = 10_000             # shares are in basis points: 2,000 = 20%


def split_point(alias: str, conversation: str) -> int:
    """The run's sticky point on [0, SHARE_SCALE) (2^64 mod 10,000 leaves a bias below 1e-15)."""
    digest = hashlib.sha256(f"{alias}\0{conversation}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % SHARE_SCALE


def takes_candidate(point: int, share_bp: int) -> bool:
    return point < share_bp


@dataclass(frozen=True, slots=True)
class Guardrails:
    """Limits on the candidate relative to the baseline (per canary, table canaries)."""

    window_s: float = 300.0              # runs finished within this long ago are compared
    min_samples: int = 20                # per arm and per metric before it is judged
    max_ttft_ratio: float = 1.5
    max_tpot_ratio: float = 1.5
    max_failure_rate_increase: float = 0.05   # absolute: 0.05 = five more failures per hundred runs
    ttft_slack_s: float = 0.05           # a p95 this close to the baseline's is never a breach
    tpot_slack_s: float = 0.002

    def __post_init__(self) -> None:
        if not (self.window_s > 0 and self.min_samples >= 1):
            raise ValueError("a guardrail needs a positive window and at least one sample")
        if not (self.max_ttft_ratio >= 1 and self.max_tpot_ratio >= 1):
            raise ValueError("latency ratios below 1 would trip on a candidate equal to the baseline")
        if not 0 <= self.max_failure_rate_increase <= 1:
            raise ValueError("max_failure_rate_increase is a rate difference in [0, 1]")


@dataclass(frozen=True, slots=True)
class RunSample:
    """One finished run of either arm."""

    ttft_s: float | None             # submit → first token (None: no token)
    tpot_s: float | None             # per output token after the first (None: fewer than 2)
    failed: bool                     # ended FAILED or INTERRUPTED


@dataclass(frozen=True, slots=True)
class ArmStats:
    runs: int
    failures: int
    ttft_n: int
    ttft_p95_s: float | None         # None: no TTFT in the window
    tpot_n: int
    tpot_p95_s: float | None

    @property
    def failure_rate(self) -> float:
        return self.failures / self.runs if self.runs else 0.0

    def as_json(self) -> dict[str, float | int | None]:
        return {"runs": self.runs, "failures": self.failures, "ttft_n": self.ttft_n,
                "ttft_p95_s": self.ttft_p95_s, "tpot_n": self.tpot_n, "tpot_p95_s": self.tpot_p95_s}


def p95(values: Sequence[float]) -> float | None:
    """Nearest-rank 95th percentile: the smallest value with at least 95% of values at or below it."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def summarize(samples: Iterable[RunSample]) -> ArmStats:
    runs = list(samples)
    ttfts = [s.ttft_s for s in runs if s.ttft_s is not None]
    tpots = [s.tpot_s for s in runs if s.tpot_s is not None]
    return ArmStats(runs=len(runs), failures=sum(s.failed for s in runs), ttft_n=len(ttfts),
                    ttft_p95_s=p95(ttfts), tpot_n=len(tpots), tpot_p95_s=p95(tpots))


class Verdict(enum.StrEnum):
    HOLD = "hold"                    # not enough samples to judge anything yet
    PASS = "pass"                    # every judged guardrail holds
    BREACH = "breach"                # roll the split back to 0%


@dataclass(frozen=True, slots=True)
class Judgment:
    verdict: Verdict
    reason: str                      # BREACH: every guardrail broken; HOLD: what is missing
    candidate: ArmStats
    baseline: ArmStats


def _latency_breach(name: str, candidate: float | None, baseline: float | None, ratio: float,
                    slack_s: float) -> str | None:
    if candidate is None or baseline is None:
        return None
    if candidate <= baseline * ratio or candidate - baseline <= slack_s:
        return None
    return (f"p95 {name} {candidate * 1000:.1f} ms vs baseline {baseline * 1000:.1f} ms "
            f"(limit x{ratio:g})")


def judge(candidate: ArmStats, baseline: ArmStats, limits: Guardrails) -> Judgment:
    """Compare the arms on every metric both have `min_samples` of; BREACH names each broken one."""
    enough = limits.min_samples
    breaches: list[str] = []
    judged = 0
    if candidate.ttft_n >= enough and baseline.ttft_n >= enough:
        judged += 1
        breaches.append(_latency_breach("TTFT", candidate.ttft_p95_s, baseline.ttft_p95_s,
                                        limits.max_ttft_ratio, limits.ttft_slack_s) or "")
    if candidate.tpot_n >= enough and baseline.tpot_n >= enough:
        judged += 1
        breaches.append(_latency_breach("TPOT", candidate.tpot_p95_s, baseline.tpot_p95_s,
                                        limits.max_tpot_ratio, limits.tpot_slack_s) or "")
    if candidate.runs >= enough and baseline.runs >= enough:
        judged += 1
        if candidate.failure_rate > baseline.failure_rate + limits.max_failure_rate_increase:
            breaches.append(f"FAILED/INTERRUPTED rate {candidate.failure_rate:.1%} vs baseline "
                            f"{baseline.failure_rate:.1%} (limit +{limits.max_failure_rate_increase:.1%})")
    broken = [text for text in breaches if text]
    if broken:
        counts = f"over {candidate.runs} candidate / {baseline.runs} baseline runs"
        return Judgment(Verdict.BREACH, "; ".join(broken) + f" {counts}", candidate, baseline)
    if judged == 0:
        return Judgment(Verdict.HOLD, f"waiting for {enough} samples per arm (candidate {candidate.runs}, "
                        f"baseline {baseline.runs} runs)", candidate, baseline)
    return Judgment(Verdict.PASS, "", candidate, baseline)
