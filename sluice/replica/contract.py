"""The `tensorrt_llm` model interface of a pinned tensorrtllm_backend, as data and pure functions.

Pinned: tensorrtllm_backend v0.19.0 (commit c1e19638304d287f554f738c1411746555ed348c, TensorRT-LLM
0.19.0): all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt and docs/model_config.md. The
contract in words, with what this replica does and does not implement, is deploy/triton/CONTRACT.md.

The strict replica mode (`[replica].interface = "tensorrt_llm"`, replica/serve.py) declares exactly
these tensors to Triton, so Triton itself refuses an input the real model would refuse ("unexpected
inference input"), and builds its responses here: `output_ids` and `sequence_length` always, the
perf-metric outputs only when the request set `return_perf_metrics`, as the real backend does.
No Triton import: the client side and unit tests use this module cheaply.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sluice.replica.engine_api import EngineRequestError, GenerationRequest
from sluice.replica.protocol import (
    ERR_BAD_INPUT_LENGTHS,
    ERR_BAD_OUTPUT_LEN,
    ERR_BAD_STOP_WORDS,
    ERR_BAD_TEMPERATURE,
    ERR_BAD_TOP_P,
    ERR_EMPTY_INPUT,
)

PINNED_VERSION = "tensorrtllm_backend v0.19.0"
PINNED_COMMIT = "c1e19638304d287f554f738c1411746555ed348c"
# The one input the pinned model lacks that Sluice needs: the trust scope's salt (TensorRT-LLM's
# executor field cache_salt_id, replica/README.md). Declared only with `[replica].cache_salt_id`.
CACHE_SALT_INPUT = "cache_salt_id"

ERR_NO_INPUT_IDS = "input_ids or encoder_input_features is not present in the request."
ERR_STOP_WITHOUT_ID = "Trying to stop a request but request ID is not provided"
ERR_OUTPUT_NOT_REQUESTED = "{} tensor must be present in list of output tensors"
ERR_NOT_IMPLEMENTED = ("input {name!r} = {value} is part of the tensorrt_llm interface (" + PINNED_VERSION
                       + ") but this replica does not implement it; leave it out or send {neutral}")


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    dtype: type[np.generic]              # numpy dtype of the Triton data_type
    dims: tuple[int, ...]                # config.pbtxt dims, without the batch dimension
    optional: bool = True


def _spec(name: str, dtype: type[np.generic], *dims: int, optional: bool = True) -> TensorSpec:
    return TensorSpec(name, dtype, dims, optional)


def _out(name: str, dtype: type[np.generic], *dims: int) -> TensorSpec:
    return TensorSpec(name, dtype, dims, optional=False)


I32, I64, U64, F32, F16, B, U8 = np.int32, np.int64, np.uint64, np.float32, np.float16, np.bool_, np.uint8

# Every input of the pinned config.pbtxt, in its order. The two template types are filled as the
# shipped deploy/triton config fills them: encoder_input_features FP16, logits FP32.
INPUTS: tuple[TensorSpec, ...] = (
    _spec("input_ids", I32, -1), _spec("encoder_input_features", F16, -1, -1),
    _spec("encoder_output_lengths", I32, 1),
    _spec("input_lengths", I32, 1, optional=False), _spec("request_output_len", I32, 1, optional=False),
    _spec("num_return_sequences", I32, 1), _spec("draft_input_ids", I32, -1),
    _spec("decoder_input_ids", I32, -1), _spec("decoder_input_lengths", I32, 1),
    _spec("draft_logits", F32, -1, -1), _spec("draft_acceptance_threshold", F32, 1),
    _spec("end_id", I32, 1), _spec("pad_id", I32, 1),
    _spec("stop_words_list", I32, 2, -1), _spec("bad_words_list", I32, 2, -1),
    _spec("embedding_bias", F32, -1), _spec("beam_width", I32, 1), _spec("temperature", F32, 1),
    _spec("runtime_top_k", I32, 1), _spec("runtime_top_p", F32, 1), _spec("runtime_top_p_min", F32, 1),
    _spec("runtime_top_p_decay", F32, 1), _spec("runtime_top_p_reset_ids", I32, 1),
    _spec("len_penalty", F32, 1), _spec("early_stopping", B, 1), _spec("repetition_penalty", F32, 1),
    _spec("min_length", I32, 1), _spec("beam_search_diversity_rate", F32, 1),
    _spec("presence_penalty", F32, 1), _spec("frequency_penalty", F32, 1), _spec("random_seed", U64, 1),
    _spec("return_log_probs", B, 1), _spec("return_context_logits", B, 1),
    _spec("return_generation_logits", B, 1), _spec("return_perf_metrics", B, 1),
    _spec("exclude_input_in_output", B, 1), _spec("stop", B, 1), _spec("streaming", B, 1),
    _spec("prompt_embedding_table", F16, -1, -1), _spec("prompt_table_extra_ids", U64, -1),
    _spec("prompt_vocab_size", I32, 1), _spec("cross_attention_mask", B, -1, -1),
    _spec("mrope_rotary_cos_sin", F32, -1), _spec("mrope_position_deltas", I64, 1),
    _spec("lora_task_id", U64, 1), _spec("lora_weights", F16, -1, -1), _spec("lora_config", I32, -1, 3),
    _spec("context_phase_params", U8, -1), _spec("skip_cross_attn_blocks", B, 1),
    _spec("retention_token_range_starts", I32, -1), _spec("retention_token_range_ends", I32, -1),
    _spec("retention_token_range_priorities", I32, -1),
    _spec("retention_token_range_durations_ms", I32, -1),
    _spec("retention_decode_priority", I32, 1), _spec("retention_decode_duration_ms", I32, 1),
    _spec("guided_decoding_guide_type", np.bytes_, 1), _spec("guided_decoding_guide", np.bytes_, 1),
    _spec("lookahead_window_size", I32, 1), _spec("lookahead_ngram_size", I32, 1),
    _spec("lookahead_verification_set_size", I32, 1),
)
CACHE_SALT_SPEC = _spec(CACHE_SALT_INPUT, U64, 1)

# Outputs: never `optional` in config.pbtxt (Triton has no optional outputs); a response simply
# leaves out what the request did not ask for. The perf-metric outputs, present only when the
# request set return_perf_metrics (v0.19.0 renamed return_kv_cache_reuse_stats to it), each [1].
PERF_OUTPUTS: tuple[TensorSpec, ...] = (
    _out("kv_cache_alloc_new_blocks", I32, 1), _out("kv_cache_reused_blocks", I32, 1),
    _out("kv_cache_alloc_total_blocks", I32, 1), _out("arrival_time_ns", I64, 1),
    _out("first_scheduled_time_ns", I64, 1), _out("first_token_time_ns", I64, 1),
    _out("last_token_time_ns", I64, 1), _out("acceptance_rate", F32, 1),
    _out("total_accepted_draft_tokens", I32, 1), _out("total_draft_tokens", I32, 1),
)
OUTPUTS: tuple[TensorSpec, ...] = (
    _out("output_ids", I32, -1, -1), _out("sequence_length", I32, -1),
    _out("cum_log_probs", F32, -1), _out("output_log_probs", F32, -1, -1),
    _out("context_logits", F32, -1, -1), _out("generation_logits", F32, -1, -1, -1),
    _out("batch_index", I32, 1), _out("sequence_index", I32, 1), _out("context_phase_params", U8, -1),
    *PERF_OUTPUTS,
)

# Inputs this replica honours (their meaning is the pinned backend's).
HONOURED = frozenset({
    "input_ids", "input_lengths", "request_output_len", "end_id", "pad_id", "stop_words_list",
    "temperature", "runtime_top_p", "random_seed", "return_perf_metrics", "exclude_input_in_output",
    "stop", "streaming", CACHE_SALT_INPUT,
})
# Declared inputs this replica does not implement, accepted at the value that changes nothing
# (the backend's default); any other value, or any other declared input, is refused by name.
NEUTRAL: Mapping[str, tuple[float, ...]] = {
    "num_return_sequences": (1,), "beam_width": (1,), "runtime_top_k": (0,), "min_length": (0, 1),
    "repetition_penalty": (1.0,), "presence_penalty": (0.0,), "frequency_penalty": (0.0,),
    "len_penalty": (0.0,), "return_log_probs": (0,), "return_context_logits": (0,),
    "return_generation_logits": (0,),
}


@dataclass(frozen=True, slots=True)
class StrictRequest:
    """One parsed request of the strict interface."""

    generation: GenerationRequest
    streaming: bool                      # one response per step (needs decoupled mode, which we are)
    exclude_input: bool                  # output_ids without the prompt (non-streaming only: streamed
                                         #   responses never carry the prompt)
    perf_metrics: bool                   # return_perf_metrics: the PERF_OUTPUTS on every response


@dataclass(frozen=True, slots=True)
class PerfMetrics:
    """The per-request values behind PERF_OUTPUTS, as the executor's RequestPerfMetrics has them."""

    new_blocks: int                      # KV blocks allocated for this request (not reused)
    reused_blocks: int                   # prompt blocks served from the prefix cache
    total_blocks: int                    # new + reused
    arrival_ns: int                      # wall-clock ns when the replica received the request
    first_scheduled_ns: int              # when its first step ran (0 before)
    first_token_ns: int                  # when its first token left the engine (0 before)
    last_token_ns: int                   # when its latest token left the engine (0 before)


