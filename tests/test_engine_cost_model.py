"""The cost model reproduces seed 003's hand arithmetic (70B FP8 on 8 × H100, TP8).

Seed 003 mixes units: it writes the KV per token as 20 KiB (20,480 B) but adds
100 × 4,000 × 20 KiB as "8.0 GB" (that is 20 KB). With KiB the read is 17.0 GB, so
the figures that depend on it are pinned within 2% and the comment says which.
Seed 003 also rounds the parameters to 70e9 and H100's bf16 peak to 990 TFLOP/s for
prefill; the preset keeps 70.6e9 and 989e12, so prefill is pinned within 1%.
Seed 003 sizes from the whole 80 GB with bf16 matmuls; its fixture says so
(`SEED_003`); the defaults (0.9 of HBM, matmuls that follow the hardware) have
their own tests below.
"""

from dataclasses import replace

import pytest

from sluice.engine.cost_model import BAD_TP, CostFactors, CostModel, allreduce_share
from sluice.engine.profiles import (
    UNKNOWN_HARDWARE,
    UNKNOWN_MODEL,
    get_hardware,
    get_model,
)

KIB = 1024
SEED_003 = CostFactors(memory_fraction=1.0, compute_dtype="bf16")   # the seed's own arithmetic


@pytest.fixture
def seed003() -> CostModel:
    return CostModel(get_model("llama-3-70b", weights="fp8", kv="fp8"), get_hardware("h100-sxm"), tp=8,
                     efficiency=SEED_003)


def test_70b_bf16_kv_is_320_kib_per_token() -> None:
    assert get_model("llama-3-70b").kv_bytes_per_token() == 320 * KIB


def test_70b_bf16_weights_are_141_gb() -> None:
    assert get_model("llama-3-70b").weight_bytes() == pytest.approx(141.2e9)


def test_weights_are_8_8_gb_per_gpu(seed003: CostModel) -> None:
    assert seed003.weight_bytes_per_gpu() == pytest.approx(8.8e9, rel=0.005)


def test_kv_is_20_kib_per_token_per_gpu(seed003: CostModel) -> None:
    assert seed003.kv_bytes_per_token_per_gpu() == 20 * KIB


def test_about_806_sequences_fit_per_node_at_4000_context(seed003: CostModel) -> None:
    # (80 − 8.825 − 5) GB / (20 KiB × 4,000) = 807.8 with unrounded weights; seed: 806.
    assert seed003.sequences_that_fit(4000) == pytest.approx(806, rel=0.005)


def test_batch_100_at_4000_reads_16_8_gb_per_gpu(seed003: CostModel) -> None:
    # 17.0 GB with KiB; seed 003 adds the KV as KB and gets 16.8 (see module docstring).
    assert seed003.decode_bytes_per_gpu(100, 4000) == pytest.approx(16.8e9, rel=0.02)


def test_batch_100_at_4000_is_5_ms_theoretical(seed003: CostModel) -> None:
    assert seed003.decode_step_theoretical_s(100, 4000) == pytest.approx(5.0e-3, rel=0.02)


def test_batch_100_at_4000_is_about_9_ms_with_allreduce_and_efficiency(seed003: CostModel) -> None:
    # 5.08 ms / 0.7 / (1 − 0.2) = 9.07 ms; seed: "~9.0 ms".
    assert seed003.decode_step_s(100, 4000) == pytest.approx(9.0e-3, rel=0.02)


def test_batch_160_is_about_11_5_ms(seed003: CostModel) -> None:
    assert seed003.decode_step_s(160, 4000) == pytest.approx(11.5e-3, rel=0.03)


def test_prefill_is_28286_tokens_per_second_per_node_before_the_allreduce(seed003: CostModel) -> None:
    # The seed's 28,286 leaves out the all-reduce that every TP8 step (prefill too) pays.
    assert seed003.prefill_tokens_per_s() == pytest.approx(28_286 * (1 - 0.2), rel=0.01)


def test_prefill_matches_seed_exactly_with_its_rounded_inputs() -> None:
    model = replace(get_model("llama-3-70b", weights="fp8"), num_params=70e9)
    rounded = CostModel(model, get_hardware("h100-sxm"), tp=8, efficiency=SEED_003)
    assert rounded.prefill_tokens_per_s() / 0.8 * 990 / 989 == pytest.approx(28_286, abs=1)


def test_fp8_weights_on_hopper_run_fp8_matmuls_by_default() -> None:
    h100 = get_hardware("h100-sxm")
    fp8 = CostModel(get_model("llama-3-70b", weights="fp8"), h100, tp=8)
    bf16 = CostModel(get_model("llama-3-70b"), h100, tp=8)
    assert (fp8.compute_dtype, bf16.compute_dtype) == ("fp8", "bf16")
    # 8 × 1,979 TFLOP/s × 0.5 ÷ (2 × 70.6e9) × (1 − 0.2 all-reduce)
    assert fp8.prefill_tokens_per_s() == pytest.approx(8 * 1979e12 * 0.5 / 141.2e9 * 0.8)
    assert fp8.prefill_tokens_per_s() / bf16.prefill_tokens_per_s() == pytest.approx(1979 / 989)


