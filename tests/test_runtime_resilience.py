"""Issue 30 on loopback servers: ejection never empties a pool, deadlines that count the admission queue and
reach the engines, engines' backpressure answered at once, clients that leave cancel their upstream call, an
engine whose /health fails is out at the next probe, and a dead instance noticed by the controller at once."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from test_runtime_gateway import FAST, chat, stack, wait_for

from coral.http_serving import ServerThread
from coral.openai_shapes import error_body, full
from coral.runtime.backends import EmulatedBackend, Watchdog
from coral.runtime.controller import Controller, Store
from coral.runtime.emulated import EngineTiming
from coral.runtime.gateway import Budget, Gateway, GatewayConfig, answer_budget
from coral.runtime.gateway.config import admission_wait_s
from coral.runtime.handmade import make_instance, make_plan
from coral.runtime.registry import Endpoint, InstanceState, Registry

pytestmark = pytest.mark.timeout(120)

STUCK = EngineTiming.constant(ttft_s=3600)


def engine_app(status: int = 200, retry_after: str | None = None, seen: list[dict[str, str]] | None = None,
               code: str | None = None) -> FastAPI:
    """A stand-in engine: answers every completion with `status` (an OpenAI error of `code`, and `retry_after`,
    unless 200), and records each request's headers in `seen`; /health answers `status` too."""
    app = FastAPI()

    def answer(message: str) -> JSONResponse:
        if status == 200:
            return JSONResponse({"status": "ok"})
        headers = {"Retry-After": retry_after} if retry_after is not None else None
        return JSONResponse(error_body(message, "server_error", None, code), status, headers=headers)

    @app.get("/health")
    async def health() -> JSONResponse:
        return answer("a node stopped")

    @app.post("/v1/chat/completions")
    async def complete(request: Request) -> Any:
        if seen is not None:
            seen.append(dict(request.headers))
        if status != 200:
            return answer("the engine's queue is full")
        return full(True, "chatcmpl-1", "m", "ok", 1, 1)

    return app


def add(registry: Registry, iid: str, srv: ServerThread, weight: float = 1.0, phase: str = "decode") -> Endpoint:
    return registry.add(Endpoint(iid, "m", phase, srv.url, weight, InstanceState.READY))


def test_ejection_is_capped_per_pool_and_never_takes_its_last_instance():
    registry = Registry()
    eps = [registry.add(Endpoint(f"e{k}", "m", "decode", "http://x", 1.0, InstanceState.READY)) for k in range(4)]
    other = registry.add(Endpoint("p0", "m", "prefill", "http://x", 1.0, InstanceState.READY))
    assert [registry.eject(e, 60.0, 0.5) for e in eps] == [True, True, False, False]  # at most half of 4
    assert sum(e.routable for e in eps) == 2 and other.routable
    assert not registry.eject(other, 60.0, 1.0)  # alone in its pool: never ejected, whatever the cap
    with stack(GatewayConfig(request_timeout_s=0.5, eject_s=3600)) as s:
        s.engine("only", "m", "decode", 1.0, STUCK)
        url = f"{s.gateway.url}/v1/chat/completions"
        for _ in range(2):  # each times out (504), and the pool keeps its instance: never 503 "no instance"
            r = httpx.post(url, json=chat(), timeout=60)
            assert r.status_code == 504 and "only did not answer" in r.json()["error"]["message"]
        only = s.registry.get("only")
        assert only is not None and only.routable and only.ejections == 0
        metrics = httpx.get(f"{s.gateway.url}/metrics").text
        assert 'coral_gateway_ejections_capped_total{instance="only"} 2.0' in metrics


