"""Optional API keys: ``Authorization: Bearer KEY`` on the OpenAI routes (``/v1/...``).

/health and /metrics stay open for load balancers and Prometheus. Keys are compared as SHA-256
digests with `hmac.compare_digest`, against every configured key without stopping at a match,
so neither the time taken nor the length of a key tells an attacker how close a guess was.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterable

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from llumdask.api.gateway.errors import Unauthorized
from llumdask.api.gateway.rate_limits import key_id

PROTECTED_PREFIX = "/v1/"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class APIKeys:
    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = tuple(_digest(k) for k in keys)

    def __bool__(self) -> bool:
        return bool(self._digests)

    def accepts(self, key: str) -> bool:
        candidate = _digest(key)
        matched = False
        for digest in self._digests:
            matched |= hmac.compare_digest(candidate, digest)
        return matched

    def check(self, authorization: str | None) -> str:
        """The key of `authorization` (``Bearer <a configured key>``); else Unauthorized."""
        if not authorization:
            raise Unauthorized("Missing API key: send it as 'Authorization: Bearer <key>'")
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthorized("The Authorization header must be 'Bearer <key>'")
        if not self.accepts(key.strip()):
            raise Unauthorized("Incorrect API key provided")
        return key.strip()


class AuthMiddleware:
    """Rejects unauthenticated requests to /v1/* with a 401 in OpenAI's error shape."""

    def __init__(self, app: ASGIApp, keys: APIKeys, on_reject: Callable[[str], None] = lambda code: None) -> None:
        self.app = app
        self.keys = keys
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.keys and scope["path"].startswith(PROTECTED_PREFIX):
            try:
                key = self.keys.check(Headers(scope=scope).get("authorization"))
            except Unauthorized as exc:
                self.on_reject(exc.code)
                await exc.response()(scope, receive, send)
                return
            # Routes see which key asked (for its rate limits), as a digest only.
            scope.setdefault("state", {})["api_key"] = key_id(key)
        await self.app(scope, receive, send)
