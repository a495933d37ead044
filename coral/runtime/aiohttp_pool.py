"""The gateway's upstream client: aiohttp's (a maintained HTTP/1.1 client with a C parser), one keep-alive
`ClientSession` for every engine. Failures map onto `UpstreamConnectionError`, an OSError. Reads are not bounded
here: the gateway bounds each phase of an answer from the model's SLOs (`gateway.Budget`) and cancels the
read. Idle connections are closed after `KEEPALIVE_S`, before Coral's engine servers close theirs
(`server.KEEP_ALIVE_S`; other servers may close sooner: uvicorn's default is 5 s); a request the server dropped
without answering (an idle connection it closed as the request went out) is sent once more on a new connection,
as the gateway would send it to another instance anyway."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp

KEEPALIVE_S = 60.0


class UpstreamConnectionError(ConnectionError):
    """The upstream could not be reached or broke off its answer."""


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
        except aiohttp.ClientError as exc:
            raise UpstreamConnectionError(f"malformed or cut answer ({type(exc).__name__})") from exc

    async def aclose(self) -> None:
        """Free the connection: back to the pool when the body was read in full, else closed."""
        self.resp.release()


class AiohttpPool:
    """Keep-alive connections through one `aiohttp.ClientSession` (made on first use, inside the event loop)."""

    def __init__(self, connect_timeout_s: float) -> None:
        self.timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s)
        self.session: aiohttp.ClientSession | None = None

    async def post(self, base_url: str, path: str, body: bytes, headers: dict[str, str]) -> AiohttpResponse:
        """POST `body`; returns once the answer's status and headers arrived."""
        if self.session is None:
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=KEEPALIVE_S)
            self.session = aiohttp.ClientSession(
                connector=connector, timeout=self.timeout, auto_decompress=False, skip_auto_headers=("User-Agent",)
            )
        resend = True
        while True:
            try:
                resp = await self.session.post(base_url + path, data=body, headers=headers)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                if resend and not isinstance(exc, aiohttp.ClientConnectorError):
                    resend = False  # dropped unanswered (an idle connection the server closed): once more
                    continue
                raise UpstreamConnectionError(f"{base_url}: {type(exc).__name__}") from exc
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise UpstreamConnectionError(f"{base_url}: {type(exc).__name__}") from exc
            return AiohttpResponse(resp)

    async def aclose(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None
