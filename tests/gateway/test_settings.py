"""Gateway settings: from dask.config (YAML / env) with overrides on top; bad values name their key."""

from __future__ import annotations

import dask.config
import pytest

from llumdask.api.gateway.settings import GatewaySettings


def test_defaults():
    s = GatewaySettings()
    assert s.api_keys == () and s.max_in_flight >= 1 and s.max_body_bytes >= 1024


def test_from_dask_config_with_overrides():
    with dask.config.set({"llumdask-gateway": {"api-keys": ["a", "b"], "max-in-flight": 8}}):
        s = GatewaySettings.from_dask(max_in_flight=None, retry_after=2.5)
    assert s.api_keys == ("a", "b") and s.max_in_flight == 8 and s.retry_after == 2.5


def test_env_var_key_is_one_string(monkeypatch):
    monkeypatch.setenv("DASK_LLUMDASK_GATEWAY__API_KEYS", "s3cret")
    dask.config.refresh()
    try:
        assert GatewaySettings.from_dask().api_keys == ("s3cret",)
    finally:
        monkeypatch.delenv("DASK_LLUMDASK_GATEWAY__API_KEYS")
        dask.config.refresh()


@pytest.mark.parametrize("section, key", [
    ({"max-in-flight": 0}, "llumdask-gateway.max-in-flight"),
    ({"max-body-bytes": "big"}, "llumdask-gateway.max-body-bytes"),
    ({"retry-after": -1}, "llumdask-gateway.retry-after"),
    ({"api-keys": [""]}, "llumdask-gateway.api-keys"),
    ({"port": 80}, "llumdask-gateway.port"),
])
def test_bad_values_name_their_key(section, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        GatewaySettings.from_mapping(section)
