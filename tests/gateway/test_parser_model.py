"""The served model's config as vLLM's parsers read it (`parser_model_config`): vLLM's loader with the
engine options that find and override it, the architecture vLLM's registry runs, and a clear error
where it cannot be read."""

from __future__ import annotations

import json

import pytest
from modelcopies import with_model_type

from llumdask.api.gateway.parser_model import parser_model_config

pytestmark = pytest.mark.vllm


def test_the_config_reads_as_vllm_s_tool_call_ids_and_architecture_need_it(tiny_model, tmp_path):
    from vllm.renderers.chat_utils import get_tool_call_id_type

    plain = parser_model_config(str(tiny_model))
    assert plain.architecture == "LlamaForCausalLM" and get_tool_call_id_type(plain) == "random"
    assert get_tool_call_id_type(parser_model_config(str(with_model_type(tiny_model, tmp_path / "k", "kimi_k2")))) \
        == "kimi_k2"
    # (An override of the model type registers its config class with transformers for the whole
    # process, as in vLLM's server: not done here, where other tests read the same model after.)
    overridden = parser_model_config(str(tiny_model), {"hf-overrides": {"max_position_embeddings": 1024}})
    assert overridden.hf_config.max_position_embeddings == 1024
    assert overridden.hf_overrides == {"max_position_embeddings": 1024}


def test_nested_overrides_reach_a_nested_config_as_in_vllm(tiny_model, tmp_path):
    """ModelConfig's rule: flat overrides while loading, then a nested config's fields one by one
    (replacing a text config with a dict would lose it), and a dict-valued field whole."""
    from vllm.renderers.chat_utils import get_tool_call_id_type

    text = json.loads((tiny_model / "config.json").read_text())
    (tmp_path / "llava").mkdir()
    (tmp_path / "llava" / "config.json").write_text(json.dumps({
        "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "text_config": text}))
    read = parser_model_config(str(tmp_path / "llava"), {"hf-overrides": {
        "text_config": {"model_type": "kimi_k2", "max_position_embeddings": 1024},
        "rope_parameters": {"rope_type": "linear", "factor": 2.0}}})
    assert read.hf_text_config is read.hf_config.text_config and read.hf_text_config.max_position_embeddings == 1024
    assert read.hf_config.rope_parameters == {"rope_type": "linear", "factor": 2.0}
    assert get_tool_call_id_type(read) == "kimi_k2" and read.architecture == "LlavaForConditionalGeneration"


def test_the_config_is_found_where_the_engine_options_put_it(tiny_model, tmp_path):
    """vLLM's --hf-config-path: the config comes from there, not from the model's files."""
    (tmp_path / "weights-only").mkdir()
    assert parser_model_config(str(tmp_path / "weights-only"), {"hf-config-path": str(tiny_model)}).architecture \
        == "LlamaForCausalLM"


def test_the_architecture_is_the_first_one_vllm_implements(tiny_model, tmp_path):
    (tmp_path / "m").mkdir()
    config = json.loads((tiny_model / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps(
        {**config, "architectures": ["NoSuchModelForCausalLM", "LlamaForCausalLM"]}))
    assert parser_model_config(str(tmp_path / "m")).architecture == "LlamaForCausalLM"
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchModelForCausalLM"]}))
    assert parser_model_config(str(tmp_path / "m")).architecture == "NoSuchModelForCausalLM"


@pytest.mark.parametrize("config", [None, "[1, 2]", "{oops", json.dumps(
    {"model_type": "quiet", "auto_map": {"AutoConfig": "configuration_quiet.QuietConfig"}})])  # code, untrusted
def test_a_config_vllm_cannot_read_is_a_clear_error(tiny_model, tmp_path, config):
    if config is not None:
        (tmp_path / "config.json").write_text(config)
    with pytest.raises(ValueError, match="cannot read the model's config"):
        parser_model_config(str(tmp_path))


def test_overrides_that_are_not_a_mapping_are_named(tiny_model):
    with pytest.raises(ValueError, match="hf-overrides must be a mapping"):
        parser_model_config(str(tiny_model), {"hf-overrides": "model_type=kimi_k2"})
