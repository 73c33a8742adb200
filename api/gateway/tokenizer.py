"""Text <-> token ids and chat templates for the served model.

A model directory with a ``tokenizer.json`` (every fast Hugging Face tokenizer has one) is
loaded with the `tokenizers` library and its chat template rendered with jinja2, the way
transformers renders it; that starts in milliseconds (transformers is an optional extra and
takes seconds to import). Templates are found as transformers finds them: the files first
(``chat_template.jinja``, what ``save_pretrained`` writes today, as the default, and each
``additional_chat_templates/NAME.jinja`` by its name), else the ``chat_template`` field of
``tokenizer_config.json`` (one template, or a list of named ones), then a processor's
``chat_template.json``. With several, a request offering tools renders with the one named
``tool_use`` where there is one, any other with ``default``, as transformers and vLLM choose. An
operator's ``--chat-template`` (a file or the template itself, as vLLM takes it, or, beyond vLLM,
the name of one of the model's templates) overrides the choice. A named template that does not
compile fails the conversations that need it, not the model's loading. Anything else (a hub name,
a slow tokenizer) goes through transformers' AutoTokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from collections.abc import Mapping, Sequence
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
                    tools: Sequence[dict[str, Any]] | None = None, *, continue_final_message: bool = False,
                    variables: Mapping[str, Any] | None = None) -> str:
        """The prompt text for `messages` (and the `tools` offered, OpenAI's shape), ending where
        the assistant's reply starts (or, without the generation prompt, where the last message
        ends; with `continue_final_message`, inside the last message, right after its text).
        `variables`: more template variables (vLLM's chat_template_kwargs, documents)."""
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

    def __init__(self, directory: str | Path, chat_template: str | Path | None = None) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        directory = Path(directory)
        self._tokenizer = RustTokenizer.from_file(str(directory / "tokenizer.json"))
        config = _read_json(directory / "tokenizer_config.json")
        self._special = {name: _token_text(config.get(name)) for name in SPECIAL_TOKENS}
        eos = self._special["eos_token"]
        self._eos_id = None if eos is None else self._tokenizer.token_to_id(eos)
        templates = chosen_template(model_chat_template(directory, config), chat_template)
        if isinstance(templates, dict):
            self._templates = {name: _compile_template(t, strict=name == "default") for name, t in templates.items()}
        else:
            self._templates = _compile_template(templates)

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
                    tools: Sequence[dict[str, Any]] | None = None, *, continue_final_message: bool = False,
                    variables: Mapping[str, Any] | None = None) -> str:
        template = template_for(self._templates, tools)
        chat = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + OPEN_END}] if (
            continue_final_message) else list(messages)
        context = {**{k: v or "" for k, v in self._special.items()}, "documents": None, **(variables or {}),
                   "messages": chat, "add_generation_prompt": add_generation_prompt,
                   "tools": list(tools) if tools else None}
        try:
            rendered = template.render(context)
        except Exception as exc:  # jinja2's errors, and a request's variables a template cannot use (TypeError)
            raise ChatTemplateError(f"the model's chat template rejected the messages: {exc}") from None
        return left_open(rendered, messages[-1]["content"]) if continue_final_message else rendered


