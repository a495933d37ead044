"""A stand-in for `vllm serve` on CPU (the profiler's process launcher is tested on it): batches requests and
sleeps for a known per-layer cost.

    python tests/fake_vllm.py --layers 4 --port 8000

Prefill batch: 2 ms + layers x (1 ms + 0.004 ms per token). Decode step: 2 ms + layers x (2 ms + 0.05 ms per seq).
"""

from __future__ import annotations

import argparse
import asyncio

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

PREFILL_MS = (2.0, 1.0, 0.004)
DECODE_MS = (2.0, 2.0, 0.05)


def make_app(layers: int) -> FastAPI:
    app = FastAPI()
    pending: list[tuple[int, asyncio.Queue[str | None], int]] = []
    active: list[tuple[asyncio.Queue[str | None], list[int]]] = []
    wake = asyncio.Event()

    async def engine() -> None:
        while True:
            if not pending and not active:
                wake.clear()
                await wake.wait()
            if pending:
                batch = pending[:]
                pending.clear()
                tokens = sum(b[0] for b in batch)
                await asyncio.sleep((PREFILL_MS[0] + layers * (PREFILL_MS[1] + PREFILL_MS[2] * tokens)) / 1e3)
                for _, q, max_tokens in batch:
                    q.put_nowait("tok")
                    if max_tokens > 1:
                        active.append((q, [max_tokens - 1]))
                    else:
                        q.put_nowait(None)
                continue
            await asyncio.sleep((DECODE_MS[0] + layers * (DECODE_MS[1] + DECODE_MS[2] * len(active))) / 1e3)
            for q, left in active[:]:
                q.put_nowait("tok")
                left[0] -= 1
                if left[0] == 0:
                    q.put_nowait(None)
                    active.remove((q, left))

    @app.on_event("startup")
    async def start() -> None:
        app.state.task = asyncio.create_task(engine())

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/completions")
    async def completions(request: Request) -> object:
        body = await request.json()
        q: asyncio.Queue[str | None] = asyncio.Queue()
        pending.append((len(body["prompt"]), q, int(body.get("max_tokens", 16))))
        wake.set()
        text = []
        while (item := await q.get()) is not None:
            text.append(item)
        return JSONResponse({"choices": [{"text": " ".join(text)}]})

    return app


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    uvicorn.run(make_app(args.layers), host="127.0.0.1", port=args.port, log_level="warning")
