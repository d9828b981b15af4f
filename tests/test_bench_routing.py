"""bench_routing's method: capacity measured in runs as long as the rows', and the verdict's arithmetic.

No simulation runs here: the sweep and the rows are replaced by recorders, since what is pinned is which
duration each is asked for and how a verdict follows from two ratios.
"""

from __future__ import annotations

import pytest

from bench import bench_routing as br


def row(policy: str, ttft_ms: float, goodput: float) -> br.Row:
    return br.Row(workload="chat", load=0.5, policy=policy, offered=100.0, hit_rate=0.9,
                  ttft_p95_s=ttft_ms / 1e3, itl_p95_s=0.01, goodput=goodput, load_cov=0.1,
                  ttft_p95_range_s=(ttft_ms / 1e3, ttft_ms / 1e3), ttft_late_p95_s=ttft_ms / 1e3,
                  recovery_s=None, slow_share=None, fair_share=None, seeds=1, sim_s=0.0)


def test_each_workloads_capacity_is_measured_in_runs_as_long_as_its_rows(monkeypatch: pytest.MonkeyPatch):
    swept: dict[str, float] = {}
    rows: dict[str, set[float]] = {}

    def sweep(workload: br.Workload, duration_s: float) -> br.Capacity:
        swept[workload.name] = duration_s
        return br.Capacity(requests_per_s=100.0, arrival_ratio=0.5)

    def make_row(workload: br.Workload, load: float, policy: str, rate: float, duration_s: float,
                 seeds: object = ()) -> br.Row:
        rows.setdefault(workload.name, set()).add(duration_s)
        assert rate == load * 100.0 / 0.5                        # the load is a share of that capacity
        return row(policy, 20.0, 50.0)

    monkeypatch.setattr(br, "capacity", sweep)
    monkeypatch.setattr(br, "make_row", make_row)
    br.main(["--workloads", "chat,restart", "--duration", "30", "--policies", "prefix_aware",
             "--loads", "0.5,0.8", "--plots", ""])
    # restart's rows run at least RESTART_MIN_DURATION_S (90 s); its sweep must too, or "80%" is of a
    # capacity measured with fewer conversations mid-way (it offered 181-185 requests/s against 162).
    assert swept == {"chat": 30.0, "restart": br.RESTART_MIN_DURATION_S}
    assert rows == {"chat": {30.0}, "restart": {br.RESTART_MIN_DURATION_S}}


@pytest.mark.parametrize(("ours", "peer", "state"), [
    ((20.0, 100.0), (20.0, 100.0), "match"),                    # equal
    ((21.0, 100.0), (20.0, 100.0), "match"),                    # 20 / 21 = 0.952 >= 0.95
    ((22.0, 100.0), (20.0, 100.0), "loses"),                    # 20 / 22 = 0.909
    ((20.0, 94.0), (20.0, 100.0), "loses"),                     # faster is not enough: goodput 0.94
    ((16.0, 100.0), (20.0, 100.0), "wins"),                     # 20 / 16 = 1.25
    ((16.0, 90.0), (20.0, 100.0), "loses"),                     # a win needs a match on both
    ((20.0, 121.0), (20.0, 100.0), "wins"),                     # goodput 1.21
])
def test_a_match_needs_both_ratios_within_5_percent_and_a_win_20_percent_on_one(
        ours: tuple[float, float], peer: tuple[float, float], state: str):
    verdict = br.verdict([row(br.OURS, *ours), row("sglang_cache_aware", *peer), row("llmd", 40.0, 50.0)])
    assert verdict.best_peer == "sglang_cache_aware"
    assert {"match": (True, False), "wins": (True, True), "loses": (False, False)}[state] == \
        (verdict.matches, verdict.wins)
