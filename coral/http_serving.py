"""uvicorn for Coral's servers: bounded header reads and shutdown (`server_config`, `DrainingServer`), and
`ServerThread`, an app served in a background thread on loopback (engine instances, tests, emulated engines), and
`unless_disconnected`, which cancels a request's work when its client leaves before the answer, and `PagePolicy`,
which gives HTML pages their Content-Security-Policy.

A top-level module, below both the runtime (`coral serve`'s gateway and controller, `coral.runtime`) and the
engine (`coral.engine`, whose instances serve the OpenAI API with `ServerThread`): the engine imports nothing
from the runtime, which starts engines.

uvicorn bounds neither the time a client may take to send a request's headers (a connection that sends a few
bytes and stalls is held forever) nor, by default, a graceful shutdown (stuck requests keep the process alive).
Here a connection whose request headers are not complete within `header_timeout_s` of its first byte (or of
its opening) is closed, bodies are bounded by the apps (`coral.runtime.gateway.read_body`), and a shutdown
waits at most `grace_s` for requests in flight; a second SIGTERM or SIGINT during that wait ends it at once. Then
an app that keeps a `closing_event` is told to end what is still open itself (the gateway ends each stream with an
error event and `[DONE]`), for at most `CLOSE_S`, and what is left after that is cancelled without a traceback.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import re
import socket
import threading
import time
from collections.abc import Awaitable
from types import FrameType
from typing import Any

import uvicorn
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from coral.catalog.loader import CoralInputError
from coral.openai_shapes import error_body, error_type

KEEP_ALIVE_S = 75
"""Idle keep-alive connections are closed after this (uvicorn's 5 s default races with clients reusing a
connection while the event loop lags under load: the request is dropped unanswered)."""
HEADER_TIMEOUT_S = 10.0
GRACE_S = 30.0
CLOSE_S = 1.0
"""After the grace (or a second signal), how long an app told by its `closing_event` has to end its open
responses before the server cancels what is left."""
POLL_S = 0.02
"""How often a shutdown checks whether every request has ended."""

logger = logging.getLogger("uvicorn.error")


def closing_event(app: Any) -> asyncio.Event:
    """The event `DrainingServer` sets once its grace is over or a second signal came (made on the first call and
    kept on `app.state`): the app then ends its open responses itself (a stream with a last event), within
    `CLOSE_S`, before the server cancels what is left."""
    event = getattr(app.state, "closing", None)
    if not isinstance(event, asyncio.Event):
        event = app.state.closing = asyncio.Event()
    return event


class _HeaderTimeout:
    """Protocol mixin: close a connection whose request headers are not complete `header_timeout_s` after it
    opened, or after the first byte of a next request on a kept-alive connection."""

    header_timeout_s: float
    cycle: Any
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    _header_timer: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        waiting_for = self.cycle

        def expire() -> None:
            self._header_timer = None
            if self.cycle is waiting_for and not self.transport.is_closing():
                self.transport.close()

        self._header_timer = self.loop.call_later(self.header_timeout_s, expire)

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._arm()
        super().data_received(data)  # type: ignore[misc]

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)  # type: ignore[misc]


def http_protocol(http: str, header_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP/1.1 protocol `http` ("auto": httptools when installed, else h11) with the header timeout."""
    base: type[asyncio.Protocol] = H11Protocol
    if http in ("auto", "httptools"):
        try:
            from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
        except ImportError:
            if http == "httptools":
                raise
        else:
            base = HttpToolsProtocol
    return type(f"Bounded{base.__name__}", (_HeaderTimeout, base), {"header_timeout_s": header_timeout_s})


def server_config(
    app: Any,
    host: str,
    port: int,
    log_level: str = "warning",
    http: str = "auto",
    loop: str = "auto",
    header_timeout_s: float = HEADER_TIMEOUT_S,
    grace_s: float = GRACE_S,
) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        timeout_graceful_shutdown=max(1, round(grace_s)),
        timeout_keep_alive=KEEP_ALIVE_S,
        http=http_protocol(http, header_timeout_s),
        loop=loop,
    )


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a second signal forcing the exit (uvicorn forces only on a second SIGINT), no
    signal re-raised after the shutdown, so the caller's cleanup (stopping engines) runs, and the app's lifespan
    ended even on a forced exit (uvicorn skips it there, and closing the loop then cancels the lifespan task,
    which logs a CancelledError traceback). Past the grace, the app's `closing_event` is set and it has `CLOSE_S`
    to end its responses; requests still running then are cancelled, each ending without a traceback
    (`_EndQuietly`)."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.config.loaded_app = _EndQuietly(self.config.loaded_app, self)
        await super().startup(sockets)

    async def _settled(self, timeout_s: float, forced_ends_wait: bool) -> bool:
        """Whether every connection and request ended within `timeout_s` (or before a second signal, when
        `forced_ends_wait`)."""
        state = self.server_state
        try:
            async with asyncio.timeout(timeout_s):
                while state.connections or state.tasks:
                    if forced_ends_wait and self.force_exit:
                        return False
                    await asyncio.sleep(POLL_S)
                for server in self.servers:
                    await server.wait_closed()
        except TimeoutError:
            return False
        return True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Stop accepting, let the requests in flight finish within the grace, tell the app to end the rest
        (`closing_event`), cancel what is still running `CLOSE_S` later, then end the app's lifespan."""
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()
        grace_s = self.config.timeout_graceful_shutdown or GRACE_S
        if not await self._settled(grace_s, forced_ends_wait=True):
            closing = getattr(getattr(self.config.app, "state", None), "closing", None)
            if isinstance(closing, asyncio.Event):
                closing.set()
                await self._settled(CLOSE_S, forced_ends_wait=False)
            if left := list(self.server_state.tasks):
                logger.warning("cancelling %d request(s) still running after the grace", len(left))
                for task in left:
                    task.cancel()
        try:
            async with asyncio.timeout(grace_s):
                await self.lifespan.shutdown()
        except TimeoutError:
            logger.warning("the app's lifespan did not end within %s s of the shutdown", grace_s)


