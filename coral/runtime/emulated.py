"""Emulated engine: a real OpenAI-compatible HTTP server per instance whose timing follows the perf model.

A plan instance is timed as the simulator serves it (`PipelineTiming`: the simulator's node kernels, chunked
prefill pipelined over the stages, decode admission by batch slot and KV room, the KV hand-off, a token per
pipeline cycle), in real time; tests may time an engine by plain functions instead (`EngineTiming`). `time_scale`
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
from typing import Any, Protocol

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from coral.allocation.plan import PlanInstance
from coral.catalog.loader import CoralInputError
from coral.http_serving import unless_disconnected
from coral.openai_shapes import bearer_allowed, choice_body, chunk, error_body, full, max_tokens_of, usage
from coral.simulation.engine import Stride, cycle_s, take_chunks
from coral.simulation.kernels import KernelCache, NodeKernel, decode_step

HANDOFF_PARAM = "coral_handoff_s_per_layer_byte"
"""The `kv_transfer_params` entry a prefill answer adds: seconds per KV byte of a layer at its path's busiest NIC,
which the decode side's hand-off time takes (with its own) as the simulator does."""

VOCAB = ("the", "cat", "sat", "on", "a", "warm", "mat", "and", "dreamt", "of", "fish", "in", "blue", "seas")


@dataclass
class EngineState:
    instance_id: str
    model: str
    phase: str
    active: int = 0
    served: int = 0
    prefills: int = 0
    cancelled: int = 0
    """Requests whose client (the gateway) left before the answer (a stream: before its first chunk): their work
    was cancelled."""
    request_ids: deque[str] = field(default_factory=lambda: deque(maxlen=64))
    engine: EngineModel | None = None

    @property
    def prefill_steps(self) -> int:
        return self.engine.prefill_steps if self.engine is not None else 0


class EngineModel(Protocol):
    """The timing of one running emulated engine (its app's event loop): waits, not work."""

    @property
    def prefill_steps(self) -> int: ...

    async def prefill(self, prompt_tokens: int) -> float:
        """Return once `prompt_tokens` are prefilled; the seconds per KV byte per layer of its path's busiest
        NIC (its side of a KV hand-off; 0: none)."""
        ...

    def decode(self, prompt_tokens: int, output_tokens: int, sender: float | None) -> AsyncIterator[None]:
        """Yield once before each output token: the first once the request is admitted (and, when `sender`
        is the prefill side's NIC figure, its KV handed over), then one per decode step."""
        ...


class Timing(Protocol):
    """What an engine app is timed by; `start` makes the engine's own (per event loop) model of it."""

    def start(self, time_scale: float) -> EngineModel: ...


@dataclass(frozen=True)
class EngineTiming:
    """Timing by functions: seconds to prefill `prompt_tokens` (waiting prompts batched into one step), and
    per decode step at `active` sequences and a context."""

    prefill_s: Callable[[int], float]
    decode_step_s: Callable[[int, int], float]

    @classmethod
    def constant(cls, ttft_s: float = 0.0, itl_s: float = 0.0) -> EngineTiming:
        return cls(prefill_s=lambda _n: ttft_s, decode_step_s=lambda _a, _c: itl_s)

    def start(self, time_scale: float) -> EngineModel:
        return _FunctionEngine(self, time_scale)


class _FunctionEngine:
    def __init__(self, timing: EngineTiming, time_scale: float) -> None:
        self.timing, self.time_scale = timing, time_scale
        self.batcher = PrefillBatcher(timing.prefill_s, time_scale)
        self.active = 0

    @property
    def prefill_steps(self) -> int:
        return self.batcher.steps

    async def prefill(self, prompt_tokens: int) -> float:
        await self.batcher.prefill(prompt_tokens)
        return 0.0

    async def decode(self, prompt_tokens: int, output_tokens: int, sender: float | None) -> AsyncIterator[None]:
        self.active += 1
        try:
            for i in range(output_tokens):
                if i and self.time_scale > 0:
                    await asyncio.sleep(self.timing.decode_step_s(self.active, prompt_tokens + i) * self.time_scale)
                yield
        finally:
            self.active -= 1


