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
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from _console import table_console  # benchmarks/_console.py
from pydantic import ValidationError
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
from coral.runtime.server import ServerThread, free_port

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
    cut: int = 0
    """Ended by a connection error because the serving process was SIGKILLed under them (the client knows)."""
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
ENGINE_PROCESS = (
    "import sys, uvicorn\n"
    "from coral.runtime.emulated import EngineTiming, create_engine_app\n"
    "ttft, itl = float(sys.argv[3]), float(sys.argv[4])\n"
    "app = create_engine_app(sys.argv[1], 'm', 'decode', EngineTiming.constant(ttft, itl))\n"
    "uvicorn.run(app, host='127.0.0.1', port=int(sys.argv[2]), log_level='warning')\n"
)


def engine_process(iid: str, ttft_s: float, itl_s: float) -> tuple[subprocess.Popen[bytes], str]:
    """An emulated decode engine of model `m` in a process of its own, healthy; (process, URL)."""
    port = free_port()
    cmd = [sys.executable, "-c", ENGINE_PROCESS, iid, str(port), str(ttft_s), str(itl_s)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    if not poll(lambda: httpx.get(f"{url}/health", timeout=1).status_code == 200, 300):
        proc.kill()
        raise RuntimeError(f"engine process {iid} did not start")
    return proc, url


def poll(check: Callable[[], bool], tries: int, every_s: float = 0.1) -> bool:
    """`check` until true, at most `tries` times (connection errors count as false)."""
    for _ in range(tries):
        with contextlib.suppress(httpx.HTTPError, OSError, KeyError, ValueError):
            if check():
                return True
        time.sleep(every_s)
    return False


def fault_engine_killed(before_first_token: bool, process: bool = False) -> Tally:
    """A decode engine crashes with requests on it (`process`: its own process, killed with SIGKILL; else a
    server thread dropping its connections): before the first token they are retried on the other decode
    engine (none lost); after it, streams end with an SSE error event (answered, not hung)."""
    when = "before" if before_first_token else "after"
    how = "process SIGKILLed" if process else "killed"
    t = Tally(f"fault: engine {how} {when} first token")
    ttft, itl = (0.5, 0.0) if before_first_token else (0.0, 0.05)
    with stack(EngineTiming.constant(), decode=0) as s:
        if process:
            proc, url = engine_process("d0", ttft, itl)
            s.registry.add(Endpoint("d0", "m", "decode", url, 1.0, InstanceState.READY))
            kill: Callable[[], None] = lambda: os.kill(proc.pid, signal.SIGKILL)  # noqa: E731
        else:
            s.add("d0", "decode", EngineTiming.constant(ttft, itl))
            kill = lambda: s.engines["d0"].stop(True)  # noqa: E731
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
                await asyncio.to_thread(kill)
                await asyncio.gather(*tasks)

        asyncio.run(run())
        t.counters_zero = s.counters_zero()
        if process:
            proc.wait(10)
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
    gateway serves; or its SQLite file turns read-only (file and folder mode 0444/0555: binding for any user
    but root, which file modes do not stop) / is deleted / is overwritten with garbage under it: the loop keeps
    running, `/state` answers 200, `/replan` answers JSON (503 naming the file when it cannot write), the
    gateway keeps serving, and a controller started on the garbage keeps it aside and starts fresh."""
    name = {
        None: "controller stopped and restarted",
        "readonly": "SQLite read-only (file modes)",
        "missing": "SQLite deleted",
        "corrupt": "SQLite overwritten with garbage",
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
                if db_fault in (None, "corrupt"):
                    c1.stop()
                    c1.store.close()
                    serve_some(20)  # no controller: the gateway goes on with what is registered
                    if db_fault == "corrupt":  # what a crash mid-write or a bad copy leaves
                        db.write_bytes(b"garbage, not sqlite " * 200)
                        for side in ("-wal", "-shm"):
                            Path(f"{db}{side}").unlink(missing_ok=True)
                    store = Store(db)
                    t.ok((db_fault == "corrupt") == ("kept as" in store.notice), f"store notice {store.notice!r}")
                    c2 = Controller(store, backend, registry, lambda: plan, interval_s=0.2, ready_timeout_s=10)
                    holder["c"] = c2
                    started = c2.reconcile()["started"]
                    t.ok(started == [] and backend.starts == 3, f"restart re-started {started}")
                    c2.start()
                    serve_some(20)
                    c2.stop()
                else:
                    if db_fault == "readonly":
                        for f in db.parent.iterdir():
                            f.chmod(0o444)
                        db.parent.chmod(0o555)
                    else:
                        db.unlink()
                        for side in ("-wal", "-shm"):
                            Path(f"{db}{side}").unlink(missing_ok=True)
                    c1.trigger()
                    time.sleep(0.6)
                    serve_some(20)
                    state = http.get("/state")
                    t.ok(
                        state.status_code == 200 and c1._thread is not None and c1._thread.is_alive(),
                        f"controller loop died / state HTTP {state.status_code}",
                    )
                    admin = {"Authorization": "bearer " + "x" * 16}  # the scheme in lower case
                    replan = http.post("/replan", content=plan.model_dump_json(), headers=admin)
                    refused = replan.status_code == 503 and "cannot be written" in replan.text
                    t.ok(replan.status_code == 200 or (db_fault == "readonly" and refused and openai_error(replan)),
                         f"/replan HTTP {replan.status_code} {replan.text[:80]}")
                    c1.stop()
                    db.parent.chmod(0o755)
        finally:
            gw.stop()
            backend.close()
        t.counters_zero = all(e.inflight == 0 for e in registry.all())
    return t


# --- the attacks of issue 20 -----------------------------------------------------------------------------
KEY, READ_TOKEN = "sk-reliability-key-01", "read-only-token-0002"


def attack_access() -> Tally:
    """With API keys set, every endpoint but /health refuses a request without a key (JSON 401), the read-only
    token reads the views only, `Bearer` is taken in any case, and engines refuse requests without the
    gateway's token."""
    t = Tally("attack: endpoints without a key")
    cfg = GatewayConfig(upstream_api_key="engine-token-0003").with_api_keys([KEY]).with_tokens(read=[READ_TOKEN])
    with stack(EngineTiming.constant(), config=cfg) as s, httpx.Client(base_url=s.gateway.url, timeout=10) as c:
        guarded = ServerThread(create_engine_app("g", "m", "decode", EngineTiming.constant(), api_key="engine-token-0003")).start()
        try:
            for path in ("/state", "/gateway/state", "/metrics", "/docs", "/openapi.json", "/v1/models"):
                r = c.get(path)
                t.ok(r.status_code == 401 and openai_error(r), f"GET {path} without a key: HTTP {r.status_code}")
            for scheme in ("Bearer", "bearer", "BEARER"):
                r = c.get("/metrics", headers={"Authorization": f"{scheme} {READ_TOKEN}"})
                t.ok(r.status_code == 200, f"/metrics with {scheme} read token: HTTP {r.status_code}")
            r = c.post("/v1/chat/completions", json=chat(), headers={"Authorization": f"Bearer {READ_TOKEN}"})
            t.ok(r.status_code == 401, f"completion with the read token: HTTP {r.status_code}")
            r = httpx.post(f"{guarded.url}/v1/completions", json={"model": "m", "prompt": "x"}, timeout=10)
            t.ok(r.status_code == 401, f"engine without the gateway's token: HTTP {r.status_code}")
        finally:
            guarded.stop()
    return t


def attack_metrics() -> Tally:
    """A lone surrogate and 2,000 unknown 4 KB model names: /metrics stays 200 and does not grow."""
    t = Tally("attack: /metrics label flood")
    with stack(EngineTiming.constant()) as s, httpx.Client(base_url=s.gateway.url, timeout=10) as c:
        r = c.post("/v1/chat/completions", content=b'{"model": "\\ud800", "messages": [{"role": "user", "content": "x"}]}')
        t.ok(400 <= r.status_code < 500 and openai_error(r), f"surrogate model: HTTP {r.status_code}")
        before = len(c.get("/metrics").content)
        for i in range(2000):
            r = c.post("/v1/chat/completions", json={**chat(), "model": f"{i}" + "x" * 4096})
            t.ok(r.status_code == 404 and openai_error(r), f"unknown model: HTTP {r.status_code}")
        after = c.get("/metrics")
        t.ok(after.status_code == 200 and len(after.content) < before + 1000,
             f"/metrics HTTP {after.status_code}, {before} -> {len(after.content)} bytes")
    return t


def attack_huge_prompt() -> Tally:
    """A 7.9 MiB prompt is refused before routing (400, over the context), and 200 concurrent ordinary requests
    right after all complete."""
    t = Tally("attack: 7.9 MiB prompt")
    with stack(EngineTiming.constant(0.002, 0.001)) as s:
        huge = {**chat(), "messages": [{"role": "user", "content": "w " * int(3.95 * (1 << 20))}]}
        r = httpx.post(f"{s.gateway.url}/v1/chat/completions", json=huge, timeout=60)
        t.ok(r.status_code == 400 and "context" in r.text, f"huge prompt: HTTP {r.status_code} {r.text[:80]}")

        async def run() -> None:
            async with httpx.AsyncClient(base_url=s.gateway.url, timeout=60) as c:
                outcomes = await asyncio.gather(*(one_request(c, i, False) for i in range(200)))
            for o in outcomes:
                t.ok(o == "ok", o)
                t.lost += o != "ok"

        asyncio.run(run())
        t.counters_zero = s.counters_zero()
    return t


def fault_engine_stalls(n: int = 200) -> Tally:
    """A decode engine stops producing tokens after the first: of `n` concurrent streamed requests, those it took
    end with an SSE error once k x TPOT passes without a token, it is ejected, the others complete, and `n` more
    requests all complete elsewhere."""
    cfg = GatewayConfig(prefill_timeout_s={"m": 5.0}, token_timeout_s={"m": 0.5}, eject_s=3600)
    t = Tally("fault: decode engine stalls mid-answer")
    with stack(EngineTiming.constant(0.002, 0.001), config=cfg) as s:
        s.add("stall", "decode", EngineTiming.constant(0.0, 3600))

        async def wave(i0: int) -> list[str]:
            async def one(i: int) -> str:
                async with c.stream("POST", "/v1/chat/completions", json=chat(i, stream=True)) as r:
                    raw = (await r.aread()).decode()
                if r.status_code == 200 and raw.rstrip().endswith("data: [DONE]"):
                    return "ok"
                last = raw.rstrip().rpartition("data: ")[2]
                if r.status_code == 200 and "stall stalled mid-answer" in last and set(json.loads(last)["error"]) == ERROR_KEYS:
                    return "cut"
                return f"HTTP {r.status_code}: {raw[-100:]!r}"

            async with httpx.AsyncClient(base_url=s.gateway.url, timeout=60) as c:
                return await asyncio.gather(*(one(i0 + i) for i in range(n)))

        first, second = asyncio.run(wave(0)), asyncio.run(wave(n))
        for o in first:
            t.ok(o in ("ok", "cut"), o)
        for o in second:
            t.ok(o == "ok", f"after the ejection: {o}")
        t.lost = sum(o not in ("ok", "cut") for o in first + second)
        t.group += f" ({first.count('cut')} cut by the token timeout)"
        t.counters_zero = s.counters_zero()
    return t


def attack_slow_connections(n: int = 200) -> Tally:
    """`n` connections send half a request's headers (or a body that stalls) and wait: the gateway closes
    every one (header and body read timeouts) and serves ordinary requests meanwhile."""
    t = Tally(f"attack: {n} slow connections")
    app = create_gateway_app(Registry(), GatewayConfig(body_timeout_s=2.0), health_checks=False)
    srv = ServerThread(app, header_timeout_s=2.0).start()
    partial = [b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
               b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"]

    async def slow(k: int) -> bool:
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        writer.write(partial[k % 2])
        try:
            await asyncio.wait_for(reader.read(), 60)  # until the server closes
            return True
        except TimeoutError:
            return False
        finally:
            writer.close()

    async def run() -> None:
        results = await asyncio.gather(*(slow(k) for k in range(n)))
        for ok in results:
            t.ok(ok, "slow connection held open for 60 s")

    try:
        asyncio.run(run())
        t.ok(httpx.get(f"{srv.url}/health", timeout=10).status_code == 200, "health after slow connections")
    finally:
        srv.stop()
    return t


def attack_replan() -> Tally:
    """/replan with 100k-deep JSON, garbage, a plan with an injected id, and a chunked body past the limit:
    each a JSON 4xx naming the reason; and `coral deploy` of a plan with an injected id writes nothing."""
    from coral.deploy.render import render

    t = Tally("attack: /replan and deploy inputs")
    c = Controller(Store(Path(tempfile.mkdtemp()) / "s.sqlite"), EmulatedBackend(time_scale=0.0), Registry())
    app = create_gateway_app(Registry(), extra_routers=[controller_router(c, max_body_bytes=1 << 20)],
                             health_checks=False)
    srv = ServerThread(app).start()
    doc = make_plan([make_instance("phi-4", "decode", [(40, ["1xL40S"])], 100.0)]).model_dump(mode="json")
    doc["instances"][0]["id"] = "x\ntouch /tmp/pwned #"
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            bodies: list[bytes | Iterator[bytes]] = [b"[" * 100_000 + b"]" * 100_000, b"{garbage", json.dumps(doc).encode(),
                      (b" " * 65536 for _ in range(40))]
            for body in bodies:
                r = http.post("/replan", content=body)
                t.ok(400 <= r.status_code < 500 and openai_error(r), f"/replan: HTTP {r.status_code} {r.text[:80]}")
    finally:
        srv.stop()
    try:
        Plan.model_validate(doc)
        t.ok(False, "a plan with an injected id validated")
    except ValidationError:
        t.ok(True, "")
    plan = make_plan([make_instance("phi-4", "decode", [(40, ["1xL40S"])], 100.0)], scenario="core")
    plan.instances[0].id = doc["instances"][0]["id"]  # changed after validation: render checks again
    with tempfile.TemporaryDirectory() as tmp:
        try:
            render(plan, "commands", Path(tmp) / "out")
            t.ok(False, "deploy rendered a plan with an injected id")
        except CoralInputError:
            t.ok(not (Path(tmp) / "out").exists(), "deploy wrote files for a refused plan")
    return t


def fault_serve_killed() -> Tally:
    """`coral serve` (controller, gateway and emulated engines in one process) under live traffic: SIGKILL,
    restart on the same state file (it resumes: the plan is there, lost engines are started again), traffic
    again; then SIGTERM with a request that never finishes: it exits after its grace period. Requests in
    flight at the SIGKILL end with a connection error (counted as `cut`, never silently lost)."""
    t = Tally("fault: coral serve SIGKILLed under traffic, then SIGTERM")
    with tempfile.TemporaryDirectory() as tmp:
        plan = make_plan([make_instance("phi-4", "decode", [(40, ["1xL40S"])], 100.0, index=k) for k in range(2)])
        plan_path = plan.save(Path(tmp) / "plan.json")
        port = free_port()
        url = f"http://127.0.0.1:{port}"

        def start(scale: str) -> subprocess.Popen[bytes]:
            cmd = [sys.executable, "-m", "coral.cli.main", "serve", "core", "--plan", str(plan_path), "--port",
                   str(port), "--db", f"{tmp}/state.sqlite", "--time-scale", scale, "--grace", "2"]
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            ready = poll(lambda: httpx.get(f"{url}/health", timeout=1).json()["routable"] == 2, 600)
            t.ok(ready, "coral serve did not become ready")
            return proc

        body = {"model": "phi-4", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "stream": True}

        async def traffic(n: int, kill: subprocess.Popen[bytes] | None) -> None:
            async with httpx.AsyncClient(base_url=url, timeout=60) as c:

                async def one() -> None:
                    try:
                        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                            raw = await r.aread()
                        done = raw.rstrip().endswith(b"[DONE]")
                        t.ok(r.status_code == 200 and (done or (kill is not None and b'"error"' in raw)),
                             f"HTTP {r.status_code} {raw[-80:]!r}")
                    except httpx.HTTPError as exc:
                        t.ok(kill is not None, f"{type(exc).__name__} without a kill")
                        t.cut += 1

                tasks = [asyncio.create_task(one()) for _ in range(n)]
                if kill is not None:
                    await asyncio.sleep(0.5)
                    kill.kill()
                await asyncio.gather(*tasks)

        first = start("0.01")
        asyncio.run(traffic(100, first))
        first.wait(30)
        second = start("0.01")
        asyncio.run(traffic(100, None))
        state = httpx.get(f"{url}/state", timeout=10)
        t.ok(state.status_code == 200 and state.json()["plan"] is not None, f"/state HTTP {state.status_code}")
        def stuck_request() -> None:
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": False, "max_tokens": 100_000},
                           timeout=120)

        threading.Thread(target=stuck_request, daemon=True).start()
        time.sleep(1.0)
        second.send_signal(signal.SIGTERM)
        try:
            second.wait(60)
            t.ok(True, "")
        except subprocess.TimeoutExpired:
            second.kill()
            t.ok(False, "coral serve alive 60 s after SIGTERM")
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
        tallies += [fault_engine_killed(True, process=True), fault_engine_killed(False, process=True)]
        tallies += [fault_controller(f) for f in (None, "readonly", "missing", "corrupt")]
        tallies += [attack_access(), attack_metrics(), attack_huge_prompt(), fault_engine_stalls(),
                    attack_slow_connections(),
                    attack_replan(), fault_serve_killed()]

    table = Table(
        "cases",
        "tried",
        "handled",
        "of which 429/503",
        "failed",
        "requests lost",
        "cut by SIGKILL",
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
            str(t.cut),
            zero,
        )
    console = table_console()
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
