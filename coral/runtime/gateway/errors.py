"""OpenAI-shaped errors, request bodies read within limits, and the gateway's upstream error."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from coral.catalog.loader import NotStrictJson, strict_json_loads
from coral.openai_shapes import InvalidRequest, error_body, error_type


class UpstreamError(Exception):
    """Every attempt on a pool failed before the first byte; `status` is what the client gets, with OpenAI's
    error `code` and, for the engines' backpressure (`backpressure`), their `Retry-After` seconds."""

    def __init__(self, status: int, message: str, code: str = "upstream_error", retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.retry_after = status, code, retry_after

    @property
    def backpressure(self) -> bool:
        """Whether the pool refused the request for now (every instance answered 429/503 with Retry-After)."""
        return self.retry_after is not None


class AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: error messages may quote client strings holding lone surrogates."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


def error_response(
    status: int,
    message: str,
    code: str | None = None,
    param: str | None = None,
    retry_after: int | None = None,
) -> JSONResponse:
    """OpenAI's error shape; `type` follows the status (server_error for 5xx)."""
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return AsciiJSONResponse(error_body(message, error_type(status), param, code), status, headers=headers)


def parse_json(raw: bytes) -> Any:
    """The JSON document of a request body; InvalidRequest when it is not strict JSON (bad UTF-8 too; a number that
    is not finite or a lone surrogate, naming its field: `strict_json_loads`) or nests beyond Python's stack."""
    try:
        return strict_json_loads(raw)
    except NotStrictJson as exc:
        raise InvalidRequest(f"invalid request: {exc}") from None
    except (ValueError, RecursionError) as exc:
        raise InvalidRequest(f"invalid request: the body is not valid JSON ({type(exc).__name__})") from None


def request_id_of(header: str | None) -> str:
    """The client's X-Request-Id when it is short and printable, else a new one."""
    if header and len(header) <= 128 and header.isascii() and header.isprintable():
        return header
    return uuid.uuid4().hex



class BodyRefused(Exception):
    """A request body past the size limit (413) or not received in time (408)."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code

    def response(self) -> JSONResponse:
        """The error, closing the connection (the rest of the body is never read)."""
        resp = error_response(self.status, str(self), self.code)
        resp.headers["connection"] = "close"
        return resp


#: a refused body up to this many bytes past the limit is still read (and dropped) within the time limit, so a
#: client still sending it reads the 413: closing a connection on unread data resets it, and the answer is lost
DRAIN_BYTES = 64 << 20


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The request body, however it is framed (Content-Length or chunked); BodyRefused past `limit` bytes (the
    rest read and dropped up to `DRAIN_BYTES` more, within `timeout_s`) or when it has not all arrived within
    `timeout_s`."""
    too_large = BodyRefused(413, f"request body over {limit} bytes", "request_too_large")
    declared = request.headers.get("content-length")
    over = declared is not None and declared.isdigit() and int(declared) > limit
    if over and int(declared or 0) > limit + DRAIN_BYTES:
        raise too_large
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit + DRAIN_BYTES:
                    break
                if size <= limit:
                    chunks.append(chunk)
    except TimeoutError:
        if over or size > limit:
            raise too_large from None
        raise BodyRefused(408, f"request body not received within {timeout_s:g} s", "request_timeout") from None
    if over or size > limit:
        raise too_large
    return b"".join(chunks)


def sse_error(message: str, code: str = "upstream_error", status: int = 502) -> bytes:
    """An SSE event of OpenAI's error shape, ending a stream that started: `code`, the `type` of `status`."""
    return f"data: {json.dumps(error_body(message, error_type(status), code=code))}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"
SHUTDOWN_MESSAGE = "the gateway is shutting down: send the request again"



def install_openai_errors(app: FastAPI) -> None:
    """Unknown routes, wrong methods and parameter errors answer in OpenAI's error shape."""

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            msg = f"Invalid URL ({request.method} {request.url.path})"
            return error_response(404, msg, "unknown_url")
        return error_response(exc.status_code, str(exc.detail), None)

    @app.exception_handler(Exception)
    async def server_error(_request: Request, exc: Exception) -> JSONResponse:
        return error_response(500, f"internal error: {type(exc).__name__}", "internal_error")

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return error_response(400, str(first.get("msg", "invalid request")), None, param)