def test_the_engine_gets_the_deadline_and_queueing_counts_against_the_budget():
    cfg = GatewayConfig(prefill_timeout_s={"m": 2.0}, token_timeout_s={"m": 0.5}, queue_timeout_s=30)
    body = {"model": "m", "prompt": "x", "max_tokens": 100}
    assert answer_budget(cfg, "m", body, prefill_only=False, waited_s=0.5) == Budget(51.5, 0.5, 51.5)
    assert answer_budget(cfg, "m", {**body, "stream": True}, False, waited_s=0.5) == Budget(1.5, 0.5, 51.5)
    assert answer_budget(cfg, "m", body, prefill_only=True, waited_s=0.5) == Budget(1.5, 1.5, 1.5)
    assert admission_wait_s(cfg, "m") == 1.0  # half the first-byte budget: the instance gets the other half
    assert admission_wait_s(cfg, "other") == 30
    seen: list[dict[str, str]] = []
    with stack(cfg) as s:
        srv = ServerThread(engine_app(seen=seen)).start()
        try:
            add(s.registry, "d0", srv)
            sent = time.time()
            r = httpx.post(f"{s.gateway.url}/v1/chat/completions", json=chat(n=10), timeout=30)
            assert r.status_code == 200
            deadline = float(seen[0]["x-coral-deadline"])
            assert sent < deadline <= time.time() + 2.0 + 10 * 0.5  # the whole answer's bound, from its sending
        finally:
            srv.stop()


def test_a_request_queued_past_half_its_budget_is_refused_at_once():
    with stack(GatewayConfig(max_concurrency=1, request_timeout_s=2.0, eject_s=3600)) as s:
        s.engine("stuck", "m", "decode", 1.0, STUCK)
        s.engine("ok", "m", "decode", 1.0, FAST)
        url = f"{s.gateway.url}/v1/chat/completions"
        first: list[int] = []
        s.registry.get("ok").healthy = False  # type: ignore[union-attr]  # the first request goes to "stuck"
        t = threading.Thread(target=lambda: first.append(httpx.post(url, json=chat(), timeout=60).status_code))
        t.start()
        assert wait_for(lambda: s.gw.active == 1, 30)
        s.registry.get("ok").healthy = True  # type: ignore[union-attr]
        r = httpx.post(url, json=chat(), timeout=60)  # waits 1 s (half of 2 s) for the one slot, then 429
        assert r.status_code == 429 and r.json()["error"]["code"] == "overloaded" and "Retry-After" in r.headers
        t.join(60)
        assert first == [504] and s.state("ok").served == 0
        assert s.gw.active == 0 and all(e.inflight == 0 for e in s.registry.all())


@pytest.mark.parametrize("status", [429, 503])
def test_an_engine_refusing_for_now_is_not_ejected_another_takes_it_or_the_client_hears_at_once(status):
    with stack(GatewayConfig(eject_s=3600)) as s:
        busy = ServerThread(engine_app(status, retry_after="7")).start()
        free = ServerThread(engine_app()).start()
        try:
            add(s.registry, "busy", busy, weight=100.0)
            add(s.registry, "free", free)
            url = f"{s.gateway.url}/v1/chat/completions"
            r = httpx.post(url, json=chat(), timeout=30)  # "busy" is picked first, refuses: "free" answers
            assert r.status_code == 200 and r.headers["x-coral-instance"] == "free"
            s.registry.remove("free")
            r = httpx.post(url, json=chat(), timeout=30)
            assert r.status_code == status and r.headers["Retry-After"] == "7"
            error = r.json()["error"]
            assert error["code"] == "overloaded" and "the engine's queue is full" in error["message"]
            ep = s.registry.get("busy")
            assert ep is not None and ep.routable and ep.healthy and ep.failed == 0 and ep.inflight == 0
            assert s.gw.active == 0
        finally:
            busy.stop()
            free.stop()


def test_an_engines_deadline_refusal_is_answered_at_once_and_not_retried():
    with stack(GatewayConfig(eject_s=3600)) as s:
        late = ServerThread(engine_app(504, retry_after="1")).start()
        free = ServerThread(engine_app()).start()
        try:
            add(s.registry, "late", late, weight=100.0)
            add(s.registry, "free", free)
            r = httpx.post(f"{s.gateway.url}/v1/chat/completions", json=chat(), timeout=30)
            assert r.status_code == 504 and "late refused" in r.json()["error"]["message"]
            ep = s.registry.get("late")
            assert ep is not None and ep.routable and ep.ejections == 0 and ep.failed == 0
            assert s.registry.get("free").served == 0  # type: ignore[union-attr]  # the deadline passed for all
        finally:
            late.stop()
            free.stop()


