"""Traffic policy (issue 14, points 1-3): which model version a run goes to, and why.

Pure rules only: the routing decision a run records (route.py), permitted fallback
(fallback.py) and the canary split with its guardrails (canary.py). Admission, the canary
guard loop and the simulator are the adapters around them.
"""