class TransformersTokenizer:
    """Anything AutoTokenizer can load (hub names, slow tokenizers)."""

    def __init__(self, hf_tokenizer: Any, chat_template: str | Path | None = None) -> None:
        self._tokenizer = hf_tokenizer
        if chat_template is not None:
            hf_tokenizer.chat_template = chosen_template(hf_tokenizer.chat_template, chat_template)

    @classmethod
    def from_pretrained(cls, name_or_path: str, chat_template: str | Path | None = None,
                        trust_remote_code: bool = False) -> "TransformersTokenizer":
        """AutoTokenizer's, or transformers' generic fast tokenizer for the model types vLLM reads
        with it (`GENERIC_TOKENIZER_TYPES`)."""
        if _model_type(name_or_path) in GENERIC_TOKENIZER_TYPES:
            from transformers.tokenization_utils_tokenizers import TokenizersBackend

            return cls(TokenizersBackend.from_pretrained(name_or_path), chat_template)
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code), chat_template)

    @property
    def eos_token_id(self) -> int | None:
        return self._tokenizer.eos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """As vLLM's engines write text: a fast tokenizer's Rust decoder (a class's own decode, and
        transformers' clean-up, never run there), a slow tokenizer's decode."""
        if getattr(self._tokenizer, "is_fast", False):
            return self._tokenizer.backend_tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        return [t or "" for t in self._tokenizer.convert_ids_to_tokens(list(token_ids))]

    def has_token(self, text: str) -> bool:
        return text in self._tokenizer.get_vocab()

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[dict[str, Any]] | None = None, *, continue_final_message: bool = False,
                    variables: Mapping[str, Any] | None = None) -> str:
        if not self._tokenizer.chat_template:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        try:
            return self._tokenizer.apply_chat_template(list(messages), tokenize=False, tools=list(tools) if tools else None,
                                                       add_generation_prompt=add_generation_prompt,
                                                       continue_final_message=continue_final_message, **(variables or {}))
        except Exception as exc:  # jinja2 and transformers raise several kinds for a bad conversation
            raise ChatTemplateError(f"the model's chat template rejected the messages: {exc}") from None


def load_tokenizer(name_or_path: str | Path, chat_template: str | Path | None = None,
                   trust_remote_code: bool = False) -> Tokenizer:
    """The fast path for a directory with tokenizer.json, transformers otherwise, and where the
    model's own tokenizer code is trusted (vLLM's `--trust-remote-code`) and it names some, that
    code through transformers, as vLLM's engines load it.

    `chat_template` overrides the model's own: a template file, the template text itself, or the
    name of one of the model's templates.
    """
    path = Path(name_or_path)
    if (path / "tokenizer.json").is_file() and not (trust_remote_code and _has_tokenizer_code(path)):
        return FastTokenizer(path, chat_template)
    return TransformersTokenizer.from_pretrained(str(name_or_path), chat_template, trust_remote_code)


# Model types whose tokenizer vLLM reads with transformers' generic fast tokenizer whatever class or
# code the model names (vLLM's _MODEL_TYPES_WITH_INCORRECT_TOKENIZER_CLASS: their hub classes are
# wrong), kept equal to vLLM's by a test, so the gateway need not import vLLM. vLLM reads the type
# through the model's config code where the code is trusted; untrusted, its engines cannot load
# such a model at all, so the gateway reads the type from config.json as it stands.
GENERIC_TOKENIZER_TYPES = frozenset({"internlm2", "step3_vl", "step3p7", "unlimited-ocr", "unlimited_ocr"})


def _has_tokenizer_code(directory: Path) -> bool:
    """Whether a model directory names tokenizer code of its own where transformers' AutoTokenizer
    looks for it, and vLLM runs it: the tokenizer config's auto_map (older ones a list)."""
    auto_map = _read_json(directory / "tokenizer_config.json").get("auto_map")
    named = isinstance(auto_map, list) or (isinstance(auto_map, dict) and "AutoTokenizer" in auto_map)
    return named and _model_type(directory) not in GENERIC_TOKENIZER_TYPES


def _model_type(name_or_path: str | Path) -> str | None:
    """The model type a directory's or a hub model's config names (the hub's from its cache or the
    hub, as transformers reads it); None where there is none to read (vLLM's tokenizer loader reads
    no type from a config it cannot read either)."""
    path = Path(name_or_path) / "config.json"
    if not path.is_file() and not Path(name_or_path).is_dir():
        from transformers.utils import cached_file

        try:
            found = cached_file(str(name_or_path), "config.json", _raise_exceptions_for_missing_entries=False)
        except (OSError, ValueError):  # offline without it, or not a hub name
            return None
        path = Path(found) if found else path
    try:
        config = _read_json(path) if path.is_file() else {}
    except (OSError, ValueError):
        return None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    return model_type if isinstance(model_type, str) else None


def model_location(model: str | None) -> str:
    """Where a served model's files are: a directory made absolute (every process finds it,
    whatever its working directory), a hub name as it is, and for None (no model configured)
    the offline tiny model, built on first use."""
    if model is None:
        from llumdask.tiny_model import build_tiny_model, default_model_dir

        return str(build_tiny_model(default_model_dir()))
    return str(Path(model).resolve()) if Path(model).is_dir() else model


