"""Gateway on loopback with real emulated engine servers: PD path, streaming, routing split, failures."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coral.http_serving import ServerThread
from coral.runtime.emulated import EngineTiming, create_engine_app, token_text
from coral.runtime.gateway import GatewayConfig, create_gateway_app
from coral.runtime.registry import Endpoint, InstanceState, Registry

pytestmark = pytest.mark.timeout(120)


class Stack:
    """Emulated engines + a gateway, all on loopback; its answers name their instance (`x-coral-instance`, which
    these tests read) unless `instance_header` is False."""

    def __init__(
        self, config: GatewayConfig | None = None, health_checks: bool = False, instance_header: bool = True
    ) -> None:
        self.registry = Registry()
        self.engines: dict[str, ServerThread] = {}
        self.apps: dict[str, object] = {}
        cfg = replace(config or GatewayConfig(), instance_header=instance_header)
        self.gateway = ServerThread(create_gateway_app(self.registry, cfg, health_checks=health_checks)).start()
        self.gw = self.gateway.server.config.app.state.gateway  # type: ignore[union-attr]

    def engine(self, iid: str, model: str, phase: str, weight: float, timing: EngineTiming) -> ServerThread:
        app = create_engine_app(iid, model, phase, timing)
        srv = self.engines[iid] = ServerThread(app).start()
        self.apps[iid] = app
        self.registry.add(Endpoint(iid, model, phase, srv.url, weight, InstanceState.READY))
        return srv

    def state(self, iid: str):
        return self.apps[iid].state.engine  # type: ignore[attr-defined]

    def close(self) -> None:
        for s in [self.gateway, *self.engines.values()]:
            s.stop()


@contextlib.contextmanager
def stack(
    config: GatewayConfig | None = None, health_checks: bool = False, instance_header: bool = True
) -> Iterator[Stack]:
    s = Stack(config, health_checks, instance_header)
    try:
        yield s
    finally:
        s.close()


FAST = EngineTiming.constant(0.0, 0.0)


def chat(model: str = "m", n: int = 4, stream: bool = False, text: str = "hello there") -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": n,
        "stream": stream,
    }


def sse_events(raw: str) -> list[dict | str]:
    out: list[dict | str] = []
    for line in raw.splitlines():
        if line.startswith("data: "):
            payload = line[6:]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def wait_for(cond, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_chat_completion_end_to_end_pd():
    with stack() as s:
        s.engine("p0", "m", "prefill", 1.0, FAST)
        s.engine("d0", "m", "decode", 1.0, FAST)
        r = httpx.post(f"{s.gateway.url}/v1/chat/completions", json=chat(n=5), timeout=10)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "chat.completion"
        expected = "".join(token_text("hello there", i) for i in range(5))
        assert body["choices"][0]["message"]["content"] == expected
        assert body["usage"]["completion_tokens"] == 5
        assert r.headers["x-coral-instance"] == "d0"
        # prefill ran on the prefill instance only; the decode instance got the KV-transfer parameters
        assert (s.state("p0").served, s.state("p0").prefills) == (1, 1)
        assert (s.state("d0").served, s.state("d0").prefills) == (1, 0)
        direct = httpx.post(f"{s.engines['d0'].url}/v1/chat/completions", json=chat(n=5), timeout=10).json()
        assert direct["choices"][0]["message"]["content"] == expected


def test_streaming_completion_and_models():
    with stack() as s:
        s.engine("p0", "m", "prefill", 1.0, FAST)
        s.engine("d0", "m", "decode", 1.0, FAST)
        body = {"model": "m", "prompt": "a b c", "max_tokens": 3, "stream": True}
        with httpx.stream("POST", f"{s.gateway.url}/v1/completions", json=body, timeout=10) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = sse_events(r.read().decode())
        assert events[-1] == "[DONE]"
        texts = [e["choices"][0]["text"] for e in events[:-1]]  # type: ignore[index]
        assert texts == [token_text("a b c", i) for i in range(3)]
        models = httpx.get(f"{s.gateway.url}/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["m"]
        assert s.registry.get("d0").inflight == 0  # type: ignore[union-attr]
        metrics = httpx.get(f"{s.gateway.url}/metrics").text
        assert 'coral_gateway_requests_total{model="m",outcome="ok"} 1.0' in metrics
        assert 'coral_gateway_inflight{instance="d0"} 0.0' in metrics


def test_errors_are_openai_shaped():
    with stack() as s:
        s.engine("d0", "m", "decode", 1.0, FAST)
        url = s.gateway.url
        assert httpx.post(f"{url}/v1/chat/completions", json=chat(model="nope")).status_code == 404
        bad = httpx.post(f"{url}/v1/chat/completions", content=b"{not json")
        assert bad.status_code == 400 and "invalid request" in bad.json()["error"]["message"]
        s.registry.set_state("d0", InstanceState.DRAINING)
        r = httpx.post(f"{url}/v1/chat/completions", json=chat())
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        s.registry.set_state("d0", InstanceState.READY)
        assert httpx.post(f"{url}/v1/chat/completions", json=chat()).status_code == 200


def test_overload_gives_429_and_releases_slots():
    slow = EngineTiming.constant(0.3, 0.0)
    with stack(GatewayConfig(max_concurrency=1, max_waiting=0)) as s:
        s.engine("d0", "m", "decode", 1.0, slow)

        async def run() -> list[int]:
            async with httpx.AsyncClient(base_url=s.gateway.url, timeout=10) as c:
                first = asyncio.create_task(c.post("/v1/chat/completions", json=chat(n=1)))
                assert await asyncio.to_thread(wait_for, lambda: s.gw.active == 1)
                second = await c.post("/v1/chat/completions", json=chat(n=1))
                assert second.headers["retry-after"] == "1"
                return [(await first).status_code, second.status_code]

        assert asyncio.run(run()) == [200, 429]
        assert s.gw.active == 0 and s.gw.waiting == 0
        assert httpx.post(f"{s.gateway.url}/v1/chat/completions", json=chat(n=1)).status_code == 200


def test_draining_instance_gets_no_new_requests():
    with stack() as s:
        s.engine("d0", "m", "decode", 1.0, FAST)
        s.engine("d1", "m", "decode", 1.0, FAST)
        s.registry.set_state("d1", InstanceState.DRAINING)
        for _ in range(10):
            assert httpx.post(f"{s.gateway.url}/v1/chat/completions", json=chat(n=1)).status_code == 200
        assert (s.state("d0").served, s.state("d1").served) == (10, 0)


def test_traffic_split_matches_weights_under_load():
    weights = {"d0": 1.0, "d1": 2.0, "d2": 5.0}
    timing = EngineTiming.constant(0.002, 0.001)
    n_requests, concurrency = 400, 6
    with stack() as s:
        s.engine("p0", "m", "prefill", 1.0, timing)
        for iid, w in weights.items():
            s.engine(iid, "m", "decode", w, timing)

        async def run() -> Counter[str]:
            sem = asyncio.Semaphore(concurrency)
            async with httpx.AsyncClient(base_url=s.gateway.url, timeout=30) as c:

                async def one(i: int) -> str:
                    async with sem:
                        r = await c.post(
                            "/v1/chat/completions", json=chat(n=3, stream=i % 2 == 0, text=f"q {i}")
                        )
                        assert r.status_code == 200
                        return r.headers["x-coral-instance"]

                return Counter(await asyncio.gather(*(one(i) for i in range(n_requests))))

        counts = asyncio.run(run())
        total_w = sum(weights.values())
        for iid, w in weights.items():
            assert counts[iid] / n_requests == pytest.approx(w / total_w, abs=0.03)
        state = s.gw.state()
        assert all(e["inflight"] == 0 for e in state["instances"])
        assert state["latency"]["m"]["count"] == n_requests


def test_killed_instance_loses_no_unstarted_request():
    """Kill one of two engines mid-run: only requests that already streamed from it may fail."""
    timing = EngineTiming.constant(0.1, 0.002)  # most of a request's time is before its first token
    n_requests, n_tokens = 60, 10
    with stack(GatewayConfig(health_interval_s=0.1)) as s:
        s.engine("d0", "m", "decode", 1.0, timing)
        s.engine("d1", "m", "decode", 1.0, timing)
        outcomes: list[tuple[bool, bool]] = []  # (got a first chunk, completed)

        async def run() -> None:
            sem = asyncio.Semaphore(8)
            async with httpx.AsyncClient(base_url=s.gateway.url, timeout=30) as c:

                async def one(i: int) -> None:
                    async with sem:
                        started = done = False
                        try:
                            async with c.stream(
                                "POST",
                                "/v1/completions",
                                json={
                                    "model": "m",
                                    "prompt": f"p {i}",
                                    "max_tokens": n_tokens,
                                    "stream": True,
                                },
                            ) as r:
                                assert r.status_code == 200, await r.aread()
                                async for line in r.aiter_lines():
                                    if line.startswith('data: {"id"'):
                                        started = True
                                    done = done or line == "data: [DONE]"
                        except httpx.HTTPError:
                            pass
                        outcomes.append((started, done))
                        if len(outcomes) == 15:
                            s.engines["d1"].stop(force=True)

                await asyncio.gather(*(one(i) for i in range(n_requests)))

        asyncio.run(run())
        assert len(outcomes) == n_requests
        assert all(started for started, _ in outcomes), "a request failed before its first token"
        assert sum(done for _, done in outcomes) >= n_requests - 8  # at most the ones streaming from d1
        assert wait_for(lambda: all(e.inflight == 0 for e in s.registry.all()))
        assert wait_for(lambda: not s.registry.get("d1").healthy)  # type: ignore[union-attr]
        assert s.state("d0").served > n_requests // 2
        client_failures = sum(not done for _, done in outcomes)
        assert s.registry.get("d1").failed > client_failures  # type: ignore[union-attr]  # the rest were retried


def test_client_cancel_releases_inflight():
    slow = EngineTiming.constant(0.0, 0.05)
    with stack() as s:
        s.engine("d0", "m", "decode", 1.0, slow)
        with httpx.stream("POST", f"{s.gateway.url}/v1/chat/completions", json=chat(n=200, stream=True)) as r:
            lines = r.iter_lines()  # keep a reference: a dropped line iterator closes the connection
            first = next(lines)
            assert first.startswith('data: {"id"'), first
            assert s.registry.get("d0").inflight == 1  # type: ignore[union-attr]
        assert wait_for(lambda: s.registry.get("d0").inflight == 0 and s.gw.active == 0)  # type: ignore[union-attr]


def test_instance_removed_mid_request_keeps_counts_consistent():
    slow = EngineTiming.constant(0.0, 0.02)
    with stack() as s:
        s.engine("d0", "m", "decode", 1.0, slow)
        old = s.registry.get("d0")
        assert old is not None
        with httpx.stream("POST", f"{s.gateway.url}/v1/chat/completions", json=chat(n=5, stream=True)) as r:
            lines = r.iter_lines()
            next(lines)
            s.registry.remove("d0")  # churn: the instance leaves and comes back while a request runs on it
            new = s.registry.add(Endpoint("d0", "m", "decode", s.engines["d0"].url, 1.0, InstanceState.READY))
            rest = list(lines)
        assert "data: [DONE]" in rest
        assert wait_for(lambda: old.inflight == 0)
        assert (old.served, new.inflight, new.served) == (1, 0, 0)


# --- routing rule, no servers ---------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(weights=st.lists(st.integers(1, 9), min_size=1, max_size=6), rounds=st.integers(1, 4))
def test_smooth_wrr_is_exact_when_requests_finish(weights, rounds):
    reg = Registry()
    for k, w in enumerate(weights):
        reg.add(Endpoint(f"e{k}", "m", "decode", "http://x", float(w), InstanceState.READY))
    counts: Counter[str] = Counter()
    for _ in range(rounds * sum(weights)):
        ep = reg.pick("m", "decode")
        assert ep is not None
        counts[ep.id] += 1
        reg.release(ep, ok=True)
    assert [counts[f"e{k}"] for k in range(len(weights))] == [rounds * w for w in weights]


@settings(max_examples=40, deadline=None)
@given(
    states=st.lists(st.sampled_from(list(InstanceState)), min_size=2, max_size=6),
    healthy=st.lists(st.booleans(), min_size=6, max_size=6),
)
def test_only_ready_healthy_instances_are_picked(states, healthy):
    reg = Registry()
    for k, stt in enumerate(states):
        reg.add(Endpoint(f"e{k}", "m", "decode", "http://x", 1.0 + k, stt, healthy=healthy[k]))
    ok = {f"e{k}" for k, stt in enumerate(states) if stt is InstanceState.READY and healthy[k]}
    for _ in range(20):
        ep = reg.pick("m", "decode")
        assert (ep is None) == (not ok)
        if ep is not None:
            assert ep.id in ok


def test_least_outstanding_correction_skips_a_stalled_instance():
    reg = Registry(max_excess=2)
    for k in range(2):
        reg.add(Endpoint(f"e{k}", "m", "decode", "http://x", 1.0, InstanceState.READY))
    picks = []
    for _ in range(40):  # e1 answers at once, e0 never does
        ep = reg.pick("m", "decode")
        assert ep is not None
        picks.append(ep.id)
        if ep.id == "e1":
            reg.release(ep, ok=True)
    stalled = reg.get("e0")
    assert stalled is not None
    # e0 may exceed its weighted share of in-flight requests (half of them) by at most max_excess
    assert stalled.inflight - (stalled.inflight + 1) / 2 <= 2 + 1
    assert picks[-20:] == ["e1"] * 20


def test_retry_on_5xx_before_first_token():
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    broken = FastAPI()

    @broken.post("/v1/chat/completions")
    async def fail() -> JSONResponse:
        return JSONResponse({"error": "boom"}, 500)

    with stack() as s:
        s.engine("good", "m", "decode", 1.0, FAST)
        bad = ServerThread(broken).start()
        s.engines["bad"] = bad
        s.registry.add(Endpoint("bad", "m", "decode", bad.url, 10.0, InstanceState.READY))
        for stream in (False, True):
            for _ in range(5):
                r = httpx.post(f"{s.gateway.url}/v1/chat/completions", json=chat(n=2, stream=stream))
                assert r.status_code == 200 and r.headers["x-coral-instance"] == "good"
        ep = s.registry.get("bad")
        assert ep is not None and ep.failed > 0 and ep.served == 0 and ep.inflight == 0
        assert s.state("good").served == 10
        s.registry.set_state("good", InstanceState.DRAINING)  # only the broken one left: 502 after retries
        r = httpx.post(f"{s.gateway.url}/v1/chat/completions", json=chat(n=2))
        assert r.status_code == 502 and "HTTP 500" in r.json()["error"]["message"]


def test_emulated_pipeline_serves_as_the_simulator_does():
    """A PlanInstance's engine uses the simulator's kernels: prompts flow stage to stage in chunks of the
    node's planned batch (a 2-stage prompt of 3 chunks takes 6 node steps), a decode node takes at most its
    batch cap of sequences (the next one waits for a slot), and stage nodes are picked by weighted round-robin."""
    from coral.catalog.loader import builtin_catalog, load_scenario
    from coral.perf.roofline import RooflineModel
    from coral.runtime.emulated import PipelineTiming, _PipelineEngine
    from coral.runtime.handmade import make_instance
    from coral.simulation.kernels import KernelCache

    kernels = KernelCache(load_scenario("core"), builtin_catalog(), RooflineModel())
    pre = make_instance("phi-4", "prefill", [(20, ["1xL40S"]), (20, ["1xL40S", "1xL4"])], 1.0)
    dec = make_instance("phi-4", "decode", [(40, ["1xL40S"])], 1.0)
    cap = kernels.kernel("phi-4", "prefill", "1xL40S", 20, 2).cap
    dec_cap = kernels.kernel("phi-4", "decode", "1xL40S", 40, 1).cap

    async def run() -> tuple[int, set[float], int, int]:
        p = PipelineTiming(pre, kernels).start(1e-6)
        nic = await p.prefill(3 * cap)
        steps = p.prefill_steps
        other = await p.prefill(1)  # the second stage's other node: its NIC is the path's busiest
        d = PipelineTiming(dec, kernels).start(1e-6)
        assert isinstance(d, _PipelineEngine)
        held = [d.decode(10, 4, nic) for _ in range(dec_cap + 1)]
        started = await asyncio.gather(*(anext(g) for g in held[:-1]))  # each admitted: its first token
        late = asyncio.ensure_future(anext(held[-1]))
        await asyncio.sleep(0.01)
        waiting = len(d.waiting)
        assert not late.done() and len(started) == dec_cap
        await held[0].aclose()  # one leaves: the waiting one gets its slot
        await asyncio.wait_for(late, 5)
        for g in held[1:]:
            await g.aclose()
        return steps, {nic, other}, waiting, len(d.waiting)

    steps, nics, waiting, after = asyncio.run(run())
    per_node = {c: 20 / builtin_catalog().node_config(c).nic_bytes_s for c in ("1xL40S", "1xL4")}
    assert steps == 6 and nics == {per_node["1xL40S"], max(per_node.values())}
    assert (waiting, after) == (1, 0)
    assert token_text("x y", 3) == token_text("x y", 3) != token_text("x z", 3)


def test_an_emulated_engine_timed_by_the_perf_model_needs_its_models_scenario():
    from coral.catalog.loader import CoralInputError, builtin_catalog, load_scenario
    from coral.perf.roofline import RooflineModel
    from coral.runtime.emulated import instance_engine_app
    from coral.runtime.handmade import make_instance
    from coral.simulation.kernels import KernelCache

    inst = make_instance("llama-3-8b", "decode", [(32, ["1xL40S"])], 1.0)
    with pytest.raises(CoralInputError, match=r"needs the scenario of llama-3-8b .* has no scenario"):
        instance_engine_app(inst, 1.0)
    core = KernelCache(load_scenario("core"), builtin_catalog(), RooflineModel())
    with pytest.raises(CoralInputError, match="scenario 'core', which does not serve it"):
        instance_engine_app(inst, 1.0, core)
    assert instance_engine_app(inst, 0.0).state.engine.prefill_steps == 0  # as fast as possible: no timing needed


def test_pd_falls_back_to_local_prefill_when_prefill_pool_is_down():
    with stack() as s:
        s.engine("p0", "m", "prefill", 1.0, FAST)
        s.engine("d0", "m", "decode", 1.0, FAST)
        s.registry.set_state("p0", InstanceState.DRAINING)
        r = httpx.post(f"{s.gateway.url}/v1/chat/completions", json=chat(n=3))
        assert r.status_code == 200
        assert (s.state("p0").served, s.state("d0").prefills) == (0, 1)
        assert 'coral_gateway_pd_fallback_total{model="m"} 1.0' in httpx.get(f"{s.gateway.url}/metrics").text


def test_emulated_prefill_batches_waiting_prompts():
    timing = EngineTiming(prefill_s=lambda n: 0.1, decode_step_s=lambda a, c: 0.0)
    with stack() as s:
        s.engine("d0", "m", "decode", 1.0, timing)

        async def run() -> list[int]:
            async with httpx.AsyncClient(base_url=s.engines["d0"].url, timeout=10) as c:
                rs = await asyncio.gather(
                    *(c.post("/v1/completions", json={"model": "m", "prompt": f"p{i}"}) for i in range(6))
                )
                return [r.status_code for r in rs]

        assert asyncio.run(run()) == [200] * 6
        st = s.state("d0")
        assert st.prefills == 6 and 1 <= st.prefill_steps < 6


def test_upstream_keepalive_survives_engine_restart_on_the_same_port():
    """The gateway's pooled connection to an engine dies with the engine; a request after the restart is sent
    again on a new connection instead of failing."""
    with stack() as s:
        srv = s.engine("d0", "m", "decode", 1.0, FAST)
        url = f"{s.gateway.url}/v1/chat/completions"
        assert httpx.post(url, json=chat(), timeout=10).status_code == 200
        assert srv.server.server_state.connections  # type: ignore[union-attr]  # the connection was kept alive
        srv.stop()
        s.engines["d0"] = ServerThread(create_engine_app("d0", "m", "decode", FAST), port=srv.port).start()
        for stream in (False, True):
            r = httpx.post(url, json=chat(stream=stream), timeout=10)
            assert r.status_code == 200 and r.headers["x-coral-instance"] == "d0"
        assert s.registry.get("d0").failed == 0  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("answer", "body"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", b"hello"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3;x=1\r\nhel\r\n2\r\nlo\r\n0\r\nT: 1\r\n\r\n", b"hello"),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nhello", b"hello"),
        (b"HTTP/1.1 204 No Content\r\n\r\n", b""),
    ],
)
def test_upstream_pool_relays_each_body_framing_unframed(answer, body):
    """The gateway relays `aiter_raw` as the body: chunked framing removed, every framing read to its end."""
    from coral.runtime.aiohttp_pool import AiohttpPool

    async def run() -> tuple[int, bytes]:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            n = int(
                next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1]
            )
            await reader.readexactly(n)
            writer.write(answer)
            await writer.drain()
            if b"close" in answer:
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = AiohttpPool(1.0)
        resp = await pool.post(f"http://127.0.0.1:{port}", "/x", b"{}", {})
        data = b"".join([c async for c in resp.aiter_raw()])
        await resp.aclose()
        await pool.aclose()
        server.close()
        return resp.status_code, data

    status, data = asyncio.run(run())
    assert data == body and status in (200, 204)


def test_upstream_pool_raises_oserror_on_garbage_and_refused_connections():
    from coral.runtime.aiohttp_pool import AiohttpPool, UpstreamConnectionError

    async def run() -> None:
        async def handle(_r: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b"NOT HTTP\r\n\r\n")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = AiohttpPool(1.0)
        with pytest.raises(UpstreamConnectionError):
            await pool.post(f"http://127.0.0.1:{port}", "/x", b"{}", {})
        server.close()
        await server.wait_closed()
        with pytest.raises(OSError):
            await pool.post(f"http://127.0.0.1:{port}", "/x", b"{}", {})
        await pool.aclose()

    asyncio.run(run())


def test_upstream_pool_resends_once_a_request_dropped_unanswered_on_a_kept_alive_connection():
    """The race of a server closing an idle keep-alive connection as a request goes out on it: the request is
    sent again on a new connection (once: a server that drops every request is an error)."""
    from coral.runtime.aiohttp_pool import AiohttpPool, UpstreamConnectionError

    async def run() -> tuple[list[int], int]:
        connections = 0
        drop_all = False

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal connections
            connections += 1
            first_connection = connections == 1
            served = 0
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                n = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1])
                await reader.readexactly(n)
                if drop_all or (first_connection and served == 1):
                    writer.close()
                    return
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
                served += 1

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        pool = AiohttpPool(1.0)
        statuses = []
        for _ in range(2):
            resp = await pool.post(url, "/x", b"{}", {})
            assert b"".join([c async for c in resp.aiter_raw()]) == b"ok"
            await resp.aclose()
            statuses.append(resp.status_code)
        seen = connections
        drop_all = True
        with pytest.raises(UpstreamConnectionError):
            await pool.post(url, "/x", b"{}", {})
        await pool.aclose()
        server.close()
        return statuses, seen

    statuses, connections = asyncio.run(run())
    assert statuses == [200, 200] and connections == 2
