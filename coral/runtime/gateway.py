"""OpenAI-compatible gateway: routes by model across plan instances, prefill then decode (vLLM's PD protocol).

Request path: admission (at most `max_concurrency` requests upstream, at most `max_waiting` queued; beyond
that 429 with Retry-After; 503 when the model has no routable instance) -> for a model with prefill and decode
instances, a non-streaming `max_tokens: 1` request with `kv_transfer_params: {do_remote_decode: true}` to a
prefill instance, then the client's request plus the returned `kv_transfer_params` to a decode instance
(models with a single pool are sent there directly). A failure before the first byte of the answer (connect
error, 5xx, dropped connection) is retried on another instance of the pool; once streaming started, an error
ends the stream with an SSE error event. In-flight counts are released in `finally` blocks that also run on
client cancels, and endpoints are released on the object they were picked on, so churn cannot skew them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from starlette.types import Receive, Scope, Send

from coral.runtime.registry import Endpoint, InstanceState, Registry

PREFILL_KV_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


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
    client_shards: int = 8


class UpstreamError(Exception):
    """Every attempt on a pool failed before the first byte; `status` is what the client gets."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def error_response(status: int, message: str, kind: str, retry_after: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(
        {"error": {"message": message, "type": kind, "code": status}}, status, headers=headers
    )


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
        self.clients: list[httpx.AsyncClient] = []
        self._next_client = 0
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

    # --- lifecycle ----------------------------------------------------------------------------------
    async def open(self) -> None:
        """Upstream clients: httpx's pool slows down with many concurrent requests on one client, so requests
        are spread round-robin over `client_shards` clients."""
        c = self.config
        timeout = httpx.Timeout(c.request_timeout_s, connect=c.connect_timeout_s)
        per = max(1, c.max_concurrency // c.client_shards)
        limits = httpx.Limits(max_connections=per * 2, max_keepalive_connections=per)
        self.clients = [httpx.AsyncClient(timeout=timeout, limits=limits) for _ in range(c.client_shards)]

    async def close(self) -> None:
        for client in self.clients:
            await client.aclose()
        self.clients = []

    def client(self) -> httpx.AsyncClient:
        if not self.clients:
            raise RuntimeError("gateway is not open (its app lifespan has not started)")
        self._next_client = (self._next_client + 1) % len(self.clients)
        return self.clients[self._next_client]

    async def health_loop(self) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(self.config.health_interval_s)

    async def check_health(self) -> None:
        """Probe `/health` of every non-stopped instance; mark unhealthy after `unhealthy_after` failures."""
        client = self.client()
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
        if isinstance(exc, httpx.TransportError):
            ep.healthy = False  # passive health: the probe loop brings it back

    async def open_stream(
        self, model: str, phase: str, path: str, body: dict[str, Any]
    ) -> tuple[Endpoint, httpx.Response, AsyncIterator[bytes]]:
        """Send `body` to an instance of the pool and read its first chunk, retrying on other instances on
        failure before that chunk. Returns the endpoint, the response and its whole body as chunks; the
        caller owns the response and the endpoint's in-flight slot."""
        tried: set[str] = set()
        last = "no routable instance"
        for _ in range(self.config.max_attempts):
            ep = self.registry.pick(model, phase, frozenset(tried))
            if ep is None:
                break
            tried.add(ep.id)
            resp: httpx.Response | None = None
            try:
                client = self.client()
                req = client.build_request("POST", f"{ep.url}{path}", json=body)
                resp = await client.send(req, stream=True)
                if resp.status_code >= 500:
                    last = f"{ep.id}: HTTP {resp.status_code}"
                    await resp.aclose()
                    self._fail(ep, None)
                    continue
                it = resp.aiter_raw()
                first = await anext(it, None)
                return ep, resp, _chain(first, it)
            except (httpx.HTTPError, OSError) as exc:
                last = f"{ep.id}: {type(exc).__name__}"
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
        self, model: str, phase: str, path: str, body: dict[str, Any]
    ) -> tuple[int, bytes, Endpoint]:
        """Non-streaming call with retries; returns (status, body bytes, endpoint)."""
        ep, resp, chunks = await self.open_stream(model, phase, path, body)
        ok = False
        try:
            data = b"".join([c async for c in chunks])
            ok = resp.status_code < 500
            return resp.status_code, data, ep
        except httpx.HTTPError as exc:
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
        instances of its pool) and observed share (of requests served by the pool), latency percentiles."""
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
    return f"data: {json.dumps({'error': {'message': message, 'type': 'upstream_error'}})}\n\n".encode()


def create_gateway_app(
    registry: Registry,
    config: GatewayConfig | None = None,
    extra_routers: Sequence[APIRouter] = (),
    health_checks: bool = True,
) -> FastAPI:
    """The gateway FastAPI app; `app.state.gateway` is the `Gateway` (its `.state()` feeds dashboards)."""
    gw = Gateway(registry, config or GatewayConfig())

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
    for r in extra_routers:
        app.include_router(r)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "routable": sum(e.routable for e in registry.all())}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gw.metrics), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        data = [{"id": m, "object": "model", "owned_by": "coral"} for m in registry.models()]
        return {"object": "list", "data": data}

    @app.get("/gateway/state")
    async def state() -> dict[str, Any]:
        return gw.state()

    async def serve(request: Request, path: str) -> Response:
        start = time.perf_counter()
        try:
            body = await request.json()
            if not isinstance(body, dict) or not isinstance(body.get("model"), str):
                raise ValueError("body must be a JSON object with a string 'model'")
        except ValueError as exc:
            gw.requests.labels("", "bad_request").inc()
            return error_response(400, f"invalid request: {exc}", "invalid_request_error")
        model = body["model"]
        if model not in registry.models():
            gw.requests.labels(model, "unknown_model").inc()
            return error_response(404, f"model {model!r} is not served; see /v1/models", "model_not_found")
        prefill_first, answer_phase = gw.pd_pools(model)
        if not any(e.routable for e in registry.pool(model, answer_phase)):
            gw.requests.labels(model, "no_instance").inc()
            return error_response(
                503, f"no ready instance for {model}", "unavailable", gw.config.retry_after_s
            )
        try:
            await gw.admit()
        except UpstreamError as exc:
            gw.requests.labels(model, "rejected").inc()
            return error_response(exc.status, str(exc), "overloaded", gw.config.retry_after_s)
        handed_off = False
        try:
            upstream_body = dict(body)
            if prefill_first:
                pre = {k: v for k, v in body.items() if k != "stream_options"}
                pre.update(max_tokens=1, stream=False, kv_transfer_params=dict(PREFILL_KV_PARAMS))
                if "max_completion_tokens" in pre:
                    pre["max_completion_tokens"] = 1
                try:
                    status, raw, _ = await gw.call(model, "prefill", path, pre)
                except UpstreamError:  # no prefill instance answered: the decode instance prefills locally
                    gw.pd_fallbacks.labels(model).inc()
                    status, raw = 0, b""
                if status >= 400:
                    gw.record(model, start, None, "error")
                    return Response(raw, status, media_type="application/json")
                if status:
                    try:
                        upstream_body["kv_transfer_params"] = json.loads(raw).get("kv_transfer_params")
                    except (ValueError, AttributeError):
                        raise UpstreamError(502, "prefill answer is not a JSON object") from None
            if not body.get("stream"):
                status, raw, ep = await gw.call(model, answer_phase, path, upstream_body)
                gw.record(model, start, None, "ok" if status < 400 else "error")
                return Response(
                    raw, status, media_type="application/json", headers={"x-coral-instance": ep.id}
                )
            ep, resp, chunks = await gw.open_stream(model, answer_phase, path, upstream_body)
            first_at = time.perf_counter()
            outcome = {"ok": False, "done": False}

            async def relay() -> AsyncIterator[bytes]:
                try:
                    async for chunk in chunks:
                        yield chunk
                    outcome["ok"] = resp.status_code < 400
                except (httpx.HTTPError, OSError) as exc:
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
                headers={"x-coral-instance": ep.id},
            )
        except UpstreamError as exc:
            gw.record(model, start, None, "error")
            return error_response(exc.status, str(exc), "upstream_error", gw.config.retry_after_s)
        finally:
            if not handed_off:
                gw.leave()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, "/v1/chat/completions")

    return app
