"""A tiny random Llama model directory, built on disk, so that a real vLLM engine runs without a hub.

The directory looks like any Hugging Face checkpoint (config.json, model.safetensors,
generation_config.json, tokenizer.json, tokenizer_config.json with a chat template), so the
code that serves it is the code that serves a real model. The weights are random but fixed by
`seed`; the tokenizer is a real byte-level BPE trained on a small built-in text, so text in and
text out round-trip. head_dim is 64 because vLLM's CPU attention has no kernel for 16.

Needs only numpy, safetensors and tokenizers (dependencies of llumdask itself); never imports
vllm or torch, so the gateway, the notebook client and the tests build it without an engine.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

# Bump when the files written change, so that an old directory is rebuilt instead of reused.
FORMAT_VERSION = 2
STAMP_FILE = "llumdask-tiny-model.json"

BOS, EOS, PAD = "<s>", "</s>", "<pad>"

# KV cache an instance of the default tiny model gets unless configured otherwise: 64 MiB holds
# 32768 tokens at float32 (2 layers x K,V x 2 heads x 64 dims x 4 bytes = 2 KiB per token).
# vLLM's own default would take most of the machine's (or GPU's) memory for every instance.
DEFAULT_KV_CACHE_BYTES = 64 * 2**20

# Tools render as Hermes-style models (Qwen, Hermes) render them: the functions' JSON in a system
# turn, calls as <tool_call>{"name": ..., "arguments": ...}</tool_call>, results in "tool" turns;
# vLLM's "hermes" parser reads such calls back. Without tools a conversation renders as before.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>\nYou may call these functions:\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    'To call one, answer <tool_call>{"name": NAME, "arguments": ARGUMENTS}</tool_call>{{ eos_token }}\n'
    "{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message.get('tool_calls') %}{% for call in message['tool_calls'] %}"
    "<tool_call>{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}"
    "</tool_call>{% endfor %}"
    "{% else %}{{ message['content'] }}{% endif %}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Training text for the tokenizer: plain English about the thing it serves, so that common words
# become single tokens and prompts in tests tokenize to plausible lengths.
CORPUS = """\
Large language models generate text one token at a time. Every generated token adds a key and a
value vector per layer to the KV cache, so the memory a request needs grows while it runs, and
its final length is unknown when it arrives. A serving system batches many requests together,
stores their caches in fixed-size blocks, and preempts a request when no block is free.
Llumnix schedules requests across many instances of the same model. It dispatches each new
request to the freest instance, and it keeps rebalancing by migrating running requests together
with their KV cache from a busy instance to an idle one. The migration copies blocks in stages
while the request keeps decoding, then stops it for a short final stage, so the downtime does
not grow with the sequence length. The quick brown fox jumps over the lazy dog. Hello world!
Question: what is the capital of France? Answer: Paris is the capital of France.
User: tell me a story about a cat. Assistant: Once upon a time there was a small cat who lived
in a house by the river, and every morning the cat watched the boats go by.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024. Punctuation: , . ; : ! ? ( ) [ ] { } " ' - _ / *
"""


@dataclass(frozen=True)
class TinyLlamaShape:
    """Model dimensions. Small enough to start in seconds on two cores, large enough that
    attention over earlier tokens visibly changes the output (random weights at std 0.1)."""

    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 2
    max_position_embeddings: int = 4096
    init_std: float = 0.1

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim not in (64, 128, 256):
            raise ValueError(f"head_dim {self.head_dim} has no vLLM CPU attention kernel; use 64, 128 or 256")


def default_model_dir() -> Path:
    """Where the offline default model lives: the user's cache directory ($XDG_CACHE_HOME or
    ~/.cache), so that the gateway and every local instance find the same files."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "llumdask" / "tiny-llama"


def llama_like_shape(layers: int, hidden: int, positions: int = 4096) -> TinyLlamaShape:
    """A Llama's proportions: heads of 64 dimensions, an MLP 11/4 as wide as the hidden size."""
    heads = hidden // 64
    return TinyLlamaShape(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                          num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=positions)


def build_llama_like(layers: int, hidden: int, seed: int = 0, positions: int = 4096) -> Path:
    """A larger random Llama (`llama_like_shape`) in the cache directory, beside the default tiny one."""
    name = f"bench-llama-{layers}x{hidden}" + ("" if positions == 4096 else f"-{positions}")
    return build_tiny_model(default_model_dir().with_name(name), seed=seed,
                            shape=llama_like_shape(layers, hidden, positions))


