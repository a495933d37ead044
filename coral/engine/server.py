"""OpenAI-compatible HTTP server of one Coral engine instance, in front of its scheduler.

Same endpoints and answer shapes as the emulated engine (/health, /v1/models, /v1/completions,
/v1/chat/completions, SSE streaming), with real tokens. Requests are validated by `coral.openai_shapes` (400
naming the field), then by what the engine implements (`coral.engine.sampling.unsupported`: `logit_bias`,
`best_of` != n, `echo`, `suffix`, tools, guided decoding, ... are a 400 naming the field).
Honoured: `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`, `presence_penalty`,
`frequency_penalty` (as vLLM applies them), `seed`, `n` (one engine request per choice, seeds `seed + i`),
`stop` (cut on the text, `finish_reason: "stop"`; a stream holds back text that may begin a stop string),
`stop_token_ids`, `min_tokens`, `ignore_eos`, `max_tokens`/`max_completion_tokens`, `logprobs` (completions:
top N with `tokens`/`token_logprobs`/`top_logprobs`/`text_offset`; chat: `logprobs` + `top_logprobs`),
`stream_options.include_usage`. Unset sampling fields take the checkpoint's generation config (temperature,
top_p, top_k, min_p, repetition_penalty), then vLLM's defaults (temperature 1, no penalty). Extensions as
vLLM: `prompt` may be token ids, `return_token_ids: true` adds the prompt's and the output's token ids to the
choice.

Context: prompt + max_tokens must fit the model's context (`max_position_embeddings`), else 400
`context_length_exceeded` naming both; without max_tokens a request may produce the rest of the context.

Admission and faults (errors in OpenAI's shape; 503 and 504 are retryable elsewhere, with `Retry-After`):
- at most `max_waiting` requests wait for their first step in the instance; beyond that 503 `engine_overloaded`;
- a request may carry `x-coral-deadline: UNIX_SECONDS` (wall clock, e.g. the gateway's first-token deadline):
  past it on arrival, or still waiting when it passes, the answer is 504 `deadline_exceeded` and the request is
  dropped before it runs;
- a dead node (`problem()` names it) fails every request in flight at once with 503 `engine_unavailable`, new
  requests get the same, and /health answers 503 with the node in the message;
- errors before the first token are HTTP statuses (a stream starts with the first token); later, a stream
  ends with an SSE `event: error` whose data is the error body;
- a client that disconnects cancels its request (streamed or not): the scheduler drops it, its KV is freed.

PD (vLLM's protocol as the gateway speaks it): a request with `kv_transfer_params.do_remote_decode` is prefilled
only; the answer's `kv_transfer_params` carries, under `coral`, the request id, the prompt length, the first
token (with its logprobs) and, per node of the request's path, its KV address and layer range. A decode
instance receiving those with `do_remote_prefill` has each of its nodes take the layers it holds from the
prefill nodes holding them (re-shard by layer, and by head between TP degrees), then decodes from the first
token. Without `coral` parameters, or if taking the KV fails, it prefills locally.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from coral.engine.sampling import Sampled, SamplingParams, sampling_params, unsupported
from coral.engine.scheduler import Request as EngineRequest
from coral.engine.scheduler import Scheduler
from coral.openai_shapes import (
    ChatCompletionRequest,
    CompletionRequest,
    InvalidRequest,
    bearer_allowed,
    choice_body,
    chunk,
    error_body,
    error_type,
    full,
    parse_request,
    usage,
)

DEADLINE_HEADER = "x-coral-deadline"
Event = tuple[int, int | None, str | None]  # (choice, token or None, finish reason or None)
T = TypeVar("T")


@dataclass(frozen=True)
class Limits:
    """What an instance admits: the model's context (tokens), waiting requests, the Retry-After of its 503s,
    and the sampling defaults of the checkpoint's generation config."""

    context: int
    max_waiting: int = 1024
    retry_after_s: int = 1
    defaults: dict[str, Any] = field(default_factory=dict)


