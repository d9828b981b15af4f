"""The engine core behind the Triton host: the adapter alone, then a real pytriton replica."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sluice.engine.sampling import TokenSpace, tokens_between
from sluice.replica.engine_api import EngineRequestError, GenerationRequest
from sluice.replica.engine_core_adapter import (
    ERR_NOT_BOOL,
    ERR_OUTPUT_LENGTH,
    CoreEngine,
    CoreSettings,
)
from sluice.replica.generator import prompt_seed
from sluice.replica.metrics import ReplicaMetrics
from sluice.router.load import parse_metrics

SPACE = TokenSpace(vocab_size=4096, first_normal_id=5)
SETTINGS = CoreSettings(model="llama-3-8b", hardware="h100-sxm", tp=1, block_size=4, num_blocks=64,
                        max_num_seqs=8, max_num_tokens=64, time_scale=0.5)


def expected(prompt: tuple[int, ...], count: int, seed: int | None = None) -> list[int]:
    return tokens_between(SPACE, prompt_seed(prompt) if seed is None else seed, 0, count)


def drain(engine: CoreEngine) -> list[tuple[str, tuple[int, ...], bool, str | None]]:
    seen = []
    while engine.has_work():
        for output in engine.step().outputs:
            seen.append((output.request_id, output.new_token_ids, output.finished, output.finish_reason))
    return seen


def test_the_adapter_streams_the_cores_tokens_one_per_step() -> None:
    engine = CoreEngine(SETTINGS)
    prompt = (11, 12, 13)
    engine.add_request(GenerationRequest("a", prompt, 5, None, prompt_seed(prompt)))
    outputs = drain(engine)
    assert [ids for _, ids, _, _ in outputs] == [(t,) for t in expected(prompt, 5)]
    assert outputs[-1][2:] == (True, "length")


def test_step_durations_are_the_cost_model_times_the_time_scale() -> None:
    engine = CoreEngine(SETTINGS)
    engine.add_request(GenerationRequest("a", (1, 2, 3), 2, None, 7))
    result = engine.step()
    assert result.duration_s == pytest.approx(engine.last_modelled_s * 0.5)
    assert engine.last_modelled_s == engine.cost_model.step_time_totals_s(3, 0, 0, 3)


def test_abort_frees_the_request_and_reports_it_known_once() -> None:
    engine = CoreEngine(SETTINGS)
    engine.add_request(GenerationRequest("a", (1, 2, 3, 4, 5), 50, None, 7))
    engine.step()
    assert engine.stats().kv_used_blocks == 2
    assert engine.abort("a") is True
    assert engine.abort("a") is False
    assert (engine.stats().kv_used_blocks, engine.stats().active, engine.has_work()) == (0, 0, False)


def test_core_errors_become_the_hosts_request_errors() -> None:
    engine = CoreEngine(SETTINGS)
    with pytest.raises(EngineRequestError, match="needs 75 KV blocks"):
        engine.add_request(GenerationRequest("big", tuple(range(200)), 100, None, 1))


def test_stats_carry_the_cores_kv_counters() -> None:
    engine = CoreEngine(SETTINGS)
    for rid in ("a", "b"):
        engine.add_request(GenerationRequest(rid, tuple(range(10, 19)), 3, None, 1))
        drain(engine)
    stats = engine.stats()
    assert (stats.kv_max_blocks, stats.kv_tokens_per_block, stats.kv_reused_blocks) == (64, 4, 2)
    assert stats.kv_fraction == 0.0


def test_settings_read_the_replica_section() -> None:
    settings = CoreSettings.from_section({"engine": "core", "model": "llama-3-70b", "weights": "fp8", "tp": 8,
                                          "time_scale": 0.25, "prefix_reuse": False, "token_delay_ms": 20})
    assert (settings.model, settings.weights, settings.tp, settings.time_scale, settings.prefix_reuse) == (
        "llama-3-70b", "fp8", 8, 0.25, False)
    assert CoreEngine(settings).core.pool.num_blocks == settings.cost_model().kv_capacity_blocks(32)


def test_an_unknown_output_length_mode_is_rejected() -> None:
    with pytest.raises(ValueError) as error:
        CoreSettings(output_length="uniform")
    assert str(error.value) == ERR_OUTPUT_LENGTH.format("uniform")


# --- a real Triton replica (pytriton) -------------------------------------------------------


@pytest.fixture(scope="module")
def core_replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from tests.support.replica_proc import ReplicaProcess, free_ports, replica_env, stop_replica, wait_ready

    log_dir: Path = tmp_path_factory.mktemp("core-replica")
    grpc_port, http_port, metrics_port = free_ports(3)
    settings = {"engine": "core", "model": "llama-3-8b", "hardware": "h100-sxm", "tp": 1, "block_size": 4,
                "num_blocks": 256, "time_scale": 1.0, "vocab_size": 4096, "first_normal_id": 5}
    log_path = log_dir / "replica.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "sluice.replica.serve", "--name", "c0"],
            env=replica_env("c0", grpc_port, http_port, metrics_port, settings),
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    replica = ReplicaProcess("c0", f"127.0.0.1:{grpc_port}", http_port, metrics_port, process, log_path)
    try:
        wait_ready(replica)
        yield replica
    finally:
        stop_replica(replica)


METRIC_LINE = re.compile(r'nv_trt_llm_(\w+)_metrics\{.*(?:request_type|kv_cache_block_type)="(\w+)".*\} '
                         r'(\S+)')


def scrape(replica: object) -> dict[str, float]:
    port = replica.metrics_port  # type: ignore[attr-defined]
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values = {}
    for line in body.splitlines():
        match = METRIC_LINE.match(line)
        if match:
            values[f"{match.group(1)}.{match.group(2)}"] = float(match.group(3))
    return values


@pytest.mark.integration
async def test_a_core_replica_streams_reuses_prefixes_stops_and_reports_state(core_replica: object) -> None:
    from sluice.services import replica_client as rc

    address = core_replica.grpc_address  # type: ignore[attr-defined]
    prompt = tuple(range(100, 110))
    first = [chunk async for chunk in rc.stream_generate(address, "first", prompt, 6)]
    assert [chunk.token_ids for chunk in first] == [(t,) for t in expected(prompt, 6)]
    assert {(c.num_input_tokens, c.kv_cache_reused_blocks) for c in first} == {(10, 0)}
    second = [chunk async for chunk in rc.stream_generate(address, "second", prompt, 2)]
    assert {c.kv_cache_reused_blocks for c in second} == {2}          # (10 − 1) // 4 full blocks cached

    stream = rc.stream_generate(address, "long", tuple(range(500, 540)), 500)
    received = []
    async for chunk in stream:
        received.append(chunk)
        if len(received) == 20:
            metrics = await asyncio.to_thread(scrape, core_replica)
            # 40 prompt tokens + ~20 generated on 4-token blocks: ~15 blocks held by the one request.
            assert metrics["request.active"] == 1
            assert 13 <= metrics["kv_cache_block.used"] <= 18
            assert metrics["kv_cache_block.max"] == 256
            started = time.monotonic()
            await rc.stop(address, "long")
            assert time.monotonic() - started < 1.0
    assert received[-1].stopped
    await asyncio.sleep(0.3)
    after = await asyncio.to_thread(scrape, core_replica)
    assert (after["request.active"], after["kv_cache_block.used"]) == (0, 0)
    assert after["kv_cache_block.reused"] == 2


def test_a_quoted_boolean_is_rejected_rather_than_read_as_true() -> None:
    with pytest.raises(ValueError) as error:
        CoreSettings.from_section({"prefix_reuse": "false"})
    assert str(error.value) == ERR_NOT_BOOL.format(key="prefix_reuse", value="false")


def test_the_metrics_export_the_cores_state_under_tensorrt_llm_names() -> None:
    engine = CoreEngine(SETTINGS)
    metrics = ReplicaMetrics(start_time=1234.5, clock=lambda: 99.0)
    engine.add_request(GenerationRequest("a", tuple(range(10, 22)), 5, None, 1))
    engine.step()                                 # a's 12-token context
    engine.add_request(GenerationRequest("b", tuple(range(10, 22)), 5, None, 2))
    engine.step()                                 # a decodes; b's context reuses (12 − 1) // 4 = 2 blocks
    metrics.update(engine.stats())
    text = generate_latest(metrics.registry).decode()
    snapshot = parse_metrics(text)
    counts = (snapshot.active, snapshot.waiting, snapshot.scheduled, snapshot.context, snapshot.max_requests)
    assert counts == (2, 0, 2, 1, 8)
    used = engine.core.pool.stats().used_blocks
    assert (snapshot.kv_max_blocks, snapshot.kv_used_blocks, snapshot.kv_free_blocks) == (64, used, 64 - used)
    assert (snapshot.kv_tokens_per_block, snapshot.kv_reused_blocks) == (4, 2)
    assert snapshot.kv_fraction == pytest.approx(used / 64)
    assert snapshot.start_time == 1234.5
    batcher = {key: value for (name, key), value in samples(text).items()
               if name == "nv_trt_llm_inflight_batcher_metrics"}
    assert batcher == {"total_context_tokens": 4.0, "generation_requests": 1.0, "micro_batch_id": 0.0,
                       "paused_requests": 0.0}    # b computes only the 4 tokens past its cached blocks
    general = {key: value for (name, key), value in samples(text).items()
               if name == "nv_trt_llm_general_metrics"}
    assert general == {"iteration_counter": 2.0, "timestamp": 99.0e6}   # µs, as tensorrtllm_backend


def samples(text: str) -> dict[tuple[str, str], float]:
    """(metric name, value of its one non-model label) -> value."""
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            label = next((v for k, v in sample.labels.items() if k not in ("model", "version")), "")
            values[(sample.name, label)] = sample.value
    return values


# --- a replica exactly as config/sluice.toml configures it ----------------------------------


@pytest.fixture(scope="module")
def default_replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from tests.support.replica_proc import start_replica, stop_replica

    replica = start_replica("d0", tmp_path_factory.mktemp("default-replica"))    # no [replica] overrides
    try:
        yield replica
    finally:
        stop_replica(replica)


def scrape_text(replica: object) -> str:
    port = replica.metrics_port  # type: ignore[attr-defined]
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


@pytest.mark.integration
async def test_the_default_replica_runs_the_core_and_its_metrics_follow_the_cores_state(
        default_replica: object) -> None:
    from sluice.services import replica_client as rc

    from sluice.config import load_settings

    settings = CoreSettings.from_section(load_settings().replica.model_dump())
    space = TokenSpace(settings.vocab_size, settings.first_normal_id)
    address = default_replica.grpc_address  # type: ignore[attr-defined]
    before = parse_metrics(await asyncio.to_thread(scrape_text, default_replica))
    assert (before.kv_tokens_per_block, before.max_requests, before.kv_max_blocks) == (
        settings.block_size, settings.max_num_seqs, CoreEngine(settings).core.pool.num_blocks)

    # 70 prompt tokens = 2 full blocks of 32. end_id 0 (tiny-chat's) is never generated: exactly the cap.
    prompt = tuple(range(1000, 1070))
    first = [c async for c in rc.stream_generate(address, "m-first", prompt, 12, end_id=0)]
    assert [c.token_ids for c in first] == [(t,) for t in tokens_between(space, prompt_seed(prompt), 0, 12)]
    second = [c async for c in rc.stream_generate(address, "m-second", prompt + (5, 6), 3, end_id=0)]
    assert {(c.num_input_tokens, c.kv_cache_reused_blocks) for c in second} == {(72, 2)}
    after_reuse = parse_metrics(await asyncio.to_thread(scrape_text, default_replica))
    assert after_reuse.kv_reused_blocks == before.kv_reused_blocks + 2
    assert (after_reuse.active, after_reuse.kv_used_blocks) == (0, 0)

    long_prompt = tuple(range(3000, 3100))        # 100 tokens
    received = 0
    async for _chunk in rc.stream_generate(address, "m-long", long_prompt, 2000, end_id=0):
        received += 1
        if received == 30:
            text = await asyncio.to_thread(scrape_text, default_replica)
            await rc.stop(address, "m-long")
    during = parse_metrics(text)
    batcher = {key: value for (name, key), value in samples(text).items()
               if name == "nv_trt_llm_inflight_batcher_metrics"}
    assert (during.active, during.waiting, during.scheduled, during.context) == (1, 0, 1, 0)
    assert batcher == {"total_context_tokens": 0.0, "generation_requests": 1.0, "micro_batch_id": 0.0,
                       "paused_requests": 0.0}
    # 100 prompt + ~30 generated tokens on 32-token blocks: 5 blocks (6 if the transport lagged a step).
    assert 5 <= during.kv_used_blocks <= 6
    assert during.kv_free_blocks == during.kv_max_blocks - during.kv_used_blocks
    assert during.kv_fraction == pytest.approx(during.kv_used_blocks / during.kv_max_blocks)
    await asyncio.sleep(0.3)
    stopped = parse_metrics(await asyncio.to_thread(scrape_text, default_replica))
    assert (stopped.active, stopped.kv_used_blocks, stopped.start_time) == (0, 0, before.start_time)
