"""The strict `tensorrt_llm` model: exactly the pinned tensorrtllm_backend interface (replica/contract.py).

What a client sees, as from the real backend in decoupled mode (deploy/triton/CONTRACT.md):
- streaming=true: one response per engine step with that step's new tokens; the last one (the
  step that finished the request) carries Triton's final flag, possibly with zero tokens;
- streaming=false: one response, final, with every token (after the prompt unless
  exclude_input_in_output);
- `output_ids` [1, 1, n] and `sequence_length` [1, 1] always; the perf outputs only with
  return_perf_metrics; no other output (no log probs or logits are computed here);
- stop=true with the id of a running request: that request ends with a final response holding the
  tokens of its last step, and the stop request itself gets one empty final response; without a
  request id it is an error, with an unknown id a plain acknowledgement;
- a refused request: one error response (the message says which input and why); an input the
  interface does not declare is refused by Triton before the model sees it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sluice.replica import contract
from sluice.replica.engine_api import EngineRequestError
from sluice.replica.generator import prompt_seed
from sluice.replica.host import EngineHost, RequestIdInUse, take_ready
from sluice.replica.protocol import ERR_BATCH, MODEL_NAME, REQUEST_ID_PARAM
from sluice.replica.pytriton_fixes import FinalResponses

Response = dict[str, NDArray[Any]]


class _Progress:
    """What one request has produced so far, for its responses and perf outputs."""

    def __init__(self, prompt_len: int, block_size: int, arrival_ns: int) -> None:
        self.prompt_len, self.block_size = prompt_len, block_size
        self.arrival_ns, self.first_step_ns, self.first_token_ns, self.last_token_ns = arrival_ns, 0, 0, 0
        self.generated, self.reused_blocks = 0, 0

    def saw_step(self, now_ns: int, new_tokens: int, reused_blocks: int) -> None:
        self.first_step_ns = self.first_step_ns or now_ns
        self.reused_blocks = reused_blocks
        if new_tokens:
            self.generated += new_tokens
            self.first_token_ns = self.first_token_ns or now_ns
            self.last_token_ns = now_ns

    def perf(self) -> contract.PerfMetrics:
        total = contract.blocks_held(self.prompt_len + self.generated, self.block_size)
        return contract.PerfMetrics(new_blocks=max(0, total - self.reused_blocks),
                                    reused_blocks=self.reused_blocks, total_blocks=total,
                                    arrival_ns=self.arrival_ns, first_scheduled_ns=self.first_step_ns,
                                    first_token_ns=self.first_token_ns, last_token_ns=self.last_token_ns)


class StrictTensorrtLlmModel:
    """The decoupled infer callable bound as `tensorrt_llm` in strict mode."""

    def __init__(self, host: EngineHost, block_size: int, clock_ns: Callable[[], int] = time.time_ns,
                 on_finished: Callable[[int, int], None] = lambda _inputs, _outputs: None) -> None:
        self._host = host
        self._block_size = block_size
        self._clock_ns = clock_ns
        self._on_finished = on_finished          # (input tokens, output tokens) of a finished request

    async def __call__(self, requests: list[Any]) -> AsyncIterator[list[Response]]:
        from pytriton.exceptions import PyTritonBadParameterError

        if len(requests) != 1:
            raise PyTritonBadParameterError(ERR_BATCH.format(len(requests)))
        request = requests[0]
        request_id = str((request.parameters or {}).get(REQUEST_ID_PARAM) or "")
        if contract.is_stop(request.data):
            if not request_id:
                raise PyTritonBadParameterError(contract.ERR_STOP_WITHOUT_ID)
            self._host.abort(request_id)
            yield FinalResponses([{}])             # the backend's empty final acknowledgement
            return
        arrival_ns = self._clock_ns()
        try:
            parsed = contract.parse(request.data, request_id or f"anon-{uuid.uuid4().hex}", prompt_seed)
            queue = self._host.submit(parsed.generation)
        except (EngineRequestError, RequestIdInUse) as exc:
            raise PyTritonBadParameterError(str(exc)) from None
        requested = frozenset(request.requested_output_names or ()) or None
        missing = [name for name in ("output_ids", "sequence_length") if requested and name not in requested]
        if missing:
            raise PyTritonBadParameterError(contract.ERR_OUTPUT_NOT_REQUESTED.format(missing[0]))
        generation = parsed.generation
        progress = _Progress(len(generation.prompt_ids), self._block_size, arrival_ns)
        held: list[int] = [] if parsed.streaming or parsed.exclude_input else list(generation.prompt_ids)
        finished = False
        try:
            while not finished:
                outputs, finished = await take_ready(queue)
                fresh: list[int] = []
                for item in outputs:
                    fresh.extend(item.new_token_ids)
                    progress.saw_step(self._clock_ns(), len(item.new_token_ids), item.kv_cache_reused_blocks)
                if not parsed.streaming:
                    held.extend(fresh)
                elif not finished and fresh:
                    yield [self._response(tuple(fresh), progress, parsed.perf_metrics, requested)]
        finally:
            if not finished:
                self._host.forget(generation.request_id)
        last = tuple(fresh) if parsed.streaming else tuple(held)
        self._on_finished(progress.prompt_len, progress.generated)
        yield FinalResponses([self._response(last, progress, parsed.perf_metrics, requested)])

    @staticmethod
    def _response(tokens: tuple[int, ...], progress: _Progress, perf_metrics: bool,
                  requested: frozenset[str] | None) -> Response:
        return contract.token_response(tokens, progress.perf() if perf_metrics else None, requested)


def _tensor(spec: contract.TensorSpec) -> Any:
    from pytriton.model_config import Tensor

    dtype = np.bytes_ if spec.dtype is np.bytes_ else spec.dtype
    return Tensor(name=spec.name, dtype=dtype, shape=spec.dims, optional=spec.optional)


def bind_strict_model(triton: Any, model: StrictTensorrtLlmModel, cache_salt_input: bool) -> None:
    """Declare exactly the pinned inputs and outputs (plus cache_salt_id when configured)."""
    from pytriton.model_config import DynamicBatcher, ModelConfig

    inputs = [*contract.INPUTS, *((contract.CACHE_SALT_SPEC,) if cache_salt_input else ())]
    triton.bind(
        model_name=MODEL_NAME,
        infer_func=model,
        inputs=[_tensor(spec) for spec in inputs],
        outputs=[_tensor(spec) for spec in contract.OUTPUTS],
        # max_batch_size=1: one request per call, so streams never advance in lockstep (the real
        # model takes up to triton_max_batch_size; Sluice always sends one).
        config=ModelConfig(batching=True, max_batch_size=1, decoupled=True,
                           batcher=DynamicBatcher(max_queue_delay_microseconds=0)),
        strict=False,
    )
