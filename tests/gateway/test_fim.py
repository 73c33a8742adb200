"""A completion's suffix: a fill-in-the-middle prompt for models with FIM tokens, a 400 for others."""

from __future__ import annotations

import json
import shutil

import pytest
from gatewayfakes import MODEL, FakeBackend
from starlette.testclient import TestClient

from llumdask.api.gateway import ModelInfo, create_app
from llumdask.api.gateway.fim import FIM_FAMILIES
from llumdask.api.gateway.tokenizer import load_tokenizer
from llumdask.config import GatewayConfig


def with_added_tokens(model, target, tokens):
    """A copy of `model` whose tokenizer has `tokens` as special tokens (as a code model's has)."""
    from tokenizers import Tokenizer as RustTokenizer

    shutil.copytree(model, target)
    rust = RustTokenizer.from_file(str(target / "tokenizer.json"))
    rust.add_special_tokens(list(tokens))
    rust.save(str(target / "tokenizer.json"))
    return target


@pytest.mark.parametrize("family", FIM_FAMILIES, ids=lambda f: f[0])
def test_a_suffix_becomes_a_fim_prompt_in_the_models_own_tokens(tiny_model, tmp_path, script, family):
    tokenizer = load_tokenizer(with_added_tokens(tiny_model, tmp_path / "coder", family))
    backend = FakeBackend(ModelInfo(MODEL, 256), script)
    with TestClient(create_app(backend.open, tokenizer, GatewayConfig())) as client:
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "def add(a, b):\n    return ",
                                                 "suffix": "\n\nprint(add(1, 2))", "max_tokens": 4})
    assert r.status_code == 200, r.text
    ids = backend.submitted[0].prompt_token_ids
    marks = [tokenizer.encode(t, add_special_tokens=False) for t in family]
    assert all(len(m) == 1 for m in marks)  # each mark is one token, as the model learned it
    positions = [ids.index(m[0]) for m in marks]
    assert positions == sorted(positions) and positions[-1] == len(ids) - 1  # prefix, suffix, then the middle
    assert tokenizer.decode(ids[positions[0] + 1:positions[1]]) == "def add(a, b):\n    return "
    assert tokenizer.decode(ids[positions[1] + 1:positions[2]]) == "\n\nprint(add(1, 2))"
    assert r.json()["choices"][0]["text"] == tokenizer.decode(script[:4])  # the middle only, as OpenAI's


@pytest.mark.parametrize("body, words", [
    ({"prompt": "def f():", "suffix": "pass"}, "fill in the middle"),
    ({"prompt": [1, 2, 3], "suffix": "pass"}, "text prompt"),
    ({"prompt": "x", "suffix": 5}, "string"),
])
def test_a_suffix_the_model_cannot_fill_is_400(client, backend, body, words):
    r = client.post("/v1/completions", json={"model": MODEL, "max_tokens": 4, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix" and words in r.json()["error"]["message"]
    assert backend.submitted == []
    empty = client.post("/v1/completions", json={"model": MODEL, "max_tokens": 2, "prompt": "x", "suffix": ""})
    assert empty.status_code == 200, json.dumps(empty.json())  # OpenAI's clients send "" for none