class Refusal(Exception):
    """A request the engine answers with an error (status, OpenAI's `code` and `param`)."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.param = status, code, param

    def body(self) -> dict[str, Any]:
        return error_body(str(self), error_type(self.status), self.param, self.code)

    def response(self, retry_after_s: int) -> JSONResponse:
        headers = {"Retry-After": str(retry_after_s)} if self.status in (503, 504) else None
        return JSONResponse(self.body(), self.status, headers=headers)


class ClientGone(Exception):
    """The HTTP client disconnected."""


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


class Choice:
    """One choice's output: tokens, text (cut before the first stop string, which finishes it once `min_tokens`
    are out), logprobs."""

    def __init__(self, index: int, tokenizer: Any, stop: tuple[str, ...], min_tokens: int = 0) -> None:
        self.index, self.tokenizer, self.stop, self.min_tokens = index, tokenizer, stop, min_tokens
        self.detok = Detokenizer(tokenizer)
        self.text = ""
        self.sent = 0  # characters of `text` streamed
        self.logprobs: list[Sampled] = []
        self.finish: str | None = None
        self.hold = max((len(s) for s in stop), default=1) - 1  # characters that may begin a stop string

    def add(self, token: int, sampled: Sampled | None) -> None:
        start = max(0, len(self.text) - self.hold)
        self.text += self.detok.add(token)
        if sampled is not None:
            self.logprobs.append(sampled)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits and len(self.detok.ids) >= self.min_tokens:
            self.text, self.finish = self.text[: min(hits)], "stop"

    def release(self) -> str:
        """Text not streamed yet, less what may still turn out to begin a stop string (all once finished)."""
        end = len(self.text) if self.finish is not None else max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent:end], end
        return out

    def token_text(self, token: int) -> str:
        return str(self.tokenizer.decode([token]))

    def completion_logprobs(self, first: int, offset: int) -> dict[str, Any]:
        """Completions' logprobs of tokens [first:], text offsets counted from `offset`."""
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for s in self.logprobs[first:]:
            text = self.token_text(s.token)
            out["tokens"].append(text)
            out["token_logprobs"].append(s.logprob)
            top = {text: s.logprob}
            for t, lp in s.top:
                top.setdefault(self.token_text(t), lp)
            out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
            offset += len(text)
        return out

    def chat_logprobs(self, first: int) -> dict[str, Any]:
        """Chat's logprobs of tokens [first:]."""

        def entry(token: int, lp: float | None) -> dict[str, Any]:
            text = self.token_text(token)
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        return {"content": [{**entry(s.token, s.logprob), "top_logprobs": [entry(t, lp) for t, lp in s.top]}
                            for s in self.logprobs[first:]]}


async def _disconnected(request: Request) -> None:
    """Return once the client has disconnected (the body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_gone(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientGone (with `work` cancelled) if the client leaves first."""
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        raise ClientGone
    return task.result()


def _deadline(header: str | None) -> float | None:
    """The time.monotonic() of an `x-coral-deadline` (Unix seconds); Refusal when malformed or past."""
    if header is None:
        return None
    try:
        at = float(header)
    except ValueError:
        raise Refusal(400, f"{DEADLINE_HEADER}: {header!r} is not Unix seconds", "invalid_header") from None
    left = at - time.time()
    if left <= 0:
        raise Refusal(504, f"the request's deadline passed {-left:.3f} s before it arrived", "deadline_exceeded")
    return time.monotonic() + left


