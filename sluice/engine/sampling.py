"""Deterministic stand-ins for sampling: token ids and output lengths from a seed.

The engine computes no logits, so "sampling" is a pure function of the
request's seed: token i of a request is `token_at(seed, i)`, and how many
tokens the request produces before the model "emits end_id" is drawn once from
a length distribution through its inverse CDF at a seed-derived quantile. A
test (or the simulator, building the next turn of a conversation) can compute
the exact stream without running the engine.

Generated ids avoid [0, first_normal_id), where tokenizers keep special ids
(pad, bos, eos, ...), so a generated token never equals a special end_id.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Protocol

import numpy as np

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX = 0xBF58476D1CE4E5B9
_LENGTH_STREAM = 0xA5A5_5A5A   # distinct stream for the length draw
_SHORT = 16                    # below this many tokens plain Python beats numpy's call overhead

INFEASIBLE_LOGNORMAL = ("no log-normal has mean {mean} and p95 {p95}: p95/mean must be in (1, 3.87); "
                        "model such tails as a mixture (e.g. multi-turn history)")


def splitmix64(value: int) -> int:
    value = (value + _GOLDEN) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def uniform(seed: int, stream: int = _LENGTH_STREAM) -> float:
    """A quantile in [0, 1) from (seed, stream)."""
    return splitmix64(splitmix64(seed & _MASK64) ^ stream) / 2.0**64


@dataclass(frozen=True, slots=True)
class TokenSpace:
    vocab_size: int = 32000
    first_normal_id: int = 4    # ids below are special and never generated

    def __post_init__(self) -> None:
        assert 0 <= self.first_normal_id < self.vocab_size, "the normal id range must be non-empty"


def token_at(space: TokenSpace, seed: int, index: int) -> int:
    """Output token `index` (0-based) of the request seeded `seed`."""
    return tokens_between(space, seed, index, index + 1)[0]


def tokens_between(space: TokenSpace, seed: int, start: int, stop: int) -> list[int]:
    """Output tokens [start, stop) of the request seeded `seed`.

    A multiplicative mix of (seed, index): cheap enough that the simulator can
    materialise millions of tokens a second when it hashes a finished answer.
    """
    base = splitmix64(seed & _MASK64)
    low = space.first_normal_id
    span = space.vocab_size - low
    if stop - start <= _SHORT:
        return [low + ((((base ^ (i * _GOLDEN)) * _MIX) & _MASK64) >> 24) % span for i in range(start, stop)]
    # The same arithmetic in wrapping uint64: (x * c) mod 2^64 depends only on x mod 2^64.
    index = np.arange(start, stop, dtype=np.uint64)
    mixed = (np.uint64(base) ^ (index * np.uint64(_GOLDEN))) * np.uint64(_MIX)
    values: list[int] = ((mixed >> np.uint64(24)) % np.uint64(span) + np.uint64(low)).tolist()
    return values


class LengthDistribution(Protocol):
    """Inverse CDF of a token-count distribution; `quantile(u)` is at least 1."""

    def quantile(self, u: float) -> int: ...

    def mean(self) -> float: ...


@dataclass(frozen=True, slots=True)
class FixedLength:
    tokens: int

    def quantile(self, u: float) -> int:
        return self.tokens

    def mean(self) -> float:
        return float(self.tokens)


@dataclass(frozen=True, slots=True)
class UniformLength:
    low: int
    high: int   # inclusive

    def quantile(self, u: float) -> int:
        return self.low + min(int(u * (self.high - self.low + 1)), self.high - self.low)

    def mean(self) -> float:
        return (self.low + self.high) / 2


@dataclass(frozen=True, slots=True)
class LogNormalLength:
    """Log-normal by its median and shape; `from_mean_p95` fits the way briefs state lengths
    (seed 003: output mean 350, p95 1,200 → median 180, sigma 1.15)."""

    median: float
    sigma: float
    maximum: int = 1 << 20

    @classmethod
    def from_mean_p95(cls, mean: float, p95: float, maximum: int = 1 << 20) -> LogNormalLength:
        # mean = exp(mu + s²/2), p95 = exp(mu + 1.645 s)  →  s²/2 − 1.645 s + ln(p95/mean) = 0
        z = NormalDist().inv_cdf(0.95)
        gap = math.log(p95 / mean) if p95 > mean > 0 else -1.0
        discriminant = z * z - 2 * gap
        if gap <= 0 or discriminant < 0:
            raise ValueError(INFEASIBLE_LOGNORMAL.format(mean=mean, p95=p95))
        sigma = z - math.sqrt(discriminant)
        return cls(median=mean / math.exp(sigma * sigma / 2), sigma=sigma, maximum=maximum)

    def quantile(self, u: float) -> int:
        u = min(max(u, 1e-12), 1 - 1e-12)
        value = self.median * math.exp(self.sigma * NormalDist().inv_cdf(u))
        return max(1, min(self.maximum, round(value)))

    def mean(self) -> float:
        return self.median * math.exp(self.sigma * self.sigma / 2)


@dataclass(frozen=True, slots=True)
class GeometricLength:
    """Memoryless counts ≥ 1 with the given mean (e.g. turns per conversation)."""

    mean_value: float

    def quantile(self, u: float) -> int:
        if self.mean_value <= 1:
            return 1
        p = 1 / self.mean_value
        return 1 + int(math.log1p(-u) / math.log1p(-p))

    def mean(self) -> float:
        return max(1.0, self.mean_value)


def draw_output_length(distribution: LengthDistribution | None, seed: int, cap: int) -> int:
    """Tokens the request streams before end_id, capped by request_output_len; None runs to the cap."""
    if distribution is None:
        return cap
    return max(1, min(cap, distribution.quantile(uniform(seed))))
