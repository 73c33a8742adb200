"""The fast tokenizer path agrees with transformers' AutoTokenizer on the same model directory."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest

from llumdask.api.gateway.tokenizer import (
    ChatTemplateError,
    FastTokenizer,
    TransformersTokenizer,
    load_tokenizer,
    max_context_of,
    served_tokenizer,
)
from llumdask.tiny_model import CHAT_TEMPLATE

TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}
CONVERSATIONS = [
    [{"role": "user", "content": "Hello world"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Italy? \u00e9\u20ac"}],
]


def test_fast_tokenizer_round_trips_text(tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.eos_token_id == 1 and tokenizer.vocab_size == 512


def test_max_context_comes_from_the_model_files(tiny_model, tmp_path):
    assert max_context_of(tiny_model) == 4096
    assert max_context_of(tmp_path) is None


def test_model_without_chat_template_refuses_chat(tiny_model, tmp_path):
    for name in ("tokenizer.json",):
        (tmp_path / name).write_bytes((tiny_model / name).read_bytes())
    with pytest.raises(ChatTemplateError, match="no chat template"):
        FastTokenizer(tmp_path).render_chat(CONVERSATIONS[0])


# A template that marks where it came from, so each test sees which one was chosen.
def _marked(mark: str) -> str:
    return f"[{mark}]" + CHAT_TEMPLATE


def _model_without_template(tiny_model: Path, directory: Path) -> Path:
    """The tiny model's tokenizer files with the template taken out of tokenizer_config.json."""
    directory.mkdir()
    shutil.copy(tiny_model / "tokenizer.json", directory)
    config = json.loads((tiny_model / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def _mark_of(tokenizer) -> str:
    return tokenizer.render_chat(CONVERSATIONS[0]).split("]")[0].lstrip("[")


def test_chat_template_jinja_file_as_save_pretrained_writes_it(tiny_model, tmp_path):
    model = _model_without_template(tiny_model, tmp_path / "model")
    (model / "chat_template.jinja").write_text(_marked("jinja"))
    assert _mark_of(load_tokenizer(model)) == "jinja"


def test_chat_template_jinja_file_wins_over_the_config_field(tiny_model, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": _marked("config")}))
    assert _mark_of(load_tokenizer(model)) == "config"
    (model / "chat_template.jinja").write_text(_marked("jinja"))
    assert _mark_of(load_tokenizer(model)) == "jinja"


def _mark_with_tools(tokenizer) -> str:
    return tokenizer.render_chat(CONVERSATIONS[0], tools=[TOOL]).split("]")[0].lstrip("[")


def test_named_templates_use_tool_use_for_tools_and_default_otherwise(tiny_model, tmp_path):
    model = _model_without_template(tiny_model, tmp_path / "model")
    (model / "additional_chat_templates").mkdir()
    (model / "additional_chat_templates" / "tool_use.jinja").write_text(_marked("tools"))
    with pytest.raises(ChatTemplateError, match=r"templates \(tool_use\) have no default"):
        load_tokenizer(model).render_chat(CONVERSATIONS[0])
    assert _mark_with_tools(load_tokenizer(model)) == "tools"
    (model / "chat_template.jinja").write_text(_marked("default"))
    assert _mark_of(load_tokenizer(model)) == "default" and _mark_with_tools(load_tokenizer(model)) == "tools"


def test_named_templates_in_the_config_field(tiny_model, tmp_path):
    model = _model_without_template(tiny_model, tmp_path / "model")
    config = json.loads((model / "tokenizer_config.json").read_text())
    named = [{"name": "default", "template": _marked("default")}, {"name": "tool_use", "template": _marked("tools")}]
    (model / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": named}))
    assert _mark_of(load_tokenizer(model)) == "default" and _mark_with_tools(load_tokenizer(model)) == "tools"
    # A file wins over the field, as in transformers.
    (model / "chat_template.jinja").write_text(_marked("jinja"))
    assert _mark_of(load_tokenizer(model)) == "jinja" and _mark_with_tools(load_tokenizer(model)) == "jinja"


def test_loop_controls_and_generation_blocks_render_as_transformers_renders_them(tiny_model, tmp_path):
    transformers = pytest.importorskip("transformers")
    model = _model_without_template(tiny_model, tmp_path / "model")
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m['content'] }}{% endfor %}"
        "{% generation %}[answer]{% endgeneration %}")
    reference = TransformersTokenizer(transformers.PreTrainedTokenizerFast.from_pretrained(str(model)))
    two = [*CONVERSATIONS[0], {"role": "user", "content": "dropped"}]
    assert load_tokenizer(model).render_chat(two) == reference.render_chat(two) == "Hello world[answer]"


def test_a_named_template_that_does_not_compile_fails_only_where_it_is_used(tiny_model, tmp_path):
    model = _model_without_template(tiny_model, tmp_path / "model")
    (model / "chat_template.jinja").write_text(_marked("default"))
    (model / "additional_chat_templates").mkdir()
    (model / "additional_chat_templates" / "tool_use.jinja").write_text("{% if %}")
    tokenizer = load_tokenizer(model)
    assert _mark_of(tokenizer) == "default"
    with pytest.raises(ChatTemplateError, match="does not compile"):
        tokenizer.render_chat(CONVERSATIONS[0], tools=[TOOL])
    (model / "chat_template.jinja").write_text("{% if %}")
    with pytest.raises(Exception, match="Expected an expression"):  # the default one: loading fails, loudly
        load_tokenizer(model)


def test_the_operator_names_one_of_the_models_templates(tiny_model, tmp_path):
    model = _model_without_template(tiny_model, tmp_path / "model")
    (model / "chat_template.jinja").write_text(_marked("default"))
    (model / "additional_chat_templates").mkdir()
    (model / "additional_chat_templates" / "rag.jinja").write_text(_marked("rag"))
    assert _mark_of(load_tokenizer(model, "rag")) == "rag" and _mark_with_tools(load_tokenizer(model, "rag")) == "rag"
    with pytest.raises(ChatTemplateError, match="'summarise' cannot be read"):
        load_tokenizer(model, "summarise")
    # A list in the config's field keeps its names even with one alone.
    config_model = _model_without_template(tiny_model, tmp_path / "config")
    config = json.loads((config_model / "tokenizer_config.json").read_text())
    named = {"chat_template": [{"name": "default", "template": _marked("only")}]}
    (config_model / "tokenizer_config.json").write_text(json.dumps(config | named))
    assert _mark_of(load_tokenizer(config_model)) == "only" == _mark_of(load_tokenizer(config_model, "default"))


def test_processor_chat_template_json(tiny_model, tmp_path):
    model = _model_without_template(tiny_model, tmp_path / "model")
    (model / "chat_template.json").write_text(json.dumps({"chat_template": _marked("processor")}))
    assert _mark_of(load_tokenizer(model)) == "processor"


def test_operator_template_overrides_the_model_as_a_file_or_as_text(tiny_model, tmp_path):
    file = tmp_path / "override.jinja"
    file.write_text(_marked("file"))
    assert _mark_of(load_tokenizer(tiny_model, file)) == "file"
    assert _mark_of(load_tokenizer(tiny_model, str(file))) == "file"
    assert _mark_of(load_tokenizer(tiny_model, _marked("text"))) == "text"
    with pytest.raises(ChatTemplateError, match="cannot be read"):
        load_tokenizer(tiny_model, str(tmp_path / "missing.jinja"))


def test_every_layout_renders_as_transformers_renders_it(tiny_model, tmp_path):
    transformers = pytest.importorskip("transformers")
    def named_in_config(m: Path) -> None:
        config = json.loads((m / "tokenizer_config.json").read_text())
        named = [{"name": "default", "template": _marked("default")}, {"name": "tool_use", "template": _marked("tools")}]
        (m / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": named}))

    layouts = {
        "jinja": lambda m: (m / "chat_template.jinja").write_text(_marked("jinja")),
        "named": lambda m: ((m / "chat_template.jinja").write_text(_marked("default")),
                            (m / "additional_chat_templates").mkdir(),
                            (m / "additional_chat_templates" / "tool_use.jinja").write_text(_marked("tools"))),
        "named in the config": named_in_config,
    }
    for name, write in layouts.items():
        model = _model_without_template(tiny_model, tmp_path / name)
        write(model)
        reference = TransformersTokenizer(transformers.PreTrainedTokenizerFast.from_pretrained(str(model)))
        for messages, tools in itertools.product(CONVERSATIONS, (None, [TOOL])):
            assert load_tokenizer(model).render_chat(messages, tools=tools) == reference.render_chat(messages, tools=tools), name


@pytest.mark.slow
def test_fast_path_matches_transformers(tiny_model, tokenizer):
    # PreTrainedTokenizerFast rather than AutoTokenizer: the latter also imports the model's
    # config class, which needs a working torchvision.
    PreTrainedTokenizerFast = pytest.importorskip("transformers").PreTrainedTokenizerFast

    reference = TransformersTokenizer(PreTrainedTokenizerFast.from_pretrained(str(tiny_model)))
    for messages in CONVERSATIONS:
        rendered = tokenizer.render_chat(messages)
        assert rendered == reference.render_chat(messages)
        ids = tokenizer.encode(rendered, add_special_tokens=False)
        assert ids == reference.encode(rendered, add_special_tokens=False)
    text = "Hello world! \u00e9\u20ac"
    assert tokenizer.encode(text) == reference.encode(text)
    assert tokenizer.decode(tokenizer.encode(text)) == reference.decode(reference.encode(text))
    assert tokenizer.eos_token_id == reference.eos_token_id and tokenizer.vocab_size == reference.vocab_size


@pytest.mark.slow
def test_tools_and_tool_calls_render_as_transformers_renders_them(tiny_model, tokenizer):
    """The tiny model's template with tools, an earlier call and its result; `tojson` as
    transformers defines it (jinja's own would HTML-escape the JSON)."""
    PreTrainedTokenizerFast = pytest.importorskip("transformers").PreTrainedTokenizerFast

    reference = TransformersTokenizer(PreTrainedTokenizerFast.from_pretrained(str(tiny_model)))
    tools = [{"type": "function", "function": {"name": "lookup", "description": "Find <things> & 'stuff' \u00e9",
                                               "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
    conversation = [{"role": "user", "content": "Find cats"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": {"q": "cats"}}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "3 cats"}]
    rendered = tokenizer.render_chat(conversation, tools=tools)
    assert rendered == reference.render_chat(conversation, tools=tools)
    assert "<things> & 'stuff' \u00e9" in rendered and '<tool_call>{"name": "lookup", "arguments": {"q": "cats"}}' in rendered
    assert tokenizer.render_chat(conversation[:1], tools=None) == reference.render_chat(conversation[:1])


QUIET = '''from tokenizers import normalizers
from transformers import PreTrainedTokenizerFast


class QuietTokenizer(PreTrainedTokenizerFast):
    """The model's own tokenizer code: it reads text in lower case, and writes it in capitals
    where its own decode runs (vLLM's engines never run it: they decode with the Rust tokenizer)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.backend_tokenizer.normalizer = normalizers.Lowercase()

    def _decode(self, token_ids, **kwargs):
        return super()._decode(token_ids, **kwargs).upper()
'''


@pytest.mark.slow
@pytest.mark.vllm
def test_the_models_own_tokenizer_code_runs_only_where_it_is_trusted(tiny_model, tmp_path):
    """vLLM's --trust-remote-code: a model naming tokenizer code of its own (auto_map) is tokenized
    by it as vLLM loads it, and its text decoded as vLLM's engines decode it (the Rust tokenizer's,
    never the class's own decode); untrusted, its tokenizer.json is read as it stands. The
    notebook client trusts it when told to."""
    from vllm.tokenizers import get_tokenizer

    from llumdask.api.client import LlumdaskClient

    model = tmp_path / "own-code"
    shutil.copytree(tiny_model, model)
    (model / "tokenization_quiet.py").write_text(QUIET)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "tokenization_quiet.QuietTokenizer"]}
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    vllms = get_tokenizer(str(model), trust_remote_code=True)
    expected = vllms.encode("HELLO World", add_special_tokens=False)
    untrusted, trusted = load_tokenizer(model), load_tokenizer(model, trust_remote_code=True)
    assert isinstance(trusted, TransformersTokenizer) and isinstance(untrusted, FastTokenizer)
    assert trusted.encode("HELLO World", add_special_tokens=False) == expected
    assert untrusted.encode("HELLO World", add_special_tokens=False) != expected
    decoded = trusted.decode(expected)
    assert decoded == vllms.backend_tokenizer.decode(expected) and decoded.islower()  # not the class's capitals
    assert served_tokenizer(str(model), None, {"trust-remote-code": True}).tokenizer.encode(
        "HELLO World", add_special_tokens=False) == expected
    assert served_tokenizer(str(model), None, {"trust_remote_code": False}).tokenizer.encode(
        "HELLO World", add_special_tokens=False) != expected
    for trust in (True, False):
        client = LlumdaskClient(None, model=str(model), trust_remote_code=trust)  # its tokenizer needs no cluster
        assert (client.tokenizer.encode("HELLO World", add_special_tokens=False) == expected) is trust


def internlm_like(tiny_model: Path, target: Path) -> Path:
    """The tiny model as a model type whose hub tokenizer class vLLM overrides (InternLM2's), with
    code of its own, as InternLM2's repositories: a config class (vLLM reads the type through it,
    where the code is trusted) and a tokenizer class AutoTokenizer would run."""
    shutil.copytree(tiny_model, target)
    (target / "tokenization_quiet.py").write_text(QUIET)
    (target / "configuration_quiet.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass QuietConfig(LlamaConfig):\n    model_type = 'internlm2'\n")
    tokenizer_config = json.loads((target / "tokenizer_config.json").read_text())
    tokenizer_config.update(auto_map={"AutoTokenizer": [None, "tokenization_quiet.QuietTokenizer"]},
                            tokenizer_class="QuietTokenizer")
    (target / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(
        {**config, "model_type": "internlm2", "auto_map": {"AutoConfig": "configuration_quiet.QuietConfig"}}))
    return target


@pytest.mark.slow
@pytest.mark.vllm
def test_a_model_type_vllm_reads_with_the_generic_tokenizer_is_read_so_here(tiny_model, tmp_path, monkeypatch):
    """vLLM reads some model types' tokenizers (InternLM2's, ...) with transformers' generic fast
    tokenizer whatever class or code they name: so does the gateway, trusted or not, from a directory
    or the hub (where AutoTokenizer, untrusted, would refuse to start)."""
    import huggingface_hub.constants
    from vllm.tokenizers import get_tokenizer

    model = internlm_like(tiny_model, tmp_path / "internlm-like")
    expected = get_tokenizer(str(model), trust_remote_code=True).encode("HELLO World", add_special_tokens=False)
    assert expected == load_tokenizer(tiny_model).encode("HELLO World", add_special_tokens=False)  # not the code's
    for trust in (True, False):
        assert load_tokenizer(model, trust_remote_code=trust).encode("HELLO World", add_special_tokens=False) == expected
    snapshot = tmp_path / "hub" / "models--some-org--internlm-like" / "snapshots" / ("a" * 40)
    shutil.copytree(model, snapshot)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub = load_tokenizer("some-org/internlm-like", trust_remote_code=True)
    assert isinstance(hub, TransformersTokenizer) and hub.encode("HELLO World", add_special_tokens=False) == expected


@pytest.mark.vllm
def test_the_generic_tokenizer_types_are_vllm_s():
    from vllm.tokenizers.registry import _MODEL_TYPES_WITH_INCORRECT_TOKENIZER_CLASS

    from llumdask.api.gateway.tokenizer import GENERIC_TOKENIZER_TYPES

    assert GENERIC_TOKENIZER_TYPES == _MODEL_TYPES_WITH_INCORRECT_TOKENIZER_CLASS


@pytest.mark.parametrize("code", [True, False])
def test_a_hub_snapshot_takes_the_models_python_modules_only_where_its_code_is_trusted(tmp_path, monkeypatch, code):
    """A tokenizer's own code imports its neighbours (Kimi's tokenizer its tool declarations): with
    the code trusted, the snapshot the gateway fetches holds every module of the model's."""
    import huggingface_hub

    from llumdask.api.gateway.tokenizer import files_at

    asked: list[list[str]] = []

    def snapshot_download(repo_id: str, *, revision: str, allow_patterns: list[str], local_files_only: bool) -> str:
        asked.append(allow_patterns)
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert files_at("some-org/tiny", "main", code) == str(tmp_path)
    assert ("*.py" in asked[0]) is code and "tokenizer.json" in asked[0]
