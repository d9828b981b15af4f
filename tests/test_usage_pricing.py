"""Integer pricing: rounding up, and the reservation bounding every settlement (pure, no servers)."""

from __future__ import annotations

from sluice.ledger.pricing import cost_micros, largest_output_cap_within_cost, reservation_cost_micros

from tests.support.ledger_factories import DEFAULT_MODEL, MICROS, ModelSpec


def test_the_reservation_always_covers_the_settled_cost():
    # Odd prices, and a cached rate above the input rate, the worst case for the bound.
    card = ModelSpec(price_input_per_m_micros=3, price_cached_input_per_m_micros=7,
                     price_output_per_m_micros=11)
    for prompt in (0, 1, 999, 1_000_001):
        for cap in (1, 7, 333_333):
            held = reservation_cost_micros(card, prompt, cap)
            for cached in (0, prompt // 2, prompt):
                assert cost_micros(card, prompt, cached, cap) <= held


def test_cost_rounds_up_to_a_whole_micro_dollar():
    assert cost_micros(DEFAULT_MODEL, 1, 0, 0) == 1     # 0.5 micros → 1
    assert cost_micros(DEFAULT_MODEL, 2, 0, 0) == 1     # exactly 1
    assert cost_micros(DEFAULT_MODEL, 0, 0, 1_000_000) == 3 * MICROS // 2


def test_the_largest_cap_within_cost_is_exact_at_the_boundary():
    # 1,000 prompt tokens at $0.50/M = 500 micros; 1,400 left → 900 micros → 600 tokens at $1.50/M.
    assert largest_output_cap_within_cost(DEFAULT_MODEL, 1_000, 1_400) == 600
    assert reservation_cost_micros(DEFAULT_MODEL, 1_000, 600) == 1_400
    assert reservation_cost_micros(DEFAULT_MODEL, 1_000, 601) == 1_402  # ceil(1,401.5)


def test_a_free_output_rate_never_bounds_the_cap():
    assert largest_output_cap_within_cost(ModelSpec(price_output_per_m_micros=0), 10, 0) is None
