"""A run's `tensorrt_llm` request as bytes, from a template (issue 9: the routing worker's cost per run).

replica_client.build_request makes a ModelInferRequest message (a dozen tensors, each a sub-message)
and SerializeToString writes it: ~24 us per run, nearly all of it for parts that are the same in every
run. A protobuf message is the concatenation of its fields' records, and a parser keeps the records
of one repeated field in the order they come, whatever other records lie between them, so a request
can be written as

    [input_ids' tensor record]  shape [1, len(prompt)]: made per run
    [model name, every scalar input's tensor record, the outputs read, triton_enable_empty_final_response]
                                the same for every request of these options: made once per options
    [id] [request_id parameter] [raw_input_contents: input_ids' bytes, then each scalar's bytes]
                                made per run

in ~3 us, and Triton reads the same message that build_request makes (tests/test_replica_request.py
parses both). Which scalars a request carries, and their order, come from `scalar_inputs`, which
build_request uses too. Requests with stop words, or stop requests, go through build_request.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import NamedTuple

from tritonclient.grpc import service_pb2

from sluice.replica.protocol import MODEL_NAME, REQUEST_ID_PARAM

# The outputs replica_client.parse_chunk reads; the backend refuses a request that does not list the
# first two. (Triton returns every declared output when none is listed: ten perf tensors per streamed
# token would cost more than the token itself.)
OUTPUTS_READ = ("output_ids", "sequence_length", "kv_cache_reused_blocks")
EMPTY_FINAL_RESPONSE_PARAM = "triton_enable_empty_final_response"

# A [1, 1] tensor's bytes by Triton datatype (little-endian, as numpy's tobytes on this platform).
SCALAR_BYTES: dict[str, Callable[[float], bytes]] = {
    "INT32": struct.Struct("<i").pack, "UINT64": struct.Struct("<Q").pack,
    "FP32": struct.Struct("<f").pack, "BOOL": struct.Struct("<?").pack}


class Scalar(NamedTuple):
    name: str                    # the tensorrt_llm input
    datatype: str                # Triton's datatype name
    value: float


def scalar_inputs(prompt_tokens: int, max_new_tokens: int, end_id: int | None, *, streaming: bool,
                  perf_metrics: bool, seed: int | None, cache_salt: int, temperature: float | None,
                  top_p: float | None) -> list[Scalar]:
    """The [1, 1] inputs of a request after input_ids, in the order they are sent; a field left None
    (or 0 for the salt) is not sent: the backend's default applies."""
    # Only new tokens, whatever the deployment's exclude_input_in_output parameter says (a non-streaming
    # response would otherwise start with the prompt). The salt is the trust scope (DESIGN.md "Trust
    # scopes"): KV blocks are reused only between requests with the same salt (TensorRT-LLM's request
    # field cache_salt_id; replica/README.md).
    inputs: tuple[tuple[str, str, float | None], ...] = (
        ("input_lengths", "INT32", prompt_tokens), ("request_output_len", "INT32", max_new_tokens),
        ("streaming", "BOOL", streaming), ("exclude_input_in_output", "BOOL", True),
        ("return_perf_metrics", "BOOL", True if perf_metrics else None), ("end_id", "INT32", end_id),
        ("random_seed", "UINT64", seed), ("cache_salt_id", "UINT64", cache_salt or None),
        ("temperature", "FP32", temperature), ("runtime_top_p", "FP32", top_p))
    return [Scalar(name, datatype, value) for name, datatype, value in inputs if value is not None]


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(tag: int, payload: bytes) -> bytes:
    """A length-delimited record (wire type 2) of field number `tag` (< 16: its key is one byte)."""
    size = len(payload)
    if size < 0x80:
        return bytes((tag << 3 | 2, size)) + payload
    return bytes((tag << 3 | 2,)) + _varint(size) + payload


_INPUTS, _RAW, _ID, _PARAMETERS = 5, 7, 3, 4       # ModelInferRequest's field numbers
_INPUT_IDS_HEAD = _field(1, b"input_ids") + _field(2, b"INT32")   # InferInputTensor name, datatype
_REQUEST_ID_KEY = _field(1, REQUEST_ID_PARAM.encode())             # the parameters map entry's key


def _constant_part(perf_metrics: bool, names: Sequence[tuple[str, str]]) -> bytes:
    """Every record that depends only on the options: the model, the scalars' tensors (name, datatype,
    shape [1, 1]), the outputs read, the empty final response asked for."""
    request = service_pb2.ModelInferRequest(model_name=MODEL_NAME)
    for name, datatype in names:
        tensor = request.inputs.add()
        tensor.name, tensor.datatype = name, datatype
        tensor.shape.extend((1, 1))
    for name in OUTPUTS_READ if perf_metrics else OUTPUTS_READ[:2]:
        request.outputs.add().name = name
    # Without this Triton drops the flags-only last response, and the client could not see the end.
    request.parameters[EMPTY_FINAL_RESPONSE_PARAM].bool_param = True
    return request.SerializeToString()


# A scalar's raw_input_contents record, but for its value: the tag and the length of its datatype.
_RAW_HEAD = {datatype: bytes((_RAW << 3 | 2, len(pack(0)))) for datatype, pack in SCALAR_BYTES.items()}


class RequestTemplates:
    """Requests as bytes, the options' constant part made once (a process sends few distinct ones)."""

    __slots__ = ("_constant",)

    def __init__(self) -> None:
        self._constant: dict[tuple[object, ...], bytes] = {}

    def encode(self, request_id: str, prompt_ids: Sequence[int], max_new_tokens: int,
               end_id: int | None = None, *, streaming: bool = True, perf_metrics: bool = True,
               seed: int | None = None, cache_salt: int = 0, temperature: float | None = None,
               top_p: float | None = None) -> bytes:
        """build_request(...).SerializeToString() for a request without stop words, as parsed."""
        count = len(prompt_ids)
        scalars = scalar_inputs(count, max_new_tokens, end_id, streaming=streaming, perf_metrics=perf_metrics,
                                seed=seed, cache_salt=cache_salt, temperature=temperature, top_p=top_p)
        # What decides which scalars are sent (scalar_inputs): the constant part of these options.
        key = (perf_metrics, end_id is None, seed is None, not cache_salt, temperature is None, top_p is None)
        constant = self._constant.get(key)
        if constant is None:
            constant = self._constant[key] = _constant_part(
                perf_metrics, [(scalar.name, scalar.datatype) for scalar in scalars])
        ids = request_id.encode()
        raw = struct.pack(f"<{count}i", *prompt_ids)
        parts = [_field(_INPUTS, _INPUT_IDS_HEAD + _field(3, b"\x01" + _varint(count))), constant,
                 _field(_ID, ids), _field(_PARAMETERS, _REQUEST_ID_KEY + _field(2, _field(3, ids))),
                 _field(_RAW, raw)]
        for _, datatype, value in scalars:
            parts.append(_RAW_HEAD[datatype])
            parts.append(SCALAR_BYTES[datatype](value))
        return b"".join(parts)
