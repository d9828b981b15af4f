"""A real replica (pytriton Triton, `python -m sluice.replica.serve`) driven by services.replica_client.

These pin the host's behaviour (streaming, stop, errors, loss) with the simple engine, whose tokens
and timing are exact; the default engine (the core) is tested in tests/test_engine_replica_adapter.py."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from sluice.services import replica_client as rc
from sluice.services.replica_client import ReplicaLost, ReplicaRejected, TokenChunk

from sluice.config.bootstrap import EXIT_BAD_CONFIG
from sluice.replica import lifecycle
from sluice.replica.engine_api import GenerationRequest
from sluice.replica.generator import GeneratorConfig, expected_tokens, prompt_seed
from sluice.replica.protocol import ERR_BAD_OUTPUT_LEN, ERR_EMPTY_INPUT
from sluice.replica.serve import (
    ERR_PORT_IN_USE,
    ERR_STOP_TIMEOUT,
    ERR_TRITON_EXITED,
    ERR_TRITON_START,
    EXIT_STARTUP_FAILED,
    STOP_TIMEOUT_S,
)
from tests.support.replica_proc import (
    ReplicaProcess,
    free_ports,
    kill_replica,
    replica_env,
    start_replica,
    stop_replica,
)

pytestmark = pytest.mark.integration

TOKEN_DELAY_MS = 20
SETTINGS = {"engine": "simple", "token_delay_ms": TOKEN_DELAY_MS, "vocab_size": 4096, "first_normal_id": 5,
            "output_length": "cap"}
GENERATOR = GeneratorConfig(vocab_size=4096, first_normal_id=5, token_delay_s=TOKEN_DELAY_MS / 1000)


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("replica-logs")


@pytest.fixture(scope="module")
def replica(log_dir: Path):
    proc = start_replica("t0", log_dir, SETTINGS)
    yield proc
    stop_replica(proc)


async def collect(address: str, request_id: str, prompt: list[int], cap: int, **kwargs) -> list[TokenChunk]:
    return [chunk async for chunk in rc.stream_generate(address, request_id, prompt, cap, **kwargs)]


def tokens_of(chunks: list[TokenChunk]) -> list[int]:
    return [t for chunk in chunks for t in chunk.token_ids]


def expected(prompt: list[int], cap: int, seed: int | None = None) -> list[int]:
    request = GenerationRequest("x", tuple(prompt), cap, None, prompt_seed(prompt) if seed is None else seed)
    return expected_tokens(GENERATOR, request)


async def test_the_replica_reports_ready(replica: ReplicaProcess):
    assert await rc.is_ready(replica.grpc_address) is True


async def test_a_closed_port_is_not_ready():
    (port,) = free_ports(1)
    assert await rc.is_ready(f"127.0.0.1:{port}", timeout_s=1.0) is False


async def test_a_request_streams_exactly_the_generators_tokens_one_per_response(replica: ReplicaProcess):
    chunks = await collect(replica.grpc_address, "exact-1", [11, 12, 13], 7)
    assert tokens_of(chunks) == expected([11, 12, 13], 7)
    assert [len(c.token_ids) for c in chunks] == [1] * 7
    assert {(c.num_input_tokens, c.kv_cache_reused_blocks, c.stopped) for c in chunks} == {(3, 0, False)}


async def test_non_streaming_mode_returns_every_token_in_one_response(replica: ReplicaProcess):
    chunks = await collect(replica.grpc_address, "whole-1", [11, 12, 13], 6, streaming=False)
    assert chunks == [TokenChunk(tuple(expected([11, 12, 13], 6)), 3, 0)]


async def test_an_explicit_seed_replaces_the_prompt_hash(replica: ReplicaProcess):
    chunks = await collect(replica.grpc_address, "seeded-1", [11, 12, 13], 4, seed=42)
    assert tokens_of(chunks) == expected([11, 12, 13], 4, seed=42)


async def test_two_concurrent_requests_stream_together(replica: ReplicaProcess):
    cap = 25                                      # 25 steps x 20 ms = 0.5 s for one request
    started = time.monotonic()
    one = await collect(replica.grpc_address, "solo", [1, 2, 3, 4], cap)
    solo_s = time.monotonic() - started
    started = time.monotonic()
    a, b = await asyncio.gather(collect(replica.grpc_address, "pair-a", [7, 8], cap),
                                collect(replica.grpc_address, "pair-b", [9, 10], cap))
    pair_s = time.monotonic() - started
    assert tokens_of(one) == expected([1, 2, 3, 4], cap)
    assert (tokens_of(a), tokens_of(b)) == (expected([7, 8], cap), expected([9, 10], cap))
    assert solo_s >= cap * TOKEN_DELAY_MS / 1000
    assert pair_s < 1.5 * solo_s, f"two streams took {pair_s:.2f}s, one {solo_s:.2f}s: not in flight together"


async def test_pushed_chunks_match_the_iterated_ones_and_a_failing_consumer_ends_only_its_own_request(
        replica: ReplicaProcess):
    # generate() hands chunks over from the connection's reader that every stream to the replica
    # shares: a consumer that raises must end its own request with its error, not the connection.
    pushed: list[TokenChunk] = []
    seen = 0

    def failing(chunk: TokenChunk) -> None:
        nonlocal seen
        seen += 1
        if seen == 3:
            raise LookupError("consumer failed")

    results = await asyncio.gather(
        rc.generate(replica.grpc_address, "pushed-ok", [11, 12, 13], 12, on_chunk=pushed.append),
        rc.generate(replica.grpc_address, "pushed-bad", [11, 12, 13], 12, on_chunk=failing),
        return_exceptions=True)
    assert results[0] is None and isinstance(results[1], LookupError) and seen == 3
    assert pushed == await collect(replica.grpc_address, "iterated", [11, 12, 13], 12)
    assert tokens_of(pushed) == expected([11, 12, 13], 12)


async def test_stop_ends_the_stream_early_and_the_replica_keeps_serving(replica: ReplicaProcess):
    stream = rc.stream_generate(replica.grpc_address, "stop-me", [5, 6], 500)
    received: list[TokenChunk] = []
    async for chunk in stream:
        received.append(chunk)
        if len(received) == 3:
            started = time.monotonic()
            await rc.stop(replica.grpc_address, "stop-me")
            stop_s = time.monotonic() - started
    assert stop_s < 1.0
    assert received[-1] == TokenChunk((), 2, 0, stopped=True)
    streamed = tokens_of(received)
    assert 3 <= len(streamed) < 20
    assert streamed == expected([5, 6], 500)[: len(streamed)]
    after = await collect(replica.grpc_address, "after-stop", [5, 6], 3)
    assert tokens_of(after) == expected([5, 6], 3)


async def test_abandoning_a_stream_stops_the_request_on_the_replica(replica: ReplicaProcess):
    stream = rc.stream_generate(replica.grpc_address, "abandoned", [5, 6], 500)
    async for _chunk in stream:
        break
    await stream.aclose()
    await asyncio.sleep(0.3)                      # the background stop reaches the replica
    # The id is free again: a live request with it would be rejected as already streaming.
    assert tokens_of(await collect(replica.grpc_address, "abandoned", [5, 6], 2)) == expected([5, 6], 2)


async def test_stop_for_an_unknown_request_returns_promptly(replica: ReplicaProcess):
    started = time.monotonic()
    await rc.stop(replica.grpc_address, "never-sent")
    assert time.monotonic() - started < 1.0


async def test_a_request_id_already_streaming_is_rejected(replica: ReplicaProcess):
    first = asyncio.ensure_future(collect(replica.grpc_address, "dup", [1], 30))
    await asyncio.sleep(0.2)
    with pytest.raises(ReplicaRejected, match="already streaming"):
        await collect(replica.grpc_address, "dup", [1], 3)
    assert tokens_of(await first) == expected([1], 30)


async def test_empty_input_ids_is_a_triton_error_not_a_hang(replica: ReplicaProcess):
    with pytest.raises(ReplicaRejected, match=ERR_EMPTY_INPUT):
        await asyncio.wait_for(collect(replica.grpc_address, "empty", [], 5), 5)


async def test_zero_output_len_is_a_triton_error(replica: ReplicaProcess):
    with pytest.raises(ReplicaRejected) as caught:
        await asyncio.wait_for(collect(replica.grpc_address, "zero", [1, 2], 0), 5)
    assert str(caught.value) == ERR_BAD_OUTPUT_LEN.format(0)


async def test_metrics_use_the_tensorrt_llm_names(replica: ReplicaProcess):
    body = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://127.0.0.1:{replica.metrics_port}/metrics", timeout=5).read())
    text = body.decode()
    for line in ('nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="max",version="1"} 256.0',
                 'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="tokens_per",model="tensorrt_llm",'
                 'version="1"} 16.0'):
        assert line in text
    for kind in ("active", "waiting", "scheduled", "context"):
        assert f'request_type="{kind}"' in text
    for kind in ("max", "free", "used", "reused"):
        assert f'kv_cache_block_type="{kind}"' in text
    start = next(line for line in text.splitlines() if line.startswith("sluice_replica_start_time_seconds "))
    assert abs(float(start.split()[1]) - time.time()) < 3600


async def test_killing_the_replica_mid_stream_raises_replica_lost_within_seconds(log_dir: Path):
    doomed = await asyncio.to_thread(start_replica, "doomed", log_dir, SETTINGS)
    try:
        stream = rc.stream_generate(doomed.grpc_address, "lost-1", [3, 4], 1000)
        received = 0
        with pytest.raises(ReplicaLost):
            async for _chunk in stream:
                received += 1
                if received == 3:
                    kill_replica(doomed)
                    killed_at = time.monotonic()
        assert time.monotonic() - killed_at < 5.0
    finally:
        kill_replica(doomed)


def processes_in_session(session: int) -> list[str]:
    """Command names of the live processes in a session (a replica's: host, tritonserver, stub)."""
    names = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if entry.name.isdigit() and int(fields[3]) == session and fields[0] != "Z":
                names.append((entry / "comm").read_text().strip())
        except (OSError, IndexError):
            continue
    return names


def shm_regions_of(pid: int) -> list[Path]:
    return list(Path("/dev/shm").glob(f"pytrtion{pid}-*"))


async def test_a_replica_whose_host_process_dies_takes_tritonserver_and_its_stub_along(log_dir: Path):
    # Only the Python host is SIGKILLed (as the OOM killer would): tritonserver gets SIGKILL as its
    # death signal (replica/lifecycle.py) instead of hanging in shutdown on the ports; the stub follows.
    orphaned = await asyncio.to_thread(start_replica, "orphaned", log_dir, SETTINGS)
    try:
        assert len(processes_in_session(orphaned.process.pid)) == 3
        stream = rc.stream_generate(orphaned.grpc_address, "lost-2", [3, 4], 1000, inactivity_timeout_s=2.0)
        received = 0
        with pytest.raises(ReplicaLost):
            async for _chunk in stream:
                received += 1
                if received == 3:
                    os.kill(orphaned.process.pid, signal.SIGKILL)
                    killed_at = time.monotonic()
        assert time.monotonic() - killed_at < 5.0
        await asyncio.sleep(2.0)                  # the stub checks its parent every 300 ms
        left = processes_in_session(orphaned.process.pid)
        # tritonserver is gone (its ports are free for a restart). The stub usually follows; when
        # tritonserver died holding their shared health mutex it hangs, and the next start ends it.
        assert left in ([], ["triton_python_b"])
        lifecycle.kill_orphaned_stubs()
        await asyncio.sleep(0.2)
        assert processes_in_session(orphaned.process.pid) == []
    finally:
        kill_replica(orphaned)


async def test_sigterm_with_a_stream_in_flight_stops_within_seconds_and_leaves_nothing(log_dir: Path):
    # pytriton's own stop() would wait for the 100k-token request to finish; the host bounds it.
    busy = await asyncio.to_thread(start_replica, "busy-stop", log_dir, SETTINGS)
    try:
        stream = rc.stream_generate(busy.grpc_address, "endless", [3, 4], 100_000)
        started = 0.0
        with pytest.raises(ReplicaLost):
            async for _chunk in stream:
                if not started:
                    busy.process.send_signal(signal.SIGTERM)
                    started = time.monotonic()
        code = await asyncio.to_thread(busy.process.wait, 15)
        assert (code, time.monotonic() - started < STOP_TIMEOUT_S + 3) == (0, True)
        assert ERR_STOP_TIMEOUT.format(seconds=STOP_TIMEOUT_S) in busy.log()
        assert processes_in_session(busy.process.pid) == []
        assert shm_regions_of(busy.process.pid) == []
    finally:
        kill_replica(busy)


def test_a_taken_port_fails_startup_with_a_clear_error(log_dir: Path):
    grpc_port, http_port, metrics_port = free_ports(3)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", grpc_port))
        squatter.listen()
        result = subprocess.run([sys.executable, "-m", "sluice.replica.serve", "--name", "busy"],
                                env=replica_env("busy", grpc_port, http_port, metrics_port, SETTINGS),
                                capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert ERR_PORT_IN_USE.format(name="busy", kind="grpc", port=grpc_port, host="127.0.0.1") in result.stderr


def test_an_unknown_engine_fails_startup_naming_the_key():
    ports = free_ports(3)
    result = subprocess.run([sys.executable, "-m", "sluice.replica.serve", "--name", "odd"],
                            env=replica_env("odd", *ports, {**SETTINGS, "engine": "magic"}),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == EXIT_BAD_CONFIG
    assert "replica.engine: Input should be 'core' or 'simple' (from SLUICE_REPLICA__ENGINE)" in result.stderr


def test_a_tritonserver_that_dies_during_startup_fails_fast_with_a_clear_error(tmp_path: Path):
    # The port check is skipped so that tritonserver itself meets the taken port (a race in real life).
    grpc_port, http_port, metrics_port = free_ports(3)
    script = (
        "import pathlib, sys, time\n"
        "import sluice.replica.serve as serve\n"
        "serve.check_ports_free = lambda settings: None\n"
        f"settings = serve.ReplicaSettings('racy', '127.0.0.1', {http_port}, {grpc_port}, {metrics_port},"
        f" serve.GeneratorConfig(), workspace=pathlib.Path({str(tmp_path / 'ws')!r}))\n"
        "try:\n"
        "    serve.serve(settings, time.time())\n"
        "except serve.StartupError as exc:\n"
        "    print('ERROR:', exc, file=sys.stderr)\n"
        "    sys.exit(2)\n"
    )
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", grpc_port))
        squatter.listen()
        started = time.monotonic()
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                                cwd=Path(__file__).resolve().parent.parent)
    assert result.returncode == EXIT_STARTUP_FAILED
    assert ERR_TRITON_START.format(name="racy", error=ERR_TRITON_EXITED) in result.stderr
    assert time.monotonic() - started < 20
    assert not (tmp_path / "ws").exists()         # the failed start leaves no pytriton workspace behind