# What the gateway reads of a model on the hub: its tokenizer, chat templates and configs (vLLM's
# engines fetch the weights themselves). Names, not wildcards: a pattern would take in files of
# other formats in subfolders, which nothing else fetches, and a cache filled by vLLM lacks.
GATEWAY_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "added_tokens.json", "*.model", "*.tiktoken", "vocab.json", "vocab.txt",
                 "merges.txt", "chat_template.jinja", "chat_template.json", "additional_chat_templates/*.jinja",
                 "preprocessor_config.json", "processor_config.json", "params.json")


def files_at(location: str, revision: str | None, code: bool = False) -> str:
    """Where to read the tokenizer, templates and configs of `location` (`model_location`'s) at a
    revision on the hub (vLLM's `--revision`: a branch, tag or commit): its snapshot in the hub
    cache, fetched without the weights, with the model's Python modules where its `code` is
    trusted (a tokenizer's code imports its neighbours). Offline, what the cache holds of it (a
    snapshot the hub cache knows to lack some of the files reads as it is: what a tokenizer needs
    fails clearly when it loads). A directory, or no revision: `location` as it is."""
    if revision is None or Path(location).is_dir():
        return location
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError

    try:
        # Offline, from the cache alone (for a commit it would otherwise try to fetch what it lacks).
        snapshot = snapshot_download(location, revision=revision,
                                     allow_patterns=[*GATEWAY_FILES, *(["*.py"] if code else [])],
                                     local_files_only=constants.HF_HUB_OFFLINE)
    except IncompleteSnapshotError as exc:
        snapshot = exc.snapshot_path
    except (OSError, ValueError) as exc:  # the hub's: no such model or revision, or offline without it cached
        raise ValueError(f"cannot read {location} at revision {revision}: {exc}") from None
    if not Path(snapshot).is_dir():  # the hub names a snapshot it fetched nothing for
        raise ValueError(f"{location} at revision {revision} has none of the files the gateway reads (a "
                         "tokenizer, the model's config)")
    return snapshot


@dataclass(frozen=True)
class ServedTokenizer:
    """The tokenizer a model is served with: `source` as vLLM's engines get it (`--tokenizer`, else
    the model), `files` where the gateway reads it (at its revision), the tokenizer itself, and
    whether the model's own code is trusted (vLLM's `--trust-remote-code`: its tokenizer code runs)."""

    source: str
    files: str
    tokenizer: Tokenizer
    trusts_code: bool = False


def served_tokenizer(model: str, tokenizer: str | None, engine_args: Mapping[str, Any],
                     chat_template: str | Path | None = None) -> ServedTokenizer:
    """The tokenizer of `model` (a `model_location`), or `tokenizer` instead (vLLM's
    `--tokenizer`), at the revision vLLM's engines read it: `engine_args`' tokenizer revision,
    else the model's revision (either spelling: the command line's dashes, Python's underscores),
    with the model's own tokenizer code where they trust it."""
    source = model if tokenizer is None else model_location(tokenizer)
    args = {name.replace("_", "-"): value for name, value in engine_args.items()}
    trusts_code = bool(args.get("trust-remote-code"))
    files = files_at(source, args.get("tokenizer-revision") or args.get("revision"), trusts_code)
    return ServedTokenizer(source, files, load_tokenizer(files, chat_template, trusts_code), trusts_code)


def stop_token_ids(tokenizer: Tokenizer, requested: Sequence[int], ignore_eos: bool,
                   model_eos: Sequence[int] = ()) -> tuple[int, ...]:
    """The token ids that end a generation: the requested ones and, unless `ignore_eos`, the
    model's end-of-sequence tokens (the tokenizer's, and `model_eos`: its generation config's), as
    vLLM ends one (the engine knows only ids, not the model's conventions)."""
    ids = list(requested)
    if not ignore_eos:
        ids += [t for t in (tokenizer.eos_token_id, *model_eos) if t is not None and t not in ids]
    return tuple(dict.fromkeys(ids))


