"""The model executor's sampler on hand-made logits: exact choices, seeded draws."""

from __future__ import annotations

import math

import numpy as np

from sluice.engine.llama.sampler import sample

LOGITS = np.log(np.asarray([0.1, 0.6, 0.3], dtype=np.float32))    # probabilities 0.1, 0.6, 0.3


def test_temperature_zero_is_argmax() -> None:
    assert sample(LOGITS, 0.0, 1.0, seed=1, index=0) == 1


def test_top_p_keeps_the_smallest_set_reaching_the_mass() -> None:
    # 0.6 < 0.65: the nucleus is {1, 2}; id 0 (0.1) can never be drawn, and at 0.6 only id 1 stays.
    draws = {sample(LOGITS, 1.0, 0.65, seed=s, index=0) for s in range(200)}
    assert draws == {1, 2}
    assert {sample(LOGITS, 1.0, 0.6, seed=s, index=0) for s in range(50)} == {1}


def test_draws_follow_the_distribution_and_repeat_per_seed_and_index() -> None:
    draws = [sample(LOGITS, 1.0, 1.0, seed=s, index=3) for s in range(2000)]
    assert draws == [sample(LOGITS, 1.0, 1.0, seed=s, index=3) for s in range(2000)]
    shares = [draws.count(i) / len(draws) for i in range(3)]
    # Binomial standard error at n = 2000 is at most 0.011: four of them either way.
    expected = (0.1, 0.6, 0.3)
    assert all(math.isclose(share, p, abs_tol=0.045) for share, p in zip(shares, expected, strict=True))
    assert draws != [sample(LOGITS, 1.0, 1.0, seed=s, index=4) for s in range(2000)]


def test_a_high_temperature_flattens_the_distribution() -> None:
    draws = [sample(LOGITS, 100.0, 1.0, seed=s, index=0) for s in range(1500)]
    assert all(abs(draws.count(i) / 1500 - 1 / 3) < 0.05 for i in range(3))
