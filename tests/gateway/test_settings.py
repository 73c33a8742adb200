"""Gateway and requester settings are sections of llumdask's configuration: from dask.config
(YAML / env) with overrides on top; bad values name their key; API keys never show in a repr."""

from __future__ import annotations

import dask.config
import pytest

from llumdask.config import ConfigError, load_config


def test_defaults():
    gateway, requester = load_config().gateway, load_config().requester
    assert gateway.api_keys == () and gateway.max_in_flight >= 1 and gateway.max_body_bytes >= 1024
    assert requester.placement_timeout > gateway.placement_timeout > 0


def test_from_dask_config_with_overrides():
    with dask.config.set({"llumdask.gateway.api-keys": ["a", "b"], "llumdask.gateway.max-in-flight": 8}):
        s = load_config({"gateway": {"retry-after": 2.5}}).gateway
    assert s.api_keys == ("a", "b") and s.max_in_flight == 8 and s.retry_after == 2.5


def test_env_var_key_is_one_string(monkeypatch):
    monkeypatch.setenv("DASK_LLUMDASK__GATEWAY__API_KEYS", "s3cret")
    dask.config.refresh()
    try:
        gateway = load_config().gateway
        assert gateway.api_keys == ("s3cret",)
        assert "s3cret" not in repr(gateway) and "s3cret" not in repr(load_config())
    finally:
        monkeypatch.delenv("DASK_LLUMDASK__GATEWAY__API_KEYS")
        dask.config.refresh()


@pytest.mark.parametrize("overrides, key", [
    ({"gateway": {"max-in-flight": 0}}, "llumdask.gateway.max-in-flight"),
    ({"gateway": {"max-body-bytes": "big"}}, "llumdask.gateway.max-body-bytes"),
    ({"gateway": {"retry-after": -1}}, "llumdask.gateway.retry-after"),
    ({"gateway": {"api-keys": [""]}}, "llumdask.gateway.api-keys"),
    ({"gateway": {"api-keys": "two words"}}, "llumdask.gateway.api-keys"),
    ({"gateway": {"port": 80}}, "llumdask.gateway.port"),
    ({"requester": {"rpc-timeout": 0}}, "llumdask.requester.rpc-timeout"),
    ({"requester": {"liveness_interval": -1.0}}, "llumdask.requester.liveness"),
    ({"requester": {"retries": 3}}, "llumdask.requester.retries"),
])
def test_bad_values_name_their_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(overrides)
