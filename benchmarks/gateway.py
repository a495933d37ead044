"""Gateway overhead: added latency (p50/p99) and max requests/s in front of fast emulated engines, vs direct.

Engines (zero-delay emulated, one process) and the gateway (another process) run on loopback; the load
generator is a minimal asyncio HTTP/1.1 client in this process. Latency: sequential non-streaming chat requests.
Throughput: closed loop with `--concurrency` clients. Routes measured: direct to a decode engine, through the
gateway to a single pool, and through the gateway's PD path (prefill call then decode call).

    .venv/bin/python benchmarks/gateway.py [--requests 400] [--concurrency 32] [--engines 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from coral.runtime.emulated import EngineTiming, create_engine_app
from coral.runtime.gateway import GatewayConfig, create_gateway_app
from coral.runtime.registry import Endpoint, InstanceState, Registry
from coral.runtime.server import ServerThread, free_port

OUT = Path("out/benchmarks/gateway.json")


def _engines(specs: list[tuple[str, str, str, int]], ready: Any, stop: Any) -> None:
    servers = [
        ServerThread(create_engine_app(iid, model, phase, EngineTiming.constant()), port=port).start()
        for iid, model, phase, port in specs
    ]
    ready.set()
    stop.wait()
    for s in servers:
        s.stop()


def _gateway(specs: list[tuple[str, str, str, int]], port: int, ready: Any, stop: Any) -> None:
    reg = Registry()
    for iid, model, phase, p in specs:
        reg.add(Endpoint(iid, model, phase, f"http://127.0.0.1:{p}", 1.0, InstanceState.READY))
    srv = ServerThread(create_gateway_app(reg, GatewayConfig(max_concurrency=512)), port=port).start()
    ready.set()
    stop.wait()
    srv.stop()


def body(model: str, i: int) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 8}


class RawClient:
    """Minimal keep-alive HTTP/1.1 client on asyncio streams: cheaper than httpx, so the load generator is not
    the bottleneck. Handles only Content-Length responses (what the engines and the gateway send here)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, payload: dict[str, Any]) -> bytes:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        assert self.reader is not None
        data = json.dumps(payload).encode()
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        self.writer.write(head.encode() + data)
        status = await self.reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"HTTP error: {status!r}")
        length = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode().partition(":")
            if k.lower() == "content-length":
                length = int(v)
        return await self.reader.readexactly(length)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def latency(port: int, model: str, n: int) -> list[float]:
    c, out = RawClient(port), []
    for i in range(n + 20):
        t0 = time.perf_counter()
        await c.post("/v1/chat/completions", body(model, i))
        if i >= 20:  # warm-up
            out.append(time.perf_counter() - t0)
    c.close()
    return out


async def throughput(port: int, model: str, n: int, concurrency: int) -> float:
    queue = iter(range(n))

    async def worker() -> None:
        c = RawClient(port)
        for i in queue:
            await c.post("/v1/chat/completions", body(model, i))
        c.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return n / (time.perf_counter() - t0)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return 1e3 * s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--engines", type=int, default=2, help="decode engines per pool")
    ap.add_argument("--repeats", type=int, default=3, help="best of N (latency: min; req/s: max)")
    args = ap.parse_args()

    specs = [(f"pd.p{k}", "pd", "prefill", free_port()) for k in range(args.engines)]
    specs += [(f"pd.d{k}", "pd", "decode", free_port()) for k in range(args.engines)]
    specs += [(f"solo.d{k}", "solo", "decode", free_port()) for k in range(args.engines)]
    ctx = mp.get_context("spawn")
    stop, ready_e, ready_g = ctx.Event(), ctx.Event(), ctx.Event()
    gw_port = free_port()
    procs = [
        ctx.Process(target=_engines, args=(specs, ready_e, stop), daemon=True),
        ctx.Process(target=_gateway, args=(specs, gw_port, ready_g, stop), daemon=True),
    ]
    for p in procs:
        p.start()
    if not (ready_e.wait(30) and ready_g.wait(30)):
        raise SystemExit("servers did not start")
    routes = {
        "direct (engine)": (specs[-1][3], "solo"),
        "gateway, one pool": (gw_port, "solo"),
        "gateway, PD path": (gw_port, "pd"),
    }
    rows: dict[str, dict[str, float]] = {}
    try:
        for name, (port, model) in routes.items():
            runs = []
            for _ in range(args.repeats):  # the machine may be shared: keep the quietest repeat
                lat = asyncio.run(latency(port, model, args.requests))
                rps = asyncio.run(throughput(port, model, args.requests * 4, args.concurrency))
                runs.append(
                    {
                        "p50_ms": pct(lat, 0.5),
                        "p99_ms": pct(lat, 0.99),
                        "mean_ms": 1e3 * statistics.fmean(lat),
                        "max_rps": rps,
                    }
                )
            rows[name] = {
                "p50_ms": min(r["p50_ms"] for r in runs),
                "p99_ms": min(r["p99_ms"] for r in runs),
                "mean_ms": min(r["mean_ms"] for r in runs),
                "max_rps": max(r["max_rps"] for r in runs),
            }
    finally:
        stop.set()
        for p in procs:
            p.join(10)
    base = rows["direct (engine)"]
    for r in rows.values():
        r["added_p50_ms"] = r["p50_ms"] - base["p50_ms"]
        r["added_p99_ms"] = r["p99_ms"] - base["p99_ms"]

    t = Table(
        "route", "p50 ms", "p99 ms", "added p50 ms", "added p99 ms", "max req/s", title="gateway overhead"
    )
    for name, r in rows.items():
        t.add_row(
            name,
            f"{r['p50_ms']:.2f}",
            f"{r['p99_ms']:.2f}",
            f"{r['added_p50_ms']:+.2f}",
            f"{r['added_p99_ms']:+.2f}",
            f"{r['max_rps']:.0f}",
        )
    Console().print(t)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "engines_per_pool": args.engines,
        "repeats": args.repeats,
        "cpus": mp.cpu_count(),
    }
    OUT.write_text(json.dumps({"config": meta, "routes": rows}, indent=2))
    Console().print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
