"""A replica on the wire alone, for benches: the simple engine behind the part of Triton's gRPC
surface the platform calls, without Triton. `python -m bench.wire_replica --name r0` serves the
[[replicas]] entry `r0` of the config (its gRPC and metrics ports, `[replica]`'s simple-engine
settings), as `python -m sluice.replica.serve --name r0` does.

Why (issue 9): a simple-engine replica under pytriton costs 0.7-1.2 ms of CPU per streamed token
(Triton's core, the Python backend's stub, the proxy), so on the 2-core box that also runs the
platform the bench can only stream ~10 tokens/s per stream (~2 tokens per DELTA event), where seed
002 streams ~117. This process sends the same bytes for the same requests (tests/test_wire_replica.py
compares them with a real replica's) for a few us per token, so that bench_platform --wire-replicas
can measure the platform at a per-stream rate a real replica could only reach on its own GPU box.
It is a load generator, not a replica: no TLS, no HTTP port, no KV cache, and only what the routing
worker calls:

  ModelStreamInfer   a request (input tensors as the tensorrt_llm contract reads them:
                     sluice/replica/contract.py) joins SimpleGenerator's next step; each step
                     sends every live request one response, the last flagged final
                     (triton_final_response); a request with `stop` ends the request it names
  ModelReady         ready
  metrics port       ReplicaMetrics' page (the nv_trt_llm_* gauges the router scrapes)

A response is written from its request's template (the protobuf message serialized once, the token's
four bytes spliced in), the way replica_conn reads it back.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import struct
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import uvloop
from sluice.services.h2server import H2Server
from tritonclient.grpc import service_pb2
from tritonclient.utils import triton_to_np_dtype

from bench.bench_replica import READY_MARKER
from sluice.config.bootstrap import start_process
from sluice.replica.contract import is_stop, parse
from sluice.replica.engine_api import EngineRequestError, StepOutput
from sluice.replica.generator import GeneratorConfig, SimpleGenerator, prompt_seed
from sluice.replica.metrics import ReplicaMetrics
from sluice.replica.serve import EXIT_STARTUP_FAILED, StartupError, settings_from_config

log = logging.getLogger(__name__)

MODEL_NAME, MODEL_VERSION = "tensorrt_llm", "1"
SERVICE = "inference.GRPCInferenceService"
FINAL_PARAM = "triton_final_response"
MARKER = b"\xfe\xfd\xfc\xfb"                    # the token's place in a template (module doc)
# The outputs a response can carry (tensorrt_llm contract), each [1, 1, ...] INT32; a request's
# `outputs` list picks among them, in its order (none listed: all three, as Triton sends every output).
KNOWN_OUTPUTS = ("output_ids", "sequence_length", "kv_cache_reused_blocks")
_I32 = struct.Struct("<i")


def tensors(request: service_pb2.ModelInferRequest) -> dict[str, np.ndarray[Any, Any]]:
    """A request's raw input tensors as arrays, by name (what contract.parse reads)."""
    arrays = {}
    for index, tensor in enumerate(request.inputs):
        dtype = triton_to_np_dtype(tensor.datatype)
        arrays[tensor.name] = np.frombuffer(request.raw_input_contents[index], dtype=dtype).reshape(
            tuple(tensor.shape))
    return arrays


@dataclass(frozen=True, slots=True)
class Template:
    """One request's response bytes around its token: prefix + token (int32 LE) + suffix."""

    prefix: bytes
    suffix: bytes

    def body(self, token: int) -> bytes:
        return self.prefix + _I32.pack(token) + self.suffix


def template(request_id: str, outputs: tuple[str, ...], final: bool) -> Template:
    """The serialized response of one token for `request_id` (final or not), split at the token."""
    message = service_pb2.ModelStreamInferResponse()
    response = message.infer_response
    response.model_name, response.model_version, response.id = MODEL_NAME, MODEL_VERSION, request_id
    response.parameters[FINAL_PARAM].bool_param = final
    for name in outputs:
        output = response.outputs.add(name=name, datatype="INT32")
        output.shape.extend((1, 1, 1) if name == "output_ids" else (1, 1))
        response.raw_output_contents.append(MARKER if name == "output_ids" else
                                            _I32.pack(1 if name == "sequence_length" else 0))
    body = message.SerializeToString()
    assert body.count(MARKER) == 1, "the token's place in the template is unambiguous"
    prefix, _, suffix = body.partition(MARKER)
    return Template(prefix, suffix)


def empty_final(request_id: str) -> bytes:
    """The flags-only last response (a stopped request's, and the answer to a stop)."""
    message = service_pb2.ModelStreamInferResponse()
    response = message.infer_response
    response.model_name, response.model_version, response.id = MODEL_NAME, MODEL_VERSION, request_id
    response.parameters[FINAL_PARAM].bool_param = True
    return message.SerializeToString()


def error_response(text: str) -> bytes:
    return service_pb2.ModelStreamInferResponse(error_message=text).SerializeToString()


@dataclass(slots=True)
class Outbox:
    """One stream's responses waiting for its handler; None ends the stream."""

    items: deque[bytes | None] = field(default_factory=deque)
    waiter: asyncio.Future[None] | None = None

    def put(self, body: bytes | None) -> None:
        self.items.append(body)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def drain(self) -> AsyncIterator[bytes]:
        while True:
            while self.items:
                body = self.items.popleft()
                if body is None:
                    return
                yield body
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter


