"""Integer pricing from a model's price card (micro-USD per million tokens).

Cached prompt tokens are billed at the cached rate and the rest of the prompt at the input rate.
The sum is divided once and rounded up, so a bill is never a fraction of a micro-dollar short and
the admission reservation (whole prompt uncached + full output cap) is always >= the settled cost.
"""

from __future__ import annotations

from typing import Any, Protocol

from sqlalchemy import BigInteger, cast

TOKENS_PER_PRICE_UNIT = 1_000_000


class PriceCard(Protocol):
    """Anything with a price card: the Model row, ModelInfo, a test spec."""

    @property
    def price_input_per_m_micros(self) -> int: ...
    @property
    def price_cached_input_per_m_micros(self) -> int: ...
    @property
    def price_output_per_m_micros(self) -> int: ...


def cost_micros(model: PriceCard, input_tokens: int, cached_input_tokens: int, output_tokens: int) -> int:
    """Cost of one run in micro-USD, rounded up. `cached_input_tokens` is a subset of `input_tokens`."""
    if not 0 <= cached_input_tokens <= input_tokens or output_tokens < 0:
        raise ValueError(
            f"token counts out of range: input={input_tokens} cached={cached_input_tokens}"
            f" output={output_tokens}"
        )
    scaled = (
        (input_tokens - cached_input_tokens) * model.price_input_per_m_micros
        + cached_input_tokens * model.price_cached_input_per_m_micros
        + output_tokens * model.price_output_per_m_micros
    )
    return -(-scaled // TOKENS_PER_PRICE_UNIT)


def _worst_prompt_rate(model: PriceCard) -> int:
    return max(model.price_input_per_m_micros, model.price_cached_input_per_m_micros)


def reservation_cost_micros(model: PriceCard, input_tokens: int, max_output_tokens: int) -> int:
    """The worst-case cost admission holds: every output token generated, the prompt at its dearer
    rate (cached or not), so that no settlement can cost more than was reserved."""
    scaled = input_tokens * _worst_prompt_rate(model) + max_output_tokens * model.price_output_per_m_micros
    return -(-scaled // TOKENS_PER_PRICE_UNIT)


def largest_output_cap_within_cost(model: PriceCard, input_tokens: int, cost_left_micros: int) -> int | None:
    """The largest output cap whose reservation fits `cost_left_micros`; None when cost never binds.

    ceil(s / 1e6) <= left  ⇔  s <= left * 1e6  (left is an integer), so the bound is exact.
    """
    if model.price_output_per_m_micros == 0:
        return None
    room = cost_left_micros * TOKENS_PER_PRICE_UNIT - input_tokens * _worst_prompt_rate(model)
    return room // model.price_output_per_m_micros


def cost_micros_sql(input_tokens: Any, cached_input_tokens: Any, output_tokens: Any, card: Any) -> Any:
    """cost_micros as a SQL expression over columns (the reconciliation recomputes every entry's
    cost in the database). All terms are non-negative, so adding unit - 1 before the integer
    division rounds up exactly as `cost_micros` does; tests pin the two against each other."""
    # Token counts are INTEGER columns: widen them first, or a product overflows int4.
    counts = (input_tokens, cached_input_tokens, output_tokens)
    inputs, cached, outputs = (cast(count, BigInteger) for count in counts)
    scaled = (
        (inputs - cached) * card.price_input_per_m_micros
        + cached * card.price_cached_input_per_m_micros
        + outputs * card.price_output_per_m_micros
    )
    return (scaled + (TOKENS_PER_PRICE_UNIT - 1)) // TOKENS_PER_PRICE_UNIT   # // : integer division in SQL
