"""deploy/triton/: the shipped `tensorrt_llm` config serves the pinned interface the strict replica
serves, and carries the engine settings the planner emits for seed 003 (as do the README's steps)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest

from sluice.planner import Plan, load_brief, plan
from sluice.replica import contract

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "triton"
CONFIG = (DEPLOY / "model_repository" / "tensorrt_llm" / "config.pbtxt").read_text()
README = (DEPLOY / "README.md").read_text()
SEED003 = Path(__file__).resolve().parents[1] / "examples" / "briefs" / "seed003.yaml"
TRITON_TYPES = {np.int32: "TYPE_INT32", np.int64: "TYPE_INT64", np.uint64: "TYPE_UINT64",
                np.float32: "TYPE_FP32", np.float16: "TYPE_FP16", np.bool_: "TYPE_BOOL",
                np.uint8: "TYPE_UINT8", np.bytes_: "TYPE_STRING"}


def declared(section: str) -> list[tuple[str, str, tuple[int, ...], bool]]:
    body = re.search(rf"\n{section} \[\n(.*?)\n\]", CONFIG, re.S)
    assert body is not None, section
    rows = []
    for line in body.group(1).splitlines():
        name = re.search(r'name: "(\w+)"', line)
        kind = re.search(r"data_type: (\w+)", line)
        dims = re.search(r"dims: \[ ([^\]]*) \]", line)
        assert name and kind and dims, line
        rows.append((name.group(1), kind.group(1), tuple(int(d) for d in dims.group(1).split(",")),
                     "optional: true" in line))
    return rows


def expected(specs: tuple[contract.TensorSpec, ...]) -> list[tuple[str, str, tuple[int, ...], bool]]:
    return [(s.name, TRITON_TYPES[s.dtype], s.dims, s.optional) for s in specs]


def parameter(key: str) -> str:
    found = re.search(rf'key: "{key}" value: {{ string_value: "([^"]*)" }}', CONFIG)
    assert found is not None, key
    return found.group(1)


def build_flag(flag: str) -> int:
    found = re.search(rf"--{flag} (\d+)", README)
    assert found is not None, flag
    return int(found.group(1))


@pytest.fixture(scope="module")
def seed003() -> Plan:
    return plan(load_brief(SEED003))


def engine_setting(result: Plan, name: str) -> float:
    return next(s.value for s in result.engine_config if s.name == name)


def test_the_shipped_config_declares_exactly_the_tensors_the_strict_replica_serves():
    assert declared("input") == expected(contract.INPUTS)
    assert declared("output") == expected(contract.OUTPUTS)
    declared_lines = [line for line in CONFIG.splitlines() if not line.lstrip().startswith("#")]
    assert not [line for line in declared_lines if contract.CACHE_SALT_INPUT in line]


def test_its_batch_and_engine_flags_are_the_planners_for_seed_003(seed003: Plan):
    seqs = int(engine_setting(seed003, "max_num_seqs"))
    assert re.search(r"\nmax_batch_size: (\d+)", CONFIG).group(1) == str(seqs)   # type: ignore[union-attr]
    assert f"preferred_batch_size: [ {seqs} ]" in CONFIG
    assert build_flag("max_batch_size") == seqs
    assert build_flag("max_num_tokens") == engine_setting(seed003, "max_num_tokens")
    assert build_flag("max_seq_len") == engine_setting(seed003, "max_model_len")
    assert build_flag("tokens_per_block") == 32


def test_its_kv_pool_is_the_planners_from_first_principles(seed003: Plan):
    fraction = engine_setting(seed003, "memory_fraction")
    # Per GPU: 0.9 x 80 GB, less fp8 weights (70.6e9 B / TP 8) and the 5 GB activation reserve, over
    # 2 (K, V) x 80 layers x 8 KV heads x 128 dims x 1 B / 8 GPUs per token.
    tokens = math.floor((fraction * 80e9 - 70.6e9 / 8 - 5e9) / (2 * 80 * 8 * 128 / 8))
    assert int(parameter("max_tokens_in_paged_kv_cache")) == tokens == 2_840_576
    assert float(parameter("kv_cache_free_gpu_mem_fraction")) == fraction
    assert f"kv_capacity_blocks = {tokens // 32}" in README
    assert parameter("batch_scheduler_policy") == "guaranteed_no_evict"
    assert (parameter("enable_chunked_context"), parameter("enable_kv_cache_reuse")) == ("true", "true")
    assert (parameter("gpt_model_type"), parameter("exclude_input_in_output")) == (
        "inflight_fused_batching", "true")
