"""The request path past admission: the prefill call, then the answer relayed from the decode pool (or the one
pool of a single-phase model)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from coral.runtime.aiohttp_pool import AiohttpResponse
from coral.runtime.gateway.config import answer_budget, prompt_tokens
from coral.runtime.gateway.errors import (
    SHUTDOWN_MESSAGE,
    SSE_DONE,
    UpstreamError,
    error_response,
    request_id_of,
    sse_error,
)
from coral.runtime.gateway.stats import TokenClock
from coral.runtime.gateway.upstream import Gateway, RelayResponse
from coral.runtime.registry import Endpoint

PREFILL_KV_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


Opened = tuple[Endpoint, AiohttpResponse, AsyncIterator[bytes]]
"""An answer stream as `Gateway.open_stream` opens it."""

PREFILL_UNSUPPORTED = ("min_tokens", "min_completion_tokens", "stream_options")
"""Options a prefill-only request (max_tokens=1, not streamed) must not carry; the decode side keeps them."""


async def forward(
    gw: Gateway, request: Request, path: str, raw: bytes, body: dict[str, Any], start: float, waited_s: float
) -> Response:
    """Answer a validated, admitted request `body` (received as `raw`, at perf_counter `start`, after `waited_s`
    in the admission queue, which its budgets lose): a prefill call first when the model has a prefill pool,
    then the answer; a streamed answer is a `RelayResponse` that releases the admission slot when done
    (otherwise the caller releases it), and that ends with an error event and `[DONE]` when `Gateway.shut` cuts
    it. The answer names its instance (`x-coral-instance`) when `Gateway.shows_instance`."""
    registry, model = gw.registry, body["model"]
    prefill_first, answer_phase = gw.pd_pools(model)
    rid = request_id_of(request.headers.get("x-request-id"))
    cls = registry.class_of(model, prompt_tokens(body))
    ids = {"x-request-id": rid}
    shown = gw.shows_instance(request)

    def named(ep: Endpoint) -> dict[str, str]:
        """The answer's headers: its request id, and its instance when `shown`."""
        return {**ids, "x-coral-instance": ep.id} if shown else ids
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
                pre_budget = answer_budget(gw.config, model, body, prefill_only=True, waited_s=waited_s)
                status, answer, _ = await gw.call(model, "prefill", path, pre_body, rid, pre_budget, cls)
                prefilled_at = time.perf_counter()
            except UpstreamError as exc:  # no prefill instance answered: the decode instance prefills locally
                if exc.status == 504 or exc.backpressure:  # ... unless one took it and timed out, or all refused
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
        budget = answer_budget(gw.config, model, body, prefill_only=False, waited_s=waited_s)

        async def open_answer(phase: str, payload: bytes) -> Response | Opened:
            """The whole answer of the `phase` pool (not streamed), or its opened stream."""
            if body.get("stream"):
                return await gw.open_stream(model, phase, path, payload, rid, budget, cls)
            status, answer, ep = await gw.call(model, phase, path, payload, rid, budget, cls)
            gw.record(model, start, None, "ok" if status < 400 else "error", prefilled_at)
            return Response(answer, status, media_type="application/json", headers=named(ep))

        try:
            opened = await open_answer(answer_phase, upstream)
        except UpstreamError as exc:  # no decode instance could answer (not busy: down): the prefill pool answers
            alone = answer_phase == "decode" and exc.status in (502, 503) and not exc.backpressure
            if not (alone and any(e.routable for e in registry.pool(model, "prefill"))):
                raise
            gw.prefill_answers.labels(model).inc()
            opened = await open_answer("prefill", raw)
        if isinstance(opened, Response):
            return opened
        ep, resp, chunks = opened
    except UpstreamError as exc:
        gw.record(model, start, None, "refused" if exc.backpressure else "error")
        return error_response(exc.status, str(exc), exc.code, None, exc.retry_after or gw.config.retry_after_s)
    first_at = time.perf_counter()
    outcome = {"ok": False, "done": False, "shut": False}
    clock = TokenClock()

    async def relay() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                clock.feed(chunk, time.perf_counter())
                if clock.done:  # the answer is whole: counted before the client can read its end
                    outcome["ok"] = resp.status_code < 400
                    release()
                yield chunk
            outcome["ok"] = resp.status_code < 400
        except TimeoutError:  # stalled mid-answer: cut, and the instance gets no requests for a while
            gw.eject(ep)
            whole = f", or not done within {budget.total_s:.3g} s" if math.isfinite(budget.total_s) else ""
            yield sse_error(f"{ep.id} stalled mid-answer: no chunk to any of its streams within {budget.gap_s:.3g} s"
                            f"{whole}")
        except OSError as exc:
            if gw.closing:  # cut by `Gateway.shut`
                outcome["shut"] = True
                yield sse_error(SHUTDOWN_MESSAGE, "server_shutdown", 503) + SSE_DONE
            else:
                yield sse_error(f"{ep.id} failed mid-stream: {type(exc).__name__}")
        release()  # before the response's end is sent (on a cut connection RelayResponse's cleanup releases)

    def release() -> None:
        """The instance, the admission slot and the answer's record, once."""
        if outcome["done"]:
            return
        outcome["done"] = True
        gw.relayed.discard(resp)
        ok, shut = outcome["ok"], outcome["shut"]
        registry.release(ep, None if shut else ok)  # the instance did not fail a stream the shutdown cut
        gw.upstream.labels(ep.id, ep.phase, "ok" if ok else "shutdown" if shut else "error").inc()
        gw.record(model, start, first_at, "ok" if ok else "shutdown" if shut else "error", clock.first, clock.tpot_s)
        gw.leave()

    async def cleanup() -> None:
        release()
        await resp.aclose()

    media = resp.headers.get("content-type", "text/event-stream")
    gw.relayed.add(resp)
    return RelayResponse(relay(), cleanup, status_code=resp.status_code, media_type=media, headers=named(ep))
