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

Access: with API keys configured (or read-only tokens), every path but `/health` needs `Authorization: Bearer
KEY` (`AccessGuard`; the scheme in any case; keys and tokens are kept only as SHA-256 digests): API keys reach
everything, read-only tokens GET the dashboard, metrics and state, the admin token `/replan` and those views.
Each key (or client address without keys) has a token bucket of `rate_limit_rps` answering 429 with
Retry-After; bodies over `max_body_bytes` get 413 however they are framed, bodies not received within
`body_timeout_s` 408. Requests are validated by pydantic models of OpenAI's request schema
(`coral.openai_shapes`: 400 naming the field), prompts certainly longer than `max_prompt_tokens` are refused
before routing, and every error has OpenAI's shape `{"error": {"message", "type", "param", "code"}}`. Metric
labels are the plan's model and instance ids only (every other model name counts as `_unknown`). One request id
(the client's `X-Request-Id` or a new one) goes to both the prefill and the decode instance, as vLLM's PD proxy
does.

Timeouts per phase, from the model's SLOs (`Budget`; `coral serve` sets k x the TTFT and TPOT SLOs): the
prefill call must answer within the prefill budget; an answer's first byte must come within it too (streamed),
each later chunk within the token budget, and the whole answer within the prefill budget plus max_tokens token
budgets (a non-streamed answer, which comes at the end, within that whole bound). An instance that misses one
gets 504 (an SSE error event once streaming started), the request is not retried elsewhere, and the instance
is ejected (`Endpoint.eject`: no requests for `eject_s`, doubling while it keeps timing out, then one at a
time until one completes). Requests piling up on a slow instance are bounded by the router (`registry`: no new
request to an instance more than `Registry.max_excess` above its weighted share of the pool's in-flight ones).
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
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import httpx
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import HTTPConnection
from starlette.types import Message, Receive, Scope, Send

from coral.catalog.loader import CoralInputError
from coral.openai_shapes import InvalidRequest, bearer_token, error_body, parse_request
from coral.runtime.aiohttp_pool import AiohttpPool, AiohttpResponse
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
MAX_CHARS_PER_TOKEN = 16.0
"""Characters per token no tokenizer exceeds on ordinary text: prompts refused as longer than the context are
longer at this rate (a lower bound on their tokens), so no prompt that fits is refused."""


def prompt_tokens(body: dict[str, Any], chars_per_token: float = CHARS_PER_TOKEN) -> float:
    """Estimated prompt tokens of a validated request: token ids are counted (the longest of several
    prompts), text is `chars_per_token` characters a token (chat: all text contents together)."""
    if "messages" in body:
        chars = 0
        for m in body["messages"]:
            c = m.get("content")
            parts = [c] if isinstance(c, str) else [p.get("text") for p in c or [] if isinstance(p, dict)]
            chars += sum(len(t) for t in parts if isinstance(t, str))
        return chars / chars_per_token
    p = body["prompt"]
    if isinstance(p, str):
        return len(p) / chars_per_token
    if isinstance(p[0], int):
        return float(len(p))
    return max(len(x) if isinstance(x, list) else len(x) / chars_per_token for x in p)


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


OPEN_PATHS = frozenset({"/health"})
"""Answered without credentials (load-balancer and orchestrator probes)."""
READ_PATHS = frozenset({"/metrics", "/gateway/state", "/state", "/dashboard", "/dashboard/state.json"})
ADMIN_PATHS = frozenset({"/replan"})
TOKEN_COOKIE = "coral_token"
"""Browsers open `/dashboard?token=TOKEN` once; the page's polls then send the token as this cookie (HttpOnly,
SameSite=Strict, Path=/dashboard)."""
UNKNOWN_MODEL = "_unknown"
"""The one metric label of every model not in the plan (label values come only from the plan)."""


@dataclass(frozen=True)
class GatewayConfig:
    max_concurrency: int = 256
    max_waiting: int = 1024
    queue_timeout_s: float = 30.0
    max_attempts: int = 3
    connect_timeout_s: float = 2.0
    request_timeout_s: float = 300.0
    """For models without SLO timeouts (`prefill_timeout_s`, `token_timeout_s`): how long an instance may go
    without sending a byte of its answer."""
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
    body_timeout_s: float = 30.0
    """A request body not received in full within this gets 408 (slow clients cannot hold a slot)."""
    upstream_api_key: str | None = field(default=None, repr=False)
    """Sent as `Authorization: Bearer` to the engines (vLLM `--api-key`)."""
    prefill_timeout_s: dict[str, float] = field(default_factory=dict)
    """Per model, how long an instance may take to answer the prefill call or send an answer's first byte (from
    the model's TTFT SLO, `coral serve`); models not listed wait `request_timeout_s`."""
    token_timeout_s: dict[str, float] = field(default_factory=dict)
    """Per model, how long a streamed answer may go without a chunk after its first, and per max_tokens token
    in the bound of the whole answer (from the model's TPOT SLO, `coral serve`); models not listed wait
    `request_timeout_s` for each chunk and have no bound for the whole answer."""
    max_prompt_tokens: int = 131_072
    """Context length: prompts certainly longer (token ids, or text at `MAX_CHARS_PER_TOKEN`) get 400 before
    routing, so no instance is stalled by one."""
    eject_s: float = 30.0
    """An instance on which a request timed out gets no requests for this long, doubling while it keeps timing
    out (outlier ejection; the timed-out request is not sent to another instance)."""
    read_token_digests: frozenset[str] = field(default=frozenset(), repr=False)
    """Digests of read-only tokens: GET on `READ_PATHS` (dashboard, metrics, state) and nothing else."""
    admin_token_digests: frozenset[str] = field(default=frozenset(), repr=False)
    """Digests of admin tokens: `ADMIN_PATHS` (`/replan`) and `READ_PATHS`."""

    def with_api_keys(self, keys: Iterable[str]) -> GatewayConfig:
        return replace(self, api_key_digests=frozenset(key_digest(k) for k in keys))

    def with_tokens(self, read: Iterable[str] = (), admin: Iterable[str] = ()) -> GatewayConfig:
        return replace(
            self,
            read_token_digests=frozenset(key_digest(k) for k in read),
            admin_token_digests=frozenset(key_digest(k) for k in admin),
        )

    @property
    def guarded(self) -> bool:
        """Whether credentials are required (API keys or read tokens configured): then every path but
        `OPEN_PATHS` needs one."""
        return bool(self.api_key_digests or self.read_token_digests)

    def allows(self, digest: str, method: str, path: str) -> bool:
        """Whether the credential of SHA-256 `digest` may call `method path`."""
        if digest in self.api_key_digests:
            return True
        read = method in ("GET", "HEAD") and path in READ_PATHS
        if digest in self.admin_token_digests:
            return read or path in ADMIN_PATHS
        return read and digest in self.read_token_digests


@dataclass(frozen=True)
class Budget:
    """How long an instance may take over one upstream call: until the first byte of the answer, between later
    chunks, and for the whole answer (seconds; `math.inf`: no bound)."""

    first_s: float
    gap_s: float
    total_s: float = math.inf


def answer_budget(config: GatewayConfig, model: str, body: dict[str, Any], prefill_only: bool) -> Budget:
    """The `Budget` of a validated request `body` of `model`: the prefill call (`prefill_only`) within the
    prefill timeout; an answer's first byte within it too when streamed, later chunks each within the token
    timeout, the whole answer within the prefill timeout plus a token timeout per token of max_tokens (of the
    context when unset); a non-streamed answer, which comes at the end, within that whole bound."""
    ttft = config.prefill_timeout_s.get(model) or config.request_timeout_s
    if prefill_only:
        return Budget(ttft, ttft, ttft)
    per_token = config.token_timeout_s.get(model)
    if per_token is None:
        return Budget(ttft if body.get("stream") else config.request_timeout_s, config.request_timeout_s)
    n = body.get("max_completion_tokens") or body.get("max_tokens") or config.max_prompt_tokens
    total = ttft + n * per_token
    return Budget(ttft if body.get("stream") else total, per_token, total)


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


def parse_json(raw: bytes) -> Any:
    """The JSON document of a request body; InvalidRequest when it is not JSON (bad UTF-8 too) or nests beyond
    Python's stack."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequest(f"invalid request: the body is not valid JSON ({type(exc).__name__})") from None


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


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The request body, however it is framed (Content-Length or chunked); BodyRefused past `limit` bytes
    (without reading the rest) or when it has not all arrived within `timeout_s`."""
    too_large = BodyRefused(413, f"request body over {limit} bytes", "request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
    except TimeoutError:
        raise BodyRefused(408, f"request body not received within {timeout_s:g} s", "request_timeout") from None
    return b"".join(chunks)


class Answer(NamedTuple):
    """One answered request as the gateway timed it (seconds from its arrival)."""

    e2e_s: float
    ttft_s: float
    """to the first byte of the answer (the whole answer when not streamed), as the traffic meter reads it"""
    first_token_s: float | None
    """time to the first token: the first streamed token, or the prefill instance's answer (PD, not streamed);
    None when not observable (a non-streamed answer without a prefill instance)"""
    tpot_s: float | None
    """mean time per output token between the first and last streamed token; None when not streamed"""


class TokenClock:
    """Times the tokens of a streamed answer from its SSE events: each event carrying generated text is a token
    (one event per token, as vLLM and the emulated engines send)."""

    MAX_PENDING = 1 << 16  # a partial event longer than this is not an SSE event: stop buffering it

    def __init__(self) -> None:
        self.pending = b""
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0

    def feed(self, chunk: bytes, at: float) -> None:
        """Read a chunk of the answer that arrived at `at` (perf_counter seconds)."""
        *events, rest = (self.pending + chunk).replace(b"\r\n", b"\n").split(b"\n\n")
        self.pending = rest if len(rest) <= self.MAX_PENDING else b""
        for event in events:
            if _carries_text(event):
                self.tokens += 1
                self.first = at if self.first is None else self.first
                self.last = at

    @property
    def tpot_s(self) -> float | None:
        if self.first is None or self.last is None or self.tokens < 2:
            return None
        return (self.last - self.first) / (self.tokens - 1)


def _carries_text(event: bytes) -> bool:
    """Whether an SSE event of a (chat) completion stream carries generated text (not the role-only opening,
    the usage chunk or [DONE])."""
    for line in event.split(b"\n"):
        if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
            continue
        try:
            choices = json.loads(line[5:]).get("choices") or []
        except (ValueError, AttributeError):
            return False
        for c in choices if isinstance(choices, list) else []:
            delta = c.get("delta") if isinstance(c, dict) else None
            if isinstance(c, dict) and c.get("text"):
                return True
            if isinstance(delta, dict) and any(delta.get(k) for k in ("content", "reasoning_content", "tool_calls")):
                return True
    return False


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
        self.http: AiohttpPool | None = None
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
        self.ejections = Counter(
            "coral_gateway_ejections",
            "instances ejected because a request timed out on them",
            ["instance"],
            registry=self.metrics,
        )
        self.pd_fallbacks = Counter(
            "coral_gateway_pd_fallback",
            "requests decoded without remote prefill (no prefill instance answered)",
            ["model"],
            registry=self.metrics,
        )
        self.metrics.register(_InflightCollector(self))
        self.recent: dict[str, deque[Answer]] = {}
        self.limiter = RateLimiter(config.rate_limit_rps, config.rate_limit_burst)
        self.upstream_headers = {"Content-Type": "application/json"}
        if config.upstream_api_key:
            self.upstream_headers["Authorization"] = f"Bearer {config.upstream_api_key}"

    def principal(self, request: Request) -> str:
        """Who sends `request` (rate limits): the digest of its API key when keys are configured (`AccessGuard`
        let it in), else the client address."""
        if not self.config.api_key_digests:
            return request.client.host if request.client else "?"
        return key_digest(bearer_token(request.headers.get("authorization", "")))

    # --- lifecycle ----------------------------------------------------------------------------------
    async def open(self) -> None:
        """Upstream requests go through aiohttp's keep-alive client; health probes through httpx."""
        self.http = AiohttpPool(self.config.connect_timeout_s)
        self.probe_client = httpx.AsyncClient(timeout=self.config.health_timeout_s)

    async def close(self) -> None:
        if self.http is not None:
            await self.http.aclose()
        if self.probe_client is not None:
            await self.probe_client.aclose()
        self.http = self.probe_client = None

    def pool(self) -> AiohttpPool:
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

    def record(
        self, model: str, start: float, first: float | None, outcome: str, first_token: float | None = None,
        tpot_s: float | None = None,
    ) -> None:
        """Count a client request; time an answered one: `first` = its first byte (None: not streamed),
        `first_token` = its first token when known, `tpot_s` its mean time per output token when streamed
        (all perf_counter seconds)."""
        self.requests.labels(model, outcome).inc()
        if outcome == "ok":
            now = time.perf_counter()
            self.latency.labels(model).observe(now - start)
            ttft = (first or now) - start
            self.ttft.labels(model).observe(ttft)
            token = None if first_token is None else first_token - start
            self.recent.setdefault(model, deque(maxlen=4096)).append(Answer(now - start, ttft, token, tpot_s))

    def client_requests(self) -> dict[str, dict[str, float]]:
        """Client requests so far per model (of the plan) and outcome: each request once, however many
        instances (prefill, decode, retries) it went to."""
        out: dict[str, dict[str, float]] = {}
        for metric in self.requests.collect():
            for sample in metric.samples:
                model = sample.labels.get("model", "")
                if sample.name.endswith("_total") and model not in ("", UNKNOWN_MODEL):
                    by = out.setdefault(model, {})
                    by[sample.labels["outcome"]] = by.get(sample.labels["outcome"], 0.0) + sample.value
        return out

    # --- upstream calls -----------------------------------------------------------------------------
    def _fail(self, ep: Endpoint, exc: BaseException | None) -> None:
        self.registry.release(ep, ok=False)
        self.upstream.labels(ep.id, ep.phase, "error").inc()
        if isinstance(exc, OSError):
            ep.healthy = False  # passive health: the probe loop brings it back

    def eject(self, ep: Endpoint) -> None:
        """A request timed out on `ep`: no requests for a while (`Endpoint.eject`)."""
        ep.eject(self.config.eject_s)
        self.ejections.labels(ep.id).inc()

    async def open_stream(
        self,
        model: str,
        phase: str,
        path: str,
        body: bytes,
        rid: str,
        budget: Budget,
        request_class: str | None = None,
    ) -> tuple[Endpoint, AiohttpResponse, AsyncIterator[bytes]]:
        """Send `body` (JSON bytes, request id `rid`, length class `request_class`) to an instance of the pool
        and read its first chunk, retrying on other instances on failure before that chunk (not after a
        timeout: the instance may still be working on it; it is ejected). Returns the endpoint, the response and
        its whole body as chunks, each read within `budget` (TimeoutError past it); the caller owns the
        response and the endpoint's in-flight slot."""
        tried: set[str] = set()
        last = "no routable instance"
        for _ in range(self.config.max_attempts):
            ep = self.registry.pick(model, phase, frozenset(tried), request_class)
            if ep is None:
                break
            tried.add(ep.id)
            resp: AiohttpResponse | None = None
            sent = asyncio.get_running_loop().time()
            try:
                headers = {**self.upstream_headers, "X-Request-Id": rid}
                async with asyncio.timeout(min(budget.first_s, budget.total_s)):
                    resp = await self.pool().post(ep.url, path, body, headers)
                    if resp.status_code >= 500:
                        last = f"{ep.id}: HTTP {resp.status_code}"
                        await resp.aclose()
                        self._fail(ep, None)
                        continue
                    it = resp.aiter_raw()
                    first = await anext(it, None)
                return ep, resp, _paced(first, it, budget.gap_s, sent + budget.total_s)
            except TimeoutError:  # the instance may still be working on it: not sent to another one
                if resp is not None:
                    await resp.aclose()
                self._fail(ep, None)
                self.eject(ep)
                wait = min(budget.first_s, budget.total_s)
                raise UpstreamError(504, f"{model} {phase}: {ep.id} did not answer within {wait:g} s") from None
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
        self,
        model: str,
        phase: str,
        path: str,
        body: bytes,
        rid: str,
        budget: Budget,
        request_class: str | None = None,
    ) -> tuple[int, bytes, Endpoint]:
        """Non-streaming call with retries; returns (status, body bytes, endpoint)."""
        ep, resp, chunks = await self.open_stream(model, phase, path, body, rid, budget, request_class)
        ok = False
        try:
            data = b"".join([c async for c in chunks])
            ok = resp.status_code < 500
            return resp.status_code, data, ep
        except TimeoutError:
            self.eject(ep)
            raise UpstreamError(504, f"{model} {phase}: {ep.id} did not finish its answer in time") from None
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
        observed share (of requests served by the pool); per model the client requests (`requests`, each once;
        `errors` of them not answered) and, over the last answers (`count`), percentiles of the end-to-end
        latency (`p50_ms`, `p99_ms`), of the time to the first token (`ttft_p50_ms`, ...: streamed answers and
        PD prefills) and of the time per output token (`tpot_p50_ms`, ...: streamed answers)."""
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
                    "ejections": e.ejections,
                    "target_share": e.weight / weight if weight and e.routable else 0.0,
                    "observed_share": e.served / served if served else 0.0,
                }
            )
        latency: dict[str, dict[str, float]] = {}
        asked = self.client_requests()
        for model in sorted(set(asked) | set(self.recent)):
            rec = list(self.recent.get(model, ()))
            by = asked.get(model, {})
            row = latency[model] = {"requests": sum(by.values()), "errors": sum(v for k, v in by.items() if k != "ok"),
                                    "count": len(rec)}
            for key, values in (("", [r.e2e_s for r in rec]),
                                ("ttft_", [r.first_token_s for r in rec if r.first_token_s is not None]),
                                ("tpot_", [r.tpot_s for r in rec if r.tpot_s is not None])):
                if values:
                    values.sort()
                    row[f"{key}p50_ms"] = 1e3 * _pct(values, 0.5)
                    row[f"{key}p99_ms"] = 1e3 * _pct(values, 0.99)
        return {
            "instances": instances,
            "latency": latency,
            "queue": {"waiting": self.waiting, "active": self.active},
        }


async def _paced(first: bytes | None, rest: AsyncIterator[bytes], gap_s: float, deadline: float) -> AsyncIterator[bytes]:
    """`first`, then the chunks of `rest`, each within `gap_s` of the previous one and all before `deadline`
    (the event loop's clock); TimeoutError past either."""
    if first is None:
        return
    yield first
    loop = asyncio.get_running_loop()
    while True:
        async with asyncio.timeout_at(min(loop.time() + gap_s, deadline)):
            chunk = await anext(rest, None)
        if chunk is None:
            return
        yield chunk


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


class AccessGuard:
    """ASGI middleware: when `GatewayConfig.guarded`, every request but `OPEN_PATHS` needs a credential the
    config `allows` for its method and path (`Authorization: Bearer`, the scheme in any case; under
    /dashboard also the `TOKEN_COOKIE`, set by `GET /dashboard?token=TOKEN`), else 401 in OpenAI's shape."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], gateway: Gateway) -> None:
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
    app.add_middleware(AccessGuard, gateway=gw)
    install_openai_errors(app)
    for r in extra_routers:
        app.include_router(r)

    def model_card(model: str) -> dict[str, Any]:
        return {"id": model, "object": "model", "created": created, "owned_by": "coral"}

    def guarded(request: Request) -> JSONResponse | None:
        """429 past the key's rate (`AccessGuard` already refused requests without a valid key); None when the
        request may go on."""
        wait = gw.limiter.wait_s(gw.principal(request))
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
            raw = await read_body(request, gw.config.max_body_bytes, gw.config.body_timeout_s)
        except BodyRefused as exc:
            gw.requests.labels("", "too_large" if exc.status == 413 else "body_timeout").inc()
            return exc.response()
        try:
            body = parse_json(raw)
            parse_request(body, chat)
        except InvalidRequest as exc:
            gw.requests.labels("", "bad_request").inc()
            return error_response(400, str(exc), None, exc.param)
        if (n := prompt_tokens(body, MAX_CHARS_PER_TOKEN)) > gw.config.max_prompt_tokens:
            gw.requests.labels("", "too_long").inc()
            msg = f"the prompt has at least {n:.0f} tokens, over the context of {gw.config.max_prompt_tokens}"
            param = "messages" if chat else "prompt"
            return error_response(400, msg, "context_length_exceeded", param)
        model = body["model"]
        if model not in registry.models():
            gw.requests.labels(UNKNOWN_MODEL, "unknown_model").inc()
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
        prefilled_at: float | None = None  # when the prefill instance answered: the first token is made
        try:
            upstream = raw  # forwarded as received unless the PD path adds the KV-transfer parameters
            if prefill_first:
                pre = {k: v for k, v in body.items() if k not in PREFILL_UNSUPPORTED}
                pre.update(max_tokens=1, stream=False, kv_transfer_params=dict(PREFILL_KV_PARAMS))
                if "max_completion_tokens" in pre:
                    pre["max_completion_tokens"] = 1
                try:
                    pre_body = json.dumps(pre).encode()
                    pre_budget = answer_budget(gw.config, model, body, prefill_only=True)
                    status, answer, _ = await gw.call(model, "prefill", path, pre_body, rid, pre_budget, cls)
                    prefilled_at = time.perf_counter()
                except UpstreamError as exc:  # no prefill instance answered: the decode instance prefills locally
                    if exc.status == 504:  # ... unless one took the request and timed out: not sent elsewhere
                        raise
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
            budget = answer_budget(gw.config, model, body, prefill_only=False)
            if not body.get("stream"):
                status, answer, ep = await gw.call(model, answer_phase, path, upstream, rid, budget, cls)
                gw.record(model, start, None, "ok" if status < 400 else "error", prefilled_at)
                return Response(
                    answer, status, media_type="application/json", headers={**ids, "x-coral-instance": ep.id}
                )
            ep, resp, chunks = await gw.open_stream(model, answer_phase, path, upstream, rid, budget, cls)
            first_at = time.perf_counter()
            outcome = {"ok": False, "done": False}
            clock = TokenClock()

            async def relay() -> AsyncIterator[bytes]:
                try:
                    async for chunk in chunks:
                        clock.feed(chunk, time.perf_counter())
                        yield chunk
                    outcome["ok"] = resp.status_code < 400
                except TimeoutError:  # stalled mid-answer: cut, and the instance gets no requests for a while
                    gw.eject(ep)
                    whole = f", or not done within {budget.total_s:g} s" if math.isfinite(budget.total_s) else ""
                    yield _sse_error(f"{ep.id} stalled mid-answer: no chunk within {budget.gap_s:g} s{whole}")
                except OSError as exc:
                    yield _sse_error(f"{ep.id} failed mid-stream: {type(exc).__name__}")

            async def cleanup() -> None:
                if outcome["done"]:
                    return
                outcome["done"] = True
                registry.release(ep, outcome["ok"])
                gw.upstream.labels(ep.id, ep.phase, "ok" if outcome["ok"] else "error").inc()
                gw.record(model, start, first_at, "ok" if outcome["ok"] else "error", clock.first, clock.tpot_s)
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
