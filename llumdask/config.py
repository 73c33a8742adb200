"""llumdask's configuration: dask.config defaults, schema validation, and one typed view.

Following the Dask convention, importing this module registers ``llumdask.yaml`` as dask.config
defaults under the key ``llumdask``; user YAML (``~/.config/dask/*.yaml``), ``DASK_LLUMDASK__...``
environment variables and ``dask.config.set`` override them as for any Dask setting. Code reads
the configuration through `LlumdaskConfig`, a frozen, typed view that is validated against
``llumdask-schema.yaml`` on construction, so a bad value fails at startup with a `ConfigError`
naming its dotted key instead of surfacing later as a strange scheduling decision.

Dict forms (`from_dict`, `load_config` overrides, `to_dict`) use the YAML's kebab-case keys,
relative to the ``llumdask`` section: ``{"migration": {"low-threshold": 3.0}}``. Like dask.config,
the merge also matches the snake_case spelling of a known key.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dask.config
import jsonschema
import yaml

from llumdask.request import Priority

_SECTION = "llumdask"
_HERE = Path(__file__).parent


class ConfigError(ValueError):
    """A configuration value is wrong; `key` is its dotted name, e.g. llumdask.migration.low-threshold."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key} {problem}")
        self.key = key


# ---------------------------------------------------------------------------------------------
# The typed view. Field names are the YAML keys in snake_case; defaults equal llumdask.yaml's
# (a test keeps them equal). The sections are validated as part of `LlumdaskConfig`.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DispatchConfig:
    policy: str = "llumnix"
    seed: int = 0
    interference_freeness: float | None = 16.0
    admission_freeness: float | None = None
    hold_freeness: float | None = 1.0
    hold_limit: float | None = None
    prefix_aware: bool = True
    priority_pool_instances: int = 0


@dataclass(frozen=True)
class MigrationConfig:
    enabled: bool = True
    interval: float = 0.1
    low_threshold: float = 2.0
    high_threshold: float = 16.0
    max_concurrent: int = 1
    max_stages: int = 6
    last_stage_blocks: int = 2
    last_stage_slack_blocks: int = 1
    handshake_timeout: float = 5.0
    hand_over_waiting: bool = False


@dataclass(frozen=True)
class ScalingConfig:
    enabled: bool = False
    band: tuple[float, float] = (10.0, 60.0)
    scale_out_period: float = 5.0
    scale_in_period: float = 30.0
    min_instances: int = 1
    max_instances: int = 16
    startup_delay: float = 0.0
    startup_timeout: float = 600.0


@dataclass(frozen=True)
class SimEngineConfig:
    profile: str = "llama-7b-a10"
    total_blocks: int | None = None
    kv_bytes_per_token: int = 64
    kv_device: str = "cpu"
    vocab_size: int = 32000
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    prefix_caching: bool = True
    real_time: bool = False


@dataclass(frozen=True)
class VllmEngineConfig:
    """A vLLM instance. The typed keys are the vLLM engine arguments every deployment decides;
    `engine_args` passes any other vLLM engine argument through unchanged. None leaves the
    choice to vLLM (or, for `model`, to the offline tiny model built on first use)."""

    model: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    tensor_parallel_size: int = 1
    enforce_eager: bool = True
    engine_args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RequesterConfig:
    listen_host: str | None = None
    liveness_interval: float = 1.0
    stall_timeout: float = 5.0
    dispatch_timeout: float = 2.0
    bypass_period: float = 5.0
    placement_timeout: float = 60.0
    rpc_timeout: float = 10.0


@dataclass(frozen=True)
class GatewayConfig:
    # Out of the repr: keys stay out of every log line and traceback that shows the configuration.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    max_in_flight: int = 256
    retry_after: float = 1.0
    max_body_bytes: int = 1 << 20
    placement_timeout: float = 10.0
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    tool_call_parser: str | None = None
    tool_strict_level: str = "auto"
    reasoning_parser: str | None = None
    write_timeout: float = 30.0
    send_buffer_bytes: int | None = None


def _default_headroom() -> dict[Priority, int | None]:
    return {Priority.HIGH: None, Priority.NORMAL: 0}