def scalar(data: Mapping[str, NDArray[Any]], name: str, default: Any) -> Any:
    if name not in data or data[name].size == 0:
        return default
    return data[name].reshape(-1)[0].item()


def is_stop(data: Mapping[str, NDArray[Any]]) -> bool:
    return bool(scalar(data, "stop", False))


def stop_words(tensor: NDArray[Any]) -> tuple[tuple[int, ...], ...]:
    """stop_words_list [batch, 2, n]: row 0 the words' ids back to back, row 1 each word's end offset
    into row 0 (increasing, at most n), padded with -1."""
    rows = tensor.reshape(-1, 2, tensor.shape[-1])[0] if tensor.size else np.zeros((2, 0), np.int32)
    flat, ends = rows[0].tolist(), [int(end) for end in rows[1].tolist() if end >= 0]
    if any(end > len(flat) for end in ends) or ends != sorted(ends):
        raise EngineRequestError(ERR_BAD_STOP_WORDS)
    starts = [0, *ends[:-1]]
    return tuple(tuple(int(t) for t in flat[start:end]) for start, end in zip(starts, ends, strict=True)
                 if end > start)


def _refuse_unimplemented(data: Mapping[str, NDArray[Any]]) -> None:
    for name, tensor in data.items():
        if name in HONOURED:
            continue
        neutral = NEUTRAL.get(name, ())
        value = tensor.reshape(-1)[0].item() if tensor.size == 1 else f"<{tensor.size} values>"
        if not (neutral and tensor.size == 1 and float(value) in neutral):
            raise EngineRequestError(ERR_NOT_IMPLEMENTED.format(
                name=name, value=value, neutral=" or ".join(str(v) for v in neutral) or "nothing"))


