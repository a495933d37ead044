"""OpenAI-compatible gateway: routes by model across plan instances, prefill then decode (vLLM's PD protocol).

Request path: admission (at most `max_concurrency` requests upstream, at most `max_waiting` queued; beyond
that 429 with Retry-After; 503 when the model has no routable instance) -> for a model with prefill and decode
instances, a non-streaming `max_tokens: 1` request with `kv_transfer_params: {do_remote_decode: true}` to a
prefill instance, then the client's request plus the returned `kv_transfer_params` to a decode instance
(models with a single pool are sent there directly). Every pick of a request (prefill, decode, retries)
routes by its length class: the plan's class of its prompt length, estimated without tokenizing
(`prompt_tokens`; see `registry`). A failure before the first byte of the answer (connect error, 5xx, dropped
connection) is retried on another instance of the pool; once streaming started, an error ends the stream with
an SSE error event. In-flight counts are released in `finally` blocks that also run on client cancels, and
endpoints are released on the object they were picked on, so churn cannot skew them.

Access: with API keys configured, `/v1/*` needs `Authorization: Bearer KEY` (keys are kept only as SHA-256
digests); each key (or client address without keys) has a token bucket of `rate_limit_rps` answering 429 with
Retry-After; bodies over `max_body_bytes` get 413. Requests are validated (400 naming the field) and every
error has OpenAI's shape `{"error": {"message", "type", "param", "code"}}`. One request id (the client's
`X-Request-Id` or a new one) goes to both the prefill and the decode instance, as vLLM's PD proxy does.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import os
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from coral.catalog.loader import CoralInputError
from coral.runtime.http1 import Http1Pool, Http1Response
from coral.runtime.registry import Endpoint, InstanceState, Registry

PREFILL_KV_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


PREFILL_UNSUPPORTED = ("min_tokens", "min_completion_tokens", "stream_options")
"""Options a prefill-only request (max_tokens=1, not streamed) must not carry; the decode side keeps them."""

CHARS_PER_TOKEN = 4.0
"""Characters per token of text prompts: an estimate (the gateway does not tokenize) for request classes."""


def prompt_tokens(body: dict[str, Any]) -> float:
    """Estimated prompt tokens of a validated request: token ids are counted (the longest of several
    prompts), text is `CHARS_PER_TOKEN` characters a token (chat: all text contents together)."""
    if "messages" in body:
        chars = 0
        for m in body["messages"]:
            c = m.get("content")
            parts = [c] if isinstance(c, str) else [p.get("text") for p in c or [] if isinstance(p, dict)]
            chars += sum(len(t) for t in parts if isinstance(t, str))
        return chars / CHARS_PER_TOKEN
    p = body["prompt"]
    if isinstance(p, str):
        return len(p) / CHARS_PER_TOKEN
    if isinstance(p[0], int):
        return float(len(p))
    return max(len(x) if isinstance(x, list) else len(x) / CHARS_PER_TOKEN for x in p)


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def load_secrets(env_var: str, path: Path | None = None) -> list[str]:
    """Secrets from `path` (one a line, `#` comments) and the comma-separated env var `env_var`. Error
    messages name the file or variable, never a secret."""
    found = [k.strip() for k in os.environ.get(env_var, "").split(",") if k.strip()]
    if path is not None:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as exc:
            raise CoralInputError(f"{path}: cannot read ({exc.strerror})") from None
        except UnicodeDecodeError:
            raise CoralInputError(f"{path}: not UTF-8 text") from None
        found += [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    for k in found:
        if len(k) < 8 or any(c.isspace() for c in k):
            raise CoralInputError(
                f"{path or env_var}: each secret must be at least 8 characters without spaces"
            )
    return found


@dataclass(frozen=True)
class GatewayConfig:
    max_concurrency: int = 256
    max_waiting: int = 1024
    queue_timeout_s: float = 30.0
    max_attempts: int = 3
    connect_timeout_s: float = 2.0
    request_timeout_s: float = 300.0
    health_interval_s: float = 2.0
    health_timeout_s: float = 1.0
    unhealthy_after: int = 2
    retry_after_s: int = 1
    api_key_digests: frozenset[str] = field(default=frozenset(), repr=False)
    """SHA-256 digests of the accepted API keys (`with_api_keys`); empty = no authentication."""
    rate_limit_rps: float = 0.0
    """Requests/s allowed per key (per client address without keys); 0 = unlimited."""
    rate_limit_burst: int = 0
    """Bucket size (default: max(1, rate_limit_rps))."""
    max_body_bytes: int = 8 << 20
    upstream_api_key: str | None = field(default=None, repr=False)
    """Sent as `Authorization: Bearer` to the engines (vLLM `--api-key`)."""

    def with_api_keys(self, keys: Iterable[str]) -> GatewayConfig:
        from dataclasses import replace

        return replace(self, api_key_digests=frozenset(key_digest(k) for k in keys))


class UpstreamError(Exception):
    """Every attempt on a pool failed before the first byte; `status` is what the client gets."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}


class AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: error messages may quote client strings holding lone surrogates."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    code: str | None = None,
    param: str | None = None,
    retry_after: int | None = None,
) -> JSONResponse:
    """OpenAI's error shape; `type` follows the status (server_error for 5xx)."""
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return AsciiJSONResponse(error_body(message, kind, param, code), status, headers=headers)


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def _number(body: dict[str, Any], name: str, lo: float, hi: float, integer: bool = False) -> None:
    v = body.get(name)
    if v is None:
        return
    ok_type = isinstance(v, int) if integer else isinstance(v, int | float)
    if not ok_type or isinstance(v, bool) or not lo <= v <= hi:
        kind = "an integer" if integer else "a number"
        raise BadRequest(f"'{name}' must be {kind} in [{lo:g}, {hi:g}], got {json.dumps(v)[:40]}", name)


def validate_request(body: Any, chat: bool) -> None:
    """Raise BadRequest (message + param) unless `body` is a well-formed (chat) completions request."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise BadRequest("'model' is required and must be a non-empty string", "model")
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise BadRequest("'messages' is required and must be a non-empty array", "messages")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise BadRequest(f"'messages[{i}]' must be an object", f"messages[{i}]")
            if m.get("role") not in ROLES:
                raise BadRequest(
                    f"'messages[{i}].role' must be one of {sorted(ROLES)}", f"messages[{i}].role"
                )
            c = m.get("content")
            if c is not None and not isinstance(c, str | list):
                raise BadRequest(
                    f"'messages[{i}].content' must be a string or an array", f"messages[{i}].content"
                )
    else:
        p = body.get("prompt")
        ok = isinstance(p, str) or (
            isinstance(p, list)
            and bool(p)
            and (
                all(isinstance(x, str) for x in p)
                or all(isinstance(x, int) and not isinstance(x, bool) for x in p)
                or all(isinstance(x, list) and all(isinstance(t, int) for t in x) for x in p)
            )
        )
        if not ok:
            raise BadRequest(
                "'prompt' is required: a string, an array of strings or an array of token ids", "prompt"
            )
    for name in ("max_tokens", "max_completion_tokens", "n", "min_tokens"):
        _number(body, name, 0 if name == "min_tokens" else 1, 1 << 31, integer=True)
    _number(body, "temperature", 0, 2)
    _number(body, "top_p", 0, 1)
    _number(body, "presence_penalty", -2, 2)
    _number(body, "frequency_penalty", -2, 2)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", "stream")
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise BadRequest("'stream_options' must be an object", "stream_options")
        if not stream:
            raise BadRequest("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if "kv_transfer_params" in body:
        raise BadRequest("'kv_transfer_params' is set by the gateway, not by clients", "kv_transfer_params")


def request_id_of(header: str | None) -> str:
    """The client's X-Request-Id when it is short and printable, else a new one."""
    if header and len(header) <= 128 and header.isascii() and header.isprintable():
        return header
    return uuid.uuid4().hex


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


class BodyTooLarge(Exception):
    pass


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (BodyTooLarge) past `limit` bytes without reading the rest."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
    return b"".join(chunks)


