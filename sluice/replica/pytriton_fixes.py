"""Three narrow fixes to pytriton 0.7: zero-size tensors, the final flag on a decoupled response,
and the requested outputs a request lists.

pytriton copies its proxy sources (pytriton/proxy/*.py) into the model store,
and the stub process serializes each request's tensors into shared memory
with `memoryview.cast("B")`, which raises for a zero-element tensor (e.g. an
empty `input_ids`). In a decoupled model that exception is never turned into a
response, so the request hangs forever instead of getting an error. The fix
makes empty frames copy as empty bytes; the callable then sees the empty
tensor and rejects it with a proper Triton error.

Applied by rewriting the copied source as pytriton hands it to Triton (both
the local-model-store and the files-in-load-request paths); if a future
pytriton changes the line, the patch is skipped with a warning and the empty
input test in tests/test_replica.py shows the regression.

Final flag: a decoupled pytriton callable cannot mark a response final; pytriton sends every
yielded response with flags 0 and, when the generator ends, a flags-only final response (seen by
a gRPC client only with `triton_enable_empty_final_response`). TensorRT-LLM's backend sends its
last response (the last tokens, or a stop's empty acknowledgement) with
TRITONSERVER_RESPONSE_COMPLETE_FINAL. The strict replica yields that response as
`FinalResponses`; the patched connector sends it with pytriton's EOS flag (which the stub turns
into COMPLETE_FINAL on that very response) and swallows the flags-only one that would follow.

Requested outputs: with PYTRITON_NO_TENSORSTORE (serve.py) requests travel through
Base64SerializerDeserializer, which drops `requested_output_names` on the way (its TensorStore
twin keeps them), so the callable cannot leave out what the client did not ask for, and builds,
serializes and ships every output only for the stub to discard it. With the ten perf outputs
that halved the strict replica's streamed tokens/s (`bench/bench_replica.py --concurrency 16
--output 128` on the shared 2-core box: 834-858 tokens/s; legacy interface 925-1,599; strict with
this fix 1,542-1,910). The stub's copy learns to send the names, and this process reads them.
"""

from __future__ import annotations

import logging
import pathlib
import typing
from typing import Any

LOG = logging.getLogger(__name__)

_BROKEN = 'shm.buf[offset + total_size : offset + total_size + frame.nbytes] = frame.cast("B")'
_FIXED = ('shm.buf[offset + total_size : offset + total_size + frame.nbytes] = '
          '(frame.cast("B") if frame.nbytes else b"")')
_PATCHED_FILE = "data.py"


# Base64SerializerDeserializer.serialize_requests (the TensorStore one already has the names).
_NAMES_BROKEN = ('                serialized_request["span"] = get_span_dict(request.span)\n'
                 '            requests_list.append(serialized_request)\n')
_NAMES_FIXED = ('                serialized_request["span"] = get_span_dict(request.span)\n'
                '            if request.requested_output_names is not None:  # sluice: keep them\n'
                '                serialized_request["requested_output_names"] = '
                'request.requested_output_names\n'
                '            requests_list.append(serialized_request)\n')
_FIXES = ((_BROKEN, _FIXED, "zero-size tensor fix"), (_NAMES_BROKEN, _NAMES_FIXED, "requested outputs fix"))


def _patch_source(text: str) -> str:
    for broken, fixed, what in _FIXES:
        if broken in text:
            text = text.replace(broken, fixed)
        elif fixed not in text:
            LOG.warning("pytriton proxy data.py changed; %s not applied", what)
    return text


def _patch_requested_names() -> None:
    """This process's half: read the names the patched stub now sends (one more JSON parse per
    request, not per response)."""
    import json

    from pytriton.proxy.data import Base64SerializerDeserializer

    original = Base64SerializerDeserializer.deserialize_requests

    def deserialize_requests(self: Any, requests_payload: bytes) -> Any:
        requests = original(self, requests_payload)
        sent = json.loads(requests_payload)["requests"]
        for request, raw in zip(requests, sent, strict=True):
            if "requested_output_names" in raw:
                request.requested_output_names = raw["requested_output_names"]
        return requests

    typing.cast(Any, Base64SerializerDeserializer).deserialize_requests = deserialize_requests


class FinalResponses(list):  # type: ignore[type-arg]
    """The last responses of a decoupled call: sent with Triton's final flag (see module doc)."""


_FINAL_SENT = "sluice_final_sent"          # scope key: the final flag has gone with a response


def _patch_final_flag() -> None:
    from pytriton.proxy.communication import PyTritonResponseFlags
    from pytriton.proxy.inference import RequestsResponsesConnector

    original_send = RequestsResponsesConnector.send

    def send(self: Any, scope: dict[str, Any], flags: Any, responses: Any) -> None:
        if isinstance(responses, FinalResponses):
            scope[_FINAL_SENT] = True
            original_send(self, scope, flags | PyTritonResponseFlags.EOS, list(responses))
        elif not scope.get(_FINAL_SENT):
            original_send(self, scope, flags, responses)

    typing.cast(Any, RequestsResponsesConnector).send = send


def apply() -> None:
    from pytriton.models.model import Model

    if getattr(Model, "_sluice_patched", False):
        return
    original_files = Model.get_proxy_model_files
    original_generate = Model.generate_model

    def get_proxy_model_files(self: Model) -> dict[str, bytes]:
        files: dict[str, bytes] = original_files(self)
        for key, content in files.items():
            if key.endswith("/" + _PATCHED_FILE):
                files[key] = _patch_source(content.decode("utf-8")).encode("utf-8")
        return files

    def generate_model(self: Model, model_repository: pathlib.Path) -> None:
        original_generate(self, model_repository)
        copied = model_repository / self.model_name / str(self.model_version) / _PATCHED_FILE
        copied.write_text(_patch_source(copied.read_text("utf-8")), "utf-8")

    typing.cast(typing.Any, Model).get_proxy_model_files = get_proxy_model_files
    typing.cast(typing.Any, Model).generate_model = generate_model
    typing.cast(typing.Any, Model)._sluice_patched = True
    _patch_final_flag()
    _patch_requested_names()
    # Our own process deserializes with the same module; patch it too for symmetry.
    from pytriton.proxy import data

    if _BROKEN in pathlib.Path(data.__file__).read_text("utf-8"):
        _patch_store_copy_frames(data)


def _patch_store_copy_frames(data: typing.Any) -> None:
    import struct

    def _copy_frames(self: typing.Any, frames: list[typing.Any], shm: typing.Any, offset: int) -> int:
        total_size = struct.calcsize("<I")
        for frame in frames:
            if isinstance(frame, bytes):
                frame = memoryview(frame)
            assert frame.contiguous, "Only contiguous arrays are supported"
            struct.pack_into("<I", shm.buf, offset + total_size, frame.nbytes)
            total_size += struct.calcsize("<I")
            shm.buf[offset + total_size: offset + total_size + frame.nbytes] = (
                frame.cast("B") if frame.nbytes else b"")
            total_size += frame.nbytes
        struct.pack_into("<I", shm.buf, offset, total_size)
        return total_size

    owner = next(cls for cls in vars(data).values()
                 if isinstance(cls, type) and "_copy_frames" in vars(cls))
    typing.cast(typing.Any, owner)._copy_frames = _copy_frames
