"""Model and hardware profiles: the named inputs of the roofline cost model.

A profile is a handful of published numbers, nothing measured: the model's
shape (what the weights and the KV cache weigh) and the GPU's HBM size,
bandwidth and dense FLOP/s per dtype. Presets cover the models and GPUs of the
seeds (000, 003); anything else is a `ModelProfile(...)` / `HardwareProfile(...)`
away.

Precision is two independent choices, as in TensorRT-LLM and vLLM: the weight
dtype (`--quantization fp8`) and the KV-cache dtype (`--kv-cache-dtype fp8`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

# Bytes per element of each storage precision. int4 packs two weights a byte.
PRECISION_BYTES: Mapping[str, float] = MappingProxyType(
    {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}
)

# Storage precisions a GPU only runs with tensor cores of that dtype.
_NEEDS_TENSOR_CORES = ("fp8",)

UNKNOWN_PRECISION = "unknown precision {name!r}; known: {known}"
UNKNOWN_MODEL = "unknown model preset {name!r}; known: {known}"
UNKNOWN_HARDWARE = "unknown hardware preset {name!r}; known: {known}"


def precision_bytes(name: str) -> float:
    """Bytes per element of a precision name, or ValueError naming the known ones."""
    try:
        return PRECISION_BYTES[name]
    except KeyError:
        raise ValueError(UNKNOWN_PRECISION.format(name=name, known=", ".join(PRECISION_BYTES))) from None


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """A dense decoder-only transformer, as far as serving cost cares."""

    name: str
    num_params: float            # total parameters (weights read once per step)
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int            # GQA: KV heads shared by groups of query heads
    head_dim: int
    bytes_per_weight: float      # 2 for bf16, 1 for fp8/int8, 0.5 for int4
    bytes_per_kv_element: float  # KV-cache dtype, chosen independently of the weights
    weight_precision: str = "bf16"
    kv_precision: str = "bf16"

    def weight_bytes(self) -> float:
        """Bytes of all weights: 70.6e9 params × 1 B (fp8) = 70.6 GB."""
        return self.num_params * self.bytes_per_weight

    def kv_bytes_per_token(self) -> float:
        """K and V for every layer and KV head: 2 × 80 × 8 × 128 × 2 B = 320 KiB for 70B in bf16."""
        return 2.0 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_kv_element

    def flops_per_token(self) -> float:
        """Forward-pass FLOPs per token, the usual 2 × parameters (attention's share ignored)."""
        return 2.0 * self.num_params

    def with_precision(self, weights: str, kv: str) -> ModelProfile:
        """The same model stored at other precisions, e.g. `with_precision("fp8", "fp8")`."""
        return replace(
            self,
            bytes_per_weight=precision_bytes(weights),
            bytes_per_kv_element=precision_bytes(kv),
            weight_precision=weights,
            kv_precision=kv,
        )


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    """One GPU. FLOP/s are dense (no 2:4 sparsity) tensor-core peaks per dtype."""

    name: str
    hbm_bytes: float
    hbm_bandwidth_bytes_per_s: float
    dense_flops_per_s: Mapping[str, float]   # keyed by compute dtype: "bf16", "fp8", "int8"
    # Share of a tensor-parallel step spent in all-reduce over NVLink/NVSwitch; the
    # cost model's default (CostFactors.allreduce_fraction) is taken from here.
    nvlink_allreduce_overhead_fraction: float = 0.2
    # The host-memory KV tier (engine.kv_cache.HostPool). Host memory per GPU (a node's system
    # memory over its GPUs) and the GPU's link to it, per direction: PCIe Gen5 x16 on HGX parts
    # (64 GB/s), NVLink-C2C on Grace Hopper (900 GB/s both ways, 450 each). 0 bytes: no host tier.
    host_memory_bytes: float = 0.0
    host_link_bytes_per_s: float = 64e9

    def supports_precision(self, precision: str) -> bool:
        """Whether the GPU can store and run a precision: FP8 needs FP8 tensor cores (Hopper and
        later); 16-bit, int8 and int4 (weight-only) run everywhere."""
        return precision not in _NEEDS_TENSOR_CORES or precision in self.dense_flops_per_s

    def flops(self, dtype: str) -> float:
        try:
            return self.dense_flops_per_s[dtype]
        except KeyError:
            known = ", ".join(self.dense_flops_per_s)
            raise ValueError(f"{self.name} has no {dtype!r} tensor cores; it has: {known}") from None


def _llama(name: str, params: float, layers: int, hidden: int, heads: int, kv_heads: int) -> ModelProfile:
    return ModelProfile(
        name=name, num_params=params, num_layers=layers, hidden_size=hidden,
        num_attention_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads,
        bytes_per_weight=2.0, bytes_per_kv_element=2.0,
    )


# Shapes from the models' config.json; parameter counts as the seeds quote them.
MODEL_PRESETS: Mapping[str, ModelProfile] = MappingProxyType({
    "llama-3-8b": _llama("llama-3-8b", 8.03e9, 32, 4096, 32, 8),
    "llama-3-70b": _llama("llama-3-70b", 70.6e9, 80, 8192, 64, 8),
    "llama-3.1-405b": _llama("llama-3.1-405b", 405.9e9, 126, 16384, 128, 8),
})

# Datasheet figures (SXM parts), dense. A100 has no FP8 tensor cores; int8 is its fast path.
# Host memory: a DGX H100/H200 node has 2 TB for 8 GPUs (256 GB each) over PCIe Gen5 x16; a DGX
# A100 1 TB (128 GB each) over PCIe Gen4 x16 (32 GB/s); a GH200 superchip 480 GB of LPDDR5X behind
# NVLink-C2C (450 GB/s each way), 7x PCIe Gen5, which is what makes its host tier cheap to hit.
HARDWARE_PRESETS: Mapping[str, HardwareProfile] = MappingProxyType({
    "h100-sxm": HardwareProfile(
        name="h100-sxm", hbm_bytes=80e9, hbm_bandwidth_bytes_per_s=3.35e12,
        dense_flops_per_s=MappingProxyType({"bf16": 989e12, "fp8": 1979e12, "int8": 1979e12}),
        host_memory_bytes=256e9, host_link_bytes_per_s=64e9,
    ),
    "h200": HardwareProfile(
        name="h200", hbm_bytes=141e9, hbm_bandwidth_bytes_per_s=4.8e12,
        dense_flops_per_s=MappingProxyType({"bf16": 989e12, "fp8": 1979e12, "int8": 1979e12}),
        host_memory_bytes=256e9, host_link_bytes_per_s=64e9,
    ),
    "a100-80g": HardwareProfile(
        name="a100-80g", hbm_bytes=80e9, hbm_bandwidth_bytes_per_s=2.039e12,
        dense_flops_per_s=MappingProxyType({"bf16": 312e12, "int8": 624e12}),
        host_memory_bytes=128e9, host_link_bytes_per_s=32e9,
    ),
    "gh200": HardwareProfile(
        name="gh200", hbm_bytes=96e9, hbm_bandwidth_bytes_per_s=4.0e12,
        dense_flops_per_s=MappingProxyType({"bf16": 989e12, "fp8": 1979e12, "int8": 1979e12}),
        host_memory_bytes=480e9, host_link_bytes_per_s=450e9,
    ),
})


def get_model(name: str, weights: str = "bf16", kv: str | None = None) -> ModelProfile:
    """A model preset at the given weight precision.

    The KV cache follows the weights unless given, except under int4 weights
    (AWQ/GPTQ), whose KV cache stays bf16 as those recipes ship it.
    """
    try:
        base = MODEL_PRESETS[name]
    except KeyError:
        raise ValueError(UNKNOWN_MODEL.format(name=name, known=", ".join(MODEL_PRESETS))) from None
    if kv is None:
        kv = "bf16" if weights == "int4" else weights
    return base.with_precision(weights, kv)


def get_hardware(name: str) -> HardwareProfile:
    try:
        return HARDWARE_PRESETS[name]
    except KeyError:
        raise ValueError(UNKNOWN_HARDWARE.format(name=name, known=", ".join(HARDWARE_PRESETS))) from None
