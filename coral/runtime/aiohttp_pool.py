"""aiohttp's client (a maintained HTTP/1.1 client with a C parser) behind the interface of `http1.Http1Pool`, so
the gateway can use either (`GatewayConfig.upstream_client`) and `benchmarks/gateway.py` can measure both.
Failures map onto the same errors: `UpstreamTimeout` when the request was sent and no answer came within the
read timeout, `UpstreamConnectionError` for everything else."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp

from coral.runtime.http1 import UpstreamConnectionError, UpstreamTimeout


class AiohttpResponse:
    """Status, headers (lower-case names) and the body as it arrives (`aiter_raw`, chunked framing removed)."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self.resp = resp
        self.status_code = resp.status
        self.headers = {k.lower(): v for k, v in resp.headers.items()}

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.resp.content.iter_any():
                yield chunk
        except aiohttp.SocketTimeoutError as exc:
            raise UpstreamTimeout("no data within the read timeout") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamConnectionError(f"malformed or cut answer ({type(exc).__name__})") from exc

    async def aclose(self) -> None:
        self.resp.release()


class AiohttpPool:
    """Keep-alive connections through one `aiohttp.ClientSession` (made on first use, inside the event loop)."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float, max_idle: int = 256) -> None:
        self.timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s, sock_read=read_timeout_s)
        self.max_idle = max_idle
        self.session: aiohttp.ClientSession | None = None

    async def post(
        self, base_url: str, path: str, body: bytes, headers: dict[str, str], timeout_s: float | None = None
    ) -> AiohttpResponse:
        if self.session is None:
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60)
            self.session = aiohttp.ClientSession(
                connector=connector, timeout=self.timeout, auto_decompress=False, skip_auto_headers=("User-Agent",)
            )
        try:
            timeout = self.timeout if timeout_s is None else aiohttp.ClientTimeout(
                total=None, connect=self.timeout.connect, sock_read=timeout_s
            )
            resp = await self.session.post(base_url + path, data=body, headers=headers, timeout=timeout)
        except aiohttp.SocketTimeoutError as exc:
            raise UpstreamTimeout(f"{base_url}: no answer within the read timeout") from exc
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise UpstreamConnectionError(f"{base_url}: {type(exc).__name__}") from exc
        return AiohttpResponse(resp)

    async def aclose(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None
