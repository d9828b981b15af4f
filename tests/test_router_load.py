"""TensorRT-LLM metric parsing, restart detection, and scraped load combined with our own sends."""

from __future__ import annotations

from prometheus_client import generate_latest

from sluice.router.load import (
    STEP_TIME_SMOOTHING,
    LoadSnapshot,
    LoadTracker,
    parse_metrics,
    record_scrape,
    restarted,
)
from sluice.router.policies import PrefixAware
from sluice.router.policy import ReplicaView, RouteRequest

TRT_LLM_TEXT = """\
# HELP nv_trt_llm_request_metrics TRT LLM request metrics
# TYPE nv_trt_llm_request_metrics gauge
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="context",version="1"} 1
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="scheduled",version="1"} 3
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="max",version="1"} 64
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="active",version="1"} 3
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="waiting",version="1"} 2
# HELP nv_trt_llm_kv_cache_block_metrics TRT LLM KV cache block metrics
# TYPE nv_trt_llm_kv_cache_block_metrics gauge
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="tokens_per",model="tensorrt_llm",version="1"} 32
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used",model="tensorrt_llm",version="1"} 120
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="free",model="tensorrt_llm",version="1"} 904
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",model="tensorrt_llm",version="1"} 1024
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="reused",model="tensorrt_llm",version="1"} 77
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction",model="tensorrt_llm",version="1"} 0.1171875
# HELP nv_trt_llm_general_metrics General TRT LLM metrics
# TYPE nv_trt_llm_general_metrics gauge
nv_trt_llm_general_metrics{general_type="iteration_counter",model="tensorrt_llm",version="1"} 5120
nv_trt_llm_general_metrics{general_type="timestamp",model="tensorrt_llm",version="1"} 1700074049
# HELP nv_inference_count Number of inferences performed
# TYPE nv_inference_count counter
nv_inference_count{model="tensorrt_llm",version="1"} 12
# HELP sluice_replica_start_time_seconds Unix time this replica process started
# TYPE sluice_replica_start_time_seconds gauge
sluice_replica_start_time_seconds 1.7e+09
"""


def test_parses_tensorrt_llm_request_and_kv_metrics_and_the_start_time():
    assert parse_metrics(TRT_LLM_TEXT) == LoadSnapshot(
        active=3, waiting=2, scheduled=3, context=1, max_requests=64, kv_max_blocks=1024, kv_free_blocks=904,
        kv_used_blocks=120, kv_tokens_per_block=32, kv_reused_blocks=77, kv_fraction=0.1171875,
        start_time=1.7e9, iterations=5120,
    )


def test_absent_metrics_read_as_zero_and_the_fraction_is_derived():
    text = 'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used"} 25\n' \
           'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max"} 100\n'
    assert parse_metrics(text) == LoadSnapshot(kv_used_blocks=25, kv_max_blocks=100, kv_fraction=0.25)


def test_parses_what_the_replica_host_exports():
    from sluice.replica.engine_api import EngineStats
    from sluice.replica.metrics import ReplicaMetrics

    metrics = ReplicaMetrics(start_time=1234.5)
    metrics.update(EngineStats(active=4, waiting=6, scheduled=4, context=2, max_requests=64,
                               kv_max_blocks=512, kv_free_blocks=500, kv_used_blocks=12,
                               kv_tokens_per_block=16, kv_reused_blocks=9))
    snapshot = parse_metrics(generate_latest(metrics.registry).decode())
    assert (snapshot.active, snapshot.waiting, snapshot.kv_used_blocks, snapshot.kv_max_blocks,
            snapshot.kv_tokens_per_block, snapshot.kv_reused_blocks, snapshot.start_time) == (
        4, 6, 12, 512, 16, 9, 1234.5)


def test_a_changed_start_time_is_a_restart():
    assert restarted(LoadSnapshot(start_time=100.0), LoadSnapshot(start_time=200.0))
    assert not restarted(LoadSnapshot(start_time=100.0, kv_reused_blocks=5),
                         LoadSnapshot(start_time=100.0, kv_reused_blocks=9))


def test_without_a_start_time_a_reused_counter_going_backwards_is_a_restart():
    assert restarted(LoadSnapshot(kv_reused_blocks=50), LoadSnapshot(kv_reused_blocks=3))
    assert not restarted(LoadSnapshot(kv_reused_blocks=50), LoadSnapshot(kv_reused_blocks=50))
    assert not restarted(None, LoadSnapshot(kv_reused_blocks=0))


def test_runs_sent_since_the_last_scrape_count_as_waiting_until_the_next_scrape():
    tracker = LoadTracker()
    tracker.on_scrape("r0", LoadSnapshot(active=3, waiting=1, kv_used_blocks=40, kv_max_blocks=100,
                                         kv_tokens_per_block=16))
    for _ in range(5):
        tracker.on_sent("r0")
    load = tracker.load("r0")
    assert (load.waiting, load.running, load.in_flight, load.kv_capacity_blocks, load.block_size) == (
        6, 3, 5, 100, 16)
    tracker.on_scrape("r0", LoadSnapshot(active=8, waiting=1))
    assert (tracker.load("r0").waiting, tracker.load("r0").running) == (1, 8)


def test_without_scrapes_a_replica_is_as_loaded_as_its_runs_in_flight():
    tracker = LoadTracker()
    for _ in range(50):
        tracker.on_sent("r0")
        tracker.on_finished("r0")
    tracker.on_sent("r0")
    tracker.on_sent("r0")
    load = tracker.load("r0")
    assert (load.waiting, load.running, load.in_flight) == (2, 0, 2)