def named_stop_token_ids(tokenizer: Tokenizer, requested: Sequence[int], ignore_eos: bool,
                         model_eos: Sequence[int] = ()) -> frozenset[int]:
    """The stop tokens a choice's stop_reason names when one ends it (vLLM's rule): the requested
    ones and, unless `ignore_eos`, the generation config's end-of-sequence tokens; never the
    tokenizer's own unless `ignore_eos` (vLLM ends on it first, unnamed)."""
    eos = tokenizer.eos_token_id
    named = set(requested) | (set() if ignore_eos else set(model_eos))
    return frozenset(t for t in named if ignore_eos or t != eos)


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


Templates = str | dict[str, str] | None


def model_chat_template(directory: Path, config: dict[str, Any]) -> Templates:
    """A model directory's chat template, or its templates by name, found as transformers finds them."""
    files = {"default": directory / "chat_template.jinja",
             **{f.name.removesuffix(".jinja"): f for f in sorted((directory / "additional_chat_templates").glob("*.jinja"))}}
    templates = {name: f.read_text(encoding="utf-8") for name, f in files.items() if f.is_file()}
    if not templates:  # the files win over the config's field, as in transformers
        found = config.get("chat_template")
        if found is None:
            found = _read_json(directory / "chat_template.json").get("chat_template")
        if not isinstance(found, list):
            return found
        return {t["name"]: t["template"] for t in found}  # named, even one alone (transformers keeps the names)
    return templates["default"] if list(templates) == ["default"] else templates


def chosen_template(templates: Templates, override: str | Path | None) -> Templates:
    """The model's `templates`, or what an operator's `--chat-template` names instead: a template
    file or the template itself (as vLLM reads the flag), or one of the model's named templates
    (as transformers resolves a name)."""
    if override is None:
        return templates
    if isinstance(templates, dict) and str(override) in templates:
        return templates[str(override)]
    return read_chat_template(override)


def template_for(templates: Any, tools: Sequence[dict[str, Any]] | None) -> Any:
    """The template a conversation renders with, chosen as transformers and vLLM choose: of named
    ones, ``tool_use`` when tools are offered and it exists, else ``default``."""
    if templates is None:
        raise ChatTemplateError("this model has no chat template; use /v1/completions")
    if not isinstance(templates, dict):
        return templates
    name = "tool_use" if tools and "tool_use" in templates else "default"
    if name not in templates:
        raise ChatTemplateError(f"this model's chat templates ({', '.join(sorted(templates))}) have no default; "
                                "name one with --chat-template")
    return templates[name]


# Marks where the last message's text ends, so that the rendering can stop there (transformers' own mark).
OPEN_END = "CONTINUE_FINAL_MESSAGE_TAG "


def left_open(rendered: str, final: str) -> str:
    """`rendered` (its last message's text marked with OPEN_END) cut right after that text, as
    transformers cuts it for continue_final_message: the model goes on with the message."""
    mark = OPEN_END.strip()
    if final.strip() not in rendered or mark not in rendered:
        raise ChatTemplateError("continue_final_message: the model's chat template does not write the last "
                                "message's text as it is, so there is nothing to continue")
    at = rendered.rindex(mark)
    return rendered[:at] if rendered[at:at + len(OPEN_END)] == OPEN_END else rendered[:at].rstrip()


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


class _Unusable:
    """A named template that did not compile: the conversations that would use it get the error."""

    def __init__(self, error: Exception) -> None:
        self._error = error

    def render(self, context: Mapping[str, Any]) -> str:
        raise ChatTemplateError(f"the model's chat template does not compile: {self._error}")


def _compile_template(source: Any, strict: bool = True):
    """Compile a chat template as transformers does: sandboxed, trim/lstrip blocks, loop controls,
    its `{% generation %}` block (which marks the assistant's part; rendered as it is here),
    raise_exception, and its `tojson` (plain JSON, not jinja's HTML-escaped one: templates render
    tools with it). Not `strict`: a template that does not compile becomes `_Unusable`."""
    if not isinstance(source, str):
        return None
    from jinja2 import nodes
    from jinja2.exceptions import TemplateError
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = tojson
    try:
        return env.from_string(source)
    except TemplateError as exc:
        if strict:
            raise
        return _Unusable(exc)
