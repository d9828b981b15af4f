"""bench/wire_replica.py stands in for a simple-engine replica only in bench_platform --wire-replicas,
and its figures mean something only if the platform reads the same thing from it: for the same
request, byte for byte the same gRPC responses as a real replica (pytriton, Triton's gRPC) with the
same generator settings; the same answer to a stop and to ModelReady."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sluice.services import replica_client as rc
from sluice.services import replica_conn
from tritonclient.grpc import service_pb2

from bench.bench_replica import start_replica, stop_replica
from sluice.replica.generator import GeneratorConfig, prompt_seed, token_at

STREAM_PATH = "/inference.GRPCInferenceService/ModelStreamInfer"
SETTINGS = {"engine": "simple", "token_delay_ms": 5}
PROMPT = [11, 12, 13, 14, 15]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A real replica and a wire replica with the same engine settings: their gRPC addresses."""
    logs: Path = tmp_path_factory.mktemp("wire-replica")
    started = []
    try:
        for module in ("sluice.replica.serve", "bench.wire_replica"):
            process = start_replica(SETTINGS, logs / f"{module}.log", name="r0", module=module)
            started.append((module, process))
        yield {module: address for module, (_, address) in started}
    finally:
        for _, (process, _) in started:
            stop_replica(process)


class Recording:
    """A stream's sink that keeps every response's bytes, until the final one (as replica_client, the
    client then drops the stream: Triton holds a ModelStreamInfer open while the client's side is)."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.ended: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()

    def message(self, body: bytes) -> None:
        self.bodies.append(body)
        if final(body) and not self.ended.done():
            self.ended.set_result(None)

    def closed(self, code: str | None, details: str) -> None:
        if not self.ended.done():
            self.ended.set_result(code)


async def responses(address: str, request: service_pb2.ModelInferRequest) -> tuple[list[bytes], str | None]:
    connection = await replica_conn.connect(address)
    try:
        sink = Recording()
        stream_id = connection.start(STREAM_PATH, sink)
        await connection.send(stream_id, request.SerializeToString())
        code = await asyncio.wait_for(sink.ended, 30)
        connection.cancel(stream_id)
        return sink.bodies, code
    finally:
        connection.close()


def final(body: bytes) -> bool:
    return bool(service_pb2.ModelStreamInferResponse.FromString(body).infer_response
                .parameters["triton_final_response"].bool_param)


async def test_the_same_request_gets_the_same_bytes_from_both(replicas):
    request = rc.build_request(f"wire-{uuid.uuid4().hex}", PROMPT, 6, perf_metrics=True)
    real, real_end = await responses(replicas["sluice.replica.serve"], request)
    wire, wire_end = await responses(replicas["bench.wire_replica"], request)
    assert real_end is None and wire_end is None          # both ended with a final response
    assert len(real) == 6                                  # one response per token, the last flagged final
    assert [final(body) for body in real] == [False] * 5 + [True]
    assert wire == real
    # And they carry the simple engine's tokens, computed here from its definition.
    tokens = [rc.parse_chunk(service_pb2.ModelStreamInferResponse.FromString(body).infer_response, 5, 0)
              .token_ids for body in wire]
    seed = prompt_seed(PROMPT)
    assert tokens == [(token_at(GeneratorConfig(), seed, i),) for i in range(6)]


async def test_without_perf_outputs_both_send_ids_and_length_only(replicas):
    request = rc.build_request(f"wire-{uuid.uuid4().hex}", PROMPT, 3, perf_metrics=False)
    real, _ = await responses(replicas["sluice.replica.serve"], request)
    wire, _ = await responses(replicas["bench.wire_replica"], request)
    assert wire == real
    names = [o.name for o in service_pb2.ModelStreamInferResponse.FromString(wire[0]).infer_response.outputs]
    assert names == ["output_ids", "sequence_length"]


async def test_a_stop_and_a_ready_check_are_answered_alike(replicas):
    for address in replicas.values():
        assert await rc.is_ready(address, timeout_s=10) is True
        request_id = f"wire-{uuid.uuid4().hex}"
        streaming = asyncio.create_task(responses(address, rc.build_request(request_id, PROMPT, 5000)))
        await asyncio.sleep(0.3)                           # some tokens streamed, far from the cap
        await rc.stop(address, request_id, timeout_s=10)
        bodies, code = await asyncio.wait_for(streaming, 30)
        assert code is None and 0 < len(bodies) < 5000, address    # ended by a final response
    await rc.close_channels()