def test_int8_weights_on_an_a100_run_int8_matmuls_and_int4_runs_bf16() -> None:
    a100 = get_hardware("a100-80g")
    assert CostModel(get_model("llama-3-8b", weights="int8"), a100).compute_dtype == "int8"
    assert CostModel(get_model("llama-3-8b", weights="int4"), a100).compute_dtype == "bf16"


def test_the_allreduce_share_scales_with_ring_traffic_from_20_percent_at_tp8() -> None:
    # 2(tp − 1)/tp per GPU: 1.75 at TP 8, 1.0 at TP 2, 1.875 at TP 16.
    assert allreduce_share(0.2, 1) == 0.0
    assert allreduce_share(0.2, 8) == pytest.approx(0.2)
    assert allreduce_share(0.2, 2) == pytest.approx(0.2 / 1.75)
    assert allreduce_share(0.2, 16) == pytest.approx(0.2 * 1.875 / 1.75)


def test_the_engine_gets_90_percent_of_hbm_by_default() -> None:
    model = CostModel(get_model("llama-3-70b", weights="fp8", kv="fp8"), get_hardware("h100-sxm"), tp=8)
    assert model.kv_pool_bytes_per_gpu() == pytest.approx(0.9 * 80e9 - 70.6e9 / 8 - 5e9)


def test_seed000_bf16_decode_step_is_6_8_ms_theoretical() -> None:
    # 141 GB + 64 × 320 KB × 2,000 = 182 GB per node over 26.8 TB/s.
    model = CostModel(get_model("llama-3-70b"), get_hardware("h100-sxm"), tp=8, efficiency=SEED_003)
    assert model.decode_step_theoretical_s(64, 2000) == pytest.approx(6.8e-3, rel=0.02)


def test_a_mixed_step_takes_the_slower_of_memory_and_compute(seed003: CostModel) -> None:
    memory_bound = seed003.step_time_s(0, [4000] * 100)
    compute_bound = seed003.step_time_s(2048, [4000] * 100)
    assert compute_bound == pytest.approx(2148 / seed003.prefill_tokens_per_s())   # all-reduce included
    assert compute_bound > memory_bound


def test_fixed_overhead_is_added_once_per_step() -> None:
    base = CostModel(get_model("llama-3-8b"), get_hardware("h100-sxm"))
    slow = CostModel(get_model("llama-3-8b"), get_hardware("h100-sxm"),
                     efficiency=CostFactors(fixed_overhead_s=0.003))
    assert slow.decode_step_s(8, 1000) - base.decode_step_s(8, 1000) == pytest.approx(0.003)


def test_a_single_gpu_pays_no_allreduce() -> None:
    model = CostModel(get_model("llama-3-8b"), get_hardware("h100-sxm"), tp=1)
    expected = model.decode_bytes_per_gpu(1, 1000) / (3.35e12 * 0.7)
    assert model.decode_step_s(1, 1000) == pytest.approx(expected)


def test_an_empty_step_takes_no_time(seed003: CostModel) -> None:
    assert seed003.step_time_s(0, []) == 0.0


def test_kv_heads_are_replicated_beyond_tp_equal_to_kv_heads() -> None:
    model = get_model("llama-3.1-405b", weights="fp8")
    tp8 = CostModel(model, get_hardware("h200"), tp=8)
    tp16 = CostModel(model, get_hardware("h200"), tp=16)
    assert tp16.kv_bytes_per_token_per_gpu() == tp8.kv_bytes_per_token_per_gpu()


def test_405b_fp8_on_tp8_h100_leaves_about_25_gb_for_kv() -> None:
    # Seed 003 variation F: "50.6 GB/GPU — fits, but only 25 GB for KV".
    model = CostModel(get_model("llama-3.1-405b", weights="fp8"), get_hardware("h100-sxm"), tp=8,
                      efficiency=SEED_003)
    assert model.kv_pool_bytes_per_gpu() == pytest.approx(24.3e9, rel=0.02)


def test_70b_bf16_does_not_fit_one_h100() -> None:
    model = CostModel(get_model("llama-3-70b"), get_hardware("h100-sxm"), tp=1)
    assert not model.fits()
    assert model.kv_capacity_tokens_per_gpu() == 0


def test_int4_weights_keep_a_bf16_kv_cache() -> None:
    model = get_model("llama-3-8b", weights="int4")
    assert (model.bytes_per_weight, model.bytes_per_kv_element) == (0.5, 2.0)


def test_a100_has_no_fp8() -> None:
    with pytest.raises(ValueError, match="a100-80g has no 'fp8'"):
        CostModel(get_model("llama-3-8b"), get_hardware("a100-80g"),
                  efficiency=CostFactors(compute_dtype="fp8"))


def test_unknown_presets_name_the_known_ones() -> None:
    with pytest.raises(ValueError) as model_error:
        get_model("gpt-5")
    assert str(model_error.value) == UNKNOWN_MODEL.format(
        name="gpt-5", known="llama-3-8b, llama-3-70b, llama-3.1-405b")
    with pytest.raises(ValueError) as hardware_error:
        get_hardware("b200")
    assert str(hardware_error.value) == UNKNOWN_HARDWARE.format(name="b200",
                                                                known="h100-sxm, h200, a100-80g, gh200")


def test_tensor_parallel_degree_must_be_positive() -> None:
    with pytest.raises(ValueError, match=BAD_TP.format(tp=0)):
        CostModel(get_model("llama-3-8b"), get_hardware("h100-sxm"), tp=0)
