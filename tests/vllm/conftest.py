"""Shared real vLLM engines on the tiny model: built once per test session (about 2 s each).

Tests that share an engine leave it empty (no requests, no held blocks) when they finish. Engines
are closed only at the session's end: closing an in-process engine tears down vLLM's process-wide
parallel state, which every other engine of the process still uses.
"""

from __future__ import annotations

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
def blind_engine(vllm_ready: None, tiny_model: Path, engine_args: dict) -> Iterator["VllmEngine"]:  # noqa: F821
    """KV-cache events off: nothing reported to the scheduler's prefix index."""
    from llumdask.engine.vllm.engine import VllmEngine

    engine = VllmEngine(str(tiny_model), {**engine_args, "kv_events_config": {"enable_kv_cache_events": False}})
    yield engine
    engine.close()
