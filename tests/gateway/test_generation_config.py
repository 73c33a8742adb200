"""The model's generation config as vLLM's server applies it: sampling defaults for what a request
leaves out, the default answer length, more end-of-sequence tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import shutil
from pathlib import Path

import pytest
from gatewayfakes import MAX_CONTEXT, MODEL

from llumdask.api.gateway.generation_config import GenerationDefaults, default_source, read_generation_config

QWEN_LIKE = {"eos_token_id": [1, 7, 9], "temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.05,
             "max_new_tokens": 64, "do_sample": True, "pad_token_id": 2}


def model_with(tiny_model: Path, tmp_path: Path, config: dict | None) -> Path:
    """A copy of the tiny model whose generation_config.json is `config` (None: no file)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "generation_config.json").unlink(missing_ok=True)
    if config is not None:
        (model / "generation_config.json").write_text(json.dumps(config))
    return model


def test_the_models_file_gives_sampling_defaults_a_length_and_end_tokens(tiny_model, tmp_path):
    model = model_with(tiny_model, tmp_path, QWEN_LIKE)
    read = read_generation_config(model)
    assert read == GenerationDefaults({"repetition_penalty": 1.05, "temperature": 0.6, "top_k": 20, "top_p": 0.95}, 64,
                                      (1, 7, 9))
    # vllm: none of its sampling, but the engine still ends on its tokens; a directory: that file's.
    assert read_generation_config(model, "vllm") == GenerationDefaults(eos_token_ids=(1, 7, 9))
    other = model_with(tiny_model, tmp_path / "other", {"temperature": 0.2, "eos_token_id": 3})
    assert read_generation_config(model, other) == GenerationDefaults({"temperature": 0.2}, None, (3,), True)
    # Without the file, the model config's settings (as transformers and vLLM read them): its end token.
    assert read_generation_config(model_with(tiny_model, tmp_path / "none", None)) == GenerationDefaults(eos_token_ids=(1,))
    assert (default_source("sim"), default_source("vllm"), default_source(None)) == ("vllm", "auto", "auto")
    # vLLM's --override-generation-config: over any source's values; its max_new_tokens caps every request.
    assert read_generation_config(model, "vllm", {"temperature": 0.3, "max_new_tokens": 9}) == GenerationDefaults(
        {"temperature": 0.3}, 9, (1, 7, 9), True)
    assert read_generation_config(model, "auto", {"top_k": 5}).sampling == {**read.sampling, "top_k": 5}


@pytest.mark.parametrize("config, words", [
    ({"temperature": "hot"}, "temperature must be a finite number"),
    ({"max_new_tokens": 0}, "max_new_tokens must be a positive integer"),
    ({"eos_token_id": "x"}, "eos_token_id must be a token id"),
    ([1, 2], "must hold a JSON object"),
])
def test_a_bad_file_is_an_error_naming_it(tiny_model, tmp_path, config, words):
    with pytest.raises(ValueError, match=words) as raised:
        read_generation_config(model_with(tiny_model, tmp_path, config))
    assert str(tmp_path / "model") in str(raised.value)


def test_a_source_that_is_no_directory_and_a_value_no_request_could_carry_are_refused(tiny_model, tmp_path):
    model = model_with(tiny_model, tmp_path, QWEN_LIKE)
    with pytest.raises(ValueError, match="takes auto, vllm, a directory"):
        read_generation_config(model, tmp_path / "missing")
    (tmp_path / "empty").mkdir()  # vLLM's engines would fail to start on it
    with pytest.raises(ValueError, match="takes auto, vllm, a directory"):
        read_generation_config(model, tmp_path / "empty")


