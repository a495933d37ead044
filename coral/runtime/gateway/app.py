"""The gateway's FastAPI app: routes, validation, and the request path (prefill, then decode)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from coral.allocation.shedding import Shedder
from coral.http_serving import PagePolicy, closing_event, unless_disconnected
from coral.openai_shapes import InvalidRequest, parse_request
from coral.runtime.gateway.access import AccessGuard, FramingGuard
from coral.runtime.gateway.config import (
    MAX_CHARS_PER_TOKEN,
    UNKNOWN_MODEL,
    GatewayConfig,
    admission_wait_s,
    output_tokens,
    prompt_tokens,
)
from coral.runtime.gateway.errors import (
    SHUTDOWN_MESSAGE,
    BodyRefused,
    UpstreamError,
    error_response,
    install_openai_errors,
    parse_json,
    read_body,
)
from coral.runtime.gateway.relay import forward
from coral.runtime.gateway.upstream import Gateway, RelayResponse
from coral.runtime.registry import Registry


def length_error(config: GatewayConfig, body: dict[str, Any], chat: bool) -> JSONResponse | None:
    """400 for a validated request over its model's context (its prompt, certainly that long at
    `MAX_CHARS_PER_TOKEN`, plus max_tokens) or asking for more than `max_output_tokens` over its n choices;
    None when it fits."""
    context = config.context_of(body["model"])
    prompt = prompt_tokens(body, MAX_CHARS_PER_TOKEN)
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 0
    if prompt + max_tokens > context:
        asked = f" + max_tokens {max_tokens}" if max_tokens else ""
        msg = (f"this model's maximum context length is {context} tokens; the prompt has at least {prompt:.0f} "
               f"tokens{asked}")
        return error_response(400, msg, "context_length_exceeded", "messages" if chat else "prompt")
    n = body.get("n") or 1
    if n * max_tokens > config.max_output_tokens:
        msg = f"n x max_tokens = {n * max_tokens} is over the {config.max_output_tokens} tokens one request may ask for"
        return error_response(400, msg, "too_many_tokens", "n")
    return None


def create_gateway_app(
    registry: Registry,
    config: GatewayConfig | None = None,
    extra_routers: Sequence[APIRouter] = (),
    health_checks: bool = True,
    shedder: Shedder | None = None,
) -> FastAPI:
    """The gateway FastAPI app; `app.state.gateway` is the `Gateway` (its `.state()` feeds dashboards). When its
    server's grace is over (`closing_event`), `Gateway.shut` ends what is still open. `shedder` admits each model
    up to its capacity while the gateway sheds (`GatewayConfig.shed`; `Shedder.for_scenario` of the scenario
    served, else 1 s of capacity per model)."""
    gw = Gateway(registry, config or GatewayConfig(), shedder)
    created = int(time.time())

    async def shut_when_closing(closing: asyncio.Event) -> None:
        await closing.wait()
        gw.shut()

    @asynccontextmanager
    async def lifespan(served: FastAPI) -> AsyncIterator[None]:
        await gw.open()
        tasks = [asyncio.create_task(shut_when_closing(closing_event(served)))]
        if health_checks:
            tasks.append(asyncio.create_task(gw.health_loop()))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await gw.close()

    app = FastAPI(title="coral gateway", lifespan=lifespan)
    app.state.gateway = gw
    closing_event(app)
    app.add_middleware(PagePolicy)  # the dashboard's CSP
    app.add_middleware(AccessGuard, gateway=gw)
    app.add_middleware(FramingGuard, gateway=gw)  # outermost: before the credentials are read
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

    def shed(model: str, body: dict[str, Any]) -> JSONResponse | None:
        """429 `model_over_capacity` with Retry-After for a request beyond its model's capacity while the
        gateway sheds (`Gateway.shed_wait`); None when it may go on. A phase with no capacity left (every
        instance of it lost, e.g. a decode node killed, until its replacement is ready) never refills: its
        requests get the gateway's `retry_after_s` (the wait was infinite, and a 500 OverflowError once)."""
        wait = gw.shed_wait(model, prompt_tokens(body), output_tokens(body))
        if wait <= 0:
            return None
        gw.requests.labels(model, "shed").inc()
        capacity = {phase: rate for (m, phase), rate in registry.capacity().items() if m == model}
        empty = sorted(phase for (m, phase), rate in gw.shed_now().items() if m == model and rate <= 0)
        capacity.update(dict.fromkeys(empty, 0.0))
        rates = ", ".join(f"{phase} {rate:,.8g} tokens/s" for phase, rate in sorted(capacity.items()))
        retry = math.ceil(wait) if math.isfinite(wait) else gw.config.retry_after_s
        why = "the excess is refused" if math.isfinite(wait) else f"nothing serves its {' and '.join(empty)} now"
        msg = f"{model} is over its capacity ({rates}): {why}; retry after {retry} s"
        return error_response(429, msg, "model_over_capacity", None, retry)

    @app.head("/health", include_in_schema=False)
    @app.get("/health")
    async def health() -> dict[str, Any]:
        """Liveness: the gateway answers (whether or not anything is routable yet: see /ready)."""
        return {"status": "ok", "routable": sum(e.routable for e in registry.all())}

    @app.head("/ready", include_in_schema=False)
    @app.get("/ready")
    async def ready() -> JSONResponse:
        """Readiness: 200 once every planned model has a routable instance, else 503 naming those that have none
        (or saying no plan is in force yet), with Retry-After."""
        planned, waiting = registry.planned_models(), gw.not_ready()
        if planned and not waiting:
            return JSONResponse({"status": "ready", "models": planned})
        body = {"status": "not_ready", "models": planned, "not_ready": waiting,
                "reason": f"no routable instance yet for {', '.join(waiting)}" if waiting else "no plan in force yet"}
        return JSONResponse(body, 503, headers={"Retry-After": str(gw.config.retry_after_s)})

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
        if (too_long := length_error(gw.config, body, chat)) is not None:
            gw.requests.labels("", "too_long").inc()
            return too_long
        model = body["model"]
        if model not in registry.models() and model not in registry.planned_models():
            gw.requests.labels(UNKNOWN_MODEL, "unknown_model").inc()
            msg = f"The model '{model}' does not exist; see /v1/models"
            return error_response(404, msg, "model_not_found", "model")
        if not gw.routable(model):  # planned, or lost its instances: come back, it is on its way
            gw.requests.labels(model, "no_instance").inc()
            msg = f"no ready instance for {model} yet (see /ready); retry after {gw.config.retry_after_s} s"
            return error_response(503, msg, "service_unavailable", None, gw.config.retry_after_s)
        if gw.closing:
            return shutting_down(model)
        if (refused := shed(model, body)) is not None:
            return refused
        work = asyncio.ensure_future(admitted(request, path, raw, body, start))
        gw.pending.add(work)
        work.add_done_callback(gw.pending.discard)
        answer = await unless_disconnected(request, work)
        if answer is not None:
            return answer
        if gw.closing:  # `Gateway.shut` cancelled it
            return shutting_down(model)
        gw.record(model, start, None, "client_gone")  # the client left: its upstream calls were cancelled
        return Response(status_code=499)

    async def admitted(request: Request, path: str, raw: bytes, body: dict[str, Any], start: float) -> Response:
        """The answer to a validated request once admitted (429 when the admission queue is full or too slow)."""
        model, queued = body["model"], time.perf_counter()
        try:
            await gw.admit(admission_wait_s(gw.config, model))
        except UpstreamError as exc:
            gw.requests.labels(model, "rejected").inc()
            return error_response(exc.status, str(exc), exc.code, None, gw.config.retry_after_s)
        handed_off = False
        try:
            answer = await forward(gw, request, path, raw, body, start, time.perf_counter() - queued)
            handed_off = isinstance(answer, RelayResponse)
            return answer
        finally:
            if not handed_off:
                gw.leave()

    def shutting_down(model: str) -> JSONResponse:
        gw.requests.labels(model, "shutdown").inc()
        return error_response(503, SHUTDOWN_MESSAGE, "server_shutdown", None, gw.config.retry_after_s)

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


