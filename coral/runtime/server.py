"""Run an ASGI app with uvicorn in a background thread on loopback (tests, emulated engines, `coral serve`)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn

from coral.catalog.loader import CoralInputError

KEEP_ALIVE_S = 75
"""Idle keep-alive connections are closed after this (uvicorn's 5 s default races with clients reusing a
connection while the event loop lags under load: the request is dropped unanswered)."""


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
    ) -> None:
        """`http`/`loop`: uvicorn's implementations ("auto" takes httptools/uvloop when installed)."""
        self.host = host
        self.port = port or free_port(host)
        config = uvicorn.Config(
            app,
            host=host,
            port=self.port,
            log_level=log_level,
            lifespan="on",
            timeout_graceful_shutdown=2,
            timeout_keep_alive=KEEP_ALIVE_S,
            http=http,
            loop=loop,
        )
        self.server = uvicorn.Server(config)
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