def test_a_client_that_leaves_cancels_the_upstream_call_and_leaves_no_task(capfd):
    with stack() as s:
        s.engine("d0", "m", "decode", 1.0, STUCK)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{s.gateway.url}/v1/chat/completions", json=chat(), timeout=1.0)  # gives up
        assert wait_for(lambda: s.state("d0").cancelled == 1, 30)  # the engine saw its request cancelled
        assert wait_for(lambda: s.gw.active == 0 and s.registry.get("d0").inflight == 0, 30)  # type: ignore[union-attr]
        metrics = httpx.get(f"{s.gateway.url}/metrics").text
        assert 'coral_gateway_requests_total{model="m",outcome="client_gone"} 1.0' in metrics
    log = capfd.readouterr().err  # uvicorn's loggers write to stderr, not to the root logger caplog reads
    assert "still running after the grace" not in log and "Traceback" not in log  # nothing left at shutdown


def test_an_instance_whose_health_fails_is_out_at_the_next_probe():
    sick = ServerThread(engine_app(503)).start()
    well = ServerThread(engine_app()).start()
    registry = Registry()
    try:
        a, b = add(registry, "sick", sick), add(registry, "well", well)
        gw = Gateway(registry, GatewayConfig(unhealthy_after=2))

        async def one_probe() -> None:
            await gw.open()
            try:
                await gw.check_health()
            finally:
                await gw.close()

        asyncio.run(one_probe())
        assert not a.routable and b.routable  # one 503 suffices (a silent instance gets `unhealthy_after` probes)
    finally:
        sick.stop()
        well.stop()


def test_a_probe_unanswered_while_the_instance_streams_is_not_counted_against_it():
    """Under 1,000 clients an engine's loop fell behind its /health probes while it streamed answers: two
    unanswered probes took the only decode instance out and 16 requests got 503 (`benchmarks/reliability.py`).
    A probe or connection that times out on an instance that just delivered a chunk is not counted; a silent
    instance still goes out after `unhealthy_after` timed-out probes, and a refused or reset connection means down
    however recently it delivered (a killed engine)."""
    from coral.runtime.aiohttp_pool import UpstreamConnectionError

    hung = socket.socket()  # accepts connections (the backlog) and never answers: every probe times out
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)
    url = f"http://127.0.0.1:{hung.getsockname()[1]}"
    registry = Registry()
    busy = registry.add(Endpoint("busy", "m", "decode", url, 1.0, InstanceState.READY))
    silent = registry.add(Endpoint("silent", "m", "decode", url, 1.0, InstanceState.READY))
    refused = registry.add(Endpoint("refused", "m", "decode", "http://127.0.0.1:9", 1.0, InstanceState.READY))
    gw = Gateway(registry, GatewayConfig(unhealthy_after=2, health_timeout_s=0.2))

    async def probes() -> None:
        await gw.open()
        try:
            for _ in range(3):
                for ep in (busy, refused):
                    ep.progress_at = asyncio.get_running_loop().time()  # a chunk delivered just now
                await gw.check_health()
        finally:
            await gw.close()

    try:
        asyncio.run(probes())
    finally:
        hung.close()
    assert busy.routable and busy.health_failures == 0
    assert not silent.routable and silent.health_failures == 3
    assert not refused.routable and refused.health_failures == 3

    def failed(kind: type[BaseException]) -> UpstreamConnectionError:
        exc = UpstreamConnectionError(f"{url}: {kind.__name__}")
        exc.__cause__ = kind()
        return exc

    async def connections_fail() -> None:  # a connection to a busy instance timed out: it stays in
        now = asyncio.get_running_loop().time()
        for ep, exc in ((busy, failed(TimeoutError)), (silent, failed(TimeoutError)),
                        (refused, failed(ConnectionRefusedError))):
            ep.healthy, ep.inflight = True, 1
            if ep is not silent:
                ep.progress_at = now
            gw._fail(ep, exc)

    asyncio.run(connections_fail())
    assert busy.routable and not silent.routable and not refused.routable


