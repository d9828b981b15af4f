"""Where a paused conversation's history waits between turns: the GPU pool, the host tier, or nowhere.

A chat user reads and types between turns; their history's KV blocks stay cached, owned by nobody,
until other traffic needs the room (engine.kv_cache). Steady state, per serving replica:

    idle histories   = (users − generating) ÷ replicas × context tokens
    GPU room         = KV pool tokens − generating ÷ replicas × context tokens
    on the GPU       = min(1, GPU room ÷ idle histories)
    in host memory   = min(1 − on the GPU, host tier tokens ÷ idle histories)
    re-prefilled     = the rest

A turn whose history is on the GPU reuses it; in host memory, copies it back (history × KV bytes per
token per GPU ÷ host link, CostModel.onboard_time_s); otherwise prefills it again. The brief's prefix
hit rate assumes a warm cache, so the reachable rate is that times the share still held. This is the
whole-fleet average under LRU; the simulator measures it (bench/bench_host_tier.py).
"""

from __future__ import annotations

from sluice.planner import fmt
from sluice.planner.brief import Brief
from sluice.planner.demand import Load
from sluice.planner.result import Figure, Section
from sluice.planner.supply import Replica


def kv_tier_section(brief: Brief, rep: Replica, load: Load, replicas: int) -> Section:
    cost, hardware, factors = rep.cost, brief.hardware, brief.factors
    serving = max(1, replicas - brief.sizing.spare_replicas)
    context = load.context_tokens
    idle = max(0.0, load.users - load.generating) / serving * context
    pool = cost.kv_capacity_tokens_per_gpu()
    room = max(0.0, pool - load.generating / serving * context)
    host = cost.host_kv_capacity_blocks(1)
    on_gpu = min(1.0, room / idle) if idle > 0 else 1.0
    in_host = min(1.0 - on_gpu, host / idle) if idle > 0 else 0.0
    lost = max(0.0, 1.0 - on_gpu - in_host)
    hit = brief.workload.prefix_hit_rate
    held = on_gpu + in_host
    onboard = cost.onboard_time_s(context, 1)
    reprefill = context / cost.prefill_tokens_per_s()
    per_token = cost.kv_bytes_per_token_per_gpu()
    link = hardware.host_link_bytes_per_s * factors.achieved_host_link_fraction
    figures = (
        Figure("kv_tier.idle_history_tokens", "idle conversation histories per replica", idle, "tokens",
               f"({fmt.count(load.users)} users − {fmt.num(load.generating)} generating) ÷ {serving} "
               f"replicas × {fmt.count(context)} tokens = {fmt.count(idle)} tokens"),
        Figure("kv_tier.gpu_room_tokens", "KV pool left for them on the GPU", room, "tokens",
               f"{fmt.count(pool)} pool tokens − {fmt.num(load.generating / serving)} generating × "
               f"{fmt.count(context)} = {fmt.count(room)} tokens"),
        Figure("kv_tier.host_tokens", "host-memory KV tier per replica", host, "tokens",
               f"{fmt.gb(hardware.host_memory_bytes)} host memory per GPU × "
               f"{fmt.num(factors.host_memory_fraction)} pinned for KV ÷ "
               f"{fmt.kv_bytes(per_token)} per token per GPU = {fmt.count(host)} tokens"),
        Figure("kv_tier.on_gpu", "histories still on the GPU at the next turn", on_gpu, "fraction",
               f"min(1, {fmt.count(room)} ÷ {fmt.count(idle)}) = {fmt.pct(on_gpu)}"),
        Figure("kv_tier.in_host", "histories in host memory at the next turn", in_host, "fraction",
               f"min({fmt.pct(1 - on_gpu)}, {fmt.count(host)} ÷ {fmt.count(idle)}) = {fmt.pct(in_host)}; "
               f"{fmt.pct(lost)} are prefilled again"),
        Figure("kv_tier.hit_rate_without", "prefix hit rate reachable without the host tier", hit * on_gpu,
               "fraction", f"{fmt.pct(hit)} expected × {fmt.pct(on_gpu)} held = {fmt.pct(hit * on_gpu)}"),
        Figure("kv_tier.hit_rate_with", "prefix hit rate reachable with the host tier",
               hit * held, "fraction",
               f"{fmt.pct(hit)} expected × {fmt.pct(held)} held = {fmt.pct(hit * held)}"),
        Figure("kv_tier.onboard_s", "a history copied back from host memory", onboard, "s",
               f"{fmt.count(context)} tokens × {fmt.kv_bytes(per_token)} ÷ ({fmt.num(link / 1e9)} GB/s "
               f"{hardware.name} host link achieved) = {fmt.ms(onboard)} added to that turn's TTFT"),
        Figure("kv_tier.reprefill_s", "the same history prefilled again", reprefill, "s",
               f"{fmt.count(context)} tokens ÷ {fmt.count(cost.prefill_tokens_per_s())} prefill tok/s = "
               f"{fmt.ms(reprefill)} ({fmt.times(reprefill / onboard if onboard > 0 else 0.0)} the copy), "
               "and that compute stalls every decode in its steps"),
    )
    return Section("kv_tier", "KV tiers: where a paused conversation waits", figures)
