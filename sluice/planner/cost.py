"""Cost per hour and per million output tokens.

A fleet sized for peak is paid for all day, so the price per token depends on
how far the daily average falls below peak (`cost.average_to_peak_traffic`);
the plan prints the peak-hour figure too, which needs no such assumption.
"""

from __future__ import annotations

from sluice.planner import fmt
from sluice.planner.brief import Brief
from sluice.planner.demand import Load
from sluice.planner.result import Figure, Section

HOURS_PER_MONTH = 730
HOURS_PER_YEAR = 8760


def cost_section(brief: Brief, load: Load, gpus: int) -> Section:
    price, ratio = brief.price_per_gpu_hour, brief.average_to_peak_traffic
    hourly = gpus * price
    at_peak = hourly / (load.decode_tok_per_s * 3600) * 1e6
    average = at_peak / ratio
    figures = (
        Figure("cost.per_hour", "fleet cost per hour", hourly, "usd",
               f"{gpus} GPUs × {fmt.usd(price)}/GPU-hour = {fmt.usd(hourly)}/h"),
        Figure("cost.per_month", "per month held at that size", hourly * HOURS_PER_MONTH, "usd",
               f"{fmt.usd(hourly)} × {HOURS_PER_MONTH} h = {fmt.usd(hourly * HOURS_PER_MONTH)}"),
        Figure("cost.per_year", "per year", hourly * HOURS_PER_YEAR, "usd",
               f"{fmt.usd(hourly)} × {fmt.count(HOURS_PER_YEAR)} h = {fmt.usd(hourly * HOURS_PER_YEAR)}"),
        Figure("cost.per_million_output_at_peak", "per million output tokens in the peak hour", at_peak,
               "usd",
               f"{fmt.usd(hourly)} ÷ ({fmt.num(load.decode_tok_per_s)} tok/s × 3,600 s) × 10⁶ = "
               f"{fmt.usd(at_peak)}"),
        Figure("cost.per_million_output", "per million output tokens over the day", average, "usd",
               f"{fmt.usd(at_peak)} ÷ {fmt.num(ratio)} (average ÷ peak traffic) = {fmt.usd(average)}"),
    )
    return Section("cost", "Cost", figures)
