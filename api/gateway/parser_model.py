"""The served model's config as vLLM's parsers read it.

`vllm serve` hands each parser the ModelConfig it loaded the model with, and the parsers read three
things of it: the model type of the config and of its text part, with the engine's `hf_overrides`
(Kimi's models number their tool calls `functions.NAME:INDEX`, counting the calls earlier in the
conversation: vLLM's `get_tool_call_id_type`), and the architecture vLLM runs (Cohere Command's parser
picks its structural tags by it). A ModelConfig built where the gateway runs would inspect the model's
classes and refuse quantizations only a GPU runs, so the gateway loads the config as ModelConfig
does (vLLM's loader with the engine options that find and override it, then vLLM's own step for the
nested overrides) and takes the architecture as vLLM's registry resolves one it implements: the
first of the config's architectures the registry holds. (Under `--model-impl transformers` vLLM runs
one of its Transformers backends instead, which no parser but Cohere's reads.) Like vLLM, the loader
registers the config class an overridden model type names with transformers, for the process.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParserModelConfig:
    """What vLLM's parsers read of a ModelConfig, under its names."""

    hf_config: Any
    hf_text_config: Any
    architecture: str | None
    hf_overrides: Mapping[str, Any] | None = None


def parser_model_config(files: str, engine_args: Mapping[str, Any] | None = None) -> ParserModelConfig:
    """The config of the model at `files` (a directory or a hub name, at the revision its engines
    load) as vLLM's engines read it with `engine_args` (vLLM's options, dashed names:
    trust-remote-code, hf-overrides, hf-config-path with revision, code-revision, config-format,
    hf-token); ValueError saying why where it cannot be read (vLLM's engines could not either)."""
    from vllm.config.model import ModelConfig
    from vllm.model_executor.models import ModelRegistry
    from vllm.transformers_utils.config import get_config, get_hf_text_config

    args = dict(engine_args or {})
    overrides = args.get("hf-overrides") or {}
    if not isinstance(overrides, Mapping):
        raise ValueError(f"hf-overrides must be a mapping of config fields, got {overrides!r}")
    # As ModelConfig: flat overrides while loading, a nested config's afterwards.
    nested = {k: v for k, v in overrides.items() if isinstance(v, dict)}
    config_path = args.get("hf-config-path")
    try:
        config = get_config(config_path or files, bool(args.get("trust-remote-code")),
                             args.get("revision") if config_path else None, args.get("code-revision"),
                             args.get("config-format", "auto"),
                             hf_overrides_kw={k: v for k, v in overrides.items() if k not in nested},
                             token=args.get("hf-token"))
        if nested:
            object.__new__(ModelConfig)._apply_dict_overrides(config, nested)  # reads nothing else of it
        text_config = get_hf_text_config(config)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RuntimeError) as exc:
        raise ValueError(f"cannot read the model's config at {config_path or files} as vLLM's parsers need "
                         f"it: {exc!r}") from None
    named = list(getattr(config, "architectures", None) or ())
    supported = set(ModelRegistry.get_supported_archs())
    architecture = next((a for a in named if a in supported), named[0] if named else None)
    return ParserModelConfig(config, text_config, architecture, dict(overrides) or None)
