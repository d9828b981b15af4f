"""services/replica_responses.py: a stream's responses read at the offsets the previous one proved,
and everything else left to the full parse. Responses are built as the replica builds them
(tritonclient's messages, serialized by protobuf)."""

from __future__ import annotations

import numpy as np
from sluice.services import replica_client
from sluice.services.replica_responses import MAX_LAYOUTS, ResponseLayout, is_final
from tritonclient.grpc import service_pb2


def response(tokens: list[int], reused: int | None = 0, *, final: bool = False, request_id: str = "run-1",
             dtype: type = np.int32) -> service_pb2.ModelStreamInferResponse:
    """One streamed response of the tensorrt_llm interface (output_ids, sequence_length, and the
    reuse count when perf outputs were asked for)."""
    message = service_pb2.ModelStreamInferResponse()
    inner = message.infer_response
    inner.model_name, inner.model_version, inner.id = "tensorrt_llm", "1", request_id
    inner.parameters["triton_final_response"].bool_param = final
    outputs = [("output_ids", np.asarray([[tokens]], dtype=dtype)),
               ("sequence_length", np.asarray([[len(tokens)]], dtype=np.int32))]
    if reused is not None:
        outputs.append(("kv_cache_reused_blocks", np.asarray([[reused]], dtype=np.int32)))
    for name, array in outputs:
        tensor = inner.outputs.add()
        tensor.name, tensor.datatype = name, "INT64" if array.dtype == np.int64 else "INT32"
        tensor.shape.extend(array.shape)
        inner.raw_output_contents.append(array.tobytes())
    return message


def varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out + bytes((value,)))


def learned(message: service_pb2.ModelStreamInferResponse) -> ResponseLayout:
    layout = ResponseLayout()
    layout.learn(message.SerializeToString(), message)
    return layout


def test_a_response_shaped_like_the_learned_one_is_read_at_its_offsets():
    layout = learned(response([17], reused=0))
    assert layout.tokens(response([4242], reused=3).SerializeToString()) == ((4242,), 3)
    assert layout.tokens(response([-5], reused=0).SerializeToString()) == ((-5,), 0)


def test_without_the_reuse_output_the_read_says_it_was_not_sent():
    layout = learned(response([17], reused=None))
    assert layout.tokens(response([99], reused=None).SerializeToString()) == ((99,), None)


def test_int64_ids_and_several_tokens_per_response_are_read_with_their_own_layout():
    layout = learned(response([1, 2], dtype=np.int64))
    assert layout.tokens(response([7, 8], dtype=np.int64).SerializeToString()) == ((7, 8), 0)
    assert layout.tokens(response([7, 8, 9], dtype=np.int64).SerializeToString()) is None   # another length
    layout.learn(response([1, 2, 3], dtype=np.int64).SerializeToString(), response([1, 2, 3], dtype=np.int64))
    assert layout.tokens(response([7, 8, 9], dtype=np.int64).SerializeToString()) == ((7, 8, 9), 0)


def test_the_final_response_and_another_streams_responses_are_left_to_the_full_parse():
    layout = learned(response([17]))
    final = response([18], final=True)
    assert len(final.SerializeToString()) == len(response([18]).SerializeToString())   # only the flag differs
    assert is_final(final.infer_response)
    assert layout.tokens(final.SerializeToString()) is None
    assert layout.tokens(response([18], request_id="run-2").SerializeToString()) is None


def test_a_final_response_or_an_error_teaches_no_layout():
    layout = learned(response([17], final=True))
    assert layout.tokens(response([18], final=True).SerializeToString()) is None
    error = service_pb2.ModelStreamInferResponse(error_message="boom")
    layout.learn(error.SerializeToString(), error)
    assert layout.tokens(error.SerializeToString()) is None


def test_a_value_whose_tags_differ_is_left_to_the_full_parse():
    layout = learned(response([17]))
    body = bytearray(response([18]).SerializeToString())
    tail_start = len(body) - 3 * 6
    body[tail_start + 6] = 0x3A          # the second value's tag is now field 7: not a raw output
    assert layout.tokens(bytes(body)) is None


def test_offsets_that_belong_to_another_field_are_never_learned():
    """The bytes that end the message look like the raw outputs, but they are the end of a string
    field written after them: the probe finds that changing them changes no output value."""
    honest = response([17])
    inner = honest.infer_response.SerializeToString()
    tail = b"".join(bytes((0x32, len(raw))) + raw for raw in honest.infer_response.raw_output_contents)
    decoy = b"\x0a" + bytes((len(tail) + 1,)) + b"x" + tail          # model_name = "x" + tail's bytes
    body = b"\x12" + varint(len(inner) + len(decoy)) + inner + decoy
    message = service_pb2.ModelStreamInferResponse.FromString(body)
    assert list(message.infer_response.raw_output_contents) == list(honest.infer_response.raw_output_contents)
    assert body.endswith(tail)
    layout = ResponseLayout()
    layout.learn(body, message)
    assert layout.tokens(body) is None


def test_a_stream_keeps_at_most_a_bounded_number_of_layouts():
    layout = ResponseLayout()
    for count in range(1, MAX_LAYOUTS + 3):
        message = response(list(range(count)))
        layout.learn(message.SerializeToString(), message)
    known = [count for count in range(1, MAX_LAYOUTS + 3)
             if layout.tokens(response([5] * count).SerializeToString()) is not None]
    assert known == list(range(1, MAX_LAYOUTS + 1))


class _Connection:
    """What a generation asks of its connection while it reads responses."""

    last_received = 0.0

    def cancel(self, stream_id: int) -> None:
        pass


async def test_a_stream_learns_its_layout_only_when_enough_responses_may_follow():
    # Learning costs ~9 full parses: a stream that may send at most a few responses parses them in
    # full; one with many to come learns from its first and reads the rest at their offsets.
    chunks: list[replica_client.TokenChunk] = []
    for max_new_tokens, learns in ((2, False), (replica_client.LEARN_MIN_RESPONSES_LEFT, False),
                                   (replica_client.LEARN_MIN_RESPONSES_LEFT + 1, True), (100, True)):
        generation = replica_client._Generation("r0", "run-1", 3, chunks.append, 1.0, 1.0,
                                                _Connection(), max_new_tokens)  # type: ignore[arg-type]
        generation.message(response([17]).SerializeToString())
        assert (generation.layout.tokens(response([18]).SerializeToString()) is not None) is learns
        generation.message(response([18]).SerializeToString())
    assert [chunk.token_ids for chunk in chunks] == [(17,), (18,)] * 4