def prompt_and_cap(data: Mapping[str, NDArray[Any]]) -> tuple[tuple[int, ...], int]:
    """The prompt (input_ids cut to input_lengths) and request_output_len; raises EngineRequestError."""
    if "input_ids" not in data:
        raise EngineRequestError(ERR_NO_INPUT_IDS)
    ids = data["input_ids"].reshape(-1)
    if ids.size == 0:
        raise EngineRequestError(ERR_EMPTY_INPUT)
    length = int(scalar(data, "input_lengths", ids.size))
    if not 1 <= length <= ids.size:
        raise EngineRequestError(ERR_BAD_INPUT_LENGTHS.format(length, ids.size))
    cap = int(scalar(data, "request_output_len", 0))
    if cap < 1:
        raise EngineRequestError(ERR_BAD_OUTPUT_LEN.format(cap))
    return tuple(int(t) for t in ids[:length]), cap


def sampling(data: Mapping[str, NDArray[Any]]) -> tuple[float, float]:
    """(temperature, top_p): absent temperature 0 = greedy; runtime_top_p absent or 0 = no nucleus
    cut (1.0), as the backend drops a value <= 0."""
    temperature = float(scalar(data, "temperature", 0.0))
    top_p = float(scalar(data, "runtime_top_p", 0.0))
    if not math.isfinite(temperature) or temperature < 0:
        raise EngineRequestError(ERR_BAD_TEMPERATURE.format(temperature))
    if not math.isfinite(top_p) or top_p < 0 or top_p > 1:
        raise EngineRequestError(ERR_BAD_TOP_P.format(top_p))
    return temperature, top_p if top_p > 0 else 1.0


