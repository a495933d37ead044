"""The gateway's state: admission, health probes, upstream calls with retries, ejection, metrics."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.types import Receive, Scope, Send

from coral.allocation.shedding import Shedder, shed_capacity
from coral.openai_shapes import bearer_token
from coral.runtime.aiohttp_pool import AiohttpPool, AiohttpResponse
from coral.runtime.gateway.access import RateLimiter
from coral.runtime.gateway.config import ADMIN_TOKEN_HEADER, UNKNOWN_MODEL, Budget, GatewayConfig, key_digest
from coral.runtime.gateway.errors import UpstreamError
from coral.runtime.gateway.stats import Answer, InflightCollector, pct
from coral.runtime.registry import Endpoint, InstanceState, Registry

DEADLINE_HEADER = "x-coral-deadline"
"""Sent to the engines: unix seconds (a float) by which the answer's first byte is due (a stream's first token,
else the whole answer); an engine drops a request still waiting then, as the gateway answers the client 504."""
BACKPRESSURE_STATUSES = (429, 503, 504)
"""With Retry-After: an engine's refusal for now (full), or its 504 for a deadline that passed."""
BROKEN_CODES = frozenset({"engine_unavailable"})
"""Error codes of an engine's 503 that say it is broken (a node died), not busy: a failure, retried elsewhere, and
the instance is out of routing until a health probe passes."""


def backpressure(resp: AiohttpResponse) -> int | None:
    """Retry-After seconds of an engine's refusal (`BACKPRESSURE_STATUSES` with Retry-After), else None."""
    value = resp.headers.get("retry-after", "")
    if resp.status_code not in BACKPRESSURE_STATUSES or not value:
        return None
    try:
        return min(3600, max(0, math.ceil(float(value))))
    except (ValueError, OverflowError):  # an HTTP date, or not a number
        return 1


async def refusal(ep: Endpoint, resp: AiohttpResponse, retry_after: int) -> UpstreamError:
    """The client's error for an engine's refusal: its status, Retry-After and error message (OpenAI shape)."""
    raw = b"".join([c async for c in resp.aiter_raw()])[:4096]
    await resp.aclose()
    try:
        error = json.loads(raw)["error"]
        message, code = str(error["message"]), str(error.get("code") or "overloaded")
    except (ValueError, KeyError, TypeError, AttributeError):
        message, code = f"HTTP {resp.status_code}", "overloaded"
    return UpstreamError(resp.status_code, f"{ep.id} refused: {message}", code, retry_after)