def test_in_flight_drops_as_runs_finish_and_never_below_zero():
    tracker = LoadTracker()
    tracker.on_sent("r0")
    tracker.on_finished("r0")
    tracker.on_finished("r0")
    assert tracker.load("r0").in_flight == 0


def test_the_tracker_reports_a_restart_seen_in_a_scrape():
    tracker = LoadTracker()
    assert not tracker.on_scrape("r0", LoadSnapshot(start_time=1.0))
    assert not tracker.on_scrape("r0", LoadSnapshot(start_time=1.0))
    assert tracker.on_scrape("r0", LoadSnapshot(start_time=2.0))


def test_a_scrape_revealing_a_restart_makes_the_policy_forget_the_replica():
    policy = PrefixAware()
    tracker = LoadTracker()
    record_scrape(tracker, policy, "r0", TRT_LLM_TEXT)
    view = ReplicaView(name="r0", pool="m", block_size=16, kv_capacity_blocks=1000)
    request = RouteRequest(request_id="a", model_version="m", token_ids=list(range(256)), max_output_tokens=8)
    decision = policy.choose(request, [view], 1.0)
    assert decision is not None
    policy.on_routed(request, decision, 1.0)
    assert policy.index.entries("r0") == 4
    same = record_scrape(tracker, policy, "r0", TRT_LLM_TEXT)
    assert same.start_time == 1.7e9 and policy.index.entries("r0") == 4
    record_scrape(tracker, policy, "r0", TRT_LLM_TEXT.replace("1.7e+09", "1.8e+09"))
    assert policy.index.entries("r0") == 0


def test_the_line_scan_reads_timestamps_label_order_and_other_models_like_a_full_parser():
    text = (
        '# HELP nv_trt_llm_request_metrics_other a lookalike name\n'
        'nv_trt_llm_request_metrics_other{request_type="active"} 99\n'
        'nv_trt_llm_request_metrics{version="1",request_type="active",model="a"} 2 1700000000000\n'
        'nv_trt_llm_request_metrics{model="b",request_type="active"} 3\n'
        'nv_trt_llm_kv_cache_block_metrics{note="a,b}c",kv_cache_block_type="used"} 7.0\n'
        'sluice_replica_start_time_seconds 1.5e+09\n'
    )
    assert parse_metrics(text) == LoadSnapshot(active=5, kv_used_blocks=7, start_time=1.5e9)
    from prometheus_client.parser import text_string_to_metric_families
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    assert sum(s.value for s in samples if s.name == "nv_trt_llm_request_metrics") == 5


def test_step_time_is_the_time_between_busy_scrapes_over_the_steps_run_and_is_smoothed():
    tracker = LoadTracker()
    tracker.on_scrape("r0", LoadSnapshot(active=8, iterations=100), now=10.0)
    assert tracker.load("r0").step_time_s == 0.0                       # one scrape: no interval yet
    tracker.on_scrape("r0", LoadSnapshot(active=8, iterations=125), now=10.5)
    assert tracker.load("r0").step_time_s == 0.5 / 25                  # 20 ms per step
    tracker.on_scrape("r0", LoadSnapshot(active=8, iterations=135), now=11.0)
    expected = 0.02 + STEP_TIME_SMOOTHING * (0.5 / 10 - 0.02)          # a 50 ms interval, smoothed in
    assert abs(tracker.load("r0").step_time_s - expected) < 1e-12
    # Idle at a scrape, or no step run: the interval says nothing about step time; it is kept.
    tracker.on_scrape("r0", LoadSnapshot(active=0, iterations=136), now=20.0)
    tracker.on_scrape("r0", LoadSnapshot(active=8, iterations=140), now=30.0)
    tracker.on_scrape("r0", LoadSnapshot(active=8, iterations=140), now=31.0)
    assert abs(tracker.load("r0").step_time_s - expected) < 1e-12
    # A restart forgets it: the new process may sit on other GPUs.
    tracker.on_scrape("r0", LoadSnapshot(active=8, iterations=140, start_time=1.0), now=32.0)
    tracker.on_scrape("r0", LoadSnapshot(active=8, iterations=10, start_time=2.0), now=33.0)
    assert tracker.load("r0").step_time_s == 0.0


def test_the_slower_replica_by_scraped_step_time_gets_the_next_new_request():
    """Two replicas at the same load, one stepping twice as long (a throttled GPU): the registry's
    views carry the scraped step times, and least-loaded weights load by them."""
    from sluice.router.factory import make_policy
    from sluice.router.registry import ReplicaRegistry, ReplicaSpec

    registry = ReplicaRegistry([ReplicaSpec(name=name, grpc_address=f"localhost:{port}", pool="m",
                                            block_size=16, kv_capacity_blocks=1000)
                                for name, port in (("a", 1), ("b", 2))])
    tracker = LoadTracker()
    for name, steps in (("a", 50), ("b", 25)):                         # in 1 s: a at 20 ms, b at 40 ms
        tracker.on_scrape(name, LoadSnapshot(active=4, iterations=1000), now=100.0)
        tracker.on_scrape(name, LoadSnapshot(active=4, iterations=1000 + steps), now=101.0)
    views = registry.views("m", now=101.0, loads=tracker)
    assert {view.name: view.step_time_s for view in views} == {"a": 0.02, "b": 0.04}
    request = RouteRequest(request_id="x", model_version="m", token_ids=list(range(64)), max_output_tokens=8)
    for policy in ("least_loaded", "prefix_aware"):
        decision = make_policy(policy).choose(request, views, 101.0)
        assert decision is not None and decision.replica == "a", policy
