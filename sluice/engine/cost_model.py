"""Roofline cost model of one replica: a tensor-parallel group of `tp` GPUs.

Every step of an inflight-batching engine reads all the weights once and the KV
cache of every sequence it touches, and spends 2 × parameters FLOPs per token it
processes. Whichever of the two takes longer sets the step:

    memory  = (weights/tp + KV/tp of every sequence in the step) / (HBM B/s × achieved_bandwidth_fraction)
    compute = tokens × 2 × params / (tp × dense FLOP/s × achieved_flops_fraction)
    step    = max(memory, compute) / (1 − allreduce_fraction) + fixed_overhead_s

`allreduce_fraction` is the share of a step spent in the tensor-parallel
all-reduce (seed 003: "+ TP AllReduce (~20%)"), so dividing by (1 − share)
stretches the step to include it. At tp = 1 there is no all-reduce and the share
is ignored. The KV cache is split across GPUs by KV head; when tp exceeds the
number of KV heads, heads are replicated (as TensorRT-LLM does), so the per-GPU
share stops shrinking at tp = num_kv_heads.

Compute dtype. Seed 003 prices FP8 prefill at 990 TFLOP/s per H100, which is
the *bf16* dense peak: FP8 storage with 16-bit matmuls (W8A16-style). The
default `compute_dtype = "bf16"` reproduces that; set "fp8" for W8A8 kernels
(1,979 TFLOP/s on H100) and "int8" for A100's fast path.

Seed 003's own arithmetic, which the tests pin (70B, FP8 weights and KV, H100, TP8):
    weights per GPU        70.6 GB / 8                      = 8.8 GB
    KV per token per GPU   320 KiB / 8 / 2                  = 20 KiB
    sequences @ 4,000 ctx  (80 − 8.8 − 5) GB / (20 KiB × 4,000) ≈ 806 per node
    decode, batch 100      8.8 GB + 100 × 4,000 × 20 KiB     ≈ 16.8 GB per GPU per step
                           / 3.35 TB/s = 5.0 ms; / 0.7 / 0.8 ≈ 9 ms
    prefill                8 × 990e12 × 0.5 / (2 × 70e9)    = 28,286 tokens/s per node
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sluice.engine.profiles import HardwareProfile, ModelProfile

BAD_TP = "tensor-parallel degree must be at least 1, got {tp}"


@dataclass(frozen=True, slots=True)
class CostFactors:
    """The knobs between datasheet peaks and what an engine achieves. Defaults are seed 003's."""

    achieved_bandwidth_fraction: float = 0.7   # of HBM bandwidth, on the memory-bound path (decode)
    achieved_flops_fraction: float = 0.5       # of dense FLOP/s, on the compute-bound path (prefill)
    allreduce_fraction: float = 0.2            # share of a TP step spent in all-reduce (tp > 1 only)
    fixed_overhead_s: float = 0.0              # per step: scheduling, sampling, launch (seed 003: ~3 ms)
    activation_reserve_bytes: float = 5e9      # per GPU, held back from the KV pool for activations
    memory_fraction: float = 1.0               # of HBM the engine may use (vLLM gpu-memory-utilization)
    compute_dtype: str = "bf16"                # matmul dtype; see the module docstring on FP8


