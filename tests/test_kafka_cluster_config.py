"""[kafka].brokers selects the single broker or the three-node cluster, and with it how the events
topic is replicated (infra/kafka_admin.py ensure-topic)."""

from __future__ import annotations

import pytest

from sluice.config import Settings, load_settings
from sluice.config.settings import ConfigError
from sluice.eventlog.kafka import KafkaEventLog, configured_bootstrap, replication


def test_the_single_broker_is_the_default_with_replication_one():
    kafka = load_settings(environ={}).kafka
    assert kafka.brokers == 1
    assert configured_bootstrap(kafka) == kafka.bootstrap
    assert replication(kafka) == (1, 1)


def test_three_brokers_select_the_cluster_with_replication_three_and_two_in_sync():
    cluster = "127.0.0.1:19111,127.0.0.1:19121,127.0.0.1:19131"
    config = Settings().updated(kafka={"brokers": 3, "bootstrap": "127.0.0.1:19092", "events_topic": "t",
                                       "cluster_bootstrap": cluster})
    assert configured_bootstrap(config.kafka) == "127.0.0.1:19111,127.0.0.1:19121,127.0.0.1:19131"
    assert replication(config.kafka) == (3, 2)
    assert KafkaEventLog.from_config(config).bootstrap == config.kafka.cluster_bootstrap


def test_the_cluster_is_selected_from_the_environment_as_infra_and_the_fault_suite_do():
    # SLUICE_KAFKA__BROKERS arrives as text: "3" selects the cluster, "2" is refused.
    kafka = load_settings(environ={"SLUICE_KAFKA__BROKERS": "3"}).kafka
    assert kafka.brokers == 3 and configured_bootstrap(kafka) == kafka.cluster_bootstrap
    with pytest.raises(ConfigError, match="kafka.brokers"):
        load_settings(environ={"SLUICE_KAFKA__BROKERS": "2"})
