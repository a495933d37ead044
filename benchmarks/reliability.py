"""Reliability of the gateway, the controller and the input files, measured: fuzzing, load and injected faults.

Everything runs on loopback, bounded in count and time. Engines are emulated as the simulator times them at
time scale 1 (the node kernels of phi-4 and llama-3-8b on one L40S, llama-3-8b at phi-4's SLOs in core: ~42 / ~23 ms
to the first token of a short prompt and between tokens, at most 25 / 98 sequences decoding per engine), and the load-bearing cases run a mix of 200 concurrent clients (streamed and non-streamed, two models,
one of them prefill/decode-disaggregated). Each request or check ends in one outcome, counted strictly:

- ok: a complete answer (a JSON completion, or a stream ending with `data: [DONE]`) or a passed check;
- expected: an error the case itself names as its outcome (a 4xx in OpenAI's shape for fuzzed input, the SSE
  error event of a stream whose engine was killed, `/replan`'s 503 `state_unwritable` while the state file is
  read-only, the connection cut of a request in flight when its process is SIGKILLed);
- failed: anything else, including every 5xx the case does not name (a 503 or 429 with Retry-After too);
- lost (of the failed): accepted but never answered (connection error, timeout, a stream cut without an error
  event).

It also checks that the in-flight counters (per instance, admission slots, queue) return to zero. The read-only
state file is a real fault root cannot bypass: the file, its WAL and its folder get the immutable attribute
(`chattr +i`, FS_IMMUTABLE_FL; needs CAP_LINUX_IMMUTABLE and ext4/xfs/btrfs). Writes then fail with EPERM for
every user, reads go on. Writes the table's rows to out/benchmarks/reliability.json.

    .venv/bin/python benchmarks/reliability.py [--clients 50,200,1000] [--seed 0] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from _console import stamped_json, table_console  # benchmarks/_console.py
from pydantic import ValidationError
from rich.table import Table

from coral.allocation.plan import Plan, PlanInstance
from coral.catalog.loader import CoralInputError, builtin_catalog, data_path, load_scenario
from coral.catalog.schema import MAX_RUN_REQUESTS, Scenario
from coral.deploy.endpoints import EndpointsFile, EndpointSpec
from coral.http_serving import ServerThread, free_port
from coral.perf.roofline import RooflineModel
from coral.runtime.backends import EmulatedBackend
from coral.runtime.controller import Controller, Store, controller_router
from coral.runtime.emulated import EngineTiming, create_engine_app, instance_engine_app
from coral.runtime.gateway import GatewayConfig, create_gateway_app, load_secrets
from coral.runtime.handmade import make_instance, make_plan
from coral.runtime.registry import Endpoint, InstanceState, Registry
from coral.simulation.kernels import KernelCache

OUT = Path("out/benchmarks/reliability.json")
ERROR_KEYS = {"message", "type", "param", "code"}
TIME_SCALE = 1.0
"""The emulated engines sleep the perf model's step times unscaled."""
MODELS = ("phi-4", "llama-3-8b")
STARTUP_S = 60.0
"""Deadline for a server to start on an idle machine; `startup_s()` stretches it with the load."""
IMMUTABLE = "chattr +i on the state file, its WAL and its folder (FS_IMMUTABLE_FL: binds root too)"


def startup_s() -> float:
    """`STARTUP_S` times the run queue per core when that is above 1 (a loaded machine starts servers slower)."""
    return STARTUP_S * max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


@dataclass
class Case:
    """The outcomes of one case. `expects` names the errors this case produces on purpose (prefixes of
    outcomes); every other outcome but "ok" is a failure."""

    name: str
    expects: tuple[str, ...] = ()
    ok: int = 0
    expected: int = 0
    failed: int = 0
    lost: int = 0
    counters_zero: bool | None = None
    seconds: float = 0.0
    named: Counter[str] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)

    @property
    def tried(self) -> int:
        return self.ok + self.expected + self.failed

    def count(self, outcome: str) -> None:
        """One request's outcome: "ok", an expected error, or a failure ("lost: ..." also counts as lost)."""
        if outcome == "ok":
            self.ok += 1
        elif outcome.startswith(self.expects) and self.expects:
            self.expected += 1
            self.named[outcome[:90]] += 1
        else:
            self.failed += 1
            self.lost += outcome.startswith("lost: ")
            self.failures[outcome[:160]] += 1

    def check(self, good: bool, what: str) -> None:
        """A check that is not a request (state answered, loop alive, nothing written, ...)."""
        self.count("ok" if good else f"check: {what}")

    def row(self) -> dict[str, Any]:
        return {"case": self.name, "tried": self.tried, "ok": self.ok, "expected": self.expected,
                "failed": self.failed, "lost": self.lost, "counters_zero": self.counters_zero,
                "seconds": round(self.seconds, 1),
                "expects": list(self.expects), "expected_outcomes": dict(self.named),
                "failures": dict(self.failures)}


# --- outcomes -------------------------------------------------------------------------------------------
def openai_error(r: httpx.Response) -> bool:
    return error_of(r.content) is not None


def error_of(raw: bytes | str) -> dict[str, Any] | None:
    """The `error` object of an answer in OpenAI's shape (exactly its four keys), else None."""
    try:
        err = json.loads(raw)["error"]
    except (ValueError, KeyError, TypeError):
        return None
    ok = isinstance(err, dict) and set(err) == ERROR_KEYS and isinstance(err["message"], str)
    return err if ok else None


