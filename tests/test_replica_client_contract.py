"""services/replica_client.py against the pinned `tensorrt_llm` interface (replica/contract.py),
without a server: what it sends is declared there with that type and shape, and it reads what a
response of that interface may or may not carry."""

from __future__ import annotations

import numpy as np
from sluice.services import replica_client as rc
from tritonclient.grpc import service_pb2

from sluice.replica import contract

TRITON_TYPES = {np.int32: "INT32", np.int64: "INT64", np.uint64: "UINT64", np.float32: "FP32",
                np.bool_: "BOOL"}
DECLARED = {spec.name: spec for spec in (*contract.INPUTS, contract.CACHE_SALT_SPEC)}


def sent(request: service_pb2.ModelInferRequest) -> dict[str, np.ndarray]:
    values = {}
    for index, tensor in enumerate(request.inputs):
        spec = DECLARED[tensor.name]                             # declared, or the test fails here
        assert tensor.datatype == TRITON_TYPES[spec.dtype], tensor.name
        assert tuple(tensor.shape)[1:] == tuple(d if d != -1 else tensor.shape[i + 1]
                                                for i, d in enumerate(spec.dims)), tensor.name
        assert tensor.shape[0] == 1, tensor.name                 # a batch of one
        raw = request.raw_input_contents[index]
        values[tensor.name] = np.frombuffer(raw, dtype=spec.dtype).reshape(tuple(tensor.shape))
    return values


def test_a_run_request_asks_for_the_perf_outputs_and_new_tokens_only_and_forwards_sampling_and_ids():
    request = rc.build_request("run-1", [5, 6, 7], 9, 2, seed=11, temperature=0.7, top_p=0.9,
                               stop_words=[[3, 4], [8]], cache_salt=99)
    values = sent(request)
    assert request.model_name == "tensorrt_llm" and request.id == "run-1"
    assert values["input_ids"].tolist() == [[5, 6, 7]] and values["input_lengths"].tolist() == [[3]]
    assert (values["request_output_len"].item(), values["end_id"].item(), values["random_seed"].item()) == (
        9, 2, 11)
    assert values["temperature"].item() == np.float32(0.7)
    assert values["runtime_top_p"].item() == np.float32(0.9)
    assert values["stop_words_list"].tolist() == [[[3, 4, 8], [2, 3, -1]]]
    assert (values["return_perf_metrics"].item(), values["exclude_input_in_output"].item(),
            values["streaming"].item()) == (True, True, True)
    assert values[contract.CACHE_SALT_INPUT].item() == 99
    assert "stop" not in values
    assert [output.name for output in request.outputs] == ["output_ids", "sequence_length",
                                                           "kv_cache_reused_blocks"]


def test_what_is_left_out_is_not_sent_so_the_backend_defaults_apply():
    request = rc.build_request("run-2", [5], 4, perf_metrics=False)
    assert set(sent(request)) == {"input_ids", "input_lengths", "request_output_len", "streaming",
                                  "exclude_input_in_output"}
    assert [output.name for output in request.outputs] == ["output_ids", "sequence_length"]


def test_a_stop_request_carries_the_required_inputs_and_the_id():
    request = rc.build_request("run-1", [0], 1, stop=True)
    values = sent(request)
    assert values["stop"].item() is True and {"input_lengths", "request_output_len"} <= set(values)
    assert request.id == "run-1" and request.parameters[rc.REQUEST_ID_PARAM].string_param == "run-1"


def response(**outputs: list[int]) -> service_pb2.ModelInferResponse:
    message = service_pb2.ModelInferResponse(model_name="tensorrt_llm")
    for name, values in outputs.items():
        tensor = message.outputs.add()
        tensor.name, tensor.datatype = name, "INT32"
        tensor.shape.extend([1, 1, len(values)] if name == "output_ids" else [1, 1])
        message.raw_output_contents.append(np.asarray(values, dtype=np.int32).tobytes())
    return message


def test_a_response_without_the_perf_outputs_keeps_the_reuse_count_already_seen():
    with_perf = rc.parse_chunk(response(output_ids=[41], sequence_length=[1], kv_cache_reused_blocks=[3],
                                        kv_cache_alloc_total_blocks=[5]), 7, 0)
    assert with_perf == rc.TokenChunk((41,), 7, 3)
    without = rc.parse_chunk(response(output_ids=[42, 43], sequence_length=[2]), 7,
                             with_perf.kv_cache_reused_blocks)
    assert without == rc.TokenChunk((42, 43), 7, 3)
    assert rc.parse_chunk(response(output_ids=[], sequence_length=[0]), 7, 3) == rc.TokenChunk((), 7, 3)
