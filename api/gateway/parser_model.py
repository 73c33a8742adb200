"""The served model's config as vLLM's parsers read it.

`vllm serve` hands each parser the ModelConfig it loaded the model with, and the parsers read three
things of it: the model type of the config and of its text part, with the engine's `hf_overrides`
(Kimi's models number their tool calls `functions.NAME:INDEX`, counting the calls earlier in the
conversation: vLLM's `get_tool_call_id_type`), and the architecture vLLM runs (Cohere Command's parser
picks its structural tags by it). A ModelConfig built where the gateway runs would inspect the model's
classes and refuse quantizations only a GPU runs, so the gateway reads the config with vLLM's own
loader (with the same overrides) and takes the architecture as vLLM's registry resolves one it
implements: the first of the config's architectures the registry holds.
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


def parser_model_config(files: str, trust_remote_code: bool = False,
                        hf_overrides: Mapping[str, Any] | None = None) -> ParserModelConfig:
    """The config of the model at `files` (a directory or a hub name, as vLLM's engines load it);
    ValueError saying why where vLLM's loader cannot read it (vLLM's engines could not either)."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.transformers_utils.config import get_config, get_hf_text_config

    if hf_overrides is not None and not isinstance(hf_overrides, Mapping):
        raise ValueError(f"hf-overrides must be a mapping of config fields, got {hf_overrides!r}")
    overrides = dict(hf_overrides) if hf_overrides else None
    try:
        config = get_config(files, trust_remote_code, hf_overrides_kw=overrides)
        text_config = get_hf_text_config(config)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"cannot read the model's config at {files} as vLLM's parsers need it: {exc}") from None
    named = list(getattr(config, "architectures", None) or ())
    supported = set(ModelRegistry.get_supported_archs())
    architecture = next((a for a in named if a in supported), named[0] if named else None)
    return ParserModelConfig(config, text_config, architecture, overrides)
