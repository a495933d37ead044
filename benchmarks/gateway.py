"""Gateway overhead: added latency (p50/p99) and max requests/s in front of fast emulated engines, vs direct.

Engines (zero-delay emulated, one process) and the gateway (another process) run on loopback; the load
generator is a minimal asyncio HTTP/1.1 client in this process. Latency: sequential non-streaming chat requests.
Throughput: closed loop with `--concurrency` clients. Routes measured: direct to a decode engine, through the
gateway to a single pool, and through the gateway's PD path (prefill call then decode call). Fixed rates
(`--rates`): open-loop arrivals at each rate for `--seconds`, the three routes measured one after the other in
the same run, so "added" latency compares like with like. `--http/--loop` pick uvicorn's implementations
(h11/asyncio, or httptools/uvloop when installed) for the gateway and the engines. CPU per request is read from
/proc for the gateway process and the engines' process.

    .venv/bin/python benchmarks/gateway.py [--requests 400] [--concurrency 32] [--engines 2] [--repeats 3]
        [--rates 200,500,1000] [--seconds 3] [--http auto|h11|httptools] [--loop auto|asyncio|uvloop]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path
from typing import Any

from _console import stamped_json, table_console  # benchmarks/_console.py
from rich.table import Table

from coral.http_serving import ServerThread, free_port
from coral.runtime.emulated import EngineTiming, create_engine_app
from coral.runtime.gateway import GatewayConfig, create_gateway_app
from coral.runtime.registry import Endpoint, InstanceState, Registry

OUT = Path("out/benchmarks/gateway.json")


def _engines(specs: list[tuple[str, str, str, int]], ready: Any, stop: Any, opts: dict[str, str]) -> None:
    servers = [
        ServerThread(create_engine_app(iid, model, phase, EngineTiming.constant()), port=port, **opts).start()
        for iid, model, phase, port in specs
    ]
    ready.set()
    stop.wait()
    for s in servers:
        s.stop()


def _gateway(specs: list[tuple[str, str, str, int]], port: int, ready: Any, stop: Any, opts: dict[str, str]) -> None:
    reg = Registry()
    for iid, model, phase, p in specs:
        reg.add(Endpoint(iid, model, phase, f"http://127.0.0.1:{p}", 1.0, InstanceState.READY))
    srv = ServerThread(create_gateway_app(reg, GatewayConfig(max_concurrency=512)), port=port, **opts).start()
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


async def fixed_rate(port: int, model: str, rate: float, seconds: float) -> dict[str, float]:
    """Open loop: a request every 1/rate s (each on an idle keep-alive connection, or a new one)."""
    idle: list[RawClient] = []
    lat: list[float] = []
    errors = 0

    async def one(i: int) -> None:
        nonlocal errors
        c = idle.pop() if idle else RawClient(port)
        t0 = time.perf_counter()
        try:
            await c.post("/v1/chat/completions", body(model, i))
            lat.append(time.perf_counter() - t0)
            idle.append(c)
        except (OSError, RuntimeError, asyncio.IncompleteReadError):
            errors += 1
            c.close()

    n = int(rate * seconds)
    tasks = []
    start = time.perf_counter()
    for i in range(n):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    for c in idle:
        c.close()
    return {
        "offered_rps": rate,
        "served_rps": len(lat) / elapsed,
        "errors": errors,
        "p50_ms": pct(lat, 0.5),
        "p99_ms": pct(lat, 0.99),
    }


def cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc): robust to other load on the machine,
    unlike wall-clock latency."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return 1e3 * s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--engines", type=int, default=2, help="decode engines per pool")
    ap.add_argument("--repeats", type=int, default=3, help="best of N (latency: min; req/s: max)")
    ap.add_argument("--rates", default="200,500,1000", help="fixed arrival rates (req/s); '' to skip")
    ap.add_argument("--seconds", type=float, default=3.0, help="duration of each fixed-rate run")
    ap.add_argument("--http", default="auto", help="uvicorn HTTP implementation: auto | h11 | httptools")
    ap.add_argument("--loop", default="auto", help="uvicorn event loop: auto | asyncio | uvloop")
    args = ap.parse_args()
    opts = {"http": args.http, "loop": args.loop}

    specs = [(f"pd.p{k}", "pd", "prefill", free_port()) for k in range(args.engines)]
    specs += [(f"pd.d{k}", "pd", "decode", free_port()) for k in range(args.engines)]
    specs += [(f"solo.d{k}", "solo", "decode", free_port()) for k in range(args.engines)]
    ctx = mp.get_context("spawn")
    stop, ready_e, ready_g = ctx.Event(), ctx.Event(), ctx.Event()
    gw_port = free_port()
    procs = [
        ctx.Process(target=_engines, args=(specs, ready_e, stop, opts), daemon=True),
        ctx.Process(target=_gateway, args=(specs, gw_port, ready_g, stop, opts), daemon=True),
    ]
    for p in procs:
        p.start()
    if not (ready_e.wait(30) and ready_g.wait(30)):
        raise SystemExit("servers did not start")
    # route -> (port, model, whether through the gateway)
    routes: dict[str, tuple[int, str, bool]] = {
        "direct (engine)": (specs[-1][3], "solo", False),
        "gateway, one pool": (gw_port, "solo", True),
        "gateway, PD path": (gw_port, "pd", True),
    }
    rows: dict[str, dict[str, float]] = {}
    fixed: list[dict[str, Any]] = []
    try:
        for rate in [float(r) for r in args.rates.split(",") if r.strip()]:
            for name, (port, model, _gw) in routes.items():
                fixed.append({"route": name, **asyncio.run(fixed_rate(port, model, rate, args.seconds))})
        for name, (port, model, gw) in routes.items():
            runs = []
            for _ in range(args.repeats):  # the machine may be shared: keep the quietest repeat
                lat = asyncio.run(latency(port, model, args.requests))
                cpu0 = [cpu_s(p.pid) for p in procs]
                rps = asyncio.run(throughput(port, model, args.requests * 4, args.concurrency))
                cpu = [
                    (cpu_s(p.pid) - c0) * 1e3 / (args.requests * 4) for p, c0 in zip(procs, cpu0, strict=True)
                ]
                runs.append(
                    {
                        "p50_ms": pct(lat, 0.5),
                        "p99_ms": pct(lat, 0.99),
                        "mean_ms": 1e3 * statistics.fmean(lat),
                        "max_rps": rps,
                        "engines_cpu_ms_per_req": cpu[0],
                        "gateway_cpu_ms_per_req": cpu[1] if gw else 0.0,
                    }
                )
            rows[name] = {
                "p50_ms": min(r["p50_ms"] for r in runs),
                "p99_ms": min(r["p99_ms"] for r in runs),
                "mean_ms": min(r["mean_ms"] for r in runs),
                "max_rps": max(r["max_rps"] for r in runs),
                "engines_cpu_ms_per_req": min(r["engines_cpu_ms_per_req"] for r in runs),
                "gateway_cpu_ms_per_req": min(r["gateway_cpu_ms_per_req"] for r in runs),
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
        "route",
        "p50 ms",
        "p99 ms",
        "added p50 ms",
        "added p99 ms",
        "max req/s",
        "gateway CPU ms/req",
        "engines CPU ms/req",
        title=f"gateway overhead (load average {os.getloadavg()[0]:.1f} on {mp.cpu_count()} CPUs)",
    )
    for name, r in rows.items():
        t.add_row(
            name,
            f"{r['p50_ms']:.2f}",
            f"{r['p99_ms']:.2f}",
            f"{r['added_p50_ms']:+.2f}",
            f"{r['added_p99_ms']:+.2f}",
            f"{r['max_rps']:.0f}",
            f"{r['gateway_cpu_ms_per_req']:.3f}",
            f"{r['engines_cpu_ms_per_req']:.3f}",
        )
    table_console().print(t)
    if fixed:
        f = Table(
            "offered req/s",
            "route",
            "served req/s",
            "errors",
            "p50 ms",
            "p99 ms",
            "added p50",
            "added p99",
            title=f"fixed rates ({args.seconds:g} s each; added = vs direct at the same rate)",
        )
        for r in fixed:
            base_r = next(
                b for b in fixed if b["offered_rps"] == r["offered_rps"] and b["route"] == "direct (engine)"
            )
            r["added_p50_ms"] = r["p50_ms"] - base_r["p50_ms"]
            r["added_p99_ms"] = r["p99_ms"] - base_r["p99_ms"]
            f.add_row(
                f"{r['offered_rps']:.0f}",
                r["route"],
                f"{r['served_rps']:.0f}",
                str(r["errors"]),
                f"{r['p50_ms']:.2f}",
                f"{r['p99_ms']:.2f}",
                f"{r['added_p50_ms']:+.2f}",
                f"{r['added_p99_ms']:+.2f}",
            )
        table_console().print(f)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "engines_per_pool": args.engines,
        "repeats": args.repeats,
        "cpus": mp.cpu_count(),
        "http": args.http,
        "loop": args.loop,
        "load_avg_1m": os.getloadavg()[0],
    }
    OUT.write_text(stamped_json({"config": meta, "routes": rows, "fixed_rates": fixed}, indent=2))
    table_console().print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
