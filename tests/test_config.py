"""The YAML defaults, their schema and the typed view agree, and every override path works."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from pathlib import Path

import dask.config
import jsonschema
import pytest
import yaml

import llumdask
from llumdask.config import (
    ConfigError,
    DispatchConfig,
    LlumdaskConfig,
    MigrationConfig,
    ScalingConfig,
    SimEngineConfig,
    VllmEngineConfig,
    load_config,
)
from llumdask.policy.dispatch import DISPATCH_POLICIES
from llumdask.request import Priority

PACKAGE = Path(llumdask.__file__).parent


def _load(name: str) -> dict:
    return yaml.safe_load((PACKAGE / name).read_text())


def _yaml_paths(node: dict, prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    paths = set()
    for key, value in node.items():
        paths.add(prefix + (key,))
        if isinstance(value, dict):
            paths |= _yaml_paths(value, prefix + (key,))
    return paths


def _schema_paths(schema: dict, prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    paths = set()
    for key, sub in schema.get("properties", {}).items():
        paths.add(prefix + (key,))
        paths |= _schema_paths(sub, prefix + (key,))
    return paths


@pytest.fixture
def restore_dask_config(monkeypatch):
    """Let a test change environment variables and dask.config; put both back afterwards."""
    saved = copy.deepcopy(dask.config.config)
    yield monkeypatch
    monkeypatch.undo()
    dask.config.config.clear()
    dask.config.config.update(saved)


# --- the files --------------------------------------------------------------------------------


def test_schema_is_a_valid_json_schema():
    schema = _load("llumdask-schema.yaml")
    jsonschema.validators.validator_for(schema).check_schema(schema)


def test_yaml_and_schema_name_the_same_keys():
    defaults, schema = _load("llumdask.yaml"), _load("llumdask-schema.yaml")
    in_yaml, in_schema = _yaml_paths(defaults), _schema_paths(schema)
    assert in_yaml - in_schema == set(), "keys in llumdask.yaml missing from the schema"
    assert in_schema - in_yaml == set(), "keys in the schema missing from llumdask.yaml"


def test_defaults_validate_against_the_schema():
    jsonschema.validate(_load("llumdask.yaml"), _load("llumdask-schema.yaml"))


def test_dataclass_defaults_equal_the_yaml():
    assert LlumdaskConfig().to_dict() == _load("llumdask.yaml")["llumdask"]
    assert LlumdaskConfig.from_dict({}) == LlumdaskConfig()


def test_schema_lists_exactly_the_registered_dispatch_policies():
    schema = _load("llumdask-schema.yaml")["properties"]["llumdask"]["properties"]
    assert sorted(schema["dispatch"]["properties"]["policy"]["enum"]) == sorted(DISPATCH_POLICIES.names())


def test_import_registers_the_yaml_as_dask_defaults():
    assert _load("llumdask.yaml") in dask.config.defaults
    assert dask.config.get("llumdask.migration.high-threshold") == 16.0


# --- the typed view ----------------------------------------------------------------------------


def test_typed_view_has_the_contract_types():
    config = LlumdaskConfig()
    assert config.headroom_tokens == {Priority.HIGH: None, Priority.NORMAL: 0}
    assert all(isinstance(p, Priority) for p in config.headroom_tokens)
    assert config.scaling.band == (10.0, 60.0) and isinstance(config.scaling.band, tuple)
    assert config.sim_engine.total_blocks is None
    assert isinstance(config.dispatch, DispatchConfig)


def test_vllm_engine_arguments_pass_through_untouched():
    args = {"max_num_seqs": 8, "override_generation_config": {"temperature": 0.5}, "swap-space": 1}
    config = LlumdaskConfig.from_dict({"vllm-engine": {"model": "org/model", "engine-args": args}})
    assert config.vllm_engine == VllmEngineConfig(model="org/model", engine_args=args)
    assert LlumdaskConfig().vllm_engine.model is None and LlumdaskConfig().vllm_engine.engine_args == {}


def test_typed_vllm_keys_cannot_hide_in_engine_args():
    with pytest.raises(ConfigError, match=r"set llumdask\.vllm-engine\.dtype instead"):
        LlumdaskConfig(vllm_engine=VllmEngineConfig(engine_args={"dtype": "half"}))


def test_config_is_frozen():
    config = LlumdaskConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_size = 32  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.migration.enabled = False  # type: ignore[misc]


def test_direct_construction_is_normalized():
    config = LlumdaskConfig(
        headroom_tokens={"high": 800, "normal": 0},  # type: ignore[dict-item]
        scaling=ScalingConfig(band=[5, 50]),  # type: ignore[arg-type]
        migration=MigrationConfig(low_threshold=1),
    )
    assert config.headroom_tokens == {Priority.HIGH: 800, Priority.NORMAL: 0}
    assert config.scaling.band == (5.0, 50.0) and isinstance(config.scaling.band, tuple)
    assert isinstance(config.migration.low_threshold, float)


def test_round_trip_through_plain_yaml():
    config = LlumdaskConfig(
        block_size=32,
        engine="vllm",
        dispatch=DispatchConfig(policy="power_of_two", seed=7),
        scaling=ScalingConfig(enabled=True, band=(1.5, 9.0), min_instances=2, max_instances=4),
        sim_engine=SimEngineConfig(total_blocks=64, real_time=True),
        vllm_engine=VllmEngineConfig(model="/m", max_model_len=512, engine_args={"max_num_seqs": 4}),
    )
    assert LlumdaskConfig.from_dict(yaml.safe_load(yaml.safe_dump(config.to_dict()))) == config


def test_pickles_for_shipping_to_workers():
    config = LlumdaskConfig(migration=MigrationConfig(enabled=False))
    assert pickle.loads(pickle.dumps(config)) == config


# --- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ({"block-size": 0}, "llumdask.block-size"),
        ({"block-size": "16"}, "llumdask.block-size"),
        ({"engine": "tgi"}, "llumdask.engine"),
        ({"report-interval": 0}, "llumdask.report-interval"),
        ({"stream-interval": -0.01}, "llumdask.stream-interval"),
        ({"headroom-tokens": {"high": -1}}, "llumdask.headroom-tokens.high"),
        ({"headroom-tokens": {"urgent": 5}}, "llumdask.headroom-tokens.urgent"),
        ({"dispatch": {"policy": "random"}}, "llumdask.dispatch.policy"),
        ({"migration": {"enabled": "yes"}}, "llumdask.migration.enabled"),
        ({"migration": {"low-treshold": 1.0}}, "llumdask.migration.low-treshold"),
        ({"migration": {"low-threshold": 16.0}}, "llumdask.migration.low-threshold"),
        ({"migration": {"interval": float("nan")}}, "llumdask.migration.interval"),
        ({"report-interval": float("inf")}, "llumdask.report-interval"),
        ({"migration": {"handshake-timeout": float("-inf")}}, "llumdask.migration.handshake-timeout"),
        ({"migration": {"max-concurrent": 0}}, "llumdask.migration.max-concurrent"),
        ({"migration": 3}, "llumdask.migration"),
        ({"scaling": {"band": [60, 10]}}, "llumdask.scaling.band"),
        ({"scaling": {"band": [10, 20, 30]}}, "llumdask.scaling.band"),
        ({"scaling": {"min-instances": 17}}, "llumdask.scaling.min-instances"),
        ({"sim-engine": {"total-blocks": 0}}, "llumdask.sim-engine.total-blocks"),
        ({"sim-engine": {"profile": ""}}, "llumdask.sim-engine.profile"),
        ({"vllm-engine": {"max-model-len": 0}}, "llumdask.vllm-engine.max-model-len"),
        ({"vllm-engine": {"gpu-memory-utilization": 1.5}}, "llumdask.vllm-engine.gpu-memory-utilization"),
        ({"vllm-engine": {"model": ""}}, "llumdask.vllm-engine.model"),
        ({"vllm-engine": {"engine-args": [1]}}, "llumdask.vllm-engine.engine-args"),
        ({"vllm-engine": {"engine-args": {"max_model_len": 64}}}, "llumdask.vllm-engine.engine-args.max_model_len"),
        ({"vllm-engine": {"engine-args": {"model": "m"}}}, "llumdask.vllm-engine.engine-args.model"),
        ({"unknown": 1}, "llumdask.unknown"),
    ],
)
def test_bad_values_name_their_key(section, key):
    with pytest.raises(ConfigError) as info:
        LlumdaskConfig.from_dict(section)
    assert info.value.key == key
    assert str(info.value).startswith(key + " ")


def test_missing_key_is_named():
    with pytest.raises(ConfigError, match=r"^llumdask\.headroom-tokens\.normal is missing"):
        LlumdaskConfig(headroom_tokens={Priority.HIGH: 1600})


def test_direct_construction_is_validated():
    with pytest.raises(ConfigError, match=r"^llumdask\.migration\.low-threshold must be below"):
        LlumdaskConfig(migration=MigrationConfig(low_threshold=20.0, high_threshold=10.0))
    with pytest.raises(ConfigError, match=r"^llumdask\.scaling\.band"):
        LlumdaskConfig(scaling=ScalingConfig(band=(5.0, 5.0)))


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("section", [None, [("block-size", 16)], "block-size: 16"])
def test_non_mapping_is_rejected(section):
    with pytest.raises(ConfigError, match=r"^llumdask must be a mapping"):
        LlumdaskConfig.from_dict(section)  # type: ignore[arg-type]
    if section is not None:
        with pytest.raises(ConfigError, match=r"^llumdask overrides must be a mapping"):
            load_config(section)  # type: ignore[arg-type]


# --- override paths ---------------------------------------------------------------------------


def test_environment_variables_override_defaults(restore_dask_config):
    restore_dask_config.setenv("DASK_LLUMDASK__MIGRATION__LOW_THRESHOLD", "3.5")
    restore_dask_config.setenv("DASK_LLUMDASK__SCALING__BAND", "[5, 50]")
    restore_dask_config.setenv("DASK_LLUMDASK__DISPATCH__POLICY", "infaas")
    dask.config.refresh()
    for config in (LlumdaskConfig.from_dask(), load_config()):
        assert config.migration.low_threshold == 3.5
        assert config.scaling.band == (5.0, 50.0)
        assert config.dispatch.policy == "infaas"
        assert config.migration.high_threshold == 16.0


def test_bad_environment_variable_names_its_key(restore_dask_config):
    restore_dask_config.setenv("DASK_LLUMDASK__MIGRATION__MAX_CONCURRENT", "many")
    dask.config.refresh()
    with pytest.raises(ConfigError) as info:
        load_config()
    assert info.value.key == "llumdask.migration.max-concurrent"


def test_user_yaml_overrides_defaults(restore_dask_config, tmp_path):
    (tmp_path / "mine.yaml").write_text("llumdask:\n  block-size: 32\n  migration:\n    enabled: false\n")
    dask.config.refresh(paths=[str(tmp_path)])
    config = load_config()
    assert config.block_size == 32 and config.migration.enabled is False
    assert config.migration.interval == 0.1


def test_dask_config_set_and_overrides_layer(restore_dask_config):
    with dask.config.set({"llumdask.migration.max-stages": 3, "llumdask.block-size": 8}):
        config = load_config({"block-size": 64, "migration": {"max_concurrent": 2}})
    assert config.migration.max_stages == 3  # from dask.config.set
    assert config.block_size == 64  # the override wins
    assert config.migration.max_concurrent == 2  # snake_case spelling of a known key
    assert load_config().block_size == 16


def test_from_dict_ignores_the_environment(restore_dask_config):
    restore_dask_config.setenv("DASK_LLUMDASK__BLOCK_SIZE", "8")
    dask.config.refresh()
    assert load_config().block_size == 8
    assert LlumdaskConfig.from_dict({}).block_size == 16
