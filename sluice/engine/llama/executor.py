"""`ModelExecutor`: the real SmolLM2-135M-Instruct behind the engine core (engine.executor).

It turns the scheduler's batch into forward inputs (which tokens, at which
positions, in which blocks), runs one forward over all of them and samples one
id per sampling sequence. Its step duration is the measured compute time: the
host does not sleep on top of it.

Why numpy. Measured on this 2-core box (load averages 2–12 from other work):
the `gguf` package alone computes nothing (dequantizing every step would cost
its 2.5 s per token), and llama-cpp-python has no wheel here: it builds
llama.cpp from source (minutes of both cores, a compiler and cmake at setup).
Dequantizing once to float32 and multiplying with numpy's OpenBLAS costs only
numpy, already a dependency; a batch-1 step reads ~250 MB of weights, so it is
memory-bound at tens of ms, and batching shares that read among the batch.
"""

from __future__ import annotations

import time

from sluice.engine.executor import StepExecution
from sluice.engine.llama.blas import limit_threads
from sluice.engine.llama.forward import LlamaModel, SeqInput
from sluice.engine.llama.sampler import sample
from sluice.engine.llama.weights import LlamaWeights, load_weights
from sluice.engine.scheduler import ScheduledBatch

DEFAULT_KV_TOKENS = 8192     # the pool when num_blocks is unset: the model's context, ~375 MB float32
# One BLAS thread per replica: on the 2-core dev box (other processes busy) OpenBLAS's second
# thread spins more than it works: bench.bench_model measured 135 ms CPU per token at batch 1
# with 2 threads against 73 ms with 1 (23 vs 28 ms at batch 16), and faster wall time too.
BLAS_THREADS = 1


class ModelExecutor:
    def __init__(self, weights: LlamaWeights, kv_tokens: int = DEFAULT_KV_TOKENS) -> None:
        self.model = LlamaModel(weights)
        self.kv_tokens = kv_tokens

    @classmethod
    def load(cls, model_path: str = "", cache_dir: str = "",
             blas_threads: int = BLAS_THREADS) -> ModelExecutor:
        """The executor a replica runs: weights from `model_path` (cached under `cache_dir`), BLAS
        limited to `blas_threads` for the whole process."""
        limit_threads(blas_threads)
        return cls(load_weights(model_path, cache_dir))

    @property
    def real_time(self) -> bool:
        return True

    @property
    def load_s(self) -> float:
        return self.model.weights.load_s

    def kv_capacity_blocks(self, block_size: int) -> int:
        return self.kv_tokens // block_size

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        self.model.allocate_kv(num_blocks, block_size)

    def execute(self, batch: ScheduledBatch) -> StepExecution:
        started = time.perf_counter()
        inputs = [SeqInput(seq.token_ids(seq.num_computed, seq.num_computed + 1), seq.num_computed,
                           seq.block_ids, True) for seq in batch.decodes]
        inputs.extend(SeqInput(seq.token_ids(seq.num_computed, seq.num_computed + chunk), seq.num_computed,
                               seq.block_ids, seq.num_computed + chunk == seq.context_len)
                      for seq, chunk in batch.chunks)
        if not inputs:
            return StepExecution(0.0, ())
        logits = self.model.forward(inputs)
        sampled = tuple(sample(row, seq.request.temperature, seq.request.top_p, seq.request.seed,
                               seq.num_sampled)
                        for row, seq in zip(logits, batch.samplers(), strict=True))
        return StepExecution(time.perf_counter() - started, sampled)
