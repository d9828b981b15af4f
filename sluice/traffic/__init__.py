"""Traffic policy (issue 14), pure rules only: no I/O, no clock.

Which model version a run goes to, and why (points 1-3):
    route.py       the routing decision a run records
    fallback.py    permitted fallback
    canary.py      the canary split with its guardrails

How load is shared and given up (points 4-6):
    priority.py    interactive / batch classes, the claim order, the pool-headroom rule batch waits for
    gpu_budget.py  a tenant's cap on the KV tokens its running runs hold across the pool
    ladder.py      the degradation ladder: defer batch → shed batch → fallbacks → shed interactive

Admission, the routing worker's claim, the canary guard loop and the simulator are the adapters
around them.
"""