def test_a_pd_model_whose_decode_pool_is_lost_is_answered_by_its_prefill_pool():
    with stack() as s:
        s.engine("p0", "m", "prefill", 1.0, FAST)
        s.engine("d0", "m", "decode", 1.0, FAST)
        s.registry.get("d0").healthy = False  # type: ignore[union-attr]
        r = httpx.post(f"{s.gateway.url}/v1/chat/completions", json=chat(n=3), timeout=30)
        assert r.status_code == 200 and r.headers["x-coral-instance"] == "p0"
        assert s.state("d0").served == 0


def test_a_decode_instance_that_says_it_is_broken_is_out_and_the_prefill_pool_answers():
    with stack() as s:
        s.engine("p0", "m", "prefill", 1.0, FAST)
        broken = ServerThread(engine_app(503, retry_after="1", code="engine_unavailable")).start()
        try:
            d0 = add(s.registry, "d0", broken)
            r = httpx.post(f"{s.gateway.url}/v1/chat/completions", json=chat(n=3), timeout=30)
            assert r.status_code == 200 and r.headers["x-coral-instance"] == "p0"
            assert s.state("p0").served == 2  # the prefill call, then the whole answer
            assert not d0.routable and d0.failed == 1 and d0.inflight == 0
            assert 'coral_gateway_prefill_answers_total{model="m"} 1.0' in httpx.get(f"{s.gateway.url}/metrics").text
        finally:
            broken.stop()


def test_the_watchdog_reports_each_death_once():
    alive = {"a": True, "b": True}
    deaths: list[str] = []
    dog = Watchdog(lambda iid, _h: alive[iid], deaths.append)
    dog.watch("a", {})
    dog.watch("b", {})
    assert dog.check() == []
    alive["a"] = False
    assert dog.check() == ["a"] and dog.check() == [] and deaths == ["a"]
    dog.forget("b")
    alive["b"] = False
    assert dog.check() == [] and deaths == ["a"]  # stopped on purpose: not a death


def test_the_controller_notices_a_dead_instance_at_once_and_says_why(tmp_path):
    plan = make_plan([make_instance("phi-4", "prefill", [(40, ["1xL40S"])], 6000.0, template_id=1),
                      make_instance("phi-4", "decode", [(40, ["1xL40S"])], 500.0, template_id=2)])
    decode = plan.instances[1].id
    backend = EmulatedBackend(time_scale=0.0)
    registry = Registry()
    failed_rows: list[dict[str, Any]] = []

    class Watching(Controller):
        def _lost(self, inst: Any, handle: Any) -> None:  # what /state shows between the death and the restart
            super()._lost(inst, handle)
            failed_rows.extend(r for r in self.state()["instances"] if r["id"] == inst.id)

    c = Watching(Store(tmp_path / "s.sqlite"), backend, registry, lambda: plan, interval_s=3600, ready_timeout_s=30)
    c.start()
    try:
        assert wait_for(lambda: sum(e.routable for e in registry.all()) == 2, 60)
        first = backend.starts
        backend.kill(decode)  # the next pass is an hour away: only the watchdog can notice
        assert wait_for(lambda: backend.starts == first + 1 and backend.alive(decode, {}), 60)
        assert failed_rows and failed_rows[0]["state"] == "failed"
        assert failed_rows[0]["last_error"] == "its server thread stopped"
        assert any(a["kind"] == "lost" and a["instance_id"] == decode for a in c.store.actions())
        assert wait_for(lambda: registry.get(decode) is not None and registry.get(decode).routable, 60)  # type: ignore[union-attr]
    finally:
        c.stop()
        backend.close()