@dataclass(frozen=True)
class PipelineTiming:
    """An instance timed as the simulator serves it (`coral.simulation.engine`), in real time: the same node
    kernels (step tables, batch caps, KV room, NICs), the same per-stage weighted round-robin, chunked prefill
    pipelined from stage to stage, decode admission to a path with a free batch slot and KV room on every
    stage, the KV hand-off at the busiest NIC of either side, and a token per pipeline cycle (`cycle_s`)."""

    instance: PlanInstance
    kernels: KernelCache

    def start(self, time_scale: float) -> EngineModel:
        return _PipelineEngine(self.instance, self.kernels, time_scale)


class _PrefillNode:
    __slots__ = ("busy", "cap", "last", "layers_per_nic", "queue", "stage", "table")

    def __init__(self, k: NodeKernel, stage: int, n_stages: int, layers: int) -> None:
        self.table, self.cap = k.table, k.cap
        self.layers_per_nic = layers / k.nic_bytes_s
        self.stage, self.last = stage, stage == n_stages - 1
        self.queue: deque[list[Any]] = deque()  # [_Prompt, tokens still to pass this node]
        self.busy = False


class _Prompt:
    __slots__ = ("done", "left", "nodes")

    def __init__(self, tokens: int, nodes: tuple[_PrefillNode, ...], done: asyncio.Future[None]) -> None:
        self.left, self.nodes, self.done = tokens, nodes, done


class _DecodeNode:
    __slots__ = ("cap", "ctx_sum", "dt", "k", "kv_cap", "kv_free", "layers_per_nic", "slots", "table")

    def __init__(self, k: NodeKernel, layers: int) -> None:
        self.table, self.cap = k.ctx_table, k.cap
        self.layers_per_nic = layers / k.nic_bytes_s
        self.kv_cap = self.kv_free = k.kv_tokens
        self.slots = self.k = 0
        self.ctx_sum = 0.0
        self.dt = decode_step(k.ctx_table, 0, 1.0)

    def change(self, delta: int, ctx: float) -> None:
        """One resident sequence of decode context `ctx` more (+1) or less (-1)."""
        self.k += delta
        self.ctx_sum = self.ctx_sum + delta * ctx if self.k else 0.0
        self.dt = decode_step(self.table, self.k, self.ctx_sum / self.k if self.k else 1.0)