class Gateway:
    """State of one gateway app: registry, admission control, upstream client, metrics and latency stats."""

    def __init__(self, registry: Registry, config: GatewayConfig, shedder: Shedder | None = None) -> None:
        self.registry = registry
        self.config = config
        self.shedder = shedder or Shedder({}, {})
        """Admission at each model's capacity while `shedding` (`Shedder.for_scenario` for SLO depths; default:
        1 s of capacity, no output-token estimate for requests without max_tokens)."""
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
        self.ejections_capped = Counter(
            "coral_gateway_ejections_capped",
            "timeouts on an instance not ejected: the pool's ejection cap kept it routable",
            ["instance"],
            registry=self.metrics,
        )
        self.prefill_answers = Counter(
            "coral_gateway_prefill_answers",
            "requests of a PD model answered by its prefill pool alone (no decode instance could take them)",
            ["model"],
            registry=self.metrics,
        )
        self.pd_fallbacks = Counter(
            "coral_gateway_pd_fallback",
            "requests decoded without remote prefill (no prefill instance answered)",
            ["model"],
            registry=self.metrics,
        )
        self.metrics.register(InflightCollector(self))
        self.recent: dict[str, deque[Answer]] = {}
        self.limiter = RateLimiter(config.rate_limit_rps, config.rate_limit_burst)
        self.upstream_headers = {"Content-Type": "application/json"}
        if config.upstream_api_key:
            self.upstream_headers["Authorization"] = f"Bearer {config.upstream_api_key}"
        self.closing = False
        """Set by `shut`: the server's grace is over."""
        self.pending: set[asyncio.Task[Any]] = set()
        """Requests admitted or queued for admission, until their answer (or a stream's first chunk) is ready."""
        self.relayed: set[AiohttpResponse] = set()
        """Upstream answers being streamed to clients."""

    def shows_instance(self, request: Request) -> bool:
        """Whether the answer to `request` names its instance (`x-coral-instance`): with
        `GatewayConfig.instance_header`, or for a request bearing an admin token in `ADMIN_TOKEN_HEADER`."""
        if self.config.instance_header:
            return True
        token = request.headers.get(ADMIN_TOKEN_HEADER)
        return token is not None and key_digest(token) in self.config.admin_token_digests

    def shut(self) -> None:
        """The server's grace is over (`coral.http_serving.closing_event`): requests without an answer yet are
        cancelled (the client gets 503 `server_shutdown`), and the upstream answers being streamed are cut, each
        stream ending with an SSE error event of that code and `[DONE]` (`relay.forward`)."""
        self.closing = True
        for task in list(self.pending):
            task.cancel()
        for answer in list(self.relayed):
            answer.resp.close()

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
        """Probe `/health` of every non-stopped instance: unhealthy at once when it answers anything but 200 (an
        engine that lost a node says 503), after `unhealthy_after` probes in a row without an answer. A probe
        unanswered while the instance is still delivering chunks to its streams is not counted: it is busy (its
        event loop behind under load), not down, and taking it out would refuse work it is doing."""
        client = self.probe_client
        if client is None:
            return
        eps = [e for e in self.registry.all() if e.state is not InstanceState.STOPPED]

        async def probe(ep: Endpoint) -> None:
            answered = True
            try:
                r = await client.get(f"{ep.url}/health", timeout=self.config.health_timeout_s)
                ok = r.status_code == 200
            except httpx.TimeoutException:
                if self.busy(ep):
                    return
                ok = answered = False
            except httpx.HTTPError:
                ok = answered = False
            ep.health_failures = 0 if ok else ep.health_failures + 1
            ep.healthy = ok or (not answered and ep.health_failures < self.config.unhealthy_after)

        await asyncio.gather(*(probe(e) for e in eps))

    # --- admission ----------------------------------------------------------------------------------
    async def admit(self, wait_s: float) -> None:
        """Wait for a slot at most `wait_s`; UpstreamError(429) when the queue is full or the wait is longer."""
        if self.sem.locked() and self.waiting >= self.config.max_waiting:
            raise UpstreamError(429, "gateway overloaded: admission queue is full", "overloaded")
        self.waiting += 1
        try:
            async with asyncio.timeout(wait_s):  # a cancelled acquire holds no slot (wait_for's may, on 3.11)
                await self.sem.acquire()
        except TimeoutError:
            msg = f"gateway overloaded: queued {wait_s:.3g} s, too long to answer in time"
            raise UpstreamError(429, msg, "overloaded") from None
        finally:
            self.waiting -= 1
        self.active += 1

    def shed_now(self) -> dict[tuple[str, str], float]:
        """The (model, phase)s shed now, with the capacity serving each (`shed_capacity`: by `GatewayConfig.shed`,
        the plan in force and the keys that lost instances)."""
        if self.config.shed == "off":
            return {}
        return shed_capacity(self.registry.capacity(), self.registry.plan, self.config.shed, self.registry.down())

    @property
    def shedding(self) -> bool:
        """Whether requests beyond their model's capacity are refused now."""
        return bool(self.shed_now())

    def shed_wait(self, model: str, prompt: float, output: float | None) -> float:
        """0 when a request of `model` with `prompt` tokens asking for `output` tokens (None: the model's mean)
        may go on (its model is not shed, or fits the capacity serving it), else the seconds until it would
        (`Shedder.admit`)."""
        now = time.monotonic()
        self.shedder.set_capacity(self.shed_now(), now)
        return self.shedder.admit(model, prompt, output, now)

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
    def busy(self, ep: Endpoint) -> bool:
        """Whether `ep` delivered a chunk to one of its answers while a probe or a connection to it could have been
        waiting (the longer of `health_timeout_s` and `connect_timeout_s`): alive, so a probe or a connection that
        timed out means its loop is behind under load, not that it is down (a refused or reset one still does)."""
        window = max(self.config.health_timeout_s, self.config.connect_timeout_s)
        return asyncio.get_running_loop().time() - ep.progress_at < window

    def _fail(self, ep: Endpoint, exc: BaseException | None) -> None:
        self.registry.release(ep, ok=False)
        self.upstream.labels(ep.id, ep.phase, "error").inc()
        timed_out = isinstance(exc, OSError) and isinstance(exc.__cause__, TimeoutError)
        if isinstance(exc, OSError) and not (timed_out and self.busy(ep)):
            ep.healthy = False  # passive health: the probe loop brings it back

    def eject(self, ep: Endpoint) -> None:
        """A request timed out on `ep`: no requests for a while, unless the pool's ejection cap holds it in
        (`Registry.eject`)."""
        ejected = self.registry.eject(ep, self.config.eject_s, self.config.max_eject_fraction)
        (self.ejections if ejected else self.ejections_capped).labels(ep.id).inc()

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
        timeout: the instance may still be working on it; it is ejected). The instance gets the deadline of
        its first byte (`DEADLINE_HEADER`, unix seconds) when the budget bounds it. An instance refusing it for
        now (429 or 503 with Retry-After: backpressure) is neither failed nor ejected: the next one is tried,
        and when none is left the refusal is the UpstreamError (`backpressure`); an engine's 504 with
        Retry-After (the deadline passed before the request ran) is that error at once. Returns the endpoint,
        the response and its whole body as chunks, each read within `budget` (TimeoutError past it); the caller
        owns the response and the endpoint's in-flight slot."""
        tried: set[str] = set()
        last = "no routable instance"
        refused: UpstreamError | None = None
        headers = {**self.upstream_headers, "X-Request-Id": rid}
        if (deadline := budget.deadline(time.time())) is not None:
            headers[DEADLINE_HEADER] = f"{deadline:.3f}"
        for _ in range(self.config.max_attempts):
            ep = self.registry.pick(model, phase, frozenset(tried), request_class)
            if ep is None:
                break
            tried.add(ep.id)
            resp: AiohttpResponse | None = None
            sent = asyncio.get_running_loop().time()
            try:
                async with asyncio.timeout(budget.first_wait_s):
                    resp = await self.pool().post(ep.url, path, body, headers)
                    if (retry_after := backpressure(resp)) is not None:
                        refusing = await refusal(ep, resp, retry_after)
                        if refusing.code in BROKEN_CODES:
                            last = str(refusing)
                            self._fail(ep, None)
                            ep.healthy = False
                            continue
                        refused = refusing
                        self.registry.release(ep, None)
                        self.upstream.labels(ep.id, ep.phase, "refused").inc()
                        if resp.status_code == 504:  # its deadline passed: no other instance makes it either
                            break
                        continue
                    if resp.status_code >= 500:
                        last = f"{ep.id}: HTTP {resp.status_code}"
                        await resp.aclose()
                        self._fail(ep, None)
                        continue
                    it = resp.aiter_raw()
                    first = await anext(it, None)
                return ep, resp, _paced(first, it, budget.gap_s, sent + budget.total_s, ep)
            except TimeoutError:  # the instance may still be working on it: not sent to another one
                if resp is not None:
                    await resp.aclose()
                self._fail(ep, None)
                self.eject(ep)
                wait = min(budget.first_s, budget.total_s)
                raise UpstreamError(504, f"{model} {phase}: {ep.id} did not answer within {wait:.3g} s") from None
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
        if refused is not None:
            raise refused
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

    def routable(self, model: str) -> bool:
        """Whether a request for `model` has an instance to go to (in the pool answering the client: `pd_pools`)."""
        return any(e.routable for e in self.registry.pool(model, self.pd_pools(model)[1]))

    def not_ready(self) -> list[str]:
        """The planned models (`Registry.planned_models`) no request can be routed for yet."""
        return [m for m in self.registry.planned_models() if not self.routable(m)]

    def pd_pools(self, model: str) -> tuple[bool, str]:
        """(prefill first?, phase answering the client) for a model: its decode pool after a prefill call when it
        has both; its prefill pool alone when no decode instance is routable but a prefill one is (a lost decode
        instance does not stop the model)."""
        eps = [e for e in self.registry.all() if e.model == model]
        phases = {e.phase for e in eps}
        if "decode" not in phases:
            return False, "prefill"
        routable = {e.phase for e in eps if e.routable}
        if "decode" not in routable and "prefill" in routable:
            return False, "prefill"
        return "prefill" in phases, "decode"

    def state(self) -> dict[str, Any]:
        """JSON-able view for dashboards: instances with counters, planned share (weight among the routable
        instances of its pool), planned tokens/s per request class (`class_weights`, None: every class) and
        observed share (of requests served by the pool); per model the client requests (`requests`, each once;
        `errors` of them not answered) and, over the last answers (`count`), percentiles of the end-to-end
        latency (`p50_ms`, `p99_ms`), of the time to the first token (`ttft_p50_ms`, ...: streamed answers and
        PD prefills) and of the time per output token (`tpot_p50_ms`, ...: streamed answers); whether it sheds now
        (`shedding`)."""
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
                    row[f"{key}p50_ms"] = 1e3 * pct(values, 0.5)
                    row[f"{key}p99_ms"] = 1e3 * pct(values, 0.99)
        return {
            "instances": instances,
            "latency": latency,
            "queue": {"waiting": self.waiting, "active": self.active},
            "shedding": self.shedding,
        }


