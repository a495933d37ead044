"""Access to the gateway: credentials per path (`AccessGuard`), rate limits per key (`RateLimiter`) and requests
framed two ways refused (`FramingGuard`)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from prometheus_client import Counter
from starlette.datastructures import Headers
from starlette.requests import HTTPConnection
from starlette.types import Message, Receive, Scope, Send

from coral.openai_shapes import bearer_token
from coral.runtime.gateway.config import OPEN_PATHS, TOKEN_COOKIE, GatewayConfig, key_digest
from coral.runtime.gateway.errors import error_response


class Guarded(Protocol):
    """What the access middlewares read of the gateway (`upstream.Gateway`): its config, and the request counter
    they count refusals in."""

    @property
    def config(self) -> GatewayConfig: ...

    @property
    def requests(self) -> Counter: ...


class RateLimiter:
    """Token bucket per principal: `rate` requests/s, up to `burst` at once."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = float(burst or max(1.0, rate))
        self.buckets: dict[str, tuple[float, float]] = {}

    def wait_s(self, who: str) -> float:
        """0 if a request by `who` may go now (and counts it), else seconds until one may."""
        if self.rate <= 0:
            return 0.0
        now = time.monotonic()
        tokens, last = self.buckets.get(who, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        if tokens >= 1.0:
            self.buckets[who] = (tokens - 1.0, now)
            return 0.0
        self.buckets[who] = (tokens, now)
        if len(self.buckets) > 100_000:  # forget idle principals (unauthenticated: one per address)
            self.buckets = {k: v for k, v in self.buckets.items() if now - v[1] < 60}
        return (1.0 - tokens) / self.rate


class AccessGuard:
    """ASGI middleware: when `GatewayConfig.guarded`, every request but `OPEN_PATHS` needs a credential the
    config `allows` for its method and path (`Authorization: Bearer`, the scheme in any case; under
    /dashboard also the `TOKEN_COOKIE`, set by `GET /dashboard?token=TOKEN`), else 401 in OpenAI's shape."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], gateway: Guarded) -> None:
        self.app, self.gw = app, gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        config = self.gw.config
        if scope["type"] != "http" or not config.guarded or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        path, method = scope["path"], scope["method"]
        token = bearer_token(Headers(scope=scope).get("authorization", ""))
        cookie = ""
        if not token and path.startswith("/dashboard"):
            conn = HTTPConnection(scope)
            cookie = conn.query_params.get("token", "") if path == "/dashboard" else ""
            token = cookie or conn.cookies.get(TOKEN_COOKIE, "")
        if not config.allows(key_digest(token), method, path):
            self.gw.requests.labels("", "unauthorized").inc()
            msg = "Incorrect API key or token provided: send `Authorization: Bearer KEY`"
            return await error_response(401, msg, "invalid_api_key")(scope, receive, send)
        if not cookie:
            return await self.app(scope, receive, send)
        value = f"{TOKEN_COOKIE}={cookie}; HttpOnly; SameSite=Strict; Path=/dashboard"

        async def send_with_cookie(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"set-cookie", value.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_cookie)


class FramingGuard:
    """ASGI middleware: a request with both Content-Length and Transfer-Encoding gets 400 before anything else
    reads it, and its connection is closed (RFC 9112 section 6.1 allows the refusal: a proxy and a server that
    each take a different one of the two framings would see different requests, the smuggling of one inside
    another)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], gateway: Guarded) -> None:
        self.app, self.gw = app, gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            names = {name.lower() for name, _ in scope["headers"]}
            if b"content-length" in names and b"transfer-encoding" in names:
                self.gw.requests.labels("", "bad_request").inc()
                msg = ("a request may not carry both Content-Length and Transfer-Encoding headers (RFC 9112 "
                       "section 6.1): send one")
                refusal = error_response(400, msg, "ambiguous_framing")
                refusal.headers["connection"] = "close"
                return await refusal(scope, receive, send)
        await self.app(scope, receive, send)
