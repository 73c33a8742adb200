"""The model's generation config as vLLM's server applies it.

Hub models ship a ``generation_config.json`` with the sampling their authors recommend (a
temperature, top_p, top_k, a repetition penalty) and, often, end-of-sequence tokens besides the
tokenizer's (Llama 3's end of turn, Qwen's end of text). vLLM's server takes the sampling values as
defaults for what a request leaves out (``--generation-config auto``, its default; ``vllm`` for its
neutral ones; or a directory holding another file), ``max_new_tokens`` as the default answer length,
and ends a generation on every listed end-of-sequence token. The gateway does the same, so that a
request gets the answer ``vllm serve`` would give it, on either engine.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llumdask.request import SamplingParams, is_number

# The sampling options vLLM's server takes from a generation config, by their request names.
SAMPLING_DEFAULTS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k", "top_p",
                     "min_p")
SOURCES = ("auto", "vllm")
FILE = "generation_config.json"


@dataclass(frozen=True)
class GenerationDefaults:
    """What a generation config gives: sampling defaults (request names), a default answer length,
    and the end-of-sequence tokens it lists (the tokenizer's own among them or not)."""

    sampling: Mapping[str, float] = field(default_factory=dict)
    max_tokens: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # A file named by directory caps what requests ask too (vLLM's server: the model's only
    # fills in where a request asks nothing).
    caps_max_tokens: bool = False

    def __post_init__(self) -> None:
        unknown = set(self.sampling) - set(SAMPLING_DEFAULTS)
        if unknown:
            raise ValueError(f"generation defaults for {sorted(unknown)}: only {', '.join(SAMPLING_DEFAULTS)} are taken")
        for name, value in self.sampling.items():
            if not is_number(value):
                raise ValueError(f"generation config {name} must be a finite number, got {value!r}")
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 1):
            raise ValueError(f"generation config max_new_tokens must be a positive integer, got {self.max_tokens!r}")
        try:  # a value requests could not carry would turn every request away: refused at start
            SamplingParams(max_tokens=1, **self.sampling)
        except ValueError as exc:
            raise ValueError(f"generation config: {exc}") from None
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.eos_token_ids):
            raise ValueError(f"generation config eos_token_id must be token ids, got {list(self.eos_token_ids)}")


def read_generation_config(model: str | Path, source: str | Path = "auto",
                           override: Mapping[str, Any] | None = None) -> GenerationDefaults:
    """The defaults vLLM's server would apply for `model` (a directory or a hub name) with
    ``--generation-config source --override-generation-config override``: the sampling and length
    of `source`'s file ("auto": the model's; "vllm": none; a directory or a model on the hub: its
    file, whose length then caps every request), `override`'s values over them (its max_new_tokens caps every request),
    the end-of-sequence tokens of that same file ("vllm": the model's, which vLLM's engine still
    ends on; never the override's). No file: nothing."""
    if not isinstance(override or {}, Mapping):
        raise ValueError(f"the generation config override must be a JSON object, got {override!r}")
    override = dict(override or {})
    named = str(source) in SOURCES  # auto or vllm: the model's own file
    where = model if named else source
    config = _config(where)
    if config is None:
        if not named:
            raise ValueError(f"--generation-config takes auto, vllm, a directory holding {FILE} (or a model's "
                             f"config.json, as vLLM reads one) or such a model on the hub; {source} is none of them")
        config = {}
    eos = config.get("eos_token_id")
    eos_ids = () if eos is None else (eos,) if isinstance(eos, int) and not isinstance(eos, bool) else eos
    if not isinstance(eos_ids, list | tuple):
        raise ValueError(f"{where}: {FILE}'s eos_token_id must be a token id or a list of them, got {eos!r}")
    # vLLM takes the values a config sets (transformers' own defaults are all unset).
    given = {**({} if str(source) == "vllm" else config), **override}
    try:
        return GenerationDefaults({name: given[name] for name in SAMPLING_DEFAULTS if given.get(name) is not None},
                                  given.get("max_new_tokens"), tuple(eos_ids),
                                  not named or "max_new_tokens" in override)
    except ValueError as exc:
        raise ValueError(f"{where}{' with ' + json.dumps(override) if override else ''}: {exc}") from None


def default_source(engine: str | None) -> str:
    """`--generation-config`'s default: the model's ("auto", as vLLM's server), but none on the
    sim engine, whose tokens are random draws (the model's advice means nothing there, and the
    options it cannot model would turn every request away)."""
    return "vllm" if engine == "sim" else "auto"


def _config(where: str | Path) -> Mapping[str, Any] | None:
    config = _read(where)
    if config is not None and not isinstance(config, Mapping):
        raise ValueError(f"{where}: {FILE} must hold a JSON object")
    return config


def _read(where: str | Path) -> Any:
    """The generation config's JSON, as transformers and vLLM find it: the file in a directory, or
    from the hub for a model name (the hub extra's transformers); without one, the settings of the
    model's config (transformers' `from_model_config`, which also reads a nested text config; a
    directory's top-level config.json where transformers is not installed); None where neither is."""
    path = Path(where)
    if path.is_dir() and (path / FILE).is_file():
        return _json(path / FILE)
    try:
        from transformers import AutoConfig, GenerationConfig
    except ImportError:
        return _model_config(path)
    if not path.is_dir():
        try:
            return GenerationConfig.from_pretrained(str(where)).to_diff_dict()
        except (OSError, ValueError):  # not on the hub, or not a hub name
            pass
    try:  # never the model's own code (vLLM runs it only when trusted)
        return GenerationConfig.from_model_config(AutoConfig.from_pretrained(str(where), trust_remote_code=False)
                                                  ).to_diff_dict()
    except Exception:  # a config transformers cannot build (unknown or custom type, strict checks), or none
        return _model_config(path)


def _model_config(path: Path) -> Any:
    """A directory's config.json as it stands; None without one."""
    return _json(path / "config.json") if (path / "config.json").is_file() else None


def _json(file: Path) -> Any:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{file} cannot be read as JSON: {exc}") from None
