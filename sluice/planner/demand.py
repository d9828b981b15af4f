"""Demand: users at peak → sequences generating at once, requests/s, tokens/s.

The chain both seeds use (seed 000 §sizing, seed 003 §2):

    duty cycle        = answer time ÷ (answer + read-and-type time)   (or stated, with a turn period)
    generating        = users × duty cycle
    requests/s        = users ÷ turn period
    decode tokens/s   = requests/s × mean output
    input tokens/s    = requests/s × mean input
    prefill tokens/s  = input tokens/s × (1 − prefix hit rate), if the sizing counts on the cache
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from sluice.planner import fmt
from sluice.planner.brief import Brief
from sluice.planner.result import Figure, Section

# Stated duty cycles are rounded; a gap wider than this (relative) against the
# times they summarise is reported, never silently used.
_DUTY_TOLERANCE = 0.005


@dataclass(frozen=True, slots=True)
class Load:
    """The demand numbers the rest of the plan consumes (also scaled by the failure scenarios)."""

    users: float
    turn_period_s: float
    generating: float                  # sequences generating at once, fleet-wide
    requests_per_s: float
    decode_tok_per_s: float
    input_tok_per_s: float             # before any prefix cache
    prefill_tok_per_s: float           # the sizing basis: after the prefix credit, if counted
    expected_prefill_tok_per_s: float  # at the expected hit rate
    context_tokens: int                # per generating sequence, for KV and decode sizing

    def scaled(self, traffic: float = 1.0, inputs: float = 1.0) -> Load:
        return replace(
            self,
            users=self.users * traffic,
            generating=self.generating * traffic,
            requests_per_s=self.requests_per_s * traffic,
            decode_tok_per_s=self.decode_tok_per_s * traffic,
            input_tok_per_s=self.input_tok_per_s * traffic * inputs,
            prefill_tok_per_s=self.prefill_tok_per_s * traffic * inputs,
            expected_prefill_tok_per_s=self.expected_prefill_tok_per_s * traffic * inputs,
        )


def demand(brief: Brief) -> tuple[Load, Section]:
    d, w = brief.demand, brief.workload
    out_mean, in_mean = w.output_tokens.mean, w.input_tokens.mean
    figures: list[Figure] = []

    rate = d.generation_tok_per_s
    if rate is not None:
        answer_s = out_mean / rate
        answer_formula = f"{fmt.count(out_mean)} tokens ÷ {fmt.num(rate)} tok/s = {fmt.num(answer_s)} s"
    else:
        rate = 1.0 / brief.slo.itl_p95_s
        answer_s = out_mean * brief.slo.itl_p95_s
        answer_formula = (f"{fmt.count(out_mean)} tokens × {fmt.ms(brief.slo.itl_p95_s)} (the p95 ITL SLO "
                          f"as the generation pace) = {fmt.num(answer_s)} s")

    if d.duty_cycle is not None and d.turn_period_s is not None:
        duty, turn = d.duty_cycle, d.turn_period_s
        implied = answer_s / turn
        note = ""
        if d.generation_tok_per_s is not None and abs(implied - duty) > _DUTY_TOLERANCE * duty:
            note = (f"the stated duty cycle rounds {fmt.num(answer_s)} s of answer ÷ {fmt.num(turn)} s "
                    f"per turn = {fmt.pct(implied)}; the plan uses the stated {fmt.pct(duty)} for sequences "
                    "generating and the turn period for request and token rates (so "
                    f"{fmt.num(d.users * duty)} × {fmt.num(rate)} tok/s = {fmt.num(d.users * duty * rate)} "
                    "differs slightly from the decode demand below)")
        figures.append(Figure("demand.duty_cycle", "share of users generating at any instant", duty,
                              "fraction", f"stated in the brief: {fmt.pct(duty)} "
                              f"(one turn every {fmt.num(turn)} s)", note))
    else:
        assert d.read_and_type_s is not None, "parse_brief guarantees a duty cycle or a read time"
        turn = answer_s + d.read_and_type_s
        duty = answer_s / turn
        figures.append(Figure("demand.answer_s", "time to generate one answer", answer_s, "seconds",
                              answer_formula))
        figures.append(Figure("demand.turn_period_s", "one turn: answer + read and type", turn, "seconds",
                              f"{fmt.num(answer_s)} s + {fmt.num(d.read_and_type_s)} s = {fmt.num(turn)} s"))
        figures.append(Figure("demand.duty_cycle", "share of users generating at any instant", duty,
                              "fraction", f"{fmt.num(answer_s)} s ÷ {fmt.num(turn)} s = {fmt.pct(duty)}"))

    generating = d.users * duty
    requests = d.users / turn
    decode = requests * out_mean
    inputs = requests * in_mean
    figures.append(Figure("demand.generating_sequences", "sequences generating at once", generating,
                          "sequences", f"{fmt.count(d.users)} users × {fmt.num(duty)} = "
                          f"{fmt.num(generating)} sequences"))
    figures.append(Figure("demand.requests_per_s", "requests per second", requests, "req/s",
                          f"{fmt.count(d.users)} users ÷ {fmt.num(turn)} s per turn = {fmt.num(requests)} "
                          "req/s"))
    decode_formula = (f"{fmt.num(requests)} req/s × {fmt.count(out_mean)} output tokens = "
                      f"{fmt.num(decode)} tok/s")
    if d.duty_cycle is None:
        decode_formula += (f" (= {fmt.count(d.users)} users × {fmt.num(duty)} × {fmt.num(rate)} tok/s "
                           "per generating user)")
    figures.append(Figure("demand.decode_tok_per_s", "decode (output) tokens per second", decode, "tok/s",
                          decode_formula))
    figures.append(Figure("demand.input_tok_per_s", "input tokens per second", inputs, "tok/s",
                          f"{fmt.num(requests)} req/s × {fmt.count(in_mean)} input tokens = "
                          f"{fmt.num(inputs)} tok/s"))

    hit = w.prefix_hit_rate
    expected = inputs * (1.0 - hit)
    if w.prefix_credit_in_sizing:
        prefill = expected
        prefill_formula = (f"{fmt.num(inputs)} tok/s × (1 − {fmt.num(hit)} prefix hit rate) = "
                           f"{fmt.num(prefill)} tok/s")
    else:
        prefill = inputs
        prefill_formula = (f"{fmt.num(inputs)} tok/s, every input token prefilled: the sizing gives the "
                           "prefix cache no credit")
    figures.append(Figure("demand.prefill_tok_per_s", "prefill tokens per second (sizing basis)", prefill,
                          "tok/s", prefill_formula))
    if hit > 0 and not w.prefix_credit_in_sizing:
        figures.append(Figure("demand.expected_prefill_tok_per_s",
                              "prefill tokens per second at the expected prefix hit rate", expected, "tok/s",
                              f"{fmt.num(inputs)} tok/s × (1 − {fmt.num(hit)}) = {fmt.num(expected)} tok/s"))
    figures.append(Figure("demand.context_tokens", "context per generating sequence (KV and decode sizing)",
                          w.kv_context_tokens, "tokens", f"{fmt.count(w.kv_context_tokens)} tokens"))

    load = Load(users=d.users, turn_period_s=turn, generating=generating, requests_per_s=requests,
                decode_tok_per_s=decode, input_tok_per_s=inputs, prefill_tok_per_s=prefill,
                expected_prefill_tok_per_s=expected, context_tokens=w.kv_context_tokens)
    return load, Section("demand", "Demand", tuple(figures))
