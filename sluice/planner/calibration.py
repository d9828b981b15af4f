"""Calibration of the engine cost model against TensorRT-LLM's published perf overview.

TensorRT-LLM's perf overview (docs/source/performance/perf-overview.md, v1.0: "Throughput
Measurements") reports `Total Output Throughput (tokens/sec)` of `trtllm-bench throughput`:
a synthetic dataset of identical requests (fixed ISL/OSL, stdev 0), all queued at once,
ModelOpt FP8 checkpoints, the PyTorch backend at default settings. `max_throughput` runs
the same scenario on the engine core (the replica's scheduler and KV pool, priced by the
cost model) on its virtual clock: every request queued at t = 0, no prefix reuse (the
prompts are random tokens), and reports output tokens ÷ modelled time.

The engine settings are TensorRT-LLM's max-throughput ones: max_batch_size 2,048 (the
largest CUDA-graph batch in the overview's llm_options.yml short of 4,096), max_num_tokens
8,192, chunked context, 32-token blocks; the KV pool is the cost model's (its default
memory fraction 0.9, TensorRT-LLM's default free-memory fraction).

`FITTED` are the six rows the cost model's defaults were checked against (issue 13);
`OUT_OF_SAMPLE` are other published rows (other GPUs, models, lengths), reported, never
fitted to.
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.engine.core import EngineCore
from sluice.engine.cost_model import CostFactors, CostModel
from sluice.engine.profiles import get_hardware, get_model
from sluice.engine.types import EngineConfig, EngineRequest

MAX_BATCH_SIZE = 2048
MAX_NUM_TOKENS = 8192
BLOCK_SIZE = 32
TOLERANCE = 0.10


@dataclass(frozen=True, slots=True)
class PublishedRow:
    model: str          # preset name
    hardware: str       # preset name
    tp: int
    isl: int            # input tokens per request
    osl: int            # output tokens per request
    requests: int       # the overview's $num_requests for this ISL/OSL
    tok_per_s: float    # published Total Output Throughput


@dataclass(frozen=True, slots=True)
class Predicted:
    row: PublishedRow
    tok_per_s: float

    @property
    def ratio(self) -> float:
        return self.tok_per_s / self.row.tok_per_s


_70B, _8B, _405B = "llama-3-70b", "llama-3-8b", "llama-3.1-405b"
_H100, _H200 = "h100-sxm", "h200"

FITTED: tuple[PublishedRow, ...] = (
    PublishedRow(_70B, _H100, 2, 128, 2048, 3000, 6651),
    PublishedRow(_70B, _H100, 2, 1000, 1000, 3000, 4205),
    PublishedRow(_70B, _H100, 2, 2048, 128, 3000, 762),
    PublishedRow(_8B, _H100, 1, 128, 2048, 3000, 22714),
    PublishedRow(_8B, _H100, 1, 1000, 1000, 3000, 15220),
    PublishedRow(_8B, _H100, 1, 2048, 128, 3000, 3450),
)

OUT_OF_SAMPLE: tuple[PublishedRow, ...] = (
    # Same GPU, other lengths.
    PublishedRow(_70B, _H100, 2, 500, 2000, 3000, 5222),
    PublishedRow(_70B, _H100, 2, 2048, 2048, 1500, 3082),
    PublishedRow(_70B, _H100, 2, 5000, 500, 1500, 898),
    PublishedRow(_8B, _H100, 1, 500, 2000, 3000, 17660),
    PublishedRow(_8B, _H100, 1, 2048, 2048, 1500, 9305),
    PublishedRow(_8B, _H100, 1, 5000, 500, 1500, 3459),
    # Another GPU (H200: 141 GB, 4.8 TB/s).
    PublishedRow(_8B, _H200, 1, 128, 2048, 3000, 26221),
    PublishedRow(_8B, _H200, 1, 1000, 1000, 3000, 17744),
    PublishedRow(_8B, _H200, 1, 2048, 128, 3000, 3538),
    PublishedRow(_70B, _H200, 1, 128, 2048, 3000, 4336),
    PublishedRow(_70B, _H200, 1, 1000, 1000, 3000, 2909),
    PublishedRow(_70B, _H200, 1, 2048, 128, 3000, 442),
    # Another model (405B at TP 8).
    PublishedRow(_405B, _H100, 8, 128, 2048, 3000, 4340),
    PublishedRow(_405B, _H100, 8, 1000, 1000, 3000, 2919),
    PublishedRow(_405B, _H100, 8, 2048, 128, 3000, 453),
    PublishedRow(_405B, _H200, 8, 1000, 1000, 3000, 3330),
)


def max_throughput(cost: CostModel, isl: int, osl: int, requests: int) -> float:
    """Output tokens per modelled second when `requests` identical requests are queued at once."""
    config = EngineConfig(block_size=BLOCK_SIZE, max_num_seqs=MAX_BATCH_SIZE, max_num_tokens=MAX_NUM_TOKENS,
                          enable_prefix_reuse=False, stream_tokens=False)
    engine = EngineCore(config, cost)
    for i in range(requests):
        # Distinct prompts: no two share a block, as trtllm-bench's random tokens do not.
        prompt = tuple(range(i * isl, (i + 1) * isl))
        engine.add_request(EngineRequest(request_id=f"r{i}", prompt_token_ids=prompt, max_output_tokens=osl))
    while engine.has_work():
        steps = engine.decode_run_limit()
        if steps:
            engine.run_decode(steps)
        else:
            engine.step()
    return requests * osl / engine.stats().busy_s


def predict(row: PublishedRow, factors: CostFactors | None = None, requests: int | None = None) -> Predicted:
    """The engine core's output tok/s for a published row, FP8 weights and KV as the overview ran."""
    model = get_model(row.model, weights="fp8", kv="fp8")
    cost = CostModel(model, get_hardware(row.hardware), row.tp, factors)
    return Predicted(row, max_throughput(cost, row.isl, row.osl, requests or row.requests))


def table(rows: tuple[PublishedRow, ...]) -> list[str]:
    lines = [f"{'model':15} {'GPU':8} {'TP':>3} {'ISL/OSL':>10} {'published':>10} {'predicted':>10} "
             f"{'ratio':>6}"]
    for row in rows:
        got = predict(row)
        lines.append(f"{row.model:15} {row.hardware:8} {row.tp:>3} {f'{row.isl}/{row.osl}':>10} "
                     f"{row.tok_per_s:>10,.0f} {got.tok_per_s:>10,.0f} {got.ratio:>6.2f}")
    return lines


if __name__ == "__main__":   # python -m sluice.planner.calibration: both tables (~1 min of CPU)
    print("fitted (TensorRT-LLM perf overview, FP8, max throughput):")
    print("\n".join(table(FITTED)))
    print("\nout of sample (reported, not fitted):")
    print("\n".join(table(OUT_OF_SAMPLE)))