class _InflightCollector:
    """Scrape-time gauges read from the registry, so removed instances vanish and counts never go stale."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    def collect(self) -> Iterable[GaugeMetricFamily]:
        inflight = GaugeMetricFamily(
            "coral_gateway_inflight", "requests in flight per instance", labels=["instance"]
        )
        ready = GaugeMetricFamily(
            "coral_gateway_instance_routable", "1 if the instance gets new requests", labels=["instance"]
        )
        for ep in self.gw.registry.all():
            inflight.add_metric([ep.id], ep.inflight)
            ready.add_metric([ep.id], 1.0 if ep.routable else 0.0)
        queue = GaugeMetricFamily("coral_gateway_queue_waiting", "requests waiting for admission")
        queue.add_metric([], self.gw.waiting)
        active = GaugeMetricFamily("coral_gateway_active", "admitted requests being served")
        active.add_metric([], self.gw.active)
        return [inflight, ready, queue, active]


class Gateway:
    """State of one gateway app: registry, admission control, upstream client, metrics and latency stats."""

    def __init__(self, registry: Registry, config: GatewayConfig) -> None:
        self.registry = registry
        self.config = config
        self.sem = asyncio.Semaphore(config.max_concurrency)
        self.waiting = 0
        self.active = 0
        self.http: Http1Pool | None = None
        self.probe_client: httpx.AsyncClient | None = None
        self.metrics = CollectorRegistry()
        self.requests = Counter(
            "coral_gateway_requests",
            "client requests by outcome",
            ["model", "outcome"],
            registry=self.metrics,
        )
        self.upstream = Counter(
            "coral_gateway_upstream_requests",
            "upstream attempts by instance and outcome",
            ["instance", "phase", "outcome"],
            registry=self.metrics,
        )
        self.latency = Histogram(
            "coral_gateway_request_latency_seconds", "end-to-end latency", ["model"], registry=self.metrics
        )
        self.ttft = Histogram(
            "coral_gateway_ttft_seconds", "time to first byte of the answer", ["model"], registry=self.metrics
        )
        self.pd_fallbacks = Counter(
            "coral_gateway_pd_fallback",
            "requests decoded without remote prefill (no prefill instance answered)",
            ["model"],
            registry=self.metrics,
        )
        self.metrics.register(_InflightCollector(self))
        self.recent: dict[str, deque[tuple[float, float]]] = {}
        self.limiter = RateLimiter(config.rate_limit_rps, config.rate_limit_burst)
        self.upstream_headers = {"Content-Type": "application/json"}
        if config.upstream_api_key:
            self.upstream_headers["Authorization"] = f"Bearer {config.upstream_api_key}"

    def principal(self, request: Request) -> str:
        """Who sends `request`: the digest of its API key; BadRequest(401) without a valid key when keys are
        configured (else the client address)."""
        if not self.config.api_key_digests:
            return request.client.host if request.client else "?"
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        digest = key_digest(token.strip()) if scheme.lower() == "bearer" else ""
        if digest not in self.config.api_key_digests:
            raise BadRequest(
                "Incorrect API key provided: send `Authorization: Bearer KEY`",
                status=401,
                code="invalid_api_key",
            )
        return digest

    # --- lifecycle ----------------------------------------------------------------------------------
    async def open(self) -> None:
        """Upstream requests go through a lean keep-alive HTTP/1.1 pool (`http1`: a fraction of httpx's
        per-request cost); health probes through httpx."""
        c = self.config
        self.http = Http1Pool(c.connect_timeout_s, c.request_timeout_s, max_idle=c.max_concurrency)
        self.probe_client = httpx.AsyncClient(timeout=c.health_timeout_s)

    async def close(self) -> None:
        if self.http is not None:
            await self.http.aclose()
        if self.probe_client is not None:
            await self.probe_client.aclose()
        self.http = self.probe_client = None

    def pool(self) -> Http1Pool:
        if self.http is None:
            raise RuntimeError("gateway is not open (its app lifespan has not started)")
        return self.http

    async def health_loop(self) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(self.config.health_interval_s)

    async def check_health(self) -> None:
        """Probe `/health` of every non-stopped instance; mark unhealthy after `unhealthy_after` failures."""
        client = self.probe_client
        if client is None:
            return
        eps = [e for e in self.registry.all() if e.state is not InstanceState.STOPPED]

        async def probe(ep: Endpoint) -> None:
            try:
                r = await client.get(f"{ep.url}/health", timeout=self.config.health_timeout_s)
                ok = r.status_code == 200
            except httpx.HTTPError:
                ok = False
            ep.health_failures = 0 if ok else ep.health_failures + 1
            ep.healthy = ok or ep.health_failures < self.config.unhealthy_after

        await asyncio.gather(*(probe(e) for e in eps))

    # --- admission ----------------------------------------------------------------------------------
    async def admit(self) -> None:
        """Wait for a slot; UpstreamError(429) when the queue is full or the wait exceeds the queue timeout."""
        if self.sem.locked() and self.waiting >= self.config.max_waiting:
            raise UpstreamError(429, "gateway overloaded: admission queue is full")
        self.waiting += 1
        try:
            await asyncio.wait_for(self.sem.acquire(), self.config.queue_timeout_s)
        except TimeoutError:
            raise UpstreamError(429, "gateway overloaded: queued too long") from None
        finally:
            self.waiting -= 1
        self.active += 1

    def leave(self) -> None:
        self.active -= 1
        self.sem.release()

    def record(self, model: str, start: float, first: float | None, outcome: str) -> None:
        self.requests.labels(model, outcome).inc()
        if outcome == "ok":
            now = time.perf_counter()
            self.latency.labels(model).observe(now - start)
            ttft = (first or now) - start
            self.ttft.labels(model).observe(ttft)
            self.recent.setdefault(model, deque(maxlen=4096)).append((now - start, ttft))

    # --- upstream calls -----------------------------------------------------------------------------
    def _fail(self, ep: Endpoint, exc: BaseException | None) -> None:
        self.registry.release(ep, ok=False)
        self.upstream.labels(ep.id, ep.phase, "error").inc()
        if isinstance(exc, OSError):
            ep.healthy = False  # passive health: the probe loop brings it back

    async def open_stream(
        self, model: str, phase: str, path: str, body: bytes, rid: str, request_class: str | None = None
    ) -> tuple[Endpoint, Http1Response, AsyncIterator[bytes]]:
        """Send `body` (JSON bytes, request id `rid`, length class `request_class`) to an instance of the pool
        and read its first chunk, retrying on other instances on failure before that chunk. Returns the
        endpoint, the response and its whole body as chunks; the caller owns the response and the endpoint's
        in-flight slot."""
        tried: set[str] = set()
        last = "no routable instance"
        for _ in range(self.config.max_attempts):
            ep = self.registry.pick(model, phase, frozenset(tried), request_class)
            if ep is None:
                break
            tried.add(ep.id)
            resp: Http1Response | None = None
            try:
                headers = {**self.upstream_headers, "X-Request-Id": rid}
                resp = await self.pool().post(ep.url, path, body, headers)
                if resp.status_code >= 500:
                    last = f"{ep.id}: HTTP {resp.status_code}"
                    await resp.aclose()
                    self._fail(ep, None)
                    continue
                it = resp.aiter_raw()
                first = await anext(it, None)
                return ep, resp, _chain(first, it)
            except OSError as exc:
                cause = exc.__cause__
                last = f"{ep.id}: {type(exc).__name__}" + (f" ({type(cause).__name__})" if cause else "")
                if resp is not None:
                    await resp.aclose()
                self._fail(ep, exc)
            except BaseException:
                if resp is not None:
                    await resp.aclose()
                self._fail(ep, None)
                raise
        status = 503 if not tried else 502
        raise UpstreamError(status, f"{model} {phase}: no instance answered ({last})")

    async def call(
        self, model: str, phase: str, path: str, body: bytes, rid: str, request_class: str | None = None
    ) -> tuple[int, bytes, Endpoint]:
        """Non-streaming call with retries; returns (status, body bytes, endpoint)."""
        ep, resp, chunks = await self.open_stream(model, phase, path, body, rid, request_class)
        ok = False
        try:
            data = b"".join([c async for c in chunks])
            ok = resp.status_code < 500
            return resp.status_code, data, ep
        except OSError as exc:
            raise UpstreamError(502, f"{ep.id}: broken answer ({type(exc).__name__})") from exc
        finally:
            await resp.aclose()
            self.registry.release(ep, ok)
            self.upstream.labels(ep.id, ep.phase, "ok" if ok else "error").inc()

    def pd_pools(self, model: str) -> tuple[bool, str]:
        """(prefill first?, phase answering the client) for a model."""
        phases = {e.phase for e in self.registry.all() if e.model == model}
        if "decode" in phases:
            return "prefill" in phases, "decode"
        return False, "prefill"

    def state(self) -> dict[str, Any]:
        """JSON-able view for dashboards: instances with counters, planned share (weight among the routable
        instances of its pool), planned tokens/s per request class (`class_weights`, None: every class) and
        observed share (of requests served by the pool), latency percentiles."""
        eps = self.registry.all()
        instances = []
        for e in eps:
            pool = [p for p in eps if p.model == e.model and p.phase == e.phase]
            served = sum(p.served for p in pool)
            weight = sum(p.weight for p in pool if p.routable)
            instances.append(
                {
                    "id": e.id,
                    "model": e.model,
                    "phase": e.phase,
                    "url": e.url,
                    "state": str(e.state),
                    "healthy": e.healthy,
                    "weight": e.weight,
                    "class_weights": e.class_weights,
                    "inflight": e.inflight,
                    "served": e.served,
                    "failed": e.failed,
                    "target_share": e.weight / weight if weight and e.routable else 0.0,
                    "observed_share": e.served / served if served else 0.0,
                }
            )
        latency = {}
        for model, rec in self.recent.items():
            e2e = sorted(r[0] for r in rec)
            ttft = sorted(r[1] for r in rec)
            latency[model] = {
                "count": len(e2e),
                "p50_ms": 1e3 * _pct(e2e, 0.5),
                "p99_ms": 1e3 * _pct(e2e, 0.99),
                "ttft_p50_ms": 1e3 * _pct(ttft, 0.5),
                "ttft_p99_ms": 1e3 * _pct(ttft, 0.99),
            }
        return {
            "instances": instances,
            "latency": latency,
            "queue": {"waiting": self.waiting, "active": self.active},
        }


async def _chain(first: bytes | None, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    if first is not None:
        yield first
    async for c in rest:
        yield c


def _pct(sorted_vals: Sequence[float], q: float) -> float:
    if not sorted_vals:
        return 0.0
    return float(sorted_vals[min(len(sorted_vals) - 1, int(q * len(sorted_vals)))])


class RelayResponse(StreamingResponse):
    """StreamingResponse whose cleanup runs whether the body was sent, cut short or never started."""

    def __init__(self, content: AsyncIterator[bytes], cleanup: Callable[[], Any], **kw: Any) -> None:
        super().__init__(content, **kw)
        self._cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._cleanup()


def _sse_error(message: str) -> bytes:
    return f"data: {json.dumps(error_body(message, 'server_error', code='upstream_error'))}\n\n".encode()


def install_openai_errors(app: FastAPI) -> None:
    """Unknown routes, wrong methods and parameter errors answer in OpenAI's error shape."""

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            msg = f"Invalid URL ({request.method} {request.url.path})"
            return error_response(404, msg, "unknown_url")
        return error_response(exc.status_code, str(exc.detail), None)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return error_response(400, str(first.get("msg", "invalid request")), None, param)