def build_tiny_model(path: str | os.PathLike[str], seed: int = 0, shape: TinyLlamaShape | None = None) -> Path:
    """Build the model directory at `path` unless an identical one (same seed, shape and format)
    is already there; return its path. Safe against concurrent builders: the files are written
    to a temporary sibling and renamed into place."""
    target = Path(path)
    shape = shape or TinyLlamaShape()
    stamp = {"format": FORMAT_VERSION, "seed": seed, "shape": asdict(shape)}
    found = _read_stamp(target)
    if found == stamp:
        return target
    if target.exists() and any(target.iterdir()) and (found is None or found.get("format") == FORMAT_VERSION):
        raise FileExistsError(f"{target} exists and is not a tiny model built with seed={seed} and this shape")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _write_model(staging, seed, shape)
        (staging / STAMP_FILE).write_text(json.dumps(stamp, sort_keys=True))
        if target.exists():  # empty, or an older format of this model (checked above): rename cannot replace it
            _remove_old(target)
        os.rename(staging, target)
    except OSError:
        if _read_stamp(target) != stamp:  # not a concurrent builder that won the race
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _remove_old(target: Path) -> None:
    """Move `target` aside, then delete it: a reader never sees half a directory."""
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
    os.rename(target, aside / target.name)
    shutil.rmtree(aside, ignore_errors=True)


def _read_stamp(target: Path) -> dict | None:
    try:
        return json.loads((target / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return None


def _write_model(directory: Path, seed: int, shape: TinyLlamaShape) -> None:
    tokenizer = _train_tokenizer(shape.vocab_size)
    tokenizer.save(str(directory / "tokenizer.json"))
    bos, eos, pad = (tokenizer.token_to_id(t) for t in (BOS, EOS, PAD))
    _write_json(
        directory / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "add_bos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": shape.max_position_embeddings,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(directory / "special_tokens_map.json", {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD})
    _write_json(directory / "config.json", _config(shape, bos, eos, pad))
    _write_json(
        directory / "generation_config.json",
        {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad, "do_sample": False},
    )
    _write_weights(directory / "model.safetensors", seed, shape)


def _train_tokenizer(vocab_size: int):
    """Byte-level BPE: every string encodes (no unknown token), and decoding is exact."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    if tokenizer.get_vocab_size() > vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, more than vocab_size={vocab_size}")
    return tokenizer


def _config(shape: TinyLlamaShape, bos: int, eos: int, pad: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "max_position_embeddings": shape.max_position_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "initializer_range": shape.init_std,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "torch_dtype": "float32",
    }


def _write_weights(file: Path, seed: int, shape: TinyLlamaShape) -> None:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    h, i, v = shape.hidden_size, shape.intermediate_size, shape.vocab_size
    kv = shape.num_key_value_heads * shape.head_dim

    def normal(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * shape.init_std).astype(np.float32)

    tensors = {"model.embed_tokens.weight": normal(v, h)}
    for layer in range(shape.num_hidden_layers):
        p = f"model.layers.{layer}."
        tensors |= {
            p + "self_attn.q_proj.weight": normal(h, h),
            p + "self_attn.k_proj.weight": normal(kv, h),
            p + "self_attn.v_proj.weight": normal(kv, h),
            p + "self_attn.o_proj.weight": normal(h, h),
            p + "mlp.gate_proj.weight": normal(i, h),
            p + "mlp.up_proj.weight": normal(i, h),
            p + "mlp.down_proj.weight": normal(h, i),
            p + "input_layernorm.weight": np.ones(h, dtype=np.float32),
            p + "post_attention_layernorm.weight": np.ones(h, dtype=np.float32),
        }
    tensors["model.norm.weight"] = np.ones(h, dtype=np.float32)
    tensors["lm_head.weight"] = normal(v, h)
    save_file(tensors, str(file), metadata={"format": "pt"})


def _write_json(file: Path, data: dict) -> None:
    file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def directory_digest(path: str | os.PathLike[str]) -> str:
    """SHA-256 over the directory's file names and contents: equal digests = identical models."""
    digest = hashlib.sha256()
    for file in sorted(Path(path).iterdir()):
        digest.update(file.name.encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()
