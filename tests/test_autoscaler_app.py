"""The autoscaler process's configuration: [autoscaler.pools.P] to the control law's ScalerConfig."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sluice.autoscaler.app import ERR_NO_POOL, loop_settings, pool_table, scaler_config
from sluice.autoscaler.control import BAD_HYSTERESIS
from sluice.config import load_settings
from sluice.config.bootstrap import EXIT_BAD_CONFIG
from sluice.config.settings import ConfigError


def test_a_pool_table_becomes_the_control_laws_config_with_the_ttft_objective_of_telemetry():
    config = load_settings(environ={}).updated(
        telemetry={"ttft_slo_ms": 400},
        autoscaler={"interval_s": 1.5, "pools": {"m-v1": {"max_replicas": 6, "warm_pool": 2,
                                                          "replica": {"engine": "simple"}}}})
    scaler = scaler_config(config, pool_table(config, "m-v1"))
    assert (scaler.max_replicas, scaler.warm_pool, scaler.min_replicas) == (6, 2, 1)
    assert scaler.ttft_slo_s == 0.4 and scaler.cold_start_s == 10.0
    assert loop_settings(config).interval_s == 1.5


def test_a_pool_without_a_table_or_with_crossed_thresholds_is_refused():
    config = load_settings(environ={})
    with pytest.raises(ConfigError) as missing:
        pool_table(config, "m-v1")
    assert str(missing.value) == ERR_NO_POOL.format(pool="m-v1", known="none")
    crossed = config.updated(autoscaler={"pools": {"m-v1": {"target_utilization": 0.5,
                                                            "scale_in_utilization": 0.6}}})
    with pytest.raises(ValueError) as bad:
        scaler_config(crossed, pool_table(crossed, "m-v1"))
    assert str(bad.value) == BAD_HYSTERESIS.format(low=0.6, high=0.5)
    with pytest.raises(ValueError, match="replica.engine"):   # checked like [replica]
        config.updated(autoscaler={"pools": {"m-v1": {"replica": {"engine": "warp"}}}})


def test_the_process_refuses_to_start_for_a_pool_it_has_no_table_for():
    for command in (["-m", "sluice.autoscaler", "--pool", "nope"],
                    ["-m", "sluice.services.main", "--role", "autoscaler", "--pool", "nope"]):
        done = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=60)
        assert done.returncode == EXIT_BAD_CONFIG
        assert ERR_NO_POOL.format(pool="nope", known="none") in done.stdout + done.stderr
