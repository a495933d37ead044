"""Emulated engine: a real OpenAI-compatible HTTP server per instance whose timing follows the perf model.

Prefill runs in steps, each over all prompts waiting (continuous batching), lasting the prefill step time of
the instance's pipeline (sum over stages) for that many tokens; the delay between tokens is the decode step
time at the current number of active sequences. `time_scale`
multiplies every sleep (0 = as fast as possible). Tokens are deterministic: a function of the prompt and
the position. The engine speaks vLLM's disaggregated-prefill protocol: a request carrying
`kv_transfer_params.do_remote_decode` is prefilled only and answers with the `kv_transfer_params` a decode
instance needs; a request carrying `kv_transfer_params.do_remote_prefill` skips the prefill. Like vLLM, it
takes the request id from `X-Request-Id` (`chatcmpl-ID` / `cmpl-ID`), refuses `min_tokens` above `max_tokens`
(why a PD proxy strips `min_tokens` from the prefill request) and sends a usage chunk when streaming with
`stream_options.include_usage`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
import zlib
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from coral.allocation.plan import PlanInstance
from coral.catalog.loader import Catalog, builtin_catalog
from coral.catalog.schema import ModelArch
from coral.http_serving import unless_disconnected
from coral.openai_shapes import bearer_allowed, chunk, error_body, full, max_tokens_of, usage
from coral.perf.model import PerfModel, Phase, Workload
from coral.perf.roofline import RooflineModel

VOCAB = ("the", "cat", "sat", "on", "a", "warm", "mat", "and", "dreamt", "of", "fish", "in", "blue", "seas")


@dataclass(frozen=True)
class EngineTiming:
    """Seconds to prefill `prompt_tokens`, and per decode step at `active` sequences."""

    prefill_s: Callable[[int], float]
    decode_step_s: Callable[[int, int], float]

    @classmethod
    def constant(cls, ttft_s: float = 0.0, itl_s: float = 0.0) -> EngineTiming:
        return cls(prefill_s=lambda _n: ttft_s, decode_step_s=lambda _a, _c: itl_s)

    @classmethod
    def from_instance(
        cls,
        instance: PlanInstance,
        model_arch: ModelArch,
        catalog: Catalog,
        perf: PerfModel | RooflineModel,
        output_tokens: float = 128,
    ) -> EngineTiming:
        """Pipeline timing of `instance`: stages run one after another for one request (first node of each)."""
        stages = [(catalog.node_config(s.nodes[0]), s.layers) for s in instance.stages]

        def prefill(n: int) -> float:
            w = Workload(input_tokens=max(n, 1), output_tokens=output_tokens)
            return float(
                sum(perf.step_time(model_arch, Phase.PREFILL, nd, j, max(n, 1), w) for nd, j in stages)
            )

        def decode(active: int, context: int) -> float:
            w = Workload(input_tokens=max(context, 1), output_tokens=1)
            b = max(active, 1)
            return float(sum(perf.step_time(model_arch, Phase.DECODE, nd, j, b, w) for nd, j in stages))

        return cls(prefill_s=prefill, decode_step_s=decode)


def prompt_text(body: dict[str, Any]) -> str:
    """The prompt of a completions request or the concatenated messages of a chat request."""
    if "messages" in body:
        parts = []
        for m in body.get("messages") or []:
            c = m.get("content", "") if isinstance(m, dict) else ""
            parts.append(c if isinstance(c, str) else json.dumps(c))
        return "\n".join(parts)
    p = body.get("prompt", "")
    return p if isinstance(p, str) else " ".join(map(str, p))


def count_tokens(text: str) -> int:
    return max(1, len(text.split()))


def token_text(prompt: str, i: int) -> str:
    return " " + VOCAB[(zlib.crc32(prompt.encode(errors="surrogatepass")) + i) % len(VOCAB)]


@dataclass
class EngineState:
    instance_id: str
    model: str
    phase: str
    active: int = 0
    served: int = 0
    prefills: int = 0
    prefill_steps: int = 0
    cancelled: int = 0
    """Requests whose client (the gateway) left before the answer (a stream: before its first chunk): their work
    was cancelled."""
    request_ids: deque[str] = field(default_factory=lambda: deque(maxlen=64))


class PrefillBatcher:
    """Prefill as the engine schedules it: one step at a time, each over every prompt waiting (up to
    `max_tokens` tokens), lasting the perf model's step time for that batch of tokens."""

    def __init__(
        self, step_s: Callable[[int], float], time_scale: float, st: EngineState, max_tokens: int = 8192
    ):
        self.step_s = step_s
        self.time_scale = time_scale
        self.st = st
        self.max_tokens = max_tokens
        self.queue: asyncio.Queue[tuple[int, asyncio.Future[None]]] | None = None
        self.task: asyncio.Task[None] | None = None

    async def prefill(self, n_tokens: int) -> None:
        if self.time_scale <= 0:
            self.st.prefill_steps += 1
            return
        if self.queue is None:
            self.queue = asyncio.Queue()
            self.task = asyncio.create_task(self._loop(self.queue))
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        await self.queue.put((n_tokens, fut))
        await fut

    async def _loop(self, queue: asyncio.Queue[tuple[int, asyncio.Future[None]]]) -> None:
        while True:
            batch = [await queue.get()]
            total = batch[0][0]
            while not queue.empty() and total < self.max_tokens:
                batch.append(queue.get_nowait())
                total += batch[-1][0]
            self.st.prefill_steps += 1
            await asyncio.sleep(self.step_s(total) * self.time_scale)
            for _, fut in batch:
                if not fut.done():  # a cancelled request left its future cancelled
                    fut.set_result(None)


