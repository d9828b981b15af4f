"""Roofline cost model of one replica: a tensor-parallel group of `tp` GPUs.

Every step of an inflight-batching engine reads all the weights once and the KV
cache of every sequence it touches, and spends 2 × parameters FLOPs per token it
processes. Whichever of the two takes longer sets the step:

    memory  = (weights/tp + KV/tp of every sequence in the step) / (HBM B/s × achieved_bandwidth_fraction)
    compute = tokens × 2 × params / (tp × dense FLOP/s × achieved_flops_fraction)
    step    = max(memory, compute) / (1 − allreduce share at tp) + fixed_overhead_s

All-reduce. `allreduce_fraction` is the share of a step spent in the tensor-parallel
all-reduce on a full 8-GPU NVSwitch node (seed 003: "+ TP AllReduce (~20%)"). A ring
all-reduce moves 2(tp − 1)/tp of the activations per GPU, so the share at another
degree scales by that traffic: 0.2 at TP 8, 0.2 × 1.0/1.75 = 0.114 at TP 2, none at
TP 1. Prefill pays it like every step (`prefill_tokens_per_s` includes it).

Compute dtype. `compute_dtype = "auto"` (the default) follows the hardware: W8A8
matmuls in the weights' dtype when the GPU has tensor cores for it (FP8 weights on
Hopper run FP8 GEMMs at 1,979 TFLOP/s; int8 on A100 at 624), 16-bit otherwise (bf16
weights, int4 weight-only). A brief may still name one: seed 003 prices its FP8
prefill at 990 TFLOP/s, H100's bf16 peak, and says so.

Memory. The KV pool is HBM × memory_fraction − weights − activation reserve per GPU:
`memory_fraction` is the engine's share of HBM (vLLM gpu-memory-utilization, 0.90 by
default, what the planner's engine configuration emits), the reserve the activations
of the largest step. One rule for the planner, the simulator and the replica engine.

Host tier. Blocks evicted from the pool can be kept in host memory (engine.kv_cache.HostPool) and
copied back on a prefix hit instead of being recomputed. Each GPU copies its own shard over its
own link, in parallel, so bringing back `n` blocks takes

    onboard = n × block_size × KV bytes per token per GPU / (host link B/s × achieved_host_link_fraction)

and the host pool holds host memory per GPU × host_memory_fraction / KV bytes per token per GPU
tokens. 70B FP8 on H100 TP8: a 32-token block is 32 × 20 KiB = 640 KiB per GPU, 12.8 us at
51.2 GB/s; prefilling the same block takes ~0.71 ms of the node's compute (56x more).

Calibration (tests/test_engine_calibration.py prints each ratio). With these defaults,
and nothing else tuned, the engine core run as trtllm-bench's max-throughput scenario
reproduces TensorRT-LLM's published perf overview (FP8, H100 SXM) within ±10%:
    achieved_bandwidth_fraction 0.7   achieved_flops_fraction 0.5   allreduce 0.2 at TP 8
    memory_fraction 0.9   activation reserve 5 GB   compute dtype auto   no fixed overhead
Those are seed 003's efficiency figures; the two rules above (FP8 GEMMs where the
hardware has them, the all-reduce share by ring traffic) are what moved the
prefill-heavy rows from 0.43× to within 10%.

Seed 003's own arithmetic (70B, FP8 weights and KV, H100, TP8; its figures use the
whole 80 GB and bf16 matmuls, `CostFactors(memory_fraction=1.0, compute_dtype="bf16")`):
    weights per GPU        70.6 GB / 8                      = 8.8 GB
    KV per token per GPU   320 KiB / 8 / 2                  = 20 KiB
    sequences @ 4,000 ctx  (80 − 8.8 − 5) GB / (20 KiB × 4,000) ≈ 806 per node
    decode, batch 100      8.8 GB + 100 × 4,000 × 20 KiB     ≈ 16.8 GB per GPU per step
                           / 3.35 TB/s = 5.0 ms; / 0.7 / 0.8 ≈ 9 ms
    prefill                8 × 990e12 × 0.5 / (2 × 70e9)    = 28,286 tokens/s per node, before the
                                                              all-reduce share the seed leaves out
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sluice.engine.profiles import HardwareProfile, ModelProfile

BAD_TP = "tensor-parallel degree must be at least 1, got {tp}"
AUTO = "auto"
# Ring all-reduce traffic per GPU, 2(tp − 1)/tp, at the node size the all-reduce share is quoted for.
_REFERENCE_TP = 8


def allreduce_share(fraction_at_tp8: float, tp: int) -> float:
    """Share of a step in all-reduce at `tp`, from the share on a full 8-GPU node (see module doc)."""
    if tp <= 1:
        return 0.0
    traffic = 2.0 * (tp - 1) / tp
    reference = 2.0 * (_REFERENCE_TP - 1) / _REFERENCE_TP
    return min(0.95, fraction_at_tp8 * traffic / reference)


def resolve_compute_dtype(requested: str, model: ModelProfile, hardware: HardwareProfile) -> str:
    """The matmul dtype: `requested`, or under "auto" the weights' own dtype where the GPU has tensor
    cores for it (FP8 on Hopper, int8 on Ampere), else bf16."""
    if requested != AUTO:
        return requested
    return model.weight_precision if model.weight_precision in ("fp8", "int8") and \
        model.weight_precision in hardware.dense_flops_per_s else "bf16"


@dataclass(frozen=True, slots=True)
class CostFactors:
    """The knobs between datasheet peaks and what an engine achieves: seed 003's figures, which
    also reproduce TensorRT-LLM's published max-throughput rows (see the module docstring)."""

    achieved_bandwidth_fraction: float = 0.7   # of HBM bandwidth, on the memory-bound path (decode)
    achieved_flops_fraction: float = 0.5       # of dense FLOP/s, on the compute-bound path (prefill)
    allreduce_fraction: float = 0.2            # share of a step in all-reduce at TP 8 (ring-traffic scaled)
    fixed_overhead_s: float = 0.0              # per step: scheduling, sampling, launch (seed 003: ~3 ms)
    activation_reserve_bytes: float = 5e9      # per GPU, held back from the KV pool for activations
    memory_fraction: float = 0.9               # of HBM the engine may use (vLLM gpu-memory-utilization)
    compute_dtype: str = AUTO                  # matmul dtype; "auto" follows weights and GPU (module doc)
    host_memory_fraction: float = 0.5          # of host memory per GPU pinned for the KV host tier
    achieved_host_link_fraction: float = 0.8   # of the host link's peak a pinned block copy reaches


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
        self.compute_dtype = resolve_compute_dtype(factors.compute_dtype, model, hardware)
        self._replica_flops = tp * hardware.flops(self.compute_dtype) * factors.achieved_flops_fraction
        self._flops_per_token = model.flops_per_token()
        self.allreduce_share = allreduce_share(factors.allreduce_fraction, tp)
        self._stretch = 1.0 / (1.0 - self.allreduce_share)

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

    def host_kv_capacity_blocks(self, block_size: int) -> int:
        """Blocks of `block_size` tokens the host tier holds (module doc, "Host tier")."""
        host_bytes = self.hardware.host_memory_bytes * self.efficiency.host_memory_fraction
        return max(0, int(host_bytes // self._kv_bytes_per_token_per_gpu)) // block_size

    def onboard_time_s(self, num_blocks: int, block_size: int) -> float:
        """Copying `num_blocks` blocks back from the host tier (every GPU its shard, in parallel)."""
        if num_blocks <= 0:
            return 0.0
        link = self.hardware.host_link_bytes_per_s * self.efficiency.achieved_host_link_fraction
        return num_blocks * block_size * self._kv_bytes_per_token_per_gpu / link

    def host_block_cost(self) -> float:
        """Copying a block back from the host tier as a share of prefilling it (the router's price
        of a host-tier hit): KV bytes per token per GPU / host link ÷ (1 / prefill tokens per s)."""
        link = self.hardware.host_link_bytes_per_s * self.efficiency.achieved_host_link_fraction
        return self._kv_bytes_per_token_per_gpu * self.prefill_tokens_per_s() / link if link > 0 else 1.0

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
        """Compute-bound prefill rate of the replica, all-reduce included: what a step of prefill
        chunks achieves in `step_time_s` (seed 003's 28,286 leaves the all-reduce out)."""
        return self._replica_flops / self._flops_per_token / self._stretch

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
