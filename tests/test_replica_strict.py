"""The strict replica mode serves exactly tensorrtllm_backend v0.19.0's `tensorrt_llm` interface
(deploy/triton/CONTRACT.md): response by response, as a gRPC client of the real backend sees it.

Real replica (pytriton Triton) with the simple engine, whose tokens and timing are exact; raw
ModelStreamInfer responses, so flags and output sets are visible."""

from __future__ import annotations

import asyncio
import math
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sluice.services import replica_client as rc
from sluice.services.replica_client import ReplicaRejected
from tritonclient.grpc import service_pb2

from sluice.replica import contract
from sluice.replica.engine_api import GenerationRequest
from sluice.replica.generator import GeneratorConfig, expected_tokens, prompt_seed
from sluice.replica.protocol import MODEL_NAME
from tests.support.replica_proc import ReplicaProcess, start_replica, stop_replica

pytestmark = pytest.mark.integration

SETTINGS = {"engine": "simple", "token_delay_ms": 20, "vocab_size": 4096, "first_normal_id": 5,
            "output_length": "cap", "interface": "tensorrt_llm"}
GENERATOR = GeneratorConfig(vocab_size=4096, first_normal_id=5, token_delay_s=0.02)
SIMPLE_BLOCK = 16                                 # the simple engine's kv tokens_per_block
PERF_NAMES = {spec.name for spec in contract.PERF_OUTPUTS}
ALWAYS = {"output_ids", "sequence_length"}


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory):
    proc = start_replica("strict0", tmp_path_factory.mktemp("strict-logs"), SETTINGS)
    yield proc
    stop_replica(proc)


def expected(prompt: list[int], cap: int) -> list[int]:
    return expected_tokens(GENERATOR, GenerationRequest("x", tuple(prompt), cap, None, prompt_seed(prompt)))


def add_input(request: service_pb2.ModelInferRequest, name: str, array: np.ndarray, datatype: str) -> None:
    rc._tensor(request, name, array, datatype)


async def exchange(address: str,
                   request: service_pb2.ModelInferRequest) -> list[service_pb2.ModelInferResponse]:
    return [response async for response in rc._exchange(address, request, 10.0, 10.0)]


def final(response: service_pb2.ModelInferResponse) -> bool:
    return rc._is_final(response)


def outputs(response: service_pb2.ModelInferResponse) -> dict[str, Any]:
    """name -> flat values (ints, or floats for FP32)."""
    values: dict[str, Any] = {}
    for index, output in enumerate(response.outputs):
        dtype = {"INT32": np.int32, "INT64": np.int64, "FP32": np.float32}[output.datatype]
        values[output.name] = np.frombuffer(response.raw_output_contents[index], dtype=dtype).tolist()
    return values


def shapes(response: service_pb2.ModelInferResponse) -> dict[str, list[int]]:
    return {output.name: list(output.shape) for output in response.outputs}


async def test_streamed_responses_carry_each_steps_tokens_and_the_last_one_the_final_flag(
        replica: ReplicaProcess):
    prompt, cap = [11, 12, 13], 5
    request = rc.build_request("flag-1", prompt, cap, perf_metrics=False)
    responses = await exchange(replica.grpc_address, request)
    assert [final(r) for r in responses] == [False] * (cap - 1) + [True]     # no empty final response
    assert [outputs(r)["output_ids"] for r in responses] == [[t] for t in expected(prompt, cap)]
    assert {tuple(sorted(outputs(r))) for r in responses} == {tuple(sorted(ALWAYS))}
    assert shapes(responses[0]) == {"output_ids": [1, 1, 1], "sequence_length": [1, 1]}
    assert {tuple(outputs(r)["sequence_length"]) for r in responses} == {(1,)}


async def test_perf_outputs_come_only_when_asked_and_count_blocks_and_times(replica: ReplicaProcess):
    prompt, cap = list(range(100, 140)), 3       # 40 prompt tokens: 3 blocks of 16, 43 tokens: still 3
    request = rc.build_request("perf-1", prompt, cap)
    del request.outputs[:]                       # no list: Triton asks for every declared output
    before = time.time_ns()
    responses = await exchange(replica.grpc_address, request)
    after = time.time_ns()
    assert {frozenset(outputs(r)) for r in responses} == {frozenset(ALWAYS | PERF_NAMES)}
    last = outputs(responses[-1])
    blocks = math.ceil((len(prompt) + cap) / SIMPLE_BLOCK)
    assert (last["kv_cache_alloc_total_blocks"], last["kv_cache_reused_blocks"],
            last["kv_cache_alloc_new_blocks"]) == ([blocks], [0], [blocks])
    times = [last[name][0] for name in ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns",
                                        "last_token_time_ns")]
    assert before <= times[0] <= times[1] <= times[2] <= times[3] <= after
    assert times[3] - times[2] >= (cap - 1) * 20_000_000 * 0.9   # cap - 1 further steps of 20 ms
    assert (last["acceptance_rate"], last["total_accepted_draft_tokens"], last["total_draft_tokens"]) == (
        [0.0], [0], [0])


