"""The fast tokenizer path agrees with transformers' AutoTokenizer on the same model directory."""

from __future__ import annotations

import pytest

from llumdask.api.gateway.tokenizer import ChatTemplateError, FastTokenizer, TransformersTokenizer, max_context_of

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


@pytest.mark.slow
def test_fast_path_matches_transformers(tiny_model, tokenizer):
    # PreTrainedTokenizerFast rather than AutoTokenizer: the latter also imports the model's
    # config class, which needs a working torchvision.
    from transformers import PreTrainedTokenizerFast

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