class _PipelineEngine:
    """`PipelineTiming` on one event loop; its prefill and decode nodes are built when first used (an
    instance of either phase answers the other when the gateway sends it one: a local prefill, or a prefill pool
    answering alone)."""

    def __init__(self, spec: PlanInstance, kernels: KernelCache, time_scale: float) -> None:
        self.spec, self.kernels, self.time_scale = spec, kernels, time_scale
        self.consts = kernels.models[spec.model]
        self.prefill_steps = 0
        self._prefill: list[list[_PrefillNode]] | None = None
        self._decode: list[list[_DecodeNode]] | None = None
        self.pickers = [Stride(list(range(len(st.nodes))), list(st.node_throughput) or [1.0] * len(st.nodes))
                        for st in spec.stages]
        self.waiting: deque[tuple[float, asyncio.Future[tuple[_DecodeNode, ...]]]] = deque()
        self.tasks: set[asyncio.Task[None]] = set()

    def _kernel(self, phase: str, config: str, layers: int) -> NodeKernel:
        return self.kernels.kernel(self.spec.model, phase, config, layers, len(self.spec.stages))

    def _kv_tokens(self, tokens: float) -> float:
        """KV tokens per layer a context of `tokens` holds."""
        return float(self.kernels.attended(self.spec.model, np.array([tokens]))[0])

    # --- prefill ----------------------------------------------------------------------------------------
    async def prefill(self, prompt_tokens: int) -> float:
        if self._prefill is None:
            n = len(self.spec.stages)
            self._prefill = [[_PrefillNode(self._kernel("prefill", c, st.layers), j, n, st.layers) for c in st.nodes]
                             for j, st in enumerate(self.spec.stages)]
        nodes = tuple(stage[p.pick()] for stage, p in zip(self._prefill, self.pickers, strict=True))
        prompt = _Prompt(prompt_tokens, nodes, asyncio.get_running_loop().create_future())
        self._queue(nodes[0], [prompt, prompt_tokens])
        await prompt.done
        return max(n.layers_per_nic for n in nodes)

    def _queue(self, node: _PrefillNode, item: list[Any]) -> None:
        q = node.queue
        if q and q[-1][0] is item[0]:
            q[-1][1] += item[1]
        else:
            q.append(item)
        if not node.busy:
            node.busy = True
            task = asyncio.create_task(self._steps(node))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _steps(self, node: _PrefillNode) -> None:
        """Chunked-prefill steps while prompts wait: FCFS up to the node's planned batch; chunks through the
        last stage finish their prompt's prefill, others queue at the prompt's next stage node."""
        try:
            while node.queue:
                batch, tokens = take_chunks(node.queue, node.cap)
                self.prefill_steps += 1
                await asyncio.sleep(node.table[tokens] * self.time_scale)
                for prompt, tok in batch:
                    if not node.last:
                        self._queue(prompt.nodes[node.stage + 1], [prompt, tok])
                        continue
                    prompt.left -= tok
                    if prompt.left <= 0 and not prompt.done.done():
                        prompt.done.set_result(None)
        finally:
            node.busy = False

    # --- decode -----------------------------------------------------------------------------------------
    async def decode(self, prompt_tokens: int, output_tokens: int, sender: float | None) -> AsyncIterator[None]:
        ctx = prompt_tokens + output_tokens / 2  # the simulator's mean decode context and KV charge
        need = self._kv_tokens(ctx)
        path = await self._admitted(need)
        try:
            if sender is not None:
                busiest = max(sender, *(n.layers_per_nic for n in path))
                kv_bytes = self._kv_tokens(prompt_tokens) * self.consts.kv_bytes_per_token_layer
                await asyncio.sleep(kv_bytes * busiest * self.time_scale)
            for n in path:
                n.change(+1, ctx)
            try:
                for i in range(output_tokens):
                    if i:
                        await asyncio.sleep(cycle_s(path) * self.time_scale)
                    yield
            finally:
                for n in path:
                    n.change(-1, ctx)
        finally:
            self._release(path, need)

    async def _admitted(self, need: float) -> tuple[_DecodeNode, ...]:
        """Wait (FIFO) for a path with a free batch slot and KV room for `need` tokens on every stage."""
        if self._decode is None:
            self._decode = [[_DecodeNode(self._kernel("decode", c, st.layers), st.layers) for c in st.nodes]
                            for st in self.spec.stages]
        fut: asyncio.Future[tuple[_DecodeNode, ...]] = asyncio.get_running_loop().create_future()
        self.waiting.append((need, fut))
        self._admit()
        try:
            return await fut
        except asyncio.CancelledError:  # the client left: give back a path admitted meanwhile
            if fut.done() and not fut.cancelled():
                self._release(fut.result(), need)
            raise

    def _release(self, path: tuple[_DecodeNode, ...], need: float) -> None:
        """Give back `path`'s batch slots and KV room held for `need` tokens, and admit who now fits."""
        for n in path:
            n.slots -= 1
            n.kv_free += min(need, n.kv_cap)
        self._admit()

    def _admit(self) -> None:
        """Admit waiting requests FIFO while the head fits; per stage the node the weighted round-robin picks
        among those with room."""
        assert self._decode is not None
        w = self.waiting
        while w:
            need, fut = w[0]
            if fut.done():  # cancelled while waiting
                w.popleft()
                continue
            free = [[i for i, n in enumerate(st) if n.slots < n.cap and n.kv_free >= min(need, n.kv_cap)]
                    for st in self._decode]
            if not all(free):
                return
            idx = [p.pick_among(ok) for p, ok in zip(self.pickers, free, strict=True)]
            path = tuple(st[i] for st, i in zip(self._decode, idx, strict=True))
            for n in path:
                n.slots += 1
                n.kv_free -= min(need, n.kv_cap)
            w.popleft()
            fut.set_result(path)


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