class _EndQuietly:
    """ASGI wrapper: a request cancelled by its server's shutdown ends without the traceback uvicorn logs for any
    exception: a 503 in OpenAI's error shape when its response had not started, an SSE error event and `[DONE]`
    when it had started a stream (else uvicorn closes the connection, the answer cut)."""

    def __init__(self, app: Any, server: uvicorn.Server) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = stream = done = False

        async def tracked(message: Message) -> None:
            nonlocal started, stream, done
            if message["type"] == "http.response.start":
                started = True
                stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                             for k, v in message.get("headers", []))
            await send(message)
            done = message["type"] == "http.response.body" and not message.get("more_body", False)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            if not self.server.should_exit:
                raise
            if done:  # its whole answer was sent before the cancel reached it
                return
            body = error_body("the server is shutting down", error_type(503), None, "server_shutdown")
            if not started:
                await send({"type": "http.response.start", "status": 503,
                            "headers": [(b"content-type", b"application/json"), (b"connection", b"close")]})
                await send({"type": "http.response.body", "body": json.dumps(body).encode()})
            elif stream:
                end = f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()
                await send({"type": "http.response.body", "body": end, "more_body": False})


_INLINE_SCRIPT = re.compile(r"<script(?![^>]*\btype=\"application/json\")[^>]*>(.*?)</script>", re.S | re.I)


def content_security_policy(page: str) -> str:
    """The Content-Security-Policy of one of Coral's self-contained HTML pages (the report, the dashboard): its
    own inline scripts only, by their SHA-256 (JSON data blocks are not scripts), inline styles (the page sets
    style attributes), images from data: URLs, fetches to its own origin (the dashboard's polling); no other
    source, no plugins, no <base>, no forms, no framing by other sites."""
    hashes = [base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()
              for body in _INLINE_SCRIPT.findall(page)]
    scripts = " ".join(f"'sha256-{h}'" for h in hashes) or "'none'"
    return (f"default-src 'none'; script-src {scripts}; style-src 'unsafe-inline'; img-src data:; "
            "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def with_policy_meta(page: str) -> str:
    """`page` with its `content_security_policy` in a `<meta http-equiv>` first in its head, for a page opened
    as a file (`coral report`), which has no headers (a meta policy cannot say frame-ancestors: left out)."""
    policy = content_security_policy(page).replace("; frame-ancestors 'none'", "")
    meta = f'<meta http-equiv="Content-Security-Policy" content="{policy}">'
    return page.replace("<head>", f"<head>\n{meta}", 1)


class PagePolicy:
    """ASGI middleware: every text/html answer under one of `prefixes` (Coral's own pages: the dashboard) gets
    its `content_security_policy` header (the page is read whole first: Coral's pages are small and never
    streamed)."""

    def __init__(self, app: Any, prefixes: tuple[str, ...] = ("/dashboard",)) -> None:
        self.app, self.prefixes = app, prefixes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefixes):
            return await self.app(scope, receive, send)
        start: Message | None = None
        chunks: list[bytes] = []

        async def send_with_policy(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers", []))
                if not headers.get(b"content-type", b"").startswith(b"text/html"):
                    return await send(message)
                start = message
                return None
            if start is None or message["type"] != "http.response.body":
                return await send(message)
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return None
            page = b"".join(chunks)
            policy = content_security_policy(page.decode(errors="replace")).encode()
            await send({**start, "headers": [*start.get("headers", []), (b"content-security-policy", policy)]})
            await send({"type": "http.response.body", "body": page})
            return None

        await self.app(scope, receive, send_with_policy)


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ServerThread:
    """uvicorn serving `app` in a daemon thread; `start()` returns once the socket accepts connections."""

    def __init__(
        self,
        app: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
        http: str = "auto",
        loop: str = "auto",
        header_timeout_s: float = HEADER_TIMEOUT_S,
        grace_s: float = 2.0,
    ) -> None:
        """`http`/`loop`: uvicorn's implementations ("auto" takes httptools/uvloop when installed)."""
        self.host = host
        self.port = port or free_port(host)
        config = server_config(app, host, self.port, log_level, http, loop, header_timeout_s, grace_s)
        self.server = DrainingServer(config)
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise CoralInputError(f"server on {self.url} did not start within {timeout_s:.0f} s")
            time.sleep(0.01)
        return self

    def alive(self) -> bool:
        return self.thread.is_alive() and self.server.started and not self.server.should_exit

    def stop(self, force: bool = False, timeout_s: float = 5.0) -> None:
        """Stop serving; `force` drops open connections at once (a crash, as seen by clients)."""
        self.server.force_exit = force
        self.server.should_exit = True
        self.thread.join(timeout_s)


async def unless_disconnected(request: Request, work: Awaitable[Response]) -> Response | None:
    """`work`'s response, or None when the client disconnected first (then `work` is cancelled, and with it its
    upstream calls). The request body must have been read: what `request.receive` gives next is the
    disconnect."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this task is cancelled: then the CancelledError goes on once both are done
        task.cancel()
        watch.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    return None if task.cancelled() else task.result()
