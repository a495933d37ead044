"""OpenAI-compatible HTTP server of one Coral engine instance, in front of its scheduler.

Same endpoints and answer shapes as the emulated engine (/health, /v1/models, /v1/completions,
/v1/chat/completions, SSE streaming), with real tokens. Extensions: `prompt` may be a list of token ids,
`return_token_ids: true` adds the prompt's and the output's token ids to the choice (as vLLM does),
`ignore_eos: true` generates `max_tokens` tokens. Greedy decoding only (temperature is ignored).

PD (vLLM's protocol as the gateway speaks it): a request with `kv_transfer_params.do_remote_decode` is prefilled
only; the answer's `kv_transfer_params` carries, under `coral`, the request id, the prompt length, the first
token and, per node of the request's path, its KV address and layer range. A decode instance receiving those
with `do_remote_prefill` has each of its nodes take the layers it holds from the prefill nodes holding them
(re-shard by layer, and by head between TP degrees), then decodes from the first token. Without `coral`
parameters, or if taking the KV fails, it prefills locally.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from coral.engine.scheduler import Request as EngineRequest
from coral.engine.scheduler import Scheduler
from coral.openai_shapes import bearer_allowed, chunk, full, max_tokens_of

Event = tuple[int | None, str | None, list[float] | None]


def _post(loop: asyncio.AbstractEventLoop, events: asyncio.Queue[Event], event: Event) -> None:
    """Hand an engine event from the scheduler thread to the request's coroutine."""
    loop.call_soon_threadsafe(events.put_nowait, event)


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status)


def prompt_ids(tokenizer: Any, body: dict[str, Any]) -> list[int]:
    """Token ids of a completions prompt (text or ids) or of chat messages through the chat template."""
    if "messages" in body:
        text = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False)
        return list(tokenizer.encode(text, add_special_tokens=False))
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return [int(t) for t in prompt]
    if not isinstance(prompt, str):
        raise ValueError("prompt: must be a string or a list of token ids")
    return list(tokenizer.encode(prompt, add_special_tokens=False))


class Detokenizer:
    """Incremental text of a growing token list (holds back an incomplete UTF-8 character)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.ids, self.sent = tokenizer, list[int](), 0

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        delta, self.sent = text[self.sent:], len(text)
        return delta


def create_instance_app(
    scheduler: Scheduler,
    tokenizer: Any,
    vocab_size: int,
    model: str,
    instance_id: str,
    nodes_alive: Callable[[], bool] = lambda: True,
    api_key: str | None = None,
) -> FastAPI:
    """The HTTP app of an instance whose requests `scheduler` runs; /health fails once a node is gone. With
    `api_key` (the gateway's engine token), `/v1/*` needs `Authorization: Bearer API_KEY`; `/health` stays open."""
    app = FastAPI(title=f"coral engine {instance_id}", docs_url=None, redoc_url=None, openapi_url=None)
    eos = frozenset(int(t) for t in [tokenizer.eos_token_id] if t is not None)

    def denied(request: Request) -> JSONResponse | None:
        if bearer_allowed(request.headers.get("authorization", ""), api_key or None):
            return None
        return _error(401, "this engine needs the gateway's token", "authentication_error")

    @app.get("/health")
    async def health() -> Any:
        if scheduler.error is not None or not scheduler.thread.is_alive() or not nodes_alive():
            return _error(503, scheduler.error or "a node or the scheduler stopped", "unavailable")
        return {"status": "ok", "instance": instance_id, "active": len(scheduler.active),
                "batches": scheduler.batches, "remote_prefills": scheduler.remote_prefills}

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        if (refused := denied(request)) is not None:
            return refused
        return {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "coral-engine"}]}

    async def complete(request: Request, chat: bool) -> Any:
        if (refused := denied(request)) is not None:
            return refused
        body = await request.json()
        if body.get("model") != model:
            return _error(404, f"model {body.get('model')!r} is not served here ({model})", "NotFound")
        try:
            prompt = prompt_ids(tokenizer, body)
        except ValueError as exc:
            return _error(400, str(exc), "invalid_request_error")
        if not prompt or min(prompt) < 0 or max(prompt) >= vocab_size:
            return _error(400, "prompt: empty or with token ids outside the vocabulary", "invalid_request_error")
        kv_in = body.get("kv_transfer_params") or {}
        prefill_only = bool(kv_in.get("do_remote_decode"))
        remote = kv_in.get("coral") if kv_in.get("do_remote_prefill") else None
        if not isinstance(remote, dict) or remote.get("prompt_tokens") != len(prompt):
            remote = None  # none, or not the prompt this instance would see: prefill locally
        rid = f"cmpl-{uuid.uuid4().hex[:16]}"
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        req = EngineRequest(
            rid=rid,
            prompt=prompt,
            max_tokens=1 if prefill_only else max_tokens_of(body),
            on_event=lambda t, f, lg: _post(loop, events, (t, f, lg)),
            stop_ids=frozenset() if body.get("ignore_eos") else eos,
            keep_kv=prefill_only,
            remote=remote,
        )
        scheduler.submit(req)
        headers = {"x-coral-instance": instance_id}
        detok = Detokenizer(tokenizer)

        async def tokens() -> AsyncIterator[tuple[str, str | None]]:
            done = False
            try:
                while not done:
                    token, finish, _ = await events.get()
                    if finish in ("error", "abort"):
                        raise RuntimeError(f"request {rid}: {scheduler.error or finish}")
                    done = finish is not None
                    yield (detok.add(token) if token is not None else ""), finish
            finally:
                if not done:
                    scheduler.cancel(rid)

        if not body.get("stream") or prefill_only:
            finish: str | None = None
            try:
                async for _text, last in tokens():
                    finish = last
            except RuntimeError as exc:
                return _error(500, str(exc), "engine_error")
            text = tokenizer.decode(detok.ids, skip_special_tokens=True)
            out = full(chat, rid, model, text, len(prompt), len(detok.ids))
            out["choices"][0]["finish_reason"] = finish
            if body.get("return_token_ids"):
                out["choices"][0]["prompt_token_ids"] = prompt
                out["choices"][0]["token_ids"] = detok.ids
            if prefill_only:
                out["kv_transfer_params"] = {
                    "do_remote_prefill": True,
                    "do_remote_decode": False,
                    "remote_engine_id": instance_id,
                    "remote_block_ids": [],
                    "remote_host": request.url.hostname,
                    "remote_port": request.url.port,
                    "coral": {
                        "request_id": rid,
                        "prompt_tokens": len(prompt),
                        "first_token": detok.ids[0],
                        "sources": scheduler.kv_sources(req.path),
                    },
                }
            return JSONResponse(out, headers=headers)

        async def sse() -> AsyncIterator[bytes]:
            first = True
            try:
                async for text, finish in tokens():
                    piece = chunk(chat, rid, model, text, finish, first)
                    if body.get("return_token_ids"):
                        piece["choices"][0]["token_ids"] = detok.ids[-1:]
                    yield f"data: {json.dumps(piece)}\n\n".encode()
                    first = False
            except RuntimeError as exc:
                yield f"data: {json.dumps({'error': {'message': str(exc), 'type': 'engine_error'}})}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream", headers=headers)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await complete(request, chat=True)

    return app