def outcome_of(status: int, headers: httpx.Headers, raw: bytes, stream: bool) -> str:
    """What a client got: "ok", "4xx CODE", "SSE error: ...", "STATUS CODE[ + Retry-After]", "lost: ..."."""
    if status == 200 and stream:
        text = raw.decode(errors="replace").rstrip()
        if text.endswith("data: [DONE]"):
            return "ok"
        err = error_of(text.rpartition("data: ")[2])
        if err is None:
            return f"lost: stream cut without an error event ({text[-60:]!r})"
        message = err["message"]
        for kind in ("stalled mid-answer", "failed mid-stream"):
            if kind in message:
                return f"SSE error: {kind}"
        return f"SSE error: {message[:80]}"
    if status == 200:
        try:
            body = json.loads(raw)["choices"][0]
            text = body["message"]["content"] if "message" in body else body["text"]
        except (ValueError, KeyError, TypeError, IndexError):
            return f"200 with a broken body {raw[:60]!r}"
        return "ok" if isinstance(text, str) and text else "200 with an empty answer"
    err = error_of(raw)
    if err is None:
        return f"{status} not in OpenAI's error shape {raw[:60]!r}"
    code = err["code"] or err["type"]
    if 400 <= status < 500:
        return f"4xx {status} {code}"
    return f"{status} {code}" + (" + Retry-After" if "retry-after" in headers else "") + f": {err['message'][:80]}"


async def send(c: httpx.AsyncClient, body: dict[str, Any], path: str = "/v1/chat/completions") -> str:
    """POST `body` and read the whole answer: its outcome."""
    try:
        async with c.stream("POST", path, json=body) as r:
            raw = await r.aread()
    except httpx.HTTPError as exc:
        return f"lost: {type(exc).__name__}"
    return outcome_of(r.status_code, r.headers, raw, bool(body.get("stream")))


# --- the engines and the traffic mix --------------------------------------------------------------------
def fleet() -> list[PlanInstance]:
    """phi-4 disaggregated (a prefill and two decode instances) and llama-3-8b (two decode instances), each on
    one L40S."""
    phi = [make_instance("phi-4", "prefill", [(40, ["1xL40S"])], 6000.0, template_id=1)]
    phi += [make_instance("phi-4", "decode", [(40, ["1xL40S"])], 500.0, template_id=2, index=k) for k in range(2)]
    llama = [make_instance("llama-3-8b", "decode", [(32, ["1xL40S"])], 800.0, template_id=3, index=k)
             for k in range(2)]
    return phi + llama


def engine_scenario() -> Scenario:
    """What times the emulated engines: core, with llama-3-8b served at phi-4's SLOs and request sizes."""
    core = load_scenario("core")
    phi = next(m for m in core.models if m.model == "phi-4")
    return core.model_copy(update={"models": [*core.models, phi.model_copy(update={"model": "llama-3-8b"})]})


def engine_kernels() -> KernelCache:
    return KernelCache(engine_scenario(), builtin_catalog(), RooflineModel())


VICTIM = fleet()[1].id
"""The phi-4 decode instance the fault cases kill or stall."""


def chat(i: int = 0, n: int = 4, stream: bool = False, model: str = "phi-4") -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": f"q {i}"}], "max_tokens": n, "stream": stream}