async def test_non_streaming_returns_one_final_response_with_the_prompt_unless_excluded(
        replica: ReplicaProcess):
    prompt, cap = [21, 22], 4
    request = service_pb2.ModelInferRequest(model_name=MODEL_NAME, id="whole-1")
    add_input(request, "input_ids", np.asarray([prompt], np.int32), "INT32")
    add_input(request, "input_lengths", np.asarray([[2]], np.int32), "INT32")
    add_input(request, "request_output_len", np.asarray([[cap]], np.int32), "INT32")
    request.parameters[rc.REQUEST_ID_PARAM].string_param = "whole-1"
    (response,) = await exchange(replica.grpc_address, request)      # streaming absent: off
    assert final(response)
    assert outputs(response) == {"output_ids": prompt + expected(prompt, cap), "sequence_length": [2 + cap]}
    excluded = await exchange(replica.grpc_address, rc.build_request("whole-2", prompt, cap, streaming=False,
                                                                     perf_metrics=False))
    assert [outputs(r) for r in excluded] == [{"output_ids": expected(prompt, cap), "sequence_length": [cap]}]


async def test_a_response_carries_only_the_outputs_a_request_lists_and_output_ids_must_be_among_them(
        replica: ReplicaProcess):
    listed = await exchange(replica.grpc_address, rc.build_request("listed-1", [1, 2], 2))
    assert {frozenset(outputs(r)) for r in listed} == {frozenset(ALWAYS | {"kv_cache_reused_blocks"})}
    request = rc.build_request("listed-2", [1, 2], 2)
    del request.outputs[:]
    request.outputs.add().name = "sequence_length"
    with pytest.raises(ReplicaRejected) as caught:
        await exchange(replica.grpc_address, request)
    assert str(caught.value) == contract.ERR_OUTPUT_NOT_REQUESTED.format("output_ids")


@pytest.mark.parametrize("name", ["foo", "return_kv_cache_reuse_stats", "num_input_tokens"])
async def test_an_input_the_interface_does_not_declare_is_refused_by_triton(replica: ReplicaProcess,
                                                                            name: str):
    request = rc.build_request("unknown-1", [1, 2], 2)
    add_input(request, name, np.asarray([[True]], np.bool_), "BOOL")
    with pytest.raises(ReplicaRejected, match=f"unexpected inference input '{name}'"):
        await exchange(replica.grpc_address, request)


async def test_a_declared_input_this_replica_does_not_implement_is_refused_by_name_unless_neutral(
        replica: ReplicaProcess):
    wide = rc.build_request("beam-2", [1, 2], 2)
    add_input(wide, "beam_width", np.asarray([[2]], np.int32), "INT32")
    with pytest.raises(ReplicaRejected) as caught:
        await exchange(replica.grpc_address, wide)
    assert str(caught.value) == contract.ERR_NOT_IMPLEMENTED.format(name="beam_width", value=2, neutral="1")
    neutral = rc.build_request("beam-1", [1, 2], 2)
    add_input(neutral, "beam_width", np.asarray([[1]], np.int32), "INT32")
    assert [outputs(r)["output_ids"] for r in await exchange(replica.grpc_address, neutral)] == [
        [t] for t in expected([1, 2], 2)]


async def test_a_missing_required_input_is_refused_by_triton(replica: ReplicaProcess):
    request = service_pb2.ModelInferRequest(model_name=MODEL_NAME, id="no-len")
    add_input(request, "input_ids", np.asarray([[1, 2]], np.int32), "INT32")
    add_input(request, "input_lengths", np.asarray([[2]], np.int32), "INT32")
    with pytest.raises(ReplicaRejected, match="request_output_len"):
        await exchange(replica.grpc_address, request)


