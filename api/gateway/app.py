"""The gateway app factory: routes, API-key middleware, and a lifespan that owns the backend.

The backend (for a cluster: an asynchronous Dask client and the token listener) is opened in
the lifespan, on the server's event loop, and closed when the server stops; handlers only
ever await it. Nothing lives in module globals, so one process may hold several apps.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from starlette.applications import Starlette
from starlette.middleware import Middleware

from llumdask.api.gateway.auth import APIKeys, AuthMiddleware
from llumdask.api.gateway.backend import Backend
from llumdask.api.gateway.errors import EXCEPTION_HANDLERS
from llumdask.api.gateway.generation import InFlight
from llumdask.api.gateway.generation_config import GenerationDefaults
from llumdask.api.gateway.metrics import GatewayMetrics
from llumdask.api.gateway.rate_limits import RateLimits
from llumdask.api.gateway.routes import ROUTES, Gateway
from llumdask.api.gateway.tokenizer import Tokenizer
from llumdask.api.gateway.tools import AnswerReading
from llumdask.config import GatewayConfig, load_config

BackendFactory = Callable[[], AbstractAsyncContextManager[Backend]]


def create_app(open_backend: BackendFactory, tokenizer: Tokenizer,
               settings: GatewayConfig | None = None, answers: AnswerReading | None = None,
               generation: GenerationDefaults | None = None) -> Starlette:
    """An OpenAI-compatible app serving the model of the backend that `open_backend()` opens;
    `settings`: the ``llumdask.gateway`` section (dask.config's when None); `answers`: how chat
    answers are read, tool calls and reasoning (without parsers when None: tool_choice "auto" is a 400);
    `generation`: the model's generation config (`read_generation_config`; none when None)."""
    settings = settings if settings is not None else load_config().gateway
    answers = answers if answers is not None else AnswerReading()
    metrics = GatewayMetrics()

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Gateway]]:
        async with open_backend() as backend:
            in_flight = InFlight(settings.max_in_flight, settings.retry_after, metrics.in_flight)
            limits = RateLimits(settings.requests_per_minute, settings.tokens_per_minute)
            yield {"gateway": Gateway(backend, tokenizer, settings, metrics, in_flight, limits, answers,
                                      generation or GenerationDefaults())}

    return Starlette(
        routes=ROUTES,
        middleware=[Middleware(AuthMiddleware, keys=APIKeys(settings.api_keys), on_reject=metrics.error)],
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=lifespan,
    )