def create_instance_app(
    scheduler: Scheduler,
    tokenizer: Any,
    vocab_size: int,
    model: str,
    instance_id: str,
    limits: Limits,
    problem: Callable[[], str | None] = lambda: None,
    api_key: str | None = None,
) -> FastAPI:
    """The HTTP app of an instance whose requests `scheduler` runs; `problem()` names what is broken (a dead
    node), None while healthy. With `api_key` (the gateway's engine token), `/v1/*` needs `Authorization: Bearer
    API_KEY`; `/health` stays open."""
    app = FastAPI(title=f"coral engine {instance_id}", docs_url=None, redoc_url=None, openapi_url=None)
    eos = frozenset(int(t) for t in [tokenizer.eos_token_id] if t is not None)

    def broken() -> str | None:
        """What is broken (a dead node named before the errors of the nodes that lost it), None if nothing."""
        if not scheduler.thread.is_alive():
            return "the scheduler stopped"
        return problem() or scheduler.error

    def denied(request: Request) -> JSONResponse | None:
        if bearer_allowed(request.headers.get("authorization", ""), api_key or None):
            return None
        return Refusal(401, "this engine needs the gateway's token").response(limits.retry_after_s)

    @app.get("/health")
    async def health() -> Any:
        if (why := broken()) is not None:
            return Refusal(503, f"{instance_id}: {why}", "engine_unavailable").response(limits.retry_after_s)
        return {"status": "ok", "instance": instance_id, "active": len(scheduler.active),
                "waiting": scheduler.waiting, "batches": scheduler.batches,
                "remote_prefills": scheduler.remote_prefills}

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        if (refused := denied(request)) is not None:
            return refused
        return {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "coral-engine",
                                            "max_model_len": limits.context}]}

    def failure(finish: str, rid: str) -> Refusal:
        """The error of a request the scheduler ended with `finish` ('error', 'abort' or 'deadline')."""
        if finish == "deadline":
            return Refusal(504, f"request {rid}: its deadline passed while it waited", "deadline_exceeded")
        if finish == "error" and scheduler.error is None:
            return Refusal(400, f"request {rid}: prompt + max_tokens need more KV blocks than a node of "
                           f"{instance_id} holds", "kv_capacity_exceeded")
        why = broken() or "the instance is stopping"
        return Refusal(503, f"request {rid}: {instance_id} failed: {why}", "engine_unavailable")

    def bounded(req: CompletionRequest | ChatCompletionRequest, n_prompt: int, chat: bool) -> int:
        """max_tokens within the context (the rest of it when unset); Refusal past it."""
        completion = req.max_completion_tokens if isinstance(req, ChatCompletionRequest) else None
        asked = completion or req.max_tokens
        if n_prompt >= limits.context:
            raise Refusal(400, f"This model's maximum context length is {limits.context} tokens. However, your "
                          f"request has {n_prompt} input tokens. Please reduce the length of the input.",
                          "context_length_exceeded", "messages" if chat else "prompt")
        if asked is not None and n_prompt + asked > limits.context:
            name = "max_completion_tokens" if completion else "max_tokens"
            raise Refusal(400, f"'{name}' is too large: {asked}. This model's maximum context length is "
                          f"{limits.context} tokens and your request has {n_prompt} input tokens ({asked} > "
                          f"{limits.context} - {n_prompt}).", "context_length_exceeded", name)
        out = asked if asked is not None else limits.context - n_prompt
        if req.min_tokens and req.min_tokens > out:
            raise Refusal(400, f"'min_tokens' ({req.min_tokens}) must be at most max_tokens ({out})", None,
                          "min_tokens")
        return out

    async def complete(request: Request, chat: bool) -> Response:
        if (refused := denied(request)) is not None:
            return refused
        try:
            return await answer(request, chat)
        except Refusal as exc:
            return exc.response(limits.retry_after_s)
        except ClientGone:
            return Response(status_code=499)

    async def answer(request: Request, chat: bool) -> Response:
        try:
            body = await request.json()
        except ValueError:
            raise Refusal(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict) or body.get("model") != model:
            got = body.get("model") if isinstance(body, dict) else None
            raise Refusal(404, f"model {got!r} is not served here ({model})", "model_not_found", "model")
        kv_in = body.get("kv_transfer_params")
        kv_in = kv_in if isinstance(kv_in, dict) else {}
        try:
            req = parse_request({k: v for k, v in body.items() if k != "kv_transfer_params"}, chat)
            unsupported(body, req)
            params = sampling_params(req, limits.defaults)
            prompt = prompt_ids(tokenizer, body)
        except InvalidRequest as exc:
            raise Refusal(400, str(exc), None, exc.param) from None
        except ValueError as exc:
            raise Refusal(400, str(exc), None, "prompt") from None
        if not prompt or min(prompt) < 0 or max(prompt) >= vocab_size:
            raise Refusal(400, "prompt: empty or with token ids outside the vocabulary", None, "prompt")
        if (why := broken()) is not None:
            raise Refusal(503, f"{instance_id}: {why}", "engine_unavailable")
        prefill_only = bool(kv_in.get("do_remote_decode"))
        max_tokens = bounded(req, len(prompt), chat)
        if prefill_only:
            max_tokens = 1
        deadline = _deadline(request.headers.get(DEADLINE_HEADER))
        remote = kv_in.get("coral") if kv_in.get("do_remote_prefill") else None
        if not isinstance(remote, dict) or remote.get("prompt_tokens") != len(prompt):
            remote = None  # none, or not the prompt this instance would see: prefill locally
        n = 1 if prefill_only else req.n or 1
        if scheduler.waiting + n > limits.max_waiting:
            raise Refusal(503, f"{instance_id}: {scheduler.waiting} requests already wait (at most "
                          f"{limits.max_waiting})", "engine_overloaded")
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(s for s in req.stop or () if s)
        stop_ids = frozenset(req.stop_token_ids or ()) | (frozenset() if req.ignore_eos else eos)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}"
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def engine_request(i: int, sp: SamplingParams) -> EngineRequest:
            def on_event(token: int | None, finish: str | None, _logits: Any) -> None:
                loop.call_soon_threadsafe(events.put_nowait, (i, token, finish))

            return EngineRequest(rid=f"{rid}-{i}", prompt=prompt, max_tokens=max_tokens, on_event=on_event,
                                 stop_ids=stop_ids, sampling=sp, deadline=deadline, keep_kv=prefill_only,
                                 remote=remote if i == 0 else None)

        reqs = [engine_request(i, params.for_choice(i)) for i in range(n)]
        choices = [Choice(i, tokenizer, stop, req.min_tokens or 0) for i in range(n)]
        for r in reqs:
            scheduler.submit(r)
        updates = run(reqs, choices, events)
        headers = {"x-coral-instance": instance_id}
        if not req.stream or prefill_only:
            await _unless_gone(request, _drain(updates))
            return JSONResponse(whole(chat, rid, req, prompt, reqs, choices, prefill_only, request), headers=headers)
        try:
            first = await _unless_gone(request, anext(updates))
        except StopAsyncIteration:
            first = None
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(sse(chat, rid, req, prompt, choices, first, updates, include_usage),
                                 media_type="text/event-stream", headers=headers)

    async def run(reqs: list[EngineRequest], choices: list[Choice],
                  events: asyncio.Queue[Event]) -> AsyncGenerator[Choice, None]:
        """The choice each engine event updates, until all are finished; Refusal when the engine fails a
        request; unfinished requests are cancelled however this ends."""
        left = set(range(len(reqs)))
        try:
            while left:
                i, token, finish = await events.get()
                if i not in left:
                    continue  # the cancel of a choice finished by a stop string
                if finish in ("error", "abort", "deadline"):
                    raise failure(finish, reqs[i].rid)
                c = choices[i]
                if token is not None:
                    asked = reqs[i].sampling.logprobs is not None
                    c.add(token, reqs[i].logprobs[len(c.detok.ids)] if asked else None)
                c.finish = c.finish or finish
                if c.finish is not None:
                    left.discard(i)
                    if finish is None:
                        scheduler.cancel(reqs[i].rid)
                yield c
        finally:
            for i in left:
                scheduler.cancel(reqs[i].rid)

    def whole(chat: bool, rid: str, req: CompletionRequest | ChatCompletionRequest, prompt: list[int],
              reqs: list[EngineRequest], choices: list[Choice], prefill_only: bool, request: Request) -> dict[str, Any]:
        """The non-streamed answer (with the KV hand-off parameters of a prefill-only request)."""
        bodies = []
        for c in choices:
            lp = (c.chat_logprobs(0) if chat else c.completion_logprobs(0, 0)) if c.logprobs else None
            b = choice_body(chat, c.index, c.text, c.finish, lp)
            if req.return_token_ids:
                b["prompt_token_ids"], b["token_ids"] = prompt, c.detok.ids
            bodies.append(b)
        out = full(chat, rid, model, "", len(prompt), sum(len(c.detok.ids) for c in choices), bodies)
        if prefill_only:
            coral: dict[str, Any] = {"request_id": reqs[0].rid, "prompt_tokens": len(prompt),
                                     "first_token": choices[0].detok.ids[0],
                                     "sources": scheduler.kv_sources(reqs[0].path)}
            if choices[0].logprobs:
                coral["first_sampled"] = choices[0].logprobs[0].wire()
            out["kv_transfer_params"] = {
                "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": instance_id,
                "remote_block_ids": [], "remote_host": request.url.hostname, "remote_port": request.url.port,
                "coral": coral,
            }
        return out

    async def sse(chat: bool, rid: str, req: CompletionRequest | ChatCompletionRequest, prompt: list[int],
                  choices: list[Choice], first: Choice | None, updates: AsyncGenerator[Choice, None],
                  include_usage: bool) -> AsyncIterator[bytes]:
        """SSE chunks: per update, the choice's released text and new tokens' logprobs; an error event ends it."""
        streamed = [0] * len(choices)  # tokens of each choice sent (their ids, logprobs)
        offsets = [0] * len(choices)  # text sent per choice (completions' text_offset)

        def piece(c: Choice) -> bytes | None:
            text, k = c.release(), streamed[c.index]
            if not text and c.finish is None and k == len(c.detok.ids):
                return None
            lp = None
            if c.logprobs[k:]:
                lp = c.chat_logprobs(k) if chat else c.completion_logprobs(k, offsets[c.index])
            out = chunk(chat, rid, model, text, c.finish, k == 0, c.index, lp)
            if req.return_token_ids:
                out["choices"][0]["token_ids"] = c.detok.ids[k:]
            streamed[c.index], offsets[c.index] = len(c.detok.ids), offsets[c.index] + len(text)
            return f"data: {json.dumps(out)}\n\n".encode()

        try:
            if first is not None and (data := piece(first)) is not None:
                yield data
            async for c in updates:
                if (data := piece(c)) is not None:
                    yield data
        except Refusal as exc:
            yield f"event: error\ndata: {json.dumps(exc.body())}\n\n".encode()
            return
        finally:
            await updates.aclose()
        if include_usage:
            n_out = sum(len(c.detok.ids) for c in choices)
            tail = {**chunk(chat, rid, model, "", None, False), "choices": [], "usage": usage(len(prompt), n_out)}
            yield f"data: {json.dumps(tail)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await complete(request, chat=True)

    return app


async def _drain(updates: AsyncIterator[Any]) -> None:
    async for _ in updates:
        pass
