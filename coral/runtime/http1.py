"""Lean HTTP/1.1 client for the gateway's upstream POSTs: a keep-alive connection pool per host on asyncio
streams, Content-Length and chunked bodies. A fraction of httpx's per-request Python (no anyio, no h11, one
buffer per message). Every failure (connect, reset, timeout, malformed answer) raises `UpstreamConnectionError`,
an OSError (`UpstreamTimeout` when the request was sent and no answer came in time); a request on a reused
connection that the server closed meanwhile is sent again on a new one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol
from urllib.parse import urlsplit

Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class UpstreamConnectionError(ConnectionError):
    """The upstream could not be reached or broke off its answer."""


class UpstreamTimeout(UpstreamConnectionError):
    """The upstream took the request and sent nothing within the read timeout (it may still be working on it)."""


class UpstreamResponse(Protocol):
    """An upstream answer as the gateway reads it (`Http1Response`, `aiohttp_pool.AiohttpResponse`)."""

    status_code: int
    headers: dict[str, str]

    def aiter_raw(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


class UpstreamPool(Protocol):
    """A keep-alive client for the gateway's upstream POSTs (`Http1Pool`, `aiohttp_pool.AiohttpPool`)."""

    async def post(
        self, base_url: str, path: str, body: bytes, headers: dict[str, str], timeout_s: float | None = None
    ) -> UpstreamResponse:
        """POST `body`; `timeout_s` (default: the pool's read timeout) bounds each read of the answer."""
        ...

    async def aclose(self) -> None: ...


class Http1Response:
    """Status and headers of an answer whose body is read with `aiter_raw` (once); `aclose` frees the
    connection (back to the pool when the body was read in full and the server keeps it alive)."""

    def __init__(
        self,
        pool: Http1Pool,
        key: tuple[str, int],
        conn: Conn,
        status: int,
        headers: dict[str, str],
        read_timeout_s: float,
    ):
        self.pool, self.key, self.conn = pool, key, conn
        self.read_timeout_s = read_timeout_s
        self.status_code = status
        self.headers = headers
        self._done = False

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        reader, timeout = self.conn[0], self.read_timeout_s
        try:
            if self.status_code in (204, 304) or self.status_code < 200:
                pass  # no body
            elif "chunked" in self.headers.get("transfer-encoding", "").lower():
                while True:
                    async with asyncio.timeout(timeout):
                        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                        if size == 0:
                            while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers
                                pass
                            break
                        data = await reader.readexactly(size + 2)
                    yield data[:-2]
            elif (length := self.headers.get("content-length")) is not None:
                left = int(length)
                while left > 0:
                    async with asyncio.timeout(timeout):
                        data = await reader.read(min(left, 1 << 16))
                    if not data:
                        raise UpstreamConnectionError("connection closed mid-body")
                    left -= len(data)
                    yield data
            else:  # body up to EOF: the connection cannot be reused
                self.headers["connection"] = "close"
                while data := await reader.read(1 << 16):
                    yield data
            self._done = True
        except TimeoutError as exc:
            raise UpstreamTimeout(f"no data within {timeout:g} s") from exc
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            raise UpstreamConnectionError(f"malformed or cut answer ({type(exc).__name__})") from exc

    async def aclose(self) -> None:
        if self._done and self.headers.get("connection", "").lower() != "close":
            self.pool.give_back(self.key, self.conn)
        else:
            self.conn[1].close()
        self._done = False  # a second aclose closes the (already pooled or closed) writer: harmless


class Http1Pool:
    """Keep-alive connections per (host, port), at most `max_idle` idle ones each."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float, max_idle: int = 256) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_idle = max_idle
        self.idle: dict[tuple[str, int], list[Conn]] = {}
        self._targets: dict[str, tuple[str, int, bytes]] = {}

    def _target(self, base_url: str) -> tuple[str, int, bytes]:
        t = self._targets.get(base_url)
        if t is None:
            u = urlsplit(base_url)
            if u.scheme != "http" or not u.hostname:
                raise UpstreamConnectionError(f"{base_url}: only http:// upstreams are supported")
            t = self._targets[base_url] = (u.hostname, u.port or 80, u.netloc.encode())
        return t

    def give_back(self, key: tuple[str, int], conn: Conn) -> None:
        idle = self.idle.setdefault(key, [])
        if len(idle) < self.max_idle and not conn[0].at_eof():
            idle.append(conn)
        else:
            conn[1].close()

    async def post(
        self, base_url: str, path: str, body: bytes, headers: dict[str, str], timeout_s: float | None = None
    ) -> Http1Response:
        host, port, netloc = self._target(base_url)
        read = timeout_s or self.read_timeout_s
        key = (host, port)
        head = b"".join(
            [
                b"POST ",
                path.encode(),
                b" HTTP/1.1\r\nHost: ",
                netloc,
                b"\r\nContent-Length: ",
                str(len(body)).encode(),
                b"\r\n",
                *(f"{k}: {v}\r\n".encode() for k, v in headers.items()),
                b"\r\n",
            ]
        )
        idle = self.idle.get(key)
        while True:
            conn = idle.pop() if idle else None
            reused = conn is not None
            try:
                if conn is None:
                    async with asyncio.timeout(self.connect_timeout_s):
                        conn = await asyncio.open_connection(host, port)
                reader, writer = conn
                if reader.at_eof():
                    raise ConnectionResetError("idle connection closed by the server")
                writer.write(head + body)
                try:
                    async with asyncio.timeout(read):
                        raw = await reader.readuntil(b"\r\n\r\n")
                except TimeoutError as exc:
                    conn[1].close()
                    raise UpstreamTimeout(f"{host}:{port}: no answer within {read:g} s") from exc
                lines = raw.decode("latin-1").split("\r\n")
                status = int(lines[0].split(" ", 2)[1])
                fields = {}
                for line in lines[1:]:
                    if line:
                        k, _, v = line.partition(":")
                        fields[k.strip().lower()] = v.strip()
                return Http1Response(self, key, conn, status, fields, read)
            except UpstreamTimeout:
                raise
            except (
                OSError,
                asyncio.IncompleteReadError,
                asyncio.LimitOverrunError,
                ValueError,
                IndexError,
            ) as exc:
                if conn is not None:
                    conn[1].close()
                if reused and not isinstance(exc, TimeoutError):
                    continue  # the server dropped an idle connection: send again on another one
                raise UpstreamConnectionError(f"{host}:{port}: {type(exc).__name__}") from exc
            except BaseException:  # cancelled (client gone): the half-used connection cannot be reused
                if conn is not None:
                    conn[1].close()
                raise

    async def aclose(self) -> None:
        for conns in self.idle.values():
            for _, writer in conns:
                writer.close()
        self.idle.clear()