def mix_body(k: int, j: int, models: Sequence[str], stream: bool | None = None) -> dict[str, Any]:
    """Request `j` of client `k`: models in turn, streamed every other one (unless `stream`), 8-32 tokens out,
    prompts of 3-52 words."""
    words = " ".join(["word"] * (k % 50))
    body = chat(k * 100 + j, 8 + (7 * k + 3 * j) % 25, (k + j) % 2 == 0 if stream is None else stream,
                models[(k // 2 + j) % len(models)])
    body["messages"][0]["content"] += f" from client {k} {words}"
    return body


async def run_mix(
    url: str,
    case: Case,
    clients: int,
    per_client: int,
    models: Sequence[str] = MODELS,
    stream: bool | None = None,
    during: Callable[[], Awaitable[None]] | None = None,
    relabel: Callable[[str], str] = lambda o: o,
) -> None:
    """`clients` concurrent clients sending `per_client` requests each, one after another; `during` runs
    meanwhile (a fault); each outcome passes `relabel` before it is counted."""
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as c:

        async def client(k: int) -> None:
            for j in range(per_client):
                case.count(relabel(await send(c, mix_body(k, j, models, stream))))

        tasks = asyncio.gather(*(client(k) for k in range(clients)))
        if during is not None:
            await during()
        await tasks


def mix(url: str, case: Case, clients: int = 200, per_client: int = 1, **kw: Any) -> None:
    asyncio.run(run_mix(url, case, clients, per_client, **kw))


class Stack:
    """The fleet's emulated engines (perf-model latency; the `processes` ids in processes of their own) and a
    gateway on loopback."""

    def __init__(self, config: GatewayConfig | None = None, processes: Sequence[str] = ()) -> None:
        self.registry = Registry()
        self.engines: dict[str, ServerThread] = {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        # health probes on, as deployed: they bring back instances that passive checks took out under overload
        app = create_gateway_app(self.registry, config or GatewayConfig(), health_checks=True)
        self.gateway = ServerThread(app).start(startup_s())
        self.gw = app.state.gateway
        kernels = engine_kernels()
        for inst in fleet():
            if inst.id in processes:
                self.procs[inst.id], url = engine_process(inst)
                self.registry.add(Endpoint(inst.id, inst.model, inst.phase, url, inst.throughput, InstanceState.READY))
            else:
                self.add(inst.id, inst.model, inst.phase, instance_engine_app(inst, TIME_SCALE, kernels),
                         inst.throughput)

    def add(self, iid: str, model: str, phase: str, app: Any, weight: float = 1.0) -> None:
        srv = self.engines[iid] = ServerThread(app).start(startup_s())
        self.registry.add(Endpoint(iid, model, phase, srv.url, weight, InstanceState.READY))

    def counters_zero(self, timeout_s: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.gw.active == 0 and self.gw.waiting == 0 and all(e.inflight == 0 for e in self.registry.all()):
                return True
            time.sleep(0.02)
        return False

    def close(self) -> None:
        for s in [self.gateway, *self.engines.values()]:
            s.stop()
        for p in self.procs.values():
            p.kill()
            p.wait(10)


@contextmanager
def stack(**kw: Any) -> Iterator[Stack]:
    s = Stack(**kw)
    try:
        yield s
    finally:
        s.close()


ENGINE_PROCESS = (
    "import sys, uvicorn\n"
    "from coral.allocation.plan import PlanInstance\n"
    "from coral.catalog.loader import builtin_catalog\n"
    "from coral.catalog.schema import Scenario\n"
    "from coral.perf.roofline import RooflineModel\n"
    "from coral.runtime.emulated import instance_engine_app\n"
    "from coral.simulation.kernels import KernelCache\n"
    "kernels = KernelCache(Scenario.model_validate_json(sys.argv[4]), builtin_catalog(), RooflineModel())\n"
    "app = instance_engine_app(PlanInstance.model_validate_json(sys.argv[1]), float(sys.argv[3]), kernels)\n"
    "uvicorn.run(app, host='127.0.0.1', port=int(sys.argv[2]), log_level='warning')\n"
)


def engine_process(inst: PlanInstance) -> tuple[subprocess.Popen[bytes], str]:
    """The emulated engine of `inst` in a process of its own, healthy; (process, URL)."""
    port = free_port()
    cmd = [sys.executable, "-c", ENGINE_PROCESS, inst.model_dump_json(), str(port), str(TIME_SCALE),
           engine_scenario().model_dump_json()]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    if not poll(lambda: httpx.get(f"{url}/health", timeout=1).status_code == 200, startup_s()):
        proc.kill()
        raise RuntimeError(f"engine process {inst.id} did not start within {startup_s():.0f} s")
    return proc, url


def poll(check: Callable[[], bool], timeout_s: float, every_s: float = 0.1) -> bool:
    """`check` until true or `timeout_s` passed (connection errors count as false)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, OSError, KeyError, ValueError):
            if check():
                return True
        time.sleep(every_s)
    return False


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
        ("lone surrogate", b'{"model": "phi-4", "messages": [{"role": "user", "content": "a\\ud800b"}]}'),
        ("surrogate model", b'{"model": "\\udfff", "prompt": "x"}'),
        ("nan", b'{"model": "phi-4", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}'),
        ("huge body 20 MB", json.dumps({**good, "pad": "x" * (20 << 20)}).encode()),
        ("big prompt 4 MB", json.dumps(chat() | {"messages": [{"role": "user", "content": "w " * (2 << 20)}]}).encode()),
    ]
    wrong = [None, 0, -1, 1.5, "7", True, [], {}, [1, "a"], "\u202e\u0000\ud83d"]
    for key in ("model", "messages", "max_tokens", "max_completion_tokens", "stream", "temperature", "top_p", "n",
                "stream_options", "min_tokens", "stop", "seed"):
        for v in wrong:
            try:
                raw = json.dumps({**good, key: v}).encode()
            except UnicodeEncodeError:
                continue
            cases.append((f"{key}={v!r}", raw))
    for text in ("héllo wörld", "数据中心", "🙂" * 1000, "\u202eRTL", "a\u0000b", "\\ud800", "\r\n\r\n"):
        cases.append((f"unicode {text[:8]!r}", json.dumps(chat() | {"messages": [{"role": "user", "content": text}]}).encode()))
    for k in range(60):  # random bytes and random JSON objects
        cases.append((f"random bytes {k}", rng.randbytes(rng.randint(1, 400))))
        obj = {rng.choice(["model", "messages", "prompt", "max_tokens", "stream", "x"]): rng.choice([*wrong, "phi-4"])
               for _ in range(rng.randint(0, 5))}
        cases.append((f"random json {k}", json.dumps(obj).encode()))
    return cases


def streamed(raw: bytes) -> bool:
    """Whether a fuzzed body asks for a stream (as `json.dumps` writes it; not parsed: some are 100k deep)."""
    return b'"stream": true' in raw


def fuzz_gateway(rng: random.Random) -> Case:
    """Fuzzed bodies on both completion paths (16 at a time) and wrong methods and paths: each a complete answer
    or a 4xx in OpenAI's shape."""
    t = Case("fuzz: gateway requests", expects=("4xx ",))
    with stack() as s:

        async def run() -> None:
            gate = asyncio.Semaphore(16)
            async with httpx.AsyncClient(base_url=s.gateway.url, timeout=60) as c:

                async def one(name: str, path: str, raw: bytes) -> None:
                    async with gate:
                        try:
                            r = await c.post(path, content=raw, headers={"Content-Type": "application/json"})
                            o = outcome_of(r.status_code, r.headers, r.content, streamed(raw))
                        except httpx.HTTPError as exc:
                            o = f"lost: {type(exc).__name__}"
                    t.count(o if o == "ok" or o.startswith("4xx ") else f"{o} ({name} {path})")

                await asyncio.gather(*(one(name, path, raw) for name, raw in gateway_cases(rng)
                                       for path in ("/v1/chat/completions", "/v1/completions")))
                for method, path in [("GET", "/v1/nope"), ("DELETE", "/v1/models"), ("POST", "/v1/embeddings"),
                                     ("GET", "/v1/models/%F0%9F%99%82"), ("PUT", "/v1/chat/completions")]:
                    r = await c.request(method, path)
                    t.count(outcome_of(r.status_code, r.headers, r.content, False) if r.status_code != 200
                            else f"{method} {path}: 200")

        asyncio.run(run())
        t.counters_zero = s.counters_zero()
    return t


# --- fuzzing the input files ----------------------------------------------------------------------------
def file_cases(valid: dict[str, Any], suffix: str, rng: random.Random) -> list[tuple[str, str | bytes | None]]:
    """(name, content) variants of a valid document; None = the file is missing."""
    dump = (lambda d: json.dumps(d)) if suffix == ".json" else (lambda d: yaml.safe_dump(d, allow_unicode=True))
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
        ("huge", text + ("\n#" + "x" * (8 << 20) if suffix != ".json" else "")),
        ("unicode keys", dump({**valid, "名前🙂": "值"})),
    ]
    for key in valid:
        for v in (None, -1, "x", [], {}, True, "🙂\u202e", 1e308):
            cases.append((f"{key}={v!r}", dump({**valid, key: v})))
        if suffix == ".json":  # numbers Python's json reads and no JSON writer writes back
            for raw in ("1e400", "NaN", "-Infinity"):
                cases.append((f"{key}={raw}", dump({**valid, key: "@@"}).replace('"@@"', raw)))
    return cases


def fuzz_files(rng: random.Random) -> Case:
    """Broken scenario, plan, endpoints and key files, numbers that are not finite among them, and paths that are
    no regular file (a FIFO nobody writes, /dev/zero, a 2 GB sparse file): each loads, or is refused at once with
    CoralInputError naming the file (the named outcome)."""
    t = Case("fuzz: input files", expects=("CoralInputError naming the file",))
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
        fifo = Path(tmp) / "nobody-writes.fifo"
        os.mkfifo(fifo)  # read, it would block forever
        sparse = Path(tmp) / "sparse.json"
        with sparse.open("wb") as f:
            f.truncate(2 << 30)  # 2 GB of nothing: read, it would fill memory
        not_files: list[tuple[str, Path | str | bytes | None]] = [
            ("a FIFO", fifo), ("/dev/zero", Path("/dev/zero")), ("a 2 GB sparse file", sparse)]
        for kind, valid, suffix, load in loaders:
            for k, (name, content) in enumerate([*file_cases(valid, suffix, rng), *not_files]):
                path = Path(tmp) / f"{kind.replace(' ', '_')}-{k}{suffix}"
                if isinstance(content, Path):
                    path = content
                elif isinstance(content, bytes):
                    path.write_bytes(content)
                elif content is not None:
                    path.write_text(content)
                try:
                    load(path)
                    t.count("ok")
                except CoralInputError as exc:  # a scenario named by path is refused naming its name
                    named = str(path) in str(exc) or (kind == "scenario" and path.stem in str(exc))
                    t.count("CoralInputError naming the file" if named else f"{kind} {name}: message lacks the file")
                except Exception as exc:
                    t.count(f"{kind} {name}: {type(exc).__name__}: {str(exc)[:80]}")
    return t


# --- load -----------------------------------------------------------------------------------------------
def load_test(clients: int, per_client: int) -> Case:
    """`clients` concurrent clients of the mix, `per_client` requests each: every one a complete answer."""
    t = Case(f"load: {clients} clients, mixed")
    with stack(config=GatewayConfig(max_concurrency=256, max_waiting=4096)) as s:
        mix(s.gateway.url, t, clients, per_client)
        t.counters_zero = s.counters_zero()
    return t


# --- faults ---------------------------------------------------------------------------------------------
def fault_engine_killed(process: bool) -> Case:
    """A phi-4 decode engine crashes under the 200-client mix (`process`: its own process, SIGKILLed; else its
    server thread drops its connections): requests it had not started answering are retried on the other decode
    engine; streams it had started end with an SSE error event (the named outcome)."""
    how = "process SIGKILLed" if process else "server dropped"
    t = Case(f"fault: engine {how} under the mix", expects=("SSE error: failed mid-stream",))
    with stack(processes=[VICTIM] if process else ()) as s:

        async def kill() -> None:  # once 20 requests are on the victim (or 30 s passed)
            deadline = time.monotonic() + 30
            while (victim := s.registry.get(VICTIM)) and victim.inflight < 20 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            t.name += f" ({victim.inflight if victim else 0} in flight on it)"
            if process:
                os.kill(s.procs[VICTIM].pid, signal.SIGKILL)
            else:
                await asyncio.to_thread(s.engines[VICTIM].stop, True)

        mix(s.gateway.url, t, 200, 2, during=kill)
        t.counters_zero = s.counters_zero()
    return t


def engines_idle(urls: Sequence[str]) -> bool:
    """Every engine's /health reports no sequence in flight."""
    return all(httpx.get(f"{u}/health", timeout=5).json()["active"] == 0 for u in urls)


def fault_client_disconnect(n: int = 200) -> Case:
    """`n` clients ask for 200-token streams and leave after the first chunk: the gateway's and the engines'
    in-flight counts return to zero (the engines stop generating)."""
    t = Case(f"fault: {n} clients leave mid-stream")
    with stack() as s:

        async def run() -> None:
            limits = httpx.Limits(max_connections=n)
            async with httpx.AsyncClient(base_url=s.gateway.url, timeout=60, limits=limits) as c:

                async def req(k: int) -> None:
                    body = {**mix_body(k, 0, MODELS, stream=True), "max_tokens": 200}
                    try:
                        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                            async for _ in r.aiter_raw():
                                break  # leave after the first chunk: the connection closes
                        t.count("ok" if r.status_code == 200 else f"HTTP {r.status_code}")
                    except httpx.HTTPError as exc:
                        t.count(f"lost: {type(exc).__name__}")

                await asyncio.gather(*(req(k) for k in range(n)))

        asyncio.run(run())
        t.counters_zero = s.counters_zero(timeout_s=20)
        t.check(poll(lambda: engines_idle([e.url for e in s.engines.values()]), 20), "engines still generating")
    return t


def fault_engine_stalls(n: int = 200) -> Case:
    """A phi-4 decode engine stops producing tokens after the first: of `n` concurrent streams (both models), those
    it took end with an SSE error once the token timeout passes without a token (the named outcome), it is
    ejected, the others complete, and `n` more streams all complete elsewhere."""
    cfg = GatewayConfig(prefill_timeout_s={m: 10.0 for m in MODELS}, token_timeout_s={m: 2.0 for m in MODELS},
                        eject_s=3600)
    t = Case("fault: decode engine stalls mid-answer", expects=("SSE error: stalled mid-answer",))
    with stack(config=cfg) as s:
        stall = create_engine_app("stall", "phi-4", "decode", EngineTiming.constant(0.0, 3600))
        s.add("stall", "phi-4", "decode", stall, fleet()[1].throughput)  # as much traffic as its peers
        mix(s.gateway.url, t, n, stream=True)
        mix(s.gateway.url, t, n, stream=True, relabel=lambda o: o if o == "ok" else f"after the ejection: {o}")
        t.counters_zero = s.counters_zero()
    return t


def chattr(flag: str, paths: Sequence[Path]) -> str:
    """`chattr flag paths`: '' when done, else why not."""
    try:
        r = subprocess.run(["chattr", flag, *map(str, paths)], capture_output=True, text=True, timeout=30)
    except OSError as exc:
        return f"chattr: {exc}"
    return "" if r.returncode == 0 else r.stderr.strip() or f"chattr exited {r.returncode}"


def routable(registry: Registry) -> int:
    return sum(e.routable for e in registry.all())


def fault_controller(db_fault: str | None) -> Case:
    """The fleet under a controller (perf-model engines), the 200-client mix before, during and after a fault:

    - None / "corrupt": the controller dies (thread stopped, nothing drained) and a new one resumes from SQLite
      while the gateway serves; "corrupt" overwrites the file with garbage first (kept aside, started fresh);
    - "missing": the file is deleted under it: the loop goes on, `/state` and `/replan` answer 200;
    - "readonly": the file, its WAL and its folder become immutable (`chattr +i`; the -shm file stays writable:
      SQLite maps it and a write to an immutable mapping is SIGBUS). Writes fail with EPERM even for root: the
      loop keeps running and reports the error in `/state`'s last_error, `/replan` answers 503
      `state_unwritable` naming the file (the named outcome), an engine that dies meanwhile leaves the gateway
      at once, and once the attribute is lifted the controller recovers on its own (error cleared, the dead
      engine restarted, `/replan` 200)."""
    name = {
        None: "controller stopped and restarted",
        "readonly": "state file read-only (chattr +i)",
        "missing": "state file deleted",
        "corrupt": "state file overwritten with garbage",
    }
    t = Case(f"fault: {name[db_fault]}", expects=("503 state_unwritable",) if db_fault == "readonly" else ())
    plan = make_plan(fleet())
    backend = EmulatedBackend(time_scale=TIME_SCALE, scenario=engine_scenario())
    registry = Registry()
    admin = {"Authorization": "bearer " + "x" * 16}  # the scheme in lower case
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "state.sqlite"
        c1 = Controller(Store(db), backend, registry, lambda: plan, interval_s=0.2, ready_timeout_s=startup_s())
        c1.set_plan(plan)
        c1.reconcile()
        app = create_gateway_app(registry, extra_routers=[controller_router(c1, admin_token="x" * 16)],
                                 health_checks=False)
        gw = ServerThread(app).start(startup_s())
        c1.start()
        try:
            with httpx.Client(base_url=gw.url, timeout=30) as http:

                def replan() -> str:
                    r = http.post("/replan", content=plan.model_dump_json(), headers=admin)
                    return "ok" if r.status_code == 200 else outcome_of(r.status_code, r.headers, r.content, False)

                t.check(poll(lambda: routable(registry) == len(plan.instances), startup_s()), "fleet not up")
                mix(gw.url, t)
                if db_fault in (None, "corrupt"):
                    c1.stop()
                    c1.store.close()
                    mix(gw.url, t)  # no controller: the gateway goes on with what is registered
                    if db_fault == "corrupt":  # what a crash mid-write or a bad copy leaves
                        db.write_bytes(b"garbage, not sqlite " * 200)
                        for side in ("-wal", "-shm"):
                            Path(f"{db}{side}").unlink(missing_ok=True)
                    store = Store(db)
                    t.check((db_fault == "corrupt") == ("kept as" in store.notice), f"store notice {store.notice!r}")
                    c2 = Controller(store, backend, registry, lambda: plan, interval_s=0.2, ready_timeout_s=startup_s())
                    started = c2.reconcile()["started"]
                    t.check(started == [] and backend.starts == len(plan.instances), f"restart re-started {started}")
                    c2.start()
                    mix(gw.url, t)
                    c2.stop()
                elif db_fault == "missing":
                    for f in (db, Path(f"{db}-wal"), Path(f"{db}-shm")):
                        f.unlink(missing_ok=True)
                    c1.trigger()
                    time.sleep(0.6)
                    mix(gw.url, t)
                    state = http.get("/state")
                    alive = c1._thread is not None and c1._thread.is_alive()
                    t.check(state.status_code == 200 and alive, f"controller loop died / state HTTP {state.status_code}")
                    t.count(replan())
                    c1.stop()
                else:
                    frozen = [db, Path(f"{db}-wal"), db.parent]
                    why = chattr("+i", frozen)
                    t.check(not why, f"chattr +i refused ({why}): the read-only fault was not injected")
                    try:
                        c1.trigger()
                        t.check(poll(lambda: "OperationalError" in c1.last_error, 10),
                                f"no write error reported: last_error={c1.last_error!r}")
                        state = http.get("/state")
                        t.check(state.status_code == 200 and "OperationalError" in state.json()["last_error"],
                                f"/state HTTP {state.status_code} without the error")
                        backend.kill(VICTIM)  # an engine dies while nothing can be written
                        t.check(poll(lambda: not (ep := registry.get(VICTIM)) or not ep.routable, 10),
                                "a dead engine still routed while the state is read-only")
                        mix(gw.url, t)
                        t.count(replan())
                    finally:
                        why = chattr("-i", frozen)
                    t.check(not why, f"chattr -i refused: {why}")
                    c1.trigger()
                    recovered = poll(lambda: not c1.last_error and routable(registry) == len(plan.instances), startup_s())
                    t.check(recovered, f"not recovered after the fault: last_error={c1.last_error!r}, "
                                       f"{routable(registry)} routable")
                    t.count(replan())
                    mix(gw.url, t)
                    c1.stop()
        finally:
            gw.stop()
            backend.close()
        t.counters_zero = all(e.inflight == 0 for e in registry.all())
    return t


# --- the attacks of issue 20 -----------------------------------------------------------------------------
KEY, READ_TOKEN = "sk-reliability-key-01", "read-only-token-0002"


def attack_access() -> Case:
    """With API keys set, every endpoint but /health refuses a request without a key (JSON 401, the named
    outcome), the read-only token reads the views only, `Bearer` is taken in any case, and engines refuse
    requests without the gateway's token."""
    t = Case("attack: endpoints without a key", expects=("4xx 401",))
    cfg = GatewayConfig(upstream_api_key="engine-token-0003").with_api_keys([KEY]).with_tokens(read=[READ_TOKEN])
    with stack(config=cfg) as s, httpx.Client(base_url=s.gateway.url, timeout=30) as c:
        guarded = create_engine_app("g", "phi-4", "decode", EngineTiming.constant(), api_key="engine-token-0003")
        srv = ServerThread(guarded).start(startup_s())
        try:
            for path in ("/state", "/gateway/state", "/metrics", "/docs", "/openapi.json", "/v1/models"):
                r = c.get(path)
                t.count(f"GET {path} without a key: " + outcome_of(r.status_code, r.headers, r.content, False)
                        if r.status_code != 401 else outcome_of(r.status_code, r.headers, r.content, False))
            for scheme in ("Bearer", "bearer", "BEARER"):
                r = c.get("/metrics", headers={"Authorization": f"{scheme} {READ_TOKEN}"})
                t.check(r.status_code == 200, f"/metrics with {scheme} read token: HTTP {r.status_code}")
            r = c.post("/v1/chat/completions", json=chat(), headers={"Authorization": f"Bearer {READ_TOKEN}"})
            t.count(outcome_of(r.status_code, r.headers, r.content, False) if r.status_code == 401
                    else f"completion with the read token: HTTP {r.status_code}")
            r = httpx.post(f"{srv.url}/v1/completions", json={"model": "phi-4", "prompt": "x"}, timeout=30)
            t.count(outcome_of(r.status_code, r.headers, r.content, False) if r.status_code == 401
                    else f"engine without the gateway's token: HTTP {r.status_code}")
        finally:
            srv.stop()
    return t


def attack_metrics() -> Case:
    """A lone surrogate and 2,000 unknown 4 KB model names (4xx, the named outcome): /metrics stays 200 and does
    not grow."""
    t = Case("attack: /metrics label flood", expects=("4xx 400", "4xx 404 model_not_found"))
    with stack() as s, httpx.Client(base_url=s.gateway.url, timeout=30) as c:
        r = c.post("/v1/chat/completions", content=b'{"model": "\\ud800", "messages": [{"role": "user", "content": "x"}]}')
        t.count(outcome_of(r.status_code, r.headers, r.content, False))
        before = len(c.get("/metrics").content)
        for i in range(2000):
            r = c.post("/v1/chat/completions", json={**chat(), "model": f"{i}" + "x" * 4096})
            t.count(outcome_of(r.status_code, r.headers, r.content, False))
        after = c.get("/metrics")
        t.check(after.status_code == 200 and len(after.content) < before + 1000,
                f"/metrics HTTP {after.status_code}, {before} -> {len(after.content)} bytes")
    return t


def attack_huge_prompt() -> Case:
    """A 7.9 MiB prompt is refused before routing (400 over the context, the named outcome), and the 200-client
    mix right after all completes."""
    t = Case("attack: 7.9 MiB prompt", expects=("4xx 400 context_length_exceeded",))
    with stack() as s:
        huge = {**chat(), "messages": [{"role": "user", "content": "w " * int(3.95 * (1 << 20))}]}
        r = httpx.post(f"{s.gateway.url}/v1/chat/completions", json=huge, timeout=60)
        t.count(outcome_of(r.status_code, r.headers, r.content, False))
        mix(s.gateway.url, t)
        t.counters_zero = s.counters_zero()
    return t


def attack_slow_connections(n: int = 200) -> Case:
    """`n` connections send half a request's headers (or a body that stalls) and wait: the gateway closes
    every one (header and body read timeouts) and serves meanwhile."""
    t = Case(f"attack: {n} slow connections")
    app = create_gateway_app(Registry(), GatewayConfig(body_timeout_s=2.0), health_checks=False)
    srv = ServerThread(app, header_timeout_s=2.0).start(startup_s())
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
        for ok in await asyncio.gather(*(slow(k) for k in range(n))):
            t.check(ok, "slow connection held open for 60 s")

    try:
        asyncio.run(run())
        t.check(httpx.get(f"{srv.url}/health", timeout=10).status_code == 200, "health after slow connections")
    finally:
        srv.stop()
    return t


def attack_replan() -> Case:
    """/replan with 100k-deep JSON, garbage, a plan with an injected id, a chunked body past the limit, and plans
    with numbers that are not finite or out of range or a class name with a line break (then /state answers 200):
    each a JSON 4xx naming the reason (the named outcome); and `coral deploy` of a plan with an injected id
    writes nothing."""
    from coral.deploy.render import render

    t = Case("attack: /replan and deploy inputs", expects=("4xx ",))
    c = Controller(Store(Path(tempfile.mkdtemp()) / "s.sqlite"), EmulatedBackend(time_scale=0.0), Registry())
    app = create_gateway_app(Registry(), extra_routers=[controller_router(c, max_body_bytes=1 << 20)],
                             health_checks=False)
    srv = ServerThread(app).start(startup_s())
    doc = make_plan([make_instance("phi-4", "decode", [(40, ["1xL40S"])], 100.0)]).model_dump(mode="json")
    doc["instances"][0]["id"] = "x\ntouch /tmp/pwned #"
    unfinite = [json.dumps({**doc, "instances": [{**doc["instances"][0], "id": "phi-4.decode.0", **change}]})
                .replace('"@@"', raw).encode() for raw, change in (
                    ("1e400", {"throughput": "@@"}), ("Infinity", {"throughput": "@@"}),
                    ("0", {"template_id": -1, "throughput": 1e308}), ("0", {"class_throughput": {"a\nb": 1.0}}))]
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            bodies: list[bytes | Iterator[bytes]] = [b"[" * 100_000 + b"]" * 100_000, b"{garbage",
                                                     json.dumps(doc).encode(), (b" " * 65536 for _ in range(40)),
                                                     *unfinite]
            for body in bodies:
                r = http.post("/replan", content=body)
                t.count(outcome_of(r.status_code, r.headers, r.content, False))
            state = http.get("/state")  # what a stored infinity once broke
            t.check(state.status_code == 200, f"/state answered {state.status_code} after the refused plans")
    finally:
        srv.stop()
    try:
        Plan.model_validate(doc)
        t.check(False, "a plan with an injected id validated")
    except ValidationError:
        t.check(True, "")
    plan = make_plan([make_instance("phi-4", "decode", [(40, ["1xL40S"])], 100.0)], scenario="core")
    plan.instances[0].id = doc["instances"][0]["id"]  # changed after validation: render checks again
    with tempfile.TemporaryDirectory() as tmp:
        try:
            render(plan, "commands", Path(tmp) / "out")
            t.check(False, "deploy rendered a plan with an injected id")
        except CoralInputError:
            t.check(not (Path(tmp) / "out").exists(), "deploy wrote files for a refused plan")
    return t


def fault_serve_killed() -> Case:
    """`coral serve` (controller, gateway and perf-model engines at time scale 1 in one process) under the
    200-client mix: SIGKILL; every request in flight then ends with a connection error (the named outcome: the
    client knows); restart on the same state file (it resumes: the plan is there, lost engines are started
    again), the mix again, all answered; then SIGTERM with a request that never finishes: it exits after its
    grace period."""
    t = Case("fault: coral serve SIGKILLed under the mix, then SIGTERM", expects=("cut by the SIGKILL",))
    with tempfile.TemporaryDirectory() as tmp:
        plan = make_plan([make_instance("phi-4", "decode", [(40, ["1xL40S"])], 500.0, index=k) for k in range(2)]
                         + [make_instance("llama-3-8b", "decode", [(32, ["1xL40S"])], 800.0, template_id=3)])
        plan_path = plan.save(Path(tmp) / "plan.json")
        scenario = Path(tmp) / "scenario.yaml"  # the engines' scenario (it serves llama-3-8b too)
        scenario.write_text(yaml.safe_dump(engine_scenario().model_dump(mode="json")))
        port = free_port()
        url = f"http://127.0.0.1:{port}"

        def start() -> subprocess.Popen[bytes]:
            cmd = [sys.executable, "-m", "coral.cli.main", "serve", str(scenario), "--plan", str(plan_path), "--port",
                   str(port), "--db", f"{tmp}/state.sqlite", "--time-scale", str(TIME_SCALE), "--grace", "2"]
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            ready = poll(lambda: httpx.get(f"{url}/health", timeout=2).json()["routable"] == 3, 2 * startup_s())
            t.check(ready, f"coral serve not ready within {2 * startup_s():.0f} s")
            return proc

        first = start()
        killed = threading.Event()

        async def kill() -> None:
            await asyncio.sleep(1.0)
            first.kill()
            killed.set()

        def cut(o: str) -> str:
            return f"cut by the SIGKILL ({o.removeprefix('lost: ')[:40]})" if o.startswith("lost: ") and killed.is_set() else o

        mix(url, t, during=kill, relabel=cut)
        first.wait(30)
        second = start()
        mix(url, t, per_client=2)
        state = httpx.get(f"{url}/state", timeout=30)
        t.check(state.status_code == 200 and state.json()["plan"] is not None, f"/state HTTP {state.status_code}")

        def stuck_request() -> None:
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(f"{url}/v1/chat/completions", json={**chat(), "max_tokens": 100_000}, timeout=120)

        threading.Thread(target=stuck_request, daemon=True).start()
        time.sleep(1.0)
        second.send_signal(signal.SIGTERM)
        try:
            second.wait(60)
            t.check(True, "")
        except subprocess.TimeoutExpired:
            second.kill()
            t.check(False, "coral serve alive 60 s after SIGTERM")
    return t


ESCAPES = "\x1b[2J\x1b]0;owned\x07\x9b31m"  # clear the screen, retitle the window, a C1 control


def coral_cli(args: Sequence[str], timeout_s: float = 60.0, **kw: Any) -> tuple[int | None, str]:
    """`coral ARGS` as a process: (exit code, its stdout and stderr); None when it was still running at the limit
    (then killed)."""
    try:
        done = subprocess.run([sys.executable, "-m", "coral.cli.main", *args], capture_output=True,
                              timeout=timeout_s, **kw)
    except subprocess.TimeoutExpired:
        return None, ""
    return done.returncode, (done.stdout + done.stderr).decode(errors="replace")


def attack_input_files() -> Case:
    """Input files that are not files: a FIFO nobody writes, /dev/zero and a 2 GB sparse file, as the plan of
    `coral plan bom` and `coral deploy` and the running plan of `coral allocate`, each command a process with a
    60 s limit: it exits 2 at once naming what the file is (the named outcome), never hangs or runs out of memory.
    And a plan whose scenario and method hold terminal escapes: `coral plan bom` prints none of them raw."""
    t = Case("attack: files that are not files, terminal escapes", expects=("exit 2 naming it",))
    with tempfile.TemporaryDirectory() as tmp:
        fifo = Path(tmp) / "plan.fifo"
        os.mkfifo(fifo)
        sparse = Path(tmp) / "sparse.json"
        with sparse.open("wb") as f:
            f.truncate(2 << 30)
        for path, what in ((fifo, "is a FIFO"), (Path("/dev/zero"), "is a character device"),
                           (sparse, "over the")):
            for args in (["plan", "bom", str(path)],
                         ["deploy", "--plan", str(path), "--target", "kubernetes", "--out", f"{tmp}/d"],
                         ["allocate", "core", "--running", str(path), "--out", f"{tmp}/a"]):
                rc, out = coral_cli(args)
                words = " ".join(out.split())
                t.count("exit 2 naming it" if rc == 2 and what in words else
                        f"{args[0]} of {path.name}: " + ("still running after 60 s" if rc is None else
                                                         f"exit {rc}: {words[-100:]}"))
        plan = make_plan([make_instance("phi-4", "decode", [(40, ["1xL40S"])], 100.0)], scenario=f"core{ESCAPES}")
        plan.method = f"m{ESCAPES}"
        rc, out = coral_cli(["plan", "bom", str(plan.save(Path(tmp) / "plan.json"))])
        raw = [c for c in "\x1b\x07\x9b" if c in out]
        t.check(rc == 0 and not raw, f"coral plan bom exit {rc}, raw control characters {raw!r}")
    return t


def fault_ready_before_ready() -> Case:
    """`coral serve core --backend emulated` (the default plan of core): from the moment /health first answers,
    requests for every model of the plan, for 3 s: each is answered, or refused with 503 and Retry-After while
    /ready is not yet 200 (the named outcome), never 404; and /ready turns 200."""
    t = Case("fault: requests from the first /health on", expects=("503 not ready yet",))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen([sys.executable, "-m", "coral.cli.main", "serve", "core", "--backend", "emulated",
                                 "--port", str(port), "--db", f"{tmp}/state.sqlite"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            up = poll(lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200, 10 * startup_s(), 0.02)
            t.check(up, f"/health never answered within {10 * startup_s():.0f} s")
            models = [sm.model for sm in load_scenario("core").models]
            deadline = time.monotonic() + 3.0
            with httpx.Client(base_url=url, timeout=30) as http:
                while up and time.monotonic() < deadline:
                    for m in models:
                        r = http.post("/v1/chat/completions", json=chat(model=m))
                        t.count("ok" if r.status_code == 200 else
                                "503 not ready yet" if r.status_code == 503 and r.headers.get("retry-after") else
                                f"HTTP {r.status_code} for {m}: {r.text[:80]}")
                ready = poll(lambda: http.get("/ready").status_code == 200, 10 * startup_s())
            t.check(ready, "/ready never answered 200")
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return t


def bound_longest_run() -> Case:
    """Memory within the schema's bounds: `coral simulate` of a plan held fixed at the most requests a run may
    have (about 10 million), its address space capped at 8 GB: it finishes (exit 0)."""
    t = Case("bound: a run at the request bound, 8 GB of address space")
    with tempfile.TemporaryDirectory() as tmp:
        sc = load_scenario("core")
        duration = 0.99 * MAX_RUN_REQUESTS / sum(m.request_rate for m in sc.models)
        plan = make_plan([make_instance(m.model, phase, [(CORE_LAYERS[m.model], ["4xL40S"])], 1000.0, index=k)
                          for k, m in enumerate(sc.models) for phase in ("prefill", "decode")], scenario="core")

        def cap() -> None:
            resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))

        rc, out = coral_cli(["simulate", "core", "--plan", str(plan.save(Path(tmp) / "plan.json")), "--duration",
                             f"{duration:.0f}", "--out", f"{tmp}/out"], timeout_s=600, preexec_fn=cap)
        t.check(rc == 0, f"coral simulate exit {rc}: {' '.join(out.split())[-160:]}")
    return t


CORE_LAYERS = {"phi-4": 40, "gpt-oss-20b": 24, "qwen3-32b": 64}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="50,200,1000", help="concurrent clients per load run (of the mix)")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="200 clients only; no file fuzz, thread-kill variant, garbage state file or controller restart")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    clients = [200] if args.quick else [int(c) for c in args.clients.split(",")]
    runs: list[Callable[[], Case]] = [lambda: fuzz_gateway(rng)]
    if not args.quick:
        runs.append(lambda: fuzz_files(rng))
    runs += [lambda n=n: load_test(n, args.requests_per_client) for n in clients]
    runs += [lambda: fault_engine_killed(process=True)]
    if not args.quick:
        runs.append(lambda: fault_engine_killed(process=False))
    runs += [fault_client_disconnect, fault_engine_stalls]
    runs += [lambda f=f: fault_controller(f) for f in ("readonly", "missing", *([] if args.quick else ["corrupt", None]))]
    runs += [attack_access, attack_metrics, attack_huge_prompt, attack_slow_connections, attack_replan,
             attack_input_files, fault_serve_killed, fault_ready_before_ready]
    if not args.quick:
        runs.append(bound_longest_run)
    t0 = time.perf_counter()
    cases = []
    for run in runs:
        started = time.perf_counter()
        cases.append(run())
        cases[-1].seconds = time.perf_counter() - started
    wall_s = time.perf_counter() - t0

    table = Table("case", "tried", "ok", "expected (named)", "failed", "lost", "counters back to 0", "s",
                  title=f"reliability (engines at time scale {TIME_SCALE:g}; read-only state: {IMMUTABLE})")
    for t in cases:
        zero = {None: "-", True: "yes", False: "[red]NO[/]"}[t.counters_zero]
        table.add_row(t.name, str(t.tried), str(t.ok), str(t.expected), f"[red]{t.failed}[/]" if t.failed else "0",
                      f"[red]{t.lost}[/]" if t.lost else "0", zero, f"{t.seconds:.0f}")
    console = table_console()
    console.print(table)
    for t in cases:
        for outcome, n in t.named.most_common():
            console.print(f"{t.name}: {n} x expected [bold]{outcome}[/]")
    for t in cases:
        for outcome, n in t.failures.most_common(8):
            console.print(f"[red]{t.name}[/]: {n} x {outcome}")
    total = {k: sum(getattr(t, k) for t in cases) for k in ("tried", "ok", "expected", "failed", "lost")}
    console.print(f"total: {total['tried']} tried, {total['ok']} ok, {total['expected']} expected errors (named), "
                  f"{total['failed']} failed, {total['lost']} lost in {wall_s:.0f} s")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(stamped_json({"args": vars(args), "time_scale": TIME_SCALE, "read_only_fault": IMMUTABLE,
                               "wall_s": round(wall_s, 1), "total": total, "cases": [t.row() for t in cases]},
                              indent=1))
    console.print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
