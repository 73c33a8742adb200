"""Fixtures for the gateway's tests: the tiny model's real tokenizer and an app over a fake backend."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from gatewayfakes import MAX_CONTEXT, MODEL, FakeBackend
from starlette.testclient import TestClient

from llumdask.api.gateway import ModelInfo, create_app
from llumdask.config import GatewayConfig
from llumdask.api.gateway.generation_config import GenerationDefaults
from llumdask.api.gateway.tokenizer import Tokenizer, load_tokenizer
from llumdask.api.gateway.tools import AnswerReading
from llumdask.tiny_model import build_tiny_model

@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", seed=0)


@pytest.fixture(scope="session")
def tokenizer(tiny_model: Path) -> Tokenizer:
    return load_tokenizer(tiny_model)


@pytest.fixture
def script(tokenizer: Tokenizer) -> list[int]:
    """The fake backend's output: a known sentence, so that text and tokens can be checked exactly."""
    return tokenizer.encode("The quick brown fox jumps over the lazy dog. Hello world!", add_special_tokens=False)


@pytest.fixture
def backend(script: list[int]) -> FakeBackend:
    return FakeBackend(ModelInfo(MODEL, MAX_CONTEXT), script)


@pytest.fixture
def make_client(tokenizer: Tokenizer) -> Iterator[Callable[..., TestClient]]:
    """`make_client(backend, answers=None, generation=None, **settings)` -> a started TestClient (lifespan
    run); closed after the test."""
    clients: list[TestClient] = []

    def make(backend: FakeBackend, answers: AnswerReading | None = None, generation: GenerationDefaults | None = None,
             **settings) -> TestClient:
        app = create_app(backend.open, tokenizer, GatewayConfig(**settings), answers, generation)
        client = TestClient(app, raise_server_exceptions=False)
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


@pytest.fixture
def client(make_client, backend: FakeBackend) -> TestClient:
    return make_client(backend)
