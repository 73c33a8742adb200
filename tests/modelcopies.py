"""Copies of the tiny model with a different tokenizer, for tests that need tokens it lacks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

THINKING = ("<think>", "</think>")


def with_thinking_tokens(model: Path, target: Path, *, in_weights: bool = False) -> Path:
    """`model` copied to `target` with <think> and </think> added to its tokenizer (ids 512 and 513
    on the tiny model). Past its weights, so only for tests that never run them on an engine, unless
    `in_weights`: then the embedding and output rows grow by two (existing rows negated: no logit
    ties with those), so that an engine can draw and be made to write them."""
    from tokenizers import AddedToken, Tokenizer

    shutil.copytree(model, target)
    tokenizer = Tokenizer.from_file(str(target / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINKING])
    tokenizer.save(str(target / "tokenizer.json"))
    if in_weights:
        import torch
        from safetensors.torch import load_file, save_file

        weights = load_file(str(target / "model.safetensors"))
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            weights[name] = torch.cat([weights[name], -weights[name][100:100 + len(THINKING)]])
        save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((target / "config.json").read_text())
        config["vocab_size"] = tokenizer.get_vocab_size()
        (target / "config.json").write_text(json.dumps(config))
    return target


FIM = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")  # StarCoder's spelling


def with_fim_tokens(model: Path, target: Path) -> Path:
    """`model` copied to `target` with its tokenizer's last three ids read as StarCoder's FIM tokens
    (the last three merges undone, their ids given to the tokens): a tokenizer for a gateway over
    the tiny model's engines, whose vocabulary the ids stay within."""
    shutil.copytree(model, target)
    spec = json.loads((target / "tokenizer.json").read_text())
    vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
    ids = sorted(vocab.values())[-len(FIM):]
    spec["model"]["vocab"] = {token: i for token, i in vocab.items() if i not in ids}
    spec["model"]["merges"] = merges[:-len(FIM)]
    spec["added_tokens"] += [{"id": i, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": True} for i, token in zip(ids, FIM)]
    (target / "tokenizer.json").write_text(json.dumps(spec))
    return target


def with_model_type(model: Path, target: Path, model_type: str) -> Path:
    """`model` copied to `target` with its config naming another model type (a family vLLM treats
    apart by its type, as Kimi's); the weights and tokenizer stay the tiny model's."""
    shutil.copytree(model, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    return target
