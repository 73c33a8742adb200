"""Shared real vLLM engines on the tiny model: built once per test session (about 2 s each).

Tests that share an engine leave it empty (no requests, no held blocks) when they finish. Engines
are closed only at the session's end: closing an in-process engine tears down vLLM's process-wide
parallel state, which every other engine of the process still uses.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from llumdask.tiny_model import build_tiny_model

# KV cache of the shared engine: 64 MiB = 256 blocks of 128 tokens for the tiny model
# (2 layers x K,V x 2 heads x 64 dims x 4 bytes = 2 KiB per token).
KV_CACHE_BYTES = 64 * 2**20
MAX_MODEL_LEN = 4096


@pytest.fixture(scope="session")
def vllm_ready() -> None:
    """Skip when vllm is not installed; fail with the fix when it is installed but broken."""
    from llumdask.engine.vllm.internals import check_vllm_importable

    try:
        check_vllm_importable()
    except ImportError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", seed=0)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    """Gather the PLAIN_PROMPTS of every module with a selected test, for `plain_tokens`."""
    modules = {item.module for item in items if hasattr(item, "module")}
    config.stash[PLAIN_PROMPTS] = [p for m in modules for p in getattr(m, "PLAIN_PROMPTS", [])]


PLAIN_PROMPTS = pytest.StashKey[list]()


@pytest.fixture(scope="session")
def plain_tokens(request: pytest.FixtureRequest, vllm_ready: None, tiny_model: Path,
                 engine_args: dict) -> dict[tuple[tuple[int, ...], int], list[int]]:
    """Greedy tokens from an unmodified `vllm.LLM` (plain_vllm.py, its own process) for every
    module's PLAIN_PROMPTS ([prompt ids, max tokens] each), keyed by (prompt ids, max tokens):
    one vLLM start for the whole session (each costs about 10 s on two cores)."""
    prompts = [list(p) for p in {(tuple(ids), n) for ids, n in request.config.stash[PLAIN_PROMPTS]}]
    script = Path(__file__).with_name("plain_vllm.py")
    done = subprocess.run([sys.executable, str(script), str(tiny_model), json.dumps(engine_args), json.dumps(prompts)],
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("PLAIN-VLLM-OUTPUT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    outputs = json.loads(lines[-1].split(" ", 1)[1])
    return {(tuple(ids), n): tokens for (ids, n), tokens in zip(prompts, outputs, strict=True)}


@pytest.fixture(scope="session")
def engine_args() -> dict:
    return {"dtype": "float32", "max_model_len": MAX_MODEL_LEN, "kv_cache_memory_bytes": KV_CACHE_BYTES, "seed": 0}


@pytest.fixture(scope="session")
def peer_engine(vllm_ready: None, tiny_model: Path, engine_args: dict) -> Iterator["VllmEngine"]:  # noqa: F821
    """A second instance like vllm_engine: the other end of migrations."""
    from llumdask.engine.vllm.engine import VllmEngine

    engine = VllmEngine(str(tiny_model), engine_args)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def small_engine_args(engine_args: dict) -> dict:
    """Three usable blocks (the pool keeps one as its null block): preemption within a few steps."""
    return {**engine_args, "num_gpu_blocks_override": 4, "max_model_len": 384}


@pytest.fixture(scope="session")
def small_engine(vllm_ready: None, tiny_model: Path, small_engine_args: dict) -> Iterator["VllmEngine"]:  # noqa: F821
    from llumdask.engine.vllm.engine import VllmEngine

    engine = VllmEngine(str(tiny_model), small_engine_args)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def vllm_engine(vllm_ready: None, tiny_model: Path, engine_args: dict) -> Iterator["VllmEngine"]:  # noqa: F821
    from llumdask.engine.vllm.engine import VllmEngine

    engine = VllmEngine(str(tiny_model), engine_args)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def tight_engine(vllm_ready: None, tiny_model: Path, engine_args: dict) -> Iterator["VllmEngine"]:  # noqa: F821
    """Ten usable blocks of 128 tokens: a 9-block prompt evicts the last one's."""
    from llumdask.engine.vllm.engine import VllmEngine

    engine = VllmEngine(str(tiny_model), {**engine_args, "num_gpu_blocks_override": 11, "max_model_len": 1280})
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def reasoning_engine(vllm_ready: None, tiny_model: Path, engine_args: dict,
                     tmp_path_factory: pytest.TempPathFactory) -> Iterator["VllmEngine"]:  # noqa: F821
    """An instance started with vLLM's deepseek_v3 reasoning parser, as `llumdask serve
    --reasoning-parser` starts them, over the tiny tokenizer with <think> and </think> added (ids
    the model never draws). That parser thinks only where the template kwargs say `thinking`.
    (Session-scoped as the others: closing one in-process engine tears down the parallel state
    every engine of the process shares.)"""
    from modelcopies import with_thinking_tokens

    from llumdask.engine.vllm.engine import VllmEngine

    tokenizer = with_thinking_tokens(tiny_model, tmp_path_factory.mktemp("think") / "tokenizer")
    engine = VllmEngine(str(tiny_model), {**engine_args, "reasoning_parser": "deepseek_v3", "tokenizer": str(tokenizer)})
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def budget_engines(vllm_ready: None, tiny_model: Path, engine_args: dict,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple["VllmEngine", "VllmEngine"]]:  # noqa: F821
    """Two instances with vLLM's deepseek_r1 reasoning parser over a copy of the tiny model whose
    vocabulary and weights have <think> and </think> (ids 512 and 513, one token each): a thinking
    budget's forced end is a token the model can write. The two ends of migrations."""
    from modelcopies import with_thinking_tokens

    from llumdask.engine.vllm.engine import VllmEngine

    model = with_thinking_tokens(tiny_model, tmp_path_factory.mktemp("budget") / "model", in_weights=True)
    engines = [VllmEngine(str(model), {**engine_args, "reasoning_parser": "deepseek_r1"}) for _ in range(2)]
    yield engines[0], engines[1]
    for engine in engines:
        engine.close()


@pytest.fixture(scope="session")
def blind_engine(vllm_ready: None, tiny_model: Path, engine_args: dict) -> Iterator["VllmEngine"]:  # noqa: F821
    """KV-cache events off: nothing reported to the scheduler's prefix index."""
    from llumdask.engine.vllm.engine import VllmEngine

    engine = VllmEngine(str(tiny_model), {**engine_args, "kv_events_config": {"enable_kv_cache_events": False}})
    yield engine
    engine.close()