def create_gateway_app(
    registry: Registry,
    config: GatewayConfig | None = None,
    extra_routers: Sequence[APIRouter] = (),
    health_checks: bool = True,
) -> FastAPI:
    """The gateway FastAPI app; `app.state.gateway` is the `Gateway` (its `.state()` feeds dashboards)."""
    gw = Gateway(registry, config or GatewayConfig())
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await gw.open()
        task = asyncio.create_task(gw.health_loop()) if health_checks else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await gw.close()

    app = FastAPI(title="coral gateway", lifespan=lifespan)
    app.state.gateway = gw
    install_openai_errors(app)
    for r in extra_routers:
        app.include_router(r)

    def model_card(model: str) -> dict[str, Any]:
        return {"id": model, "object": "model", "created": created, "owned_by": "coral"}

    def guarded(request: Request) -> JSONResponse | None:
        """401 without a valid key, 429 past the key's rate; None when the request may go on."""
        try:
            who = gw.principal(request)
        except BadRequest as exc:
            gw.requests.labels("", "unauthorized").inc()
            return error_response(exc.status, str(exc), exc.code)
        wait = gw.limiter.wait_s(who)
        if wait > 0:
            gw.requests.labels("", "rate_limited").inc()
            return error_response(
                429, "rate limit reached for this API key", "rate_limit_exceeded", None, math.ceil(wait)
            )
        return None

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "routable": sum(e.routable for e in registry.all())}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gw.metrics), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        return guarded(request) or {"object": "list", "data": [model_card(m) for m in registry.models()]}

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str) -> Any:
        if (denied := guarded(request)) is not None:
            return denied
        if model not in registry.models():
            return error_response(404, f"The model '{model}' does not exist", "model_not_found", "model")
        return model_card(model)

    @app.get("/gateway/state")
    async def state() -> dict[str, Any]:
        return gw.state()

    async def serve(request: Request, path: str, chat: bool) -> Response:
        start = time.perf_counter()
        if (denied := guarded(request)) is not None:
            return denied
        try:
            raw = await read_body(request, gw.config.max_body_bytes)
        except BodyTooLarge:
            gw.requests.labels("", "too_large").inc()
            limit = gw.config.max_body_bytes
            return error_response(413, f"request body over {limit} bytes", "request_too_large")
        try:
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError) as exc:  # bad UTF-8 too; nesting beyond Python's stack
                raise BadRequest(f"invalid request: the body is not valid JSON ({exc})") from None
            validate_request(body, chat)
        except BadRequest as exc:
            gw.requests.labels("", "bad_request").inc()
            return error_response(exc.status, str(exc), exc.code, exc.param)
        model = body["model"]
        if model not in registry.models():
            gw.requests.labels(model, "unknown_model").inc()
            msg = f"The model '{model}' does not exist; see /v1/models"
            return error_response(404, msg, "model_not_found", "model")
        prefill_first, answer_phase = gw.pd_pools(model)
        if not any(e.routable for e in registry.pool(model, answer_phase)):
            gw.requests.labels(model, "no_instance").inc()
            msg = f"no ready instance for {model}"
            return error_response(503, msg, "service_unavailable", None, gw.config.retry_after_s)
        try:
            await gw.admit()
        except UpstreamError as exc:
            gw.requests.labels(model, "rejected").inc()
            return error_response(exc.status, str(exc), "overloaded", None, gw.config.retry_after_s)
        rid = request_id_of(request.headers.get("x-request-id"))
        cls = registry.class_of(model, prompt_tokens(body))
        ids = {"x-request-id": rid}
        handed_off = False
        try:
            upstream = raw  # forwarded as received unless the PD path adds the KV-transfer parameters
            if prefill_first:
                pre = {k: v for k, v in body.items() if k not in PREFILL_UNSUPPORTED}
                pre.update(max_tokens=1, stream=False, kv_transfer_params=dict(PREFILL_KV_PARAMS))
                if "max_completion_tokens" in pre:
                    pre["max_completion_tokens"] = 1
                try:
                    pre_body = json.dumps(pre).encode()
                    status, answer, _ = await gw.call(model, "prefill", path, pre_body, rid, cls)
                except UpstreamError:  # no prefill instance answered: the decode instance prefills locally
                    gw.pd_fallbacks.labels(model).inc()
                    status, answer = 0, b""
                if status >= 400:
                    gw.record(model, start, None, "error")
                    return Response(answer, status, media_type="application/json", headers=ids)
                if status:
                    try:
                        kv = json.loads(answer).get("kv_transfer_params")
                    except (ValueError, AttributeError):
                        raise UpstreamError(502, "prefill answer is not a JSON object") from None
                    upstream = json.dumps({**body, "kv_transfer_params": kv}).encode()
            if not body.get("stream"):
                status, answer, ep = await gw.call(model, answer_phase, path, upstream, rid, cls)
                gw.record(model, start, None, "ok" if status < 400 else "error")
                return Response(
                    answer, status, media_type="application/json", headers={**ids, "x-coral-instance": ep.id}
                )
            ep, resp, chunks = await gw.open_stream(model, answer_phase, path, upstream, rid, cls)
            first_at = time.perf_counter()
            outcome = {"ok": False, "done": False}

            async def relay() -> AsyncIterator[bytes]:
                try:
                    async for chunk in chunks:
                        yield chunk
                    outcome["ok"] = resp.status_code < 400
                except OSError as exc:
                    yield _sse_error(f"{ep.id} failed mid-stream: {type(exc).__name__}")

            async def cleanup() -> None:
                if outcome["done"]:
                    return
                outcome["done"] = True
                registry.release(ep, outcome["ok"])
                gw.upstream.labels(ep.id, ep.phase, "ok" if outcome["ok"] else "error").inc()
                gw.record(model, start, first_at, "ok" if outcome["ok"] else "error")
                gw.leave()
                await resp.aclose()

            handed_off = True
            media = resp.headers.get("content-type", "text/event-stream")
            return RelayResponse(
                relay(),
                cleanup,
                status_code=resp.status_code,
                media_type=media,
                headers={**ids, "x-coral-instance": ep.id},
            )
        except UpstreamError as exc:
            gw.record(model, start, None, "error")
            return error_response(exc.status, str(exc), "upstream_error", None, gw.config.retry_after_s)
        finally:
            if not handed_off:
                gw.leave()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, "/v1/chat/completions", chat=True)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        if (denied := guarded(request)) is not None:
            return denied
        msg = "/v1/embeddings is not served: Coral serves generative models (completions, chat completions)"
        return error_response(404, msg, "unsupported_endpoint")

    return app