def _error(status: int, message: str, param: str | None, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(error_body(message, kind, param), status_code=status)


def create_engine_app(
    instance_id: str,
    model: str,
    phase: str,
    timing: EngineTiming,
    time_scale: float = 1.0,
    api_key: str | None = None,
) -> FastAPI:
    """FastAPI app of one emulated instance; its `state.engine` is the `EngineState` (counters for tests).
    With `api_key`, `/v1/*` needs `Authorization: Bearer API_KEY` (vLLM's `--api-key`; `/health` stays open)."""
    app = FastAPI(title=f"coral emulated engine {instance_id}", docs_url=None, redoc_url=None, openapi_url=None)

    def denied(request: Request) -> JSONResponse | None:
        if bearer_allowed(request.headers.get("authorization", ""), api_key or None):
            return None
        return _error(401, "this engine needs the gateway's token", None, "authentication_error")

    st = EngineState(instance_id=instance_id, model=model, phase=phase)
    app.state.engine = st
    batcher = PrefillBatcher(timing.prefill_s, time_scale, st)

    async def sleep(seconds: float) -> None:
        if time_scale > 0 and seconds > 0:
            await asyncio.sleep(seconds * time_scale)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "instance": instance_id, "active": st.active}

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        if (refused := denied(request)) is not None:
            return refused
        card = {"id": model, "object": "model", "created": int(time.time()), "owned_by": "coral-emulated"}
        return {"object": "list", "data": [card]}

    async def complete(request: Request, chat: bool) -> Any:
        """Answer a request, cancelled when its client leaves first (counted; a stream once it started ends when
        its client leaves)."""
        if (refused := denied(request)) is not None:
            return refused
        body = await request.json()
        done = await unless_disconnected(request, answer(request, body, chat))
        if done is None:
            st.cancelled += 1
            return Response(status_code=499)
        return done

    async def answer(request: Request, body: dict[str, Any], chat: bool) -> Response:
        if body.get("model") != model:
            return _error(404, f"model {body.get('model')!r} is not served here ({model})", "model")
        prompt = prompt_text(body)
        n_prompt, n_out = count_tokens(prompt), max_tokens_of(body)
        if int(body.get("min_tokens") or 0) > n_out:
            return _error(400, f"min_tokens must be <= max_tokens={n_out}", "min_tokens")
        kv_in = body.get("kv_transfer_params") or {}
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        st.request_ids.append(request_id)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        headers = {"x-coral-instance": instance_id}
        st.served += 1
        if not kv_in.get("do_remote_prefill"):
            st.prefills += 1
            st.active += 1
            try:
                await batcher.prefill(n_prompt)
            finally:
                st.active -= 1
        if kv_in.get("do_remote_decode"):
            text = token_text(prompt, 0)
            out = full(chat, rid, model, text, n_prompt, 1)
            out["kv_transfer_params"] = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": instance_id,
                "remote_block_ids": list(range((n_prompt + 15) // 16)),
                "remote_host": request.url.hostname,
                "remote_port": request.url.port,
            }
            return JSONResponse(out, headers=headers)

        async def tokens() -> AsyncIterator[str]:
            st.active += 1
            try:
                for i in range(n_out):
                    if i:
                        await sleep(timing.decode_step_s(st.active, n_prompt + i))
                    yield token_text(prompt, i)
            finally:
                st.active -= 1

        if not body.get("stream"):
            text = "".join([t async for t in tokens()])
            return JSONResponse(full(chat, rid, model, text, n_prompt, n_out), headers=headers)

        so = body.get("stream_options")
        include_usage = isinstance(so, dict) and bool(so.get("include_usage"))

        async def sse() -> AsyncIterator[bytes]:
            i = 0
            async for t in tokens():
                finish = "length" if i == n_out - 1 else None
                piece = chunk(chat, rid, model, t, finish, i == 0)
                if include_usage:
                    piece["usage"] = None
                yield f"data: {json.dumps(piece)}\n\n".encode()
                i += 1
            if include_usage:
                last = {
                    **chunk(chat, rid, model, "", None, False),
                    "choices": [],
                    "usage": usage(n_prompt, i),
                }
                yield f"data: {json.dumps(last)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream", headers=headers)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await complete(request, chat=True)

    return app


def instance_engine_app(
    instance: PlanInstance,
    time_scale: float = 1.0,
    catalog: Catalog | None = None,
    perf: PerfModel | RooflineModel | None = None,
    api_key: str | None = None,
) -> FastAPI:
    """The emulated engine of a plan instance, timed by the perf model (roofline by default)."""
    cat = catalog or builtin_catalog()
    timing = EngineTiming.from_instance(instance, cat.model(instance.model), cat, perf or RooflineModel())
    return create_engine_app(instance.id, instance.model, instance.phase, timing, time_scale, api_key)