def parse(data: Mapping[str, NDArray[Any]], request_id: str,
          default_seed: Callable[[tuple[int, ...]], int]) -> StrictRequest:
    """A strict request (batch of one) as the engine's GenerationRequest; raises EngineRequestError.

    Defaults are the backend's: streaming off, exclude_input_in_output off (the model parameter
    the deploy config sets; a request value wins), end_id -1 (none), greedy, no stop words."""
    _refuse_unimplemented(data)
    prompt, cap = prompt_and_cap(data)
    temperature, top_p = sampling(data)
    end_id = int(scalar(data, "end_id", -1))
    seed = scalar(data, "random_seed", None)
    generation = GenerationRequest(
        request_id=request_id, prompt_ids=prompt, max_new_tokens=cap,
        end_id=end_id if end_id >= 0 else None,
        seed=default_seed(prompt) if seed is None else int(seed), temperature=temperature,
        top_p=top_p,
        stop_sequences=stop_words(data["stop_words_list"]) if "stop_words_list" in data else (),
        cache_salt=int(scalar(data, CACHE_SALT_INPUT, 0)))
    return StrictRequest(generation, streaming=bool(scalar(data, "streaming", False)),
                         exclude_input=bool(scalar(data, "exclude_input_in_output", False)),
                         perf_metrics=bool(scalar(data, "return_perf_metrics", False)))


def blocks_held(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size) if block_size > 0 else 0


def token_response(token_ids: tuple[int, ...], perf: PerfMetrics | None,
                   requested: frozenset[str] | None = None) -> dict[str, NDArray[Any]]:
    """One response: output_ids [1, beam 1, n], sequence_length [1, 1] = n, and the perf outputs
    ([1, 1] each) only when asked for. n may be 0 (the final response of a stopped request).
    `requested`: the outputs the request listed (None: all, as Triton reads an empty list); the
    rest are not built, as Triton would not send them."""
    response: dict[str, NDArray[Any]] = {
        "output_ids": np.asarray(token_ids, dtype=np.int32).reshape(1, 1, -1),
        "sequence_length": np.asarray([[len(token_ids)]], dtype=np.int32),
    }
    if perf is None:
        return response
    values: tuple[float, ...] = (perf.new_blocks, perf.reused_blocks, perf.total_blocks, perf.arrival_ns,
                                 perf.first_scheduled_ns, perf.first_token_ns, perf.last_token_ns,
                                 0.0, 0, 0)          # no speculative decoding: acceptance 0, drafts 0
    for spec, value in zip(PERF_OUTPUTS, values, strict=True):
        if requested is None or spec.name in requested:
            response[spec.name] = np.asarray([[value]], dtype=spec.dtype)
    return response
