"""Reliability of the gateway, the controller and the input files, measured: fuzzing, load and injected faults.

Everything runs on loopback in this process (emulated engines and the gateway in uvicorn threads), bounded in
count and time. For each case group it prints the cases tried, handled (a clean answer: success, or a 4xx/SSE
error in OpenAI's shape, or a CoralInputError naming the file), failed (5xx, wrong shape, hang, or any other
exception) and requests lost (accepted but never answered), and checks that the in-flight counters (per
instance, admission slots, queue) return to zero. Writes out/benchmarks/reliability.json.

    .venv/bin/python benchmarks/reliability.py [--clients 50,200,1000] [--seed 0] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from rich.console import Console
from rich.table import Table

from coral.allocation.plan import Plan
from coral.catalog.loader import CoralInputError, data_path, load_scenario
from coral.deploy.endpoints import EndpointsFile, EndpointSpec
from coral.runtime.backends import EmulatedBackend
from coral.runtime.controller import Controller, Store, controller_router
from coral.runtime.emulated import EngineTiming, create_engine_app
from coral.runtime.gateway import GatewayConfig, create_gateway_app, load_secrets
from coral.runtime.handmade import make_instance, make_plan
from coral.runtime.registry import Endpoint, InstanceState, Registry
from coral.runtime.server import ServerThread

OUT = Path("out/benchmarks/reliability.json")
ERROR_KEYS = {"message", "type", "param", "code"}


@dataclass
class Tally:
    group: str
    tried: int = 0
    handled: int = 0
    failed: int = 0
    lost: int = 0
    rejected: int = 0
    """Answered 429/503 with Retry-After (overload shed cleanly: handled, not lost)."""
    counters_zero: bool | None = None
    failures: list[str] = field(default_factory=list)

    def ok(self, good: bool, what: str) -> None:
        self.tried += 1
        if good:
            self.handled += 1
        else:
            self.failed += 1
            if len(self.failures) < 8:
                self.failures.append(what[:200])


class Stack:
    """Emulated engines (PD pools for model `m`) and a gateway on loopback."""

    def __init__(self, timing: EngineTiming, decode: int = 2, config: GatewayConfig | None = None) -> None:
        self.registry = Registry()
        self.engines: dict[str, ServerThread] = {}
        # health probes on, as deployed: they bring back instances that passive checks took out under overload
        app = create_gateway_app(self.registry, config or GatewayConfig(), health_checks=True)
        self.gateway = ServerThread(app).start()
        self.gw = app.state.gateway
        self.add("p0", "prefill", timing)
        for k in range(decode):
            self.add(f"d{k}", "decode", timing)

    def add(self, iid: str, phase: str, timing: EngineTiming) -> None:
        srv = self.engines[iid] = ServerThread(create_engine_app(iid, "m", phase, timing)).start()
        self.registry.add(Endpoint(iid, "m", phase, srv.url, 1.0, InstanceState.READY))

    def counters_zero(self, timeout_s: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (
                self.gw.active == 0
                and self.gw.waiting == 0
                and all(e.inflight == 0 for e in self.registry.all())
            ):
                return True
            time.sleep(0.02)
        return False

    def close(self) -> None:
        for s in [self.gateway, *self.engines.values()]:
            s.stop()


@contextmanager
def stack(timing: EngineTiming, **kw: Any) -> Iterator[Stack]:
    s = Stack(timing, **kw)
    try:
        yield s
    finally:
        s.close()


def chat(i: int = 0, n: int = 4, stream: bool = False) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": f"q {i}"}],
        "max_tokens": n,
        "stream": stream,
    }


def openai_error(r: httpx.Response) -> bool:
    try:
        err = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(err, dict) and set(err) == ERROR_KEYS and isinstance(err["message"], str)


# --- fuzzing the gateway --------------------------------------------------------------------------------
def gateway_cases(rng: random.Random) -> list[tuple[str, bytes]]:
    """(name, raw body) pairs for /v1/chat/completions: malformed, wrong types, huge, unicode, random."""
    good = chat()
    cases: list[tuple[str, bytes]] = [
        ("empty", b""),
        ("not json", b"{not json"),
        ("truncated", json.dumps(good).encode()[:-3]),
        ("bad utf-8", b'{"model": "\xff\xfe"}'),
        ("json array", b"[]"),
        ("json null", b"null"),
        ("deep nesting", b"[" * 100_000 + b"]" * 100_000),
        ("lone surrogate", b'{"model": "m", "messages": [{"role": "user", "content": "a\\ud800b"}]}'),
        ("surrogate model", b'{"model": "\\udfff", "prompt": "x"}'),
        ("nan", b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}'),
        ("huge body 20 MB", json.dumps({**good, "pad": "x" * (20 << 20)}).encode()),
        (
            "big prompt 4 MB",
            json.dumps(chat() | {"messages": [{"role": "user", "content": "w " * (2 << 20)}]}).encode(),
        ),
    ]
    wrong = [None, 0, -1, 1.5, "7", True, [], {}, [1, "a"], "\u202e\u0000\ud83d"]
    for key in (
        "model",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "stream",
        "temperature",
        "top_p",
        "n",
        "stream_options",
        "min_tokens",
        "stop",
        "seed",
    ):
        for v in wrong:
            try:
                raw = json.dumps({**good, key: v}).encode()
            except UnicodeEncodeError:
                continue
            cases.append((f"{key}={v!r}", raw))
    for text in ("héllo wörld", "数据中心", "🙂" * 1000, "\u202eRTL", "a\u0000b", "\\ud800", "\r\n\r\n"):
        cases.append(
            (
                f"unicode {text[:8]!r}",
                json.dumps(chat() | {"messages": [{"role": "user", "content": text}]}).encode(),
            )
        )
    for k in range(60):  # random bytes and random JSON objects
        cases.append((f"random bytes {k}", rng.randbytes(rng.randint(1, 400))))
        obj = {
            rng.choice(["model", "messages", "prompt", "max_tokens", "stream", "x"]): rng.choice(
                [*wrong, "m"]
            )
            for _ in range(rng.randint(0, 5))
        }
        cases.append((f"random json {k}", json.dumps(obj).encode()))
    return cases


def fuzz_gateway(rng: random.Random) -> Tally:
    t = Tally("fuzz: gateway requests")
    with stack(EngineTiming.constant()) as s, httpx.Client(base_url=s.gateway.url, timeout=30) as c:
        for name, raw in gateway_cases(rng):
            for path in ("/v1/chat/completions", "/v1/completions"):
                try:
                    r = c.post(path, content=raw, headers={"Content-Type": "application/json"})
                    good = r.status_code == 200 or (400 <= r.status_code < 500 and openai_error(r))
                    t.ok(good, f"{name} {path}: HTTP {r.status_code} {r.text[:100]}")
                except httpx.HTTPError as exc:
                    t.ok(False, f"{name} {path}: {type(exc).__name__}")
        for method, path in [
            ("GET", "/v1/nope"),
            ("DELETE", "/v1/models"),
            ("POST", "/v1/embeddings"),
            ("GET", "/v1/models/%F0%9F%99%82"),
            ("PUT", "/v1/chat/completions"),
        ]:
            r = c.request(method, path)
            t.ok(r.status_code < 500 and openai_error(r), f"{method} {path}: HTTP {r.status_code}")
        t.counters_zero = s.counters_zero()
    return t


# --- fuzzing the input files ----------------------------------------------------------------------------
def file_cases(
    valid: dict[str, Any], suffix: str, rng: random.Random
) -> list[tuple[str, str | bytes | None]]:
    """(name, content) variants of a valid document; None = the file is missing."""
    dump = (
        (lambda d: json.dumps(d)) if suffix == ".json" else (lambda d: yaml.safe_dump(d, allow_unicode=True))
    )
    text = dump(valid)
    cases: list[tuple[str, str | bytes | None]] = [
        ("missing", None),
        ("empty", ""),
        ("binary", rng.randbytes(300)),
        ("bad utf-8", b"name: \xff\xfe\n"),
        ("truncated", text[: len(text) // 2]),
        ("malformed", text.replace(":", "", 3) + "\n  - ]["),
        ("a list", dump([1, 2])),
        ("a scalar", "42"),
        ("deep nesting", "[" * 50_000 + "]" * 50_000),
        (
            "huge",
            text + ("\n" if suffix != ".json" else "") + ("#" + "x" * (8 << 20) if suffix != ".json" else ""),
        ),
        ("unicode keys", dump({**valid, "名前🙂": "值"})),
    ]
    for key in valid:
        for v in (None, -1, "x", [], {}, True, "🙂\u202e"):
            cases.append((f"{key}={v!r}", dump({**valid, key: v})))
    return cases


def fuzz_files(rng: random.Random) -> Tally:
    t = Tally("fuzz: input files")
    plan = make_plan([make_instance("phi-4", "decode", [(40, ["1xL40S"])], 100.0)])
    endpoints = EndpointsFile(
        endpoints=[EndpointSpec(id="e", model="m", phase="decode", url="http://127.0.0.1:1", weight=1.0)]
    )  # type: ignore[arg-type]
    scenario = yaml.safe_load(data_path("scenarios", "core.yaml").read_text())
    loaders: list[tuple[str, dict[str, Any], str, Callable[[Path], Any]]] = [
        ("scenario", scenario, ".yaml", load_scenario),
        ("plan", plan.model_dump(mode="json"), ".json", Plan.load),
        ("endpoints", endpoints.model_dump(mode="json"), ".json", EndpointsFile.load),
        ("api keys", {"k": "sk-valid-key-1"}, ".txt", lambda p: load_secrets("CORAL_FUZZ_UNSET", p)),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for kind, valid, suffix, load in loaders:
            for k, (name, content) in enumerate(file_cases(valid, suffix, rng)):
                path = Path(tmp) / f"{kind.replace(' ', '_')}-{k}{suffix}"
                if isinstance(content, bytes):
                    path.write_bytes(content)
                elif content is not None:
                    path.write_text(content)
                try:
                    load(path)
                    t.ok(True, "")
                except CoralInputError as exc:
                    t.ok(
                        str(path) in str(exc) or kind == "scenario", f"{kind} {name}: message lacks the file"
                    )
                except Exception as exc:
                    t.ok(False, f"{kind} {name}: {type(exc).__name__}: {str(exc)[:80]}")
    return t


# --- load -----------------------------------------------------------------------------------------------
async def one_request(c: httpx.AsyncClient, i: int, stream: bool) -> str:
    """ "ok" for a complete answer (stream ending with [DONE], or a JSON completion), "rejected" for a clean
    overload answer (429/503, OpenAI shape, Retry-After), else what went wrong."""
    async with c.stream("POST", "/v1/chat/completions", json=chat(i, stream=stream)) as r:
        raw = await r.aread()
    if r.status_code in (429, 503) and "retry-after" in r.headers and openai_error(r):
        return "rejected"
    if r.status_code != 200:
        return f"HTTP {r.status_code}: {raw[:100]!r}"
    if stream:
        return "ok" if raw.decode().rstrip().endswith("data: [DONE]") else f"cut stream: {raw[-100:]!r}"
    return "ok" if json.loads(raw)["choices"][0]["message"]["content"] is not None else "empty answer"


def load_test(clients: int, stream: bool, requests_per_client: int) -> Tally:
    t = Tally(f"load: {clients} clients, {'streaming' if stream else 'non-streaming'}")
    timing = EngineTiming.constant(0.002, 0.001)
    with stack(timing, config=GatewayConfig(max_concurrency=256, max_waiting=4096)) as s:

        async def run() -> None:
            limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
            async with httpx.AsyncClient(base_url=s.gateway.url, timeout=60, limits=limits) as c:

                async def client(k: int) -> None:
                    for j in range(requests_per_client):
                        try:
                            outcome = await one_request(c, k * 1000 + j, stream)
                            t.ok(outcome in ("ok", "rejected"), outcome)
                            t.rejected += outcome == "rejected"
                            t.lost += outcome not in ("ok", "rejected")
                        except httpx.HTTPError as exc:
                            t.ok(False, f"{type(exc).__name__}")
                            t.lost += 1

                await asyncio.gather(*(client(k) for k in range(clients)))

        asyncio.run(run())
        t.counters_zero = s.counters_zero()
    return t


# --- faults ---------------------------------------------------------------------------------------------
def fault_engine_killed(before_first_token: bool) -> Tally:
    """A decode engine crashes with requests on it: before the first token they are retried on the other
    decode engine (none lost); after it, streams end with an SSE error event (answered, not hung)."""
    when = "before" if before_first_token else "after"
    t = Tally(f"fault: engine killed {when} first token")
    timing = EngineTiming.constant(0.5, 0.0) if before_first_token else EngineTiming.constant(0.0, 0.05)
    with stack(EngineTiming.constant(), decode=0) as s:
        s.add("d0", "decode", timing)
        s.add("d1", "decode", EngineTiming.constant(0.0, 0.0))

        async def run() -> None:
            async with httpx.AsyncClient(base_url=s.gateway.url, timeout=30) as c:

                async def req(i: int) -> None:
                    try:
                        async with c.stream(
                            "POST", "/v1/chat/completions", json=chat(i, n=40, stream=True)
                        ) as r:
                            body = (await r.aread()).decode()
                        done = body.rstrip().endswith("[DONE]")
                        sse_error = '"error"' in body
                        good = r.status_code == 200 and (done if before_first_token else done or sse_error)
                        t.ok(good, f"HTTP {r.status_code}: {body[-120:]}")
                        t.lost += not (done or sse_error)
                    except httpx.HTTPError as exc:
                        t.ok(False, type(exc).__name__)
                        t.lost += 1

                tasks = [asyncio.create_task(req(i)) for i in range(20)]
                await asyncio.sleep(0.3)
                await asyncio.to_thread(s.engines["d0"].stop, True)
                await asyncio.gather(*tasks)

        asyncio.run(run())
        t.counters_zero = s.counters_zero()
    return t


def fault_client_disconnect() -> Tally:
    t = Tally("fault: client disconnects mid-stream")
    with stack(EngineTiming.constant(0.0, 0.02)) as s:

        async def run() -> None:
            async with httpx.AsyncClient(base_url=s.gateway.url, timeout=30) as c:

                async def req(i: int) -> None:
                    async with c.stream(
                        "POST", "/v1/chat/completions", json=chat(i, n=200, stream=True)
                    ) as r:
                        async for _ in r.aiter_raw():
                            break  # leave after the first chunk: the connection closes
                    t.ok(r.status_code == 200, f"HTTP {r.status_code}")

                await asyncio.gather(*(req(i) for i in range(30)))

        asyncio.run(run())
        t.counters_zero = s.counters_zero(timeout_s=10)
        engines_idle = all(e.inflight == 0 for e in s.registry.all())
        t.ok(engines_idle, "in-flight left after disconnects")
    return t


def fault_controller(db_fault: str | None) -> Tally:
    """The controller dies (thread stopped, nothing drained) and a new one resumes from SQLite while the
    gateway serves; or its SQLite file turns read-only / is deleted under it: the loop keeps running, reports
    the error, and the gateway keeps serving."""
    name = {
        None: "controller killed and restarted",
        "readonly": "SQLite read-only",
        "missing": "SQLite deleted",
    }
    t = Tally(f"fault: {name[db_fault]}")
    plan = make_plan(
        [make_instance("phi-4", "prefill", [(40, ["1xL40S"])], 6000.0, template_id=1)]
        + [
            make_instance("phi-4", "decode", [(40, ["1xL40S"])], 500.0, template_id=2, index=k)
            for k in range(2)
        ]
    )
    backend = EmulatedBackend(time_scale=0.0)
    registry = Registry()
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "state.sqlite"
        c1 = Controller(Store(db), backend, registry, lambda: plan, interval_s=0.2, ready_timeout_s=10)
        c1.set_plan(plan)
        c1.reconcile()
        holder = {"c": c1}
        app = create_gateway_app(
            registry,
            extra_routers=[controller_router(holder["c"], admin_token="x" * 16)],
            health_checks=False,
        )
        gw = ServerThread(app).start()
        c1.start()
        body = {"model": "phi-4", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        try:
            with httpx.Client(base_url=gw.url, timeout=10) as http:

                def serve_some(n: int) -> None:
                    for _ in range(n):
                        try:
                            r = http.post("/v1/chat/completions", json=body)
                            t.ok(r.status_code == 200, f"HTTP {r.status_code} {r.text[:80]}")
                            t.lost += r.status_code != 200
                        except httpx.HTTPError as exc:
                            t.ok(False, type(exc).__name__)
                            t.lost += 1

                serve_some(20)
                if db_fault is None:
                    c1.stop()
                    c1.store.close()
                    serve_some(20)  # no controller: the gateway goes on with what is registered
                    c2 = Controller(
                        Store(db), backend, registry, lambda: plan, interval_s=0.2, ready_timeout_s=10
                    )
                    holder["c"] = c2
                    started = c2.reconcile()["started"]
                    t.ok(started == [] and backend.starts == 3, f"restart re-started {started}")
                    c2.start()
                    serve_some(20)
                    c2.stop()
                else:
                    if db_fault == "readonly":
                        c1.store.db.execute("PRAGMA query_only = 1")
                    else:
                        db.unlink()
                        for side in ("-wal", "-shm"):
                            Path(f"{db}{side}").unlink(missing_ok=True)
                    c1.trigger()
                    time.sleep(0.6)
                    serve_some(20)
                    state = http.get("/state")
                    t.ok(
                        state.status_code in (200, 500) and c1._thread is not None and c1._thread.is_alive(),
                        f"controller loop died / state HTTP {state.status_code}",
                    )
                    t.ok(db_fault != "readonly" or bool(c1.last_error), "read-only store raised no error")
                    c1.stop()
        finally:
            gw.stop()
            backend.close()
        t.counters_zero = all(e.inflight == 0 for e in registry.all())
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="50,200,1000", help="concurrent clients per load run")
    ap.add_argument("--requests-per-client", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="skip the 1000-client runs and the file fuzz")
    ap.add_argument("--only-load", action="store_true", help="run the load groups only")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    clients = [int(c) for c in args.clients.split(",")]
    if args.quick:
        clients = [c for c in clients if c < 1000]
    t0 = time.perf_counter()
    tallies = [] if args.only_load else [fuzz_gateway(rng)]
    if not (args.quick or args.only_load):
        tallies.append(fuzz_files(rng))
    for n in clients:
        for stream in (False, True):
            tallies.append(load_test(n, stream, args.requests_per_client))
    if not args.only_load:
        tallies += [fault_engine_killed(True), fault_engine_killed(False), fault_client_disconnect()]
        tallies += [fault_controller(None), fault_controller("readonly"), fault_controller("missing")]

    table = Table(
        "cases",
        "tried",
        "handled",
        "of which 429/503",
        "failed",
        "requests lost",
        "counters back to 0",
        title="reliability",
    )
    for t in tallies:
        zero = {None: "-", True: "yes", False: "[red]NO[/]"}[t.counters_zero]
        table.add_row(
            t.group,
            str(t.tried),
            str(t.handled),
            str(t.rejected),
            f"[red]{t.failed}[/]" if t.failed else "0",
            str(t.lost),
            zero,
        )
    console = Console()
    console.print(table)
    for t in tallies:
        for f in t.failures:
            console.print(f"[red]{t.group}[/]: {f}")
    total = Tally(
        "total", *(sum(getattr(t, k) for t in tallies) for k in ("tried", "handled", "failed", "lost"))
    )
    console.print(
        f"total: {total.tried} tried, {total.handled} handled, {total.failed} failed, {total.lost} lost "
        f"in {time.perf_counter() - t0:.0f} s"
    )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"seed": args.seed, "groups": [asdict(t) for t in tallies]}, indent=2))
    console.print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