async def test_stop_ends_the_running_request_with_a_final_response_and_is_acknowledged_empty(
        replica: ReplicaProcess):
    running = rc.build_request("stop-1", [5, 6], 500, perf_metrics=False)
    seen: list[service_pb2.ModelInferResponse] = []
    three = asyncio.Event()

    async def read() -> None:
        async for response in rc._exchange(replica.grpc_address, running, 10.0, 10.0):
            seen.append(response)
            if len(seen) == 3:
                three.set()

    reader = asyncio.create_task(read())
    await asyncio.wait_for(three.wait(), 5)
    ack = await exchange(replica.grpc_address, rc.build_request("stop-1", [0], 1, stop=True))
    await asyncio.wait_for(reader, 5)
    assert [(final(r), list(r.outputs)) for r in ack] == [(True, [])]     # one empty final response
    assert final(seen[-1]) and not any(final(r) for r in seen[:-1])
    streamed = [t for r in seen for t in outputs(r)["output_ids"]]
    assert 3 <= len(streamed) < 40 and streamed == expected([5, 6], 500)[: len(streamed)]


async def test_stop_without_a_request_id_is_an_error(replica: ReplicaProcess):
    request = rc.build_request("", [0], 1, stop=True)
    with pytest.raises(ReplicaRejected, match=contract.ERR_STOP_WITHOUT_ID):
        await exchange(replica.grpc_address, request)


async def test_the_client_reads_tokens_and_reuse_from_the_strict_replica(replica: ReplicaProcess):
    chunks = [c async for c in rc.stream_generate(replica.grpc_address, "client-1", [11, 12, 13], 6)]
    assert [t for c in chunks for t in c.token_ids] == expected([11, 12, 13], 6)
    assert {(c.num_input_tokens, c.kv_cache_reused_blocks) for c in chunks} == {(3, 0)}


def test_the_declared_tensors_are_the_pinned_config_pbtxt(tmp_path: Path):
    """Spot checks against tensorrtllm_backend v0.19.0's config.pbtxt: counts, required inputs, types."""
    assert (len(contract.INPUTS), len(contract.OUTPUTS)) == (60, 19)
    assert [s.name for s in contract.INPUTS if not s.optional] == ["input_lengths", "request_output_len"]
    by_name = {s.name: s for s in contract.INPUTS}
    assert (by_name["stop_words_list"].dims, by_name["random_seed"].dtype) == ((2, -1), np.uint64)
    assert "return_kv_cache_reuse_stats" not in by_name and contract.CACHE_SALT_INPUT not in by_name


def scrape(replica: ReplicaProcess) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    body = urllib.request.urlopen(f"http://127.0.0.1:{replica.metrics_port}/metrics", timeout=5).read()
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(body.decode()) for sample in family.samples}


def labelled(kind_label: str, kind: str, **more: str) -> frozenset[tuple[str, str]]:
    return frozenset({"model": MODEL_NAME, "version": "1", kind_label: kind, **more}.items())


async def test_metrics_carry_the_backends_names_labels_and_a_sample_per_finished_request(
        replica: ReplicaProcess):
    before = await asyncio.to_thread(scrape, replica)
    await exchange(replica.grpc_address, rc.build_request("metered-1", list(range(100, 140)), 3))
    after = await asyncio.to_thread(scrape, replica)

    def grew(name: str, kind: str, **more: str) -> float:
        key = (name, labelled("response_metric_type", kind, **more))
        return after[key] - before.get(key, 0.0)

    assert (grew("nv_llm_input_token_len_count", "total_input_tokens"),
            grew("nv_llm_input_token_len_sum", "total_input_tokens"),
            grew("nv_llm_input_token_len_bucket", "total_input_tokens", le="10.0"),
            grew("nv_llm_input_token_len_bucket", "total_input_tokens", le="50.0")) == (1, 40, 0, 1)
    assert (grew("nv_llm_output_token_len_sum", "total_output_tokens"),
            grew("nv_llm_output_token_len_bucket", "total_output_tokens", le="10.0")) == (3, 1)
    for kind in ("cpu", "gpu", "pinned"):
        assert after[("nv_trt_llm_runtime_memory_metrics", labelled("memory_type", kind))] == 0
    for kind in ("active", "max", "scheduled", "context", "waiting"):
        assert ("nv_trt_llm_request_metrics", labelled("request_type", kind)) in after
    for kind in ("max", "free", "used", "tokens_per", "reused", "fraction"):
        assert ("nv_trt_llm_kv_cache_block_metrics", labelled("kv_cache_block_type", kind)) in after
    for kind in ("total_context_tokens", "generation_requests", "micro_batch_id", "paused_requests"):
        key = ("nv_trt_llm_inflight_batcher_metrics", labelled("inflight_batcher_specific_metric", kind))
        assert key in after
    stamp = after[("nv_trt_llm_general_metrics", labelled("general_type", "timestamp"))]
    assert abs(stamp / 1e6 - time.time()) < 600                   # microseconds since the epoch