def test_a_model_on_the_hub_is_a_source_too(tiny_model, tmp_path):
    """vLLM reads `--generation-config NAME` from the hub as transformers does: so does the gateway
    (a hub cache filled beforehand, read offline in a process of its own)."""
    snapshot = tmp_path / "hub" / "models--some-org--tuned" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "generation_config.json").write_text(json.dumps({"temperature": 0.4, "eos_token_id": [1, 9]}))
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    script = ("from llumdask.api.gateway.generation_config import read_generation_config as r; import sys; "
              "print(r(sys.argv[1], sys.argv[2]))")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-c", script, str(tiny_model), "some-org/tuned"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == repr(GenerationDefaults({"temperature": 0.4}, None, (1, 9), True))
    missing = subprocess.run([sys.executable, "-c", script, str(tiny_model), "some-org/absent"], env=env,
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode != 0 and "or such a model on the hub; some-org/absent is none of them" in missing.stderr


def test_a_config_transformers_cannot_build_is_read_as_it_stands(tiny_model, tmp_path):
    """A model type transformers does not know (vLLM's own registry may): its end tokens still count."""
    model = model_with(tiny_model, tmp_path, None)
    (model / "config.json").write_text(json.dumps({"model_type": "no-such-type", "eos_token_id": [5, 6]}))
    assert read_generation_config(model, "vllm") == GenerationDefaults(eos_token_ids=(5, 6))
    with pytest.raises(ValueError, match="repetition_penalty must be a number > 0"):
        read_generation_config(model_with(tiny_model, tmp_path / "none", {"repetition_penalty": 0}))
    # vLLM takes any penalty above 0: so does the gateway.
    assert read_generation_config(model_with(tiny_model, tmp_path / "strong", {"repetition_penalty": 2.5})).sampling == {
        "repetition_penalty": 2.5}


def test_a_bad_override_is_an_error_naming_it(tiny_model, tmp_path):
    model = model_with(tiny_model, tmp_path, QWEN_LIKE)
    with pytest.raises(ValueError, match="must be a JSON object"):
        read_generation_config(model, "auto", [1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match='with {"top_p": "x"}: generation config top_p must be a finite number'):
        read_generation_config(model, "auto", {"top_p": "x"})


def test_requests_get_the_models_defaults_for_what_they_leave_out(make_client, backend, tokenizer):
    defaults = GenerationDefaults({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05}, 64,
                                  (tokenizer.eos_token_id, 7))
    client = make_client(backend, generation=defaults)
    messages = [{"role": "user", "content": "Hi"}]
    assert client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages}).status_code == 200
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "temperature": 0, "top_k": 5,
                                                "ignore_eos": True}).status_code == 200
    chat, given = (s.sampling for s in backend.submitted)
    assert (chat.temperature, chat.top_p, chat.top_k, chat.repetition_penalty) == (0.6, 0.95, 20, 1.05)
    assert chat.max_tokens == 64 and chat.stop_token_ids == (tokenizer.eos_token_id, 7)
    # The request's own values win; completions keep OpenAI's 16; ignore_eos drops every end token.
    assert (given.temperature, given.top_p, given.top_k, given.repetition_penalty) == (0.0, 0.95, 5, 1.05)
    assert given.max_tokens == 16 and given.stop_token_ids == ()


def test_the_default_length_never_passes_the_context(make_client, backend):
    client = make_client(backend, generation=GenerationDefaults(max_tokens=10 * MAX_CONTEXT))
    client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
    sub = backend.submitted[0]
    assert sub.sampling.max_tokens == MAX_CONTEXT - len(sub.prompt_token_ids)


def test_a_file_named_by_directory_caps_what_requests_ask(make_client, backend):
    client = make_client(backend, generation=GenerationDefaults(max_tokens=8, caps_max_tokens=True))
    client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 20})
    client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 5})
    assert [s.sampling.max_tokens for s in backend.submitted] == [8, 5]


def test_an_end_token_of_the_generation_config_is_named_as_the_stop_reason(make_client, backend, script, tokenizer):
    """vLLM adds the generation config's end tokens to the request's stop tokens: one ends the
    answer with stop_reason naming it (the tokenizer's own ends it unnamed)."""
    backend.script = [*script[:3], script[5], *script[3:]]
    client = make_client(backend, generation=GenerationDefaults(eos_token_ids=(tokenizer.eos_token_id, script[5])))
    choice = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 20}).json()["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"], choice["text"]) == ("stop", script[5], tokenizer.decode(script[:3]))
    backend.script = [*script[:2], tokenizer.eos_token_id, *script[2:]]  # the tokenizer's own, listed too: unnamed
    choice = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 20}).json()["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"], choice["text"]) == ("stop", None, tokenizer.decode(script[:2]))


def test_beam_search_takes_only_the_temperature_from_the_model(make_client, backend):
    """As vLLM's server: its beam search reads the default temperature (and a default top_k is no
    option the search refuses)."""
    backend.batch_size = 1
    client = make_client(backend, generation=GenerationDefaults({"temperature": 0.6, "top_k": 20}))
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "n": 2,
                                             "use_beam_search": True})
    assert r.status_code == 200, r.text
    assert {s.sampling.temperature for s in backend.submitted} == {0.6}


@pytest.mark.vllm
def test_the_defaults_are_those_vllms_server_takes(tiny_model, tmp_path):
    """Against vLLM's own reading of the same files (its ModelConfig, as `vllm serve` builds it)."""
    from vllm.config import ModelConfig

    configs = [QWEN_LIKE, {"eos_token_id": 1, "temperature": 1.0, "top_k": 50}, {"presence_penalty": 0.5, "min_p": 0.1},
               {"do_sample": False}, None]
    for k, config in enumerate(configs):
        model = model_with(tiny_model, tmp_path / str(k), config)
        elsewhere = model_with(tiny_model, tmp_path / f"elsewhere-{k}", configs[k - 1])
        for source, override in (("auto", {}), ("vllm", {}), (str(elsewhere), {}), ("auto", {"top_k": 3}),
                                 ("vllm", {"temperature": 0.4, "max_new_tokens": 12})):
            vllm_config = ModelConfig(model=str(model), generation_config=source, override_generation_config=override)
            ours = read_generation_config(model, source, override)
            expected = vllm_config.get_diff_sampling_param()
            assert {**ours.sampling, **({"max_tokens": ours.max_tokens} if ours.max_tokens else {})} == expected
            eos = vllm_config.try_get_generation_config().get("eos_token_id")
            assert ours.eos_token_ids == (() if eos is None else (eos,) if isinstance(eos, int) else tuple(eos))