class CostModel:
    """Step times and KV capacity of one replica of `model` on `tp` GPUs of `hardware`."""

    def __init__(self, model: ModelProfile, hardware: HardwareProfile, tp: int = 1,
                 efficiency: CostFactors | None = None) -> None:
        if tp < 1:
            raise ValueError(BAD_TP.format(tp=tp))
        self.model = model
        self.hardware = hardware
        self.tp = tp
        self.efficiency = efficiency if efficiency is not None else CostFactors()
        factors = self.efficiency
        # Hoisted constants: the simulator calls step_time_totals_s millions of times.
        self._weight_bytes_per_gpu = model.weight_bytes() / tp
        self._kv_shards = min(tp, model.num_kv_heads)
        self._kv_bytes_per_token_per_gpu = model.kv_bytes_per_token() / self._kv_shards
        self._bytes_per_s = hardware.hbm_bandwidth_bytes_per_s * factors.achieved_bandwidth_fraction
        self._replica_flops = tp * hardware.flops(factors.compute_dtype) * factors.achieved_flops_fraction
        self._flops_per_token = model.flops_per_token()
        self._stretch = 1.0 / (1.0 - factors.allreduce_fraction) if tp > 1 else 1.0

    # --- memory -----------------------------------------------------------------------------

    def weight_bytes_per_gpu(self) -> float:
        return self._weight_bytes_per_gpu

    def kv_shards(self) -> int:
        """Ways each token's KV is split: by KV head over the GPUs, replicated past num_kv_heads."""
        return self._kv_shards

    def kv_bytes_per_token_per_gpu(self) -> float:
        return self._kv_bytes_per_token_per_gpu

    def kv_pool_bytes_per_gpu(self) -> float:
        """HBM left for the KV pool on each GPU; negative when the weights do not fit."""
        factors = self.efficiency
        return (self.hardware.hbm_bytes * factors.memory_fraction
                - self._weight_bytes_per_gpu - factors.activation_reserve_bytes)

    def fits(self) -> bool:
        """Whether the weights and the activation reserve leave any room for KV."""
        return self.kv_pool_bytes_per_gpu() > 0

    def kv_capacity_tokens_per_gpu(self) -> int:
        """Tokens of KV the pool holds. Each GPU holds 1/tp of every token, so this is also
        the replica's capacity in tokens."""
        return max(0, int(self.kv_pool_bytes_per_gpu() // self._kv_bytes_per_token_per_gpu))

    def kv_capacity_blocks(self, block_size: int) -> int:
        return self.kv_capacity_tokens_per_gpu() // block_size

    def sequences_that_fit(self, context_tokens: int) -> int:
        """Sequences of `context_tokens` each whose KV fits the replica's pool at once."""
        return self.kv_capacity_tokens_per_gpu() // context_tokens

    # --- decode -----------------------------------------------------------------------------

    def decode_bytes_per_gpu(self, batch: int, context_tokens: int) -> float:
        """Bytes each GPU reads in one decode step: all its weights plus its share of every KV."""
        return self._weight_bytes_per_gpu + batch * context_tokens * self._kv_bytes_per_token_per_gpu

    def decode_step_theoretical_s(self, batch: int, context_tokens: int) -> float:
        """Pure roofline at 100% of HBM bandwidth, no all-reduce, no overhead."""
        return self.decode_bytes_per_gpu(batch, context_tokens) / self.hardware.hbm_bandwidth_bytes_per_s

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """A decode-only step of `batch` sequences at `context_tokens` each, as the engine prices it."""
        return self.step_time_totals_s(0, batch, batch * context_tokens)

    # --- prefill ----------------------------------------------------------------------------

    def replica_flops_per_s(self) -> float:
        """Achieved dense FLOP/s of the replica: tp × the compute dtype's peak × achieved fraction."""
        return self._replica_flops

    def prefill_tokens_per_s(self) -> float:
        """Compute-bound prefill rate of the replica (seed 003's figure: no all-reduce share).
        Inside `step_time_s` prefill is stretched by the all-reduce like everything else."""
        return self._replica_flops / self._flops_per_token

    # --- the general step -------------------------------------------------------------------

    def step_time_s(self, num_prefill_tokens: int, decode_contexts: Sequence[int],
                    prefill_kv_tokens: int = 0) -> float:
        """One mixed step: `num_prefill_tokens` context tokens (all chunks together) plus one
        decode token for each sequence whose context length is listed in `decode_contexts`.
        `prefill_kv_tokens` is the KV the chunks read and write (their earlier context plus
        the chunk itself); zero treats prefill as pure compute."""
        return self.step_time_totals_s(num_prefill_tokens, len(decode_contexts), sum(decode_contexts),
                                       prefill_kv_tokens)

    def step_time_totals_s(self, num_prefill_tokens: int, num_decode: int, decode_context_tokens: int,
                           prefill_kv_tokens: int = 0) -> float:
        """`step_time_s` from totals, for callers that keep running sums (the simulator)."""
        tokens = num_prefill_tokens + num_decode
        if tokens == 0:
            return 0.0
        kv_tokens = decode_context_tokens + prefill_kv_tokens
        memory_bytes = self._weight_bytes_per_gpu + kv_tokens * self._kv_bytes_per_token_per_gpu
        memory_s = memory_bytes / self._bytes_per_s
        compute_s = tokens * self._flops_per_token / self._replica_flops
        return max(memory_s, compute_s) * self._stretch + self.efficiency.fixed_overhead_s