class PrefillBatcher:
    """Prefill in steps, each over every prompt waiting (up to `max_tokens` tokens), lasting `step_s` of that
    batch of tokens."""

    def __init__(self, step_s: Callable[[int], float], time_scale: float, max_tokens: int = 8192):
        self.step_s = step_s
        self.time_scale = time_scale
        self.max_tokens = max_tokens
        self.steps = 0
        self.queue: asyncio.Queue[tuple[int, asyncio.Future[None]]] | None = None
        self.task: asyncio.Task[None] | None = None

    async def prefill(self, n_tokens: int) -> None:
        if self.time_scale <= 0:
            self.steps += 1
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
            self.steps += 1
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
    timing: Timing,
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
    engine = st.engine = timing.start(time_scale)

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
        sender: float | None = None  # the prefill side's NIC figure when its KV is handed over
        nic = 0.0
        if not kv_in.get("do_remote_prefill"):
            st.prefills += 1
            st.active += 1
            try:
                nic = await engine.prefill(n_prompt)
            finally:
                st.active -= 1
        else:
            sender = float(kv_in.get(HANDOFF_PARAM) or 0.0)
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
                HANDOFF_PARAM: nic,
            }
            return JSONResponse(out, headers=headers)

        n = int(body.get("n") or 1)  # choices, each of n_out tokens, decoded side by side (one decode's time)

        async def steps() -> AsyncIterator[int]:
            st.active += 1
            try:
                i = 0
                async for _ in engine.decode(n_prompt, n_out, sender):
                    yield i
                    i += 1
            finally:
                st.active -= 1

        def text_of(k: int, i: int) -> str:
            """Token i of choice k (the choices differ)."""
            return token_text(prompt, i + k)

        if not body.get("stream"):
            done = [i async for i in steps()]
            choices = [choice_body(chat, k, "".join(text_of(k, i) for i in done)) for k in range(n)]
            return JSONResponse(full(chat, rid, model, "", n_prompt, n * len(done), choices), headers=headers)

        so = body.get("stream_options")
        include_usage = isinstance(so, dict) and bool(so.get("include_usage"))

        async def sse() -> AsyncIterator[bytes]:
            decoded = 0
            async for i in steps():
                finish = "length" if i == n_out - 1 else None
                for k in range(n):
                    piece = chunk(chat, rid, model, text_of(k, i), finish, i == 0, k)
                    if include_usage:
                        piece["usage"] = None
                    yield f"data: {json.dumps(piece)}\n\n".encode()
                decoded = i + 1
            if include_usage:
                last = {
                    **chunk(chat, rid, model, "", None, False),
                    "choices": [],
                    "usage": usage(n_prompt, n * decoded),
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
    kernels: KernelCache | None = None,
    api_key: str | None = None,
) -> FastAPI:
    """The emulated engine of a plan instance, timed as the simulator serves it (`PipelineTiming`) with the
    node kernels of `kernels` (its scenario's SLOs and request sizes size the batches); at `time_scale` 0 it
    answers at once and needs none."""
    timing: Timing
    if time_scale <= 0:
        timing = EngineTiming.constant()
    elif kernels is None or instance.model not in kernels.models:
        where = "no scenario" if kernels is None else f"scenario {kernels.scenario.name!r}, which does not serve it"
        raise CoralInputError(f"instance {instance.id}: an emulated engine timed by the perf model needs the "
                              f"scenario of {instance.model} (its SLOs and request sizes), and has {where}")
    else:
        timing = PipelineTiming(instance, kernels)
    return create_engine_app(instance.id, instance.model, instance.phase, timing, time_scale, api_key)