@dataclass(slots=True)
class _Live:
    outbox: Outbox
    token: Template
    last: Template


class WireReplica:
    """The simple engine stepped on the event loop; each live request's responses go to its stream."""

    def __init__(self, config: GeneratorConfig, metrics: ReplicaMetrics) -> None:
        self.engine = SimpleGenerator(config)
        self.metrics = metrics
        self.live: dict[str, _Live] = {}
        self._stepping: asyncio.Task[None] | None = None

    async def stream_infer(self, requests: AsyncIterator[service_pb2.ModelInferRequest],
                           context: Any) -> AsyncIterator[bytes]:
        async for request in requests:
            outbox = self.start(request)
            async for body in outbox.drain():
                yield body
            return

    def start(self, request: service_pb2.ModelInferRequest) -> Outbox:
        """Admit one request (or carry out a stop); its stream's outbox."""
        outbox = Outbox()
        request_id = request.id
        try:
            data = tensors(request)
            if is_stop(data):
                self.stop(request_id)
                outbox.put(empty_final(request_id))
                outbox.put(None)
                return outbox
            strict = parse(data, request_id, prompt_seed)
            self.engine.add_request(strict.generation)
        except (EngineRequestError, ValueError, TypeError, KeyError) as exc:
            outbox.put(error_response(f"wire replica: {exc}"))
            outbox.put(None)
            return outbox
        listed = tuple(output.name for output in request.outputs if output.name in KNOWN_OUTPUTS)
        outputs = listed or KNOWN_OUTPUTS
        self.live[request_id] = _Live(outbox, template(request_id, outputs, False),
                                      template(request_id, outputs, True))
        if self._stepping is None or self._stepping.done():
            self._stepping = asyncio.get_running_loop().create_task(self._step_while_busy())
        return outbox

    def stop(self, request_id: str) -> None:
        live = self.live.pop(request_id, None)
        if live is not None and self.engine.abort(request_id):
            live.outbox.put(empty_final(request_id))
            live.outbox.put(None)

    async def _step_while_busy(self) -> None:
        """One engine step per step time while any request lives (a request joins the next step)."""
        while self.engine.has_work():
            started = time.monotonic()
            result = self.engine.step()
            for output in result.outputs:
                self._send(output)
            self.metrics.update(self.engine.stats())
            await asyncio.sleep(max(0.0, result.duration_s - (time.monotonic() - started)))
        self.metrics.update(self.engine.stats())

    def _send(self, output: StepOutput) -> None:
        live = self.live.get(output.request_id)
        if live is None:
            return
        shape = live.last if output.finished else live.token
        for token in output.new_token_ids:
            live.outbox.put(shape.body(token))
        if output.finished:
            del self.live[output.request_id]
            live.outbox.put(None)

    async def model_ready(self, request: service_pb2.ModelReadyRequest, context: Any) -> \
            service_pb2.ModelReadyResponse:
        return service_pb2.ModelReadyResponse(ready=request.name in ("", MODEL_NAME))


def handlers(replica: WireReplica) -> Mapping[str, grpc.RpcMethodHandler]:
    return {
        "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(
            replica.stream_infer, request_deserializer=service_pb2.ModelInferRequest.FromString),
        "ModelReady": grpc.unary_unary_rpc_method_handler(
            replica.model_ready, request_deserializer=service_pb2.ModelReadyRequest.FromString,
            response_serializer=service_pb2.ModelReadyResponse.SerializeToString),
    }


async def serve(name: str, host: str, grpc_port: int, metrics_port: int, config: GeneratorConfig) -> None:
    metrics = ReplicaMetrics(start_time=time.time())
    replica = WireReplica(config, metrics)
    metrics.update(replica.engine.stats())
    metrics.serve(metrics_port, host)
    server = H2Server()
    server.add_registered_method_handlers(SERVICE, dict(handlers(replica)))
    server.add_insecure_port(f"{host}:{grpc_port}")
    await server.start()
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopped.set)
    # The line bench_replica.start_replica (and the autoscaler's local launcher) wait for.
    print(f"replica {name} {READY_MARKER} grpc={host}:{grpc_port} metrics={metrics_port} (wire replica)",
          flush=True)
    await stopped.wait()
    with contextlib.suppress(Exception):
        await server.stop(1.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The simple engine on Triton's gRPC wire, without Triton.")
    parser.add_argument("--name", required=True, help="the [[replicas]] entry to serve, e.g. r0")
    args = parser.parse_args(argv)
    config = start_process("replica", level=logging.WARNING, stream=sys.stdout)
    try:
        settings = settings_from_config(config, args.name)
    except StartupError as exc:
        print(f"ERROR: {exc}", file=sys.stderr, flush=True)
        return EXIT_STARTUP_FAILED
    if settings.generator is None:
        print("ERROR: the wire replica serves the simple engine only ([replica].engine = \"simple\")",
              file=sys.stderr, flush=True)
        return EXIT_STARTUP_FAILED
    uvloop.run(serve(settings.name, settings.host, settings.grpc_port, settings.metrics_port,
                     settings.generator))
    return 0


if __name__ == "__main__":
    sys.exit(main())