async def _paced(first: bytes | None, rest: AsyncIterator[bytes], gap_s: float, deadline: float,
                 ep: Endpoint) -> AsyncIterator[bytes]:
    """`first`, then the chunks of `rest`, all before `deadline` (the event loop's clock), each within `gap_s` of
    the previous one unless the instance `ep` delivered a chunk to another of its streams within `gap_s`: a busy
    instance that makes progress is not stalled (its micro-batches can hold a stream back longer than a token's
    time), one that delivers nothing to anyone is. TimeoutError past either bound. Each wait costs one timer, as a
    plain timeout would: the timer, when it fires, moves itself to the instance's newer progress instead of
    expiring.

    `gap_s` stays k x the TPOT SLO, not a looser dead-instance bound: a dead node is already failed by its engine
    (503 `engine_unavailable`) and a dead process by its connection, so what this catches is an instance alive
    but silent (hung, stopped, starved), whose streams would otherwise wait out the whole-answer bound. An engine
    with running streams delivers some token every step; the Coral engine keeps that while it takes new
    requests' KV (its decode nodes never wait on a hand-off: `coral.engine.node.Pulls`; before, a pull waiting
    on a busy prefill node left every stream of the instance without a token for 1-6 s under
    `benchmarks/engine_load.py`, and this check cut them)."""
    if first is None:
        return
    loop = asyncio.get_running_loop()
    ep.progress_at = loop.time()
    yield first
    while True:
        async with asyncio.timeout(None) as reader:
            timer = _StallTimer(loop, reader, ep, gap_s, deadline)
            try:
                chunk = await anext(rest, None)
            finally:
                timer.cancel()
        if chunk is None:
            return
        ep.progress_at = loop.time()
        yield chunk


class _StallTimer:
    """Expires `reader` once `ep` has delivered nothing for `gap_s`, or at `deadline`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, reader: asyncio.Timeout, ep: Endpoint, gap_s: float,
                 deadline: float) -> None:
        self.loop, self.reader, self.ep, self.gap_s, self.deadline = loop, reader, ep, gap_s, deadline
        self.handle = loop.call_at(self._due(), self._fire)

    def _due(self) -> float:
        return min(self.ep.progress_at + self.gap_s, self.deadline)

    def _fire(self) -> None:
        now, due = self.loop.time(), self._due()
        if now >= due:
            self.reader.reschedule(now)
        else:
            self.handle = self.loop.call_at(due, self._fire)

    def cancel(self) -> None:
        self.handle.cancel()



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




