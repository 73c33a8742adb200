"""Text <-> token ids and chat templates for the served model.

A model directory with a ``tokenizer.json`` (every fast Hugging Face tokenizer has one) is
loaded with the `tokenizers` library and its chat template rendered with jinja2, the way
transformers renders it; that starts in milliseconds (transformers is an optional extra and
takes seconds to import). The template is looked up where transformers and vLLM look:
``chat_template.jinja`` (what ``save_pretrained`` writes today) before the ``chat_template``
field of ``tokenizer_config.json``, then a processor's ``chat_template.json``; an operator's
``--chat-template`` (a file or the template itself, as vLLM takes it) overrides all of them.
Anything else (a hub name, a slow tokenizer) goes through transformers' AutoTokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol


# Special tokens a chat template may refer to by name.
SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


class ChatTemplateError(ValueError):
    """The model has no chat template, or its template rejected the messages."""


class Tokenizer(Protocol):
    """What the gateway needs from a tokenizer."""

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`, special tokens left out unless asked for."""
        ...

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[dict[str, Any]] | None = None) -> str:
        """The prompt text for `messages` (and the `tools` offered, OpenAI's shape), ending where
        the assistant's reply starts (or, without the generation prompt, where the last message ends)."""
        ...

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        """Each token id's own vocabulary entry (byte-level pieces as the tokenizer spells them)."""
        ...

    def has_token(self, text: str) -> bool:
        """`text` is one entry of the vocabulary (added tokens included)."""
        ...


def max_context_of(directory: str | Path) -> int | None:
    """The context length a model directory declares (config.json, tokenizer_config.json), if any."""
    directory = Path(directory)
    declared = (_read_json(directory / "config.json").get("max_position_embeddings"),
                _read_json(directory / "tokenizer_config.json").get("model_max_length"))
    # transformers writes 1e30 as model_max_length for "no limit".
    limits = [v for v in declared if isinstance(v, int) and not isinstance(v, bool) and 0 < v < 1 << 40]
    return min(limits) if limits else None


class FastTokenizer:
    """A ``tokenizer.json`` plus ``tokenizer_config.json`` (special tokens, chat template)."""

    def __init__(self, directory: str | Path, chat_template: str | None = None) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        directory = Path(directory)
        self._tokenizer = RustTokenizer.from_file(str(directory / "tokenizer.json"))
        config = _read_json(directory / "tokenizer_config.json")
        self._special = {name: _token_text(config.get(name)) for name in SPECIAL_TOKENS}
        eos = self._special["eos_token"]
        self._eos_id = None if eos is None else self._tokenizer.token_to_id(eos)
        self._template = _compile_template(chat_template if chat_template is not None
                                           else model_chat_template(directory, config))

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_id

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        return [self._tokenizer.id_to_token(t) or "" for t in token_ids]

    def has_token(self, text: str) -> bool:
        return self._tokenizer.token_to_id(text) is not None

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[dict[str, Any]] | None = None) -> str:
        if self._template is None:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        from jinja2 import TemplateError

        try:
            return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         tools=list(tools) if tools else None,
                                         **{k: v or "" for k, v in self._special.items()})
        except TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template rejected the messages: {exc}") from None


class TransformersTokenizer:
    """Anything AutoTokenizer can load (hub names, slow tokenizers)."""

    def __init__(self, hf_tokenizer: Any, chat_template: str | None = None) -> None:
        self._tokenizer = hf_tokenizer
        if chat_template is not None:
            hf_tokenizer.chat_template = chat_template

    @classmethod
    def from_pretrained(cls, name_or_path: str, chat_template: str | None = None) -> "TransformersTokenizer":
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(name_or_path), chat_template)

    @property
    def eos_token_id(self) -> int | None:
        return self._tokenizer.eos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        return [t or "" for t in self._tokenizer.convert_ids_to_tokens(list(token_ids))]

    def has_token(self, text: str) -> bool:
        return text in self._tokenizer.get_vocab()

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[dict[str, Any]] | None = None) -> str:
        if not self._tokenizer.chat_template:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        try:
            return self._tokenizer.apply_chat_template(list(messages), tokenize=False, tools=list(tools) if tools else None,
                                                       add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # jinja2 and transformers raise several kinds for a bad conversation
            raise ChatTemplateError(f"the model's chat template rejected the messages: {exc}") from None


def load_tokenizer(name_or_path: str | Path, chat_template: str | Path | None = None) -> Tokenizer:
    """The fast path for a directory with tokenizer.json, transformers otherwise.

    `chat_template` overrides the model's own: a template file, or the template text itself.
    """
    template = None if chat_template is None else read_chat_template(chat_template)
    path = Path(name_or_path)
    if (path / "tokenizer.json").is_file():
        return FastTokenizer(path, template)
    return TransformersTokenizer.from_pretrained(str(name_or_path), template)


def model_location(model: str | None) -> str:
    """Where a served model's files are: a directory made absolute (every process finds it,
    whatever its working directory), a hub name as it is, and for None (no model configured)
    the offline tiny model, built on first use."""
    if model is None:
        from llumdask.tiny_model import build_tiny_model, default_model_dir

        return str(build_tiny_model(default_model_dir()))
    return str(Path(model).resolve()) if Path(model).is_dir() else model


def stop_token_ids(tokenizer: Tokenizer, requested: Sequence[int], ignore_eos: bool) -> tuple[int, ...]:
    """The token ids that end a generation: the requested ones and, unless `ignore_eos`, the
    model's end-of-sequence token (the engine knows only ids, not the model's conventions)."""
    ids = list(requested)
    eos = tokenizer.eos_token_id
    if eos is not None and not ignore_eos and eos not in ids:
        ids.append(eos)
    return tuple(ids)


def read_chat_template(value: str | Path) -> str:
    """A `--chat-template` value as vLLM reads it: a file's text, or the value itself when it is a template."""
    path = Path(value)
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        # Template text holds jinja delimiters or line breaks; anything else was meant as a file.
        if isinstance(value, str) and any(c in value for c in "{}\n"):
            return value
        raise ChatTemplateError(f"chat template file {str(value)!r} cannot be read") from None


def model_chat_template(directory: Path, config: dict[str, Any]) -> str | list[dict[str, str]] | None:
    """A model directory's chat template, found where transformers and vLLM find it."""
    default = directory / "chat_template.jinja"
    if default.is_file():
        return default.read_text(encoding="utf-8")
    if any((directory / "additional_chat_templates").glob("*.jinja")):
        return None  # named templates and no default: transformers then ignores the config's field too
    if config.get("chat_template") is not None:
        return config["chat_template"]
    return _read_json(directory / "chat_template.json").get("chat_template")


def _read_json(file: Path) -> dict[str, Any]:
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        return {}


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _compile_template(source: Any):
    """Compile a chat template as transformers does: sandboxed, trim/lstrip blocks, raise_exception,
    and its `tojson` (plain JSON, not jinja's HTML-escaped one: templates render tools with it)."""
    if isinstance(source, list):  # several named templates: use "default"
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    if not isinstance(source, str):
        return None
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = tojson
    return env.from_string(source)