@dataclass(frozen=True)
class LlumdaskConfig:
    """The whole ``llumdask`` section. Treat `headroom_tokens` as read-only like everything else."""

    block_size: int = 16
    engine: str = "sim"
    report_interval: float = 0.05
    stream_interval: float = 0.01
    max_failed_steps: int = 3
    headroom_tokens: dict[Priority, int | None] = field(default_factory=_default_headroom)
    dispatch: DispatchConfig = field(default_factory=DispatchConfig)
    migration: MigrationConfig = field(default_factory=MigrationConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    sim_engine: SimEngineConfig = field(default_factory=SimEngineConfig)
    vllm_engine: VllmEngineConfig = field(default_factory=VllmEngineConfig)
    requester: RequesterConfig = field(default_factory=RequesterConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)

    def __post_init__(self) -> None:
        # Direct construction gets the same checks as YAML, and the same normal form
        # (Priority keys, tuples, floats), so every consumer sees one shape.
        section = self.to_dict()
        _validate(section)
        for name, value in _typed_fields(type(self), section).items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_dict(cls, section: Mapping[str, Any]) -> LlumdaskConfig:
        """Build from a (partial) ``llumdask`` section; missing keys take llumdask.yaml's defaults.

        Only the packaged defaults fill the gaps, not dask.config's current values, so the
        result does not depend on the environment; use `load_config` for that.
        """
        if not isinstance(section, Mapping):
            raise ConfigError(_SECTION, f"must be a mapping, not {type(section).__name__}")
        merged = dask.config.merge(_packaged_defaults()[_SECTION], section)
        _validate(merged)
        return cls(**_typed_fields(cls, merged))

    @classmethod
    def from_dask(cls) -> LlumdaskConfig:
        """The ``llumdask`` section as dask.config holds it now (defaults, user YAML, env, `set`)."""
        return cls.from_dict(dask.config.get(_SECTION))

    def to_dict(self) -> dict[str, Any]:
        """The ``llumdask`` section as plain YAML/msgpack data, e.g. for ``dask.config.set``."""
        return _plain(self)


def load_config(overrides: Mapping[str, Any] | None = None) -> LlumdaskConfig:
    """dask.config's current ``llumdask`` section with `overrides` (kebab-case, nested) on top."""
    if overrides is not None and not isinstance(overrides, Mapping):
        raise ConfigError(_SECTION, f"overrides must be a mapping, not {type(overrides).__name__}")
    return LlumdaskConfig.from_dict(dask.config.merge(dask.config.get(_SECTION), overrides or {}))


# ---------------------------------------------------------------------------------------------
# Files, validation and conversion between the YAML form and the typed view
# ---------------------------------------------------------------------------------------------


def _read_yaml(name: str) -> dict[str, Any]:
    with open(_HERE / name) as f:
        return yaml.safe_load(f)


def _packaged_defaults() -> dict[str, Any]:
    """A fresh copy of llumdask.yaml, so no caller can change another's defaults."""
    return _read_yaml("llumdask.yaml")


@functools.cache
def _validator() -> jsonschema.protocols.Validator:
    schema = _read_yaml("llumdask-schema.yaml")
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def _validate(section: Mapping[str, Any]) -> None:
    """Raise ConfigError for the most relevant problem in `section` (the ``llumdask`` mapping)."""
    error = jsonschema.exceptions.best_match(_validator().iter_errors({_SECTION: section}))
    if error is not None:
        raise _schema_error(error)
    for key, value in _leaves(section, _SECTION):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(key, f"is {value}, not a finite number")
    _check_relations(section)


def _schema_error(error: jsonschema.ValidationError) -> ConfigError:
    key = ".".join(str(part) for part in error.absolute_path)
    if error.validator == "additionalProperties":
        known = error.schema["properties"]
        unknown = sorted(set(error.instance) - set(known))
        return ConfigError(f"{key}.{unknown[0]}", f"is not a known key; known: {', '.join(known)}")
    if error.validator == "required":
        missing = [name for name in error.validator_value if name not in error.instance]
        return ConfigError(f"{key}.{missing[0]}", "is missing")
    return ConfigError(key, f"is invalid: {error.message}")


def _check_relations(section: Mapping[str, Any]) -> None:
    """The constraints between keys, which the schema cannot express."""
    migration, scaling = section["migration"], section["scaling"]
    low, high = migration["low-threshold"], migration["high-threshold"]
    if not low < high:
        raise ConfigError(
            f"{_SECTION}.migration.low-threshold",
            f"must be below {_SECTION}.migration.high-threshold, got {low} and {high}",
        )
    band = scaling["band"]
    if not band[0] < band[1]:
        raise ConfigError(f"{_SECTION}.scaling.band", f"must be [low, high] with low < high, got {band}")
    if scaling["min-instances"] > scaling["max-instances"]:
        raise ConfigError(
            f"{_SECTION}.scaling.min-instances",
            f"must not exceed {_SECTION}.scaling.max-instances, got {scaling['min-instances']} "
            f"and {scaling['max-instances']}",
        )
    vllm = section["vllm-engine"]
    for name in vllm["engine-args"]:
        typed = _kebab(name)
        if typed in vllm:
            raise ConfigError(
                f"{_SECTION}.vllm-engine.engine-args.{name}",
                f"is a key of its own: set {_SECTION}.vllm-engine.{typed} instead",
            )


def _leaves(value: Any, key: str) -> Iterator[tuple[str, Any]]:
    if isinstance(value, Mapping):
        for name, item in value.items():
            yield from _leaves(item, f"{key}.{name}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _leaves(item, f"{key}.{index}")
    else:
        yield key, value


def _kebab(name: str) -> str:
    return name.replace("_", "-")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _typed_fields(cls: type, section: Mapping[str, Any]) -> dict[str, Any]:
    """Constructor arguments of dataclass `cls` from a validated kebab-case section."""
    hints = _hints(cls)
    return {f.name: _typed(hints[f.name], section[_kebab(f.name)]) for f in dataclasses.fields(cls)}


def _typed(hint: Any, value: Any) -> Any:
    """Convert one validated YAML value to the field's annotated type."""
    if hint is Any:  # passed through as given (vLLM engine arguments)
        return value
    if dataclasses.is_dataclass(hint):
        return hint(**_typed_fields(hint, value))
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple and args[-1] is Ellipsis:  # any length; one item may stand alone
        return tuple(_typed(args[0], item) for item in ([value] if isinstance(value, str) else value))
    if origin is tuple:
        return tuple(_typed(arg, item) for arg, item in zip(args, value, strict=True))
    if origin is dict:
        return {_typed(args[0], k): _typed(args[1], v) for k, v in value.items()}
    if origin is types.UnionType:  # only "X | None" occurs
        return None if value is None else _typed(next(a for a in args if a is not type(None)), value)
    if hint is Priority:
        return Priority.parse(value)
    return hint(value)  # int, float, str, bool: the schema has checked the kind


def _plain(value: Any) -> Any:
    """The YAML form of a typed value: kebab-case keys, lists, priority names."""
    if dataclasses.is_dataclass(value):
        return {_kebab(f.name): _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Priority):
        return value.name.lower()
    if isinstance(value, (tuple, list)):
        return [_plain(item) for item in value]
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    return value


dask.config.update_defaults(_packaged_defaults())
