"""The served model's config as vLLM's parsers read it (`parser_model_config`): vLLM's loader, the
instances' overrides, the architecture vLLM's registry runs, and a clear error where it cannot be read."""

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
    overridden = parser_model_config(str(tiny_model), hf_overrides={"model_type": "kimi_k25"})
    assert overridden.hf_config.model_type == "kimi_k25" and get_tool_call_id_type(overridden) == "kimi_k2"


def test_the_architecture_is_the_first_one_vllm_implements(tiny_model, tmp_path):
    (tmp_path / "m").mkdir()
    config = json.loads((tiny_model / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps(
        {**config, "architectures": ["NoSuchModelForCausalLM", "LlamaForCausalLM"]}))
    assert parser_model_config(str(tmp_path / "m")).architecture == "LlamaForCausalLM"
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchModelForCausalLM"]}))
    assert parser_model_config(str(tmp_path / "m")).architecture == "NoSuchModelForCausalLM"


def test_a_config_vllm_cannot_read_is_a_clear_error(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="cannot read the model's config"):
        parser_model_config(str(tmp_path))  # no config.json
    with pytest.raises(ValueError, match="hf-overrides must be a mapping"):
        parser_model_config(str(tiny_model), hf_overrides="model_type=kimi_k2")  # type: ignore[arg-type]
