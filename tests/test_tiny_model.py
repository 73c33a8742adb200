"""The offline test model: a deterministic, idempotent Hugging Face directory with a real tokenizer.

Needs only tokenizers and safetensors (vLLM dependencies), not vllm itself, and runs in
milliseconds, so it is neither slow nor vllm-marked.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

from llumdask.tiny_model import TinyLlamaShape, build_llama_like, build_tiny_model, directory_digest  # noqa: E402


def test_same_seed_same_model_other_seed_other_weights(tmp_path):
    a = build_tiny_model(tmp_path / "a", seed=3)
    b = build_tiny_model(tmp_path / "b", seed=3)
    c = build_tiny_model(tmp_path / "c", seed=4)
    assert directory_digest(a) == directory_digest(b) != directory_digest(c)
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_building_again_reuses_the_directory(tmp_path):
    path = build_tiny_model(tmp_path / "m")
    weights = path / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert build_tiny_model(path) == path
    assert weights.stat().st_mtime_ns == before
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no staging directory left behind


def test_refuses_to_overwrite_something_else(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a tiny model"):
        build_tiny_model(tmp_path / "m")
    build_tiny_model(tmp_path / "n", seed=0)
    with pytest.raises(FileExistsError, match="seed=1"):
        build_tiny_model(tmp_path / "n", seed=1)


def test_is_a_llama_checkpoint_with_a_real_tokenizer(tmp_path):
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer

    path = build_tiny_model(tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["head_dim"] == 64
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert tokenizer.get_vocab_size() <= config["vocab_size"]
    text = "The cat migrates its KV cache, 2048 tokens at a time!"
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids) == text and len(ids) < len(text) // 2
    assert tokenizer.token_to_id("</s>") == config["eos_token_id"]
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    assert "add_generation_prompt" in tokenizer_config["chat_template"]
    weights = load_file(str(path / "model.safetensors"))
    assert weights["model.embed_tokens.weight"].shape == (config["vocab_size"], config["hidden_size"])
    assert len([k for k in weights if k.endswith("q_proj.weight")]) == config["num_hidden_layers"]


def test_rejects_shapes_vllm_cpu_cannot_run():
    with pytest.raises(ValueError, match="head_dim 16"):
        TinyLlamaShape(hidden_size=32, num_attention_heads=2)


def test_a_llama_like_model_has_llama_proportions_beside_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = build_llama_like(layers=3, hidden=192)
    assert path == tmp_path / "llumdask" / "bench-llama-3x192"
    config = json.loads((path / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (3, 192, 528)
    assert config["num_attention_heads"] == config["num_key_value_heads"] == 3 and config["head_dim"] == 64
    assert build_llama_like(layers=3, hidden=192) == path
