"""Issue 20 on real loopback servers: every endpoint behind a key when keys are set, engines behind the
gateway's token, /metrics labels only from the plan, /replan errors as JSON with a size limit however framed,
a posted plan pinned until released, header and body read timeouts, a corrupt or unwritable state database,
timeouts per phase from the SLOs (prefill, first token, each later token, the whole answer) and outlier
ejection."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from test_runtime_gateway import FAST, chat, sse_events, stack

from coral.catalog.loader import CoralInputError
from coral.cli.runtime import build_runtime
from coral.http_serving import ServerThread, free_port
from coral.openai_shapes import error_type
from coral.runtime.backends import EmulatedBackend
from coral.runtime.controller import Controller, Store, controller_router
from coral.runtime.emulated import EngineTiming, create_engine_app
from coral.runtime.gateway import GatewayConfig, create_gateway_app
from coral.runtime.handmade import make_instance, make_plan
from coral.runtime.registry import Registry

pytestmark = pytest.mark.timeout(120)

KEY, READ, ADMIN = "sk-hardening-key-0001", "read-only-token-0002", "admin-token-0003"
PLAN = make_plan([make_instance("phi-4", "decode", [(40, ["1xL40S"])], 100.0)])
OTHER_PLAN = make_plan([make_instance("phi-4", "decode", [(40, ["1xL40S"])], 100.0, template_id=9)])
GUARDED = ["/state", "/gateway/state", "/metrics", "/dashboard", "/dashboard/state.json", "/docs", "/openapi.json",
           "/v1/models"]
READ_ONLY = ["/state", "/gateway/state", "/metrics", "/dashboard", "/dashboard/state.json"]


def bearer(token: str, scheme: str = "Bearer") -> dict[str, str]:
    return {"Authorization": f"{scheme} {token}"}


@contextlib.contextmanager
def runtime(tmp_path, planner=lambda: PLAN, config: GatewayConfig | None = None) -> Iterator[tuple[str, Controller]]:
    """`coral serve`'s app (gateway, controller API, dashboard) with emulated engines, on loopback."""
    store = Store(tmp_path / "state.sqlite")
    backend = EmulatedBackend(time_scale=0.0, api_key=store.engine_token())
    cfg = (config or GatewayConfig()).with_api_keys([KEY]).with_tokens(read=[READ], admin=[ADMIN])
    app, controller = build_runtime(planner, store, backend, 3600.0, cfg, ADMIN)
    srv = ServerThread(app).start()
    try:
        yield srv.url, controller
    finally:
        srv.stop()
        controller.stop()
        backend.close()


def test_every_endpoint_but_health_needs_a_credential_when_keys_are_set(tmp_path):
    with runtime(tmp_path) as (url, controller):
        controller.replan()
        assert httpx.get(f"{url}/health").status_code == 200
        for path in GUARDED:
            r = httpx.get(f"{url}{path}")
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", path
            assert httpx.get(f"{url}{path}", headers=bearer(KEY)).status_code == 200, path
            assert httpx.get(f"{url}{path}", headers=bearer(KEY, "bearer")).status_code == 200, path
        for path in READ_ONLY:  # the read-only token reads the views and nothing else
            assert httpx.get(f"{url}{path}", headers=bearer(READ)).status_code == 200, path
        body = {"model": "phi-4", "prompt": "x", "max_tokens": 1}
        assert httpx.post(f"{url}/v1/completions", json=body, headers=bearer(READ)).status_code == 401
        assert httpx.post(f"{url}/v1/completions", json=body, headers=bearer(KEY)).status_code == 200
        assert httpx.post(f"{url}/replan", headers=bearer(READ)).status_code == 401
        assert httpx.post(f"{url}/replan", headers=bearer(KEY)).status_code == 401  # the admin token's alone
        assert httpx.post(f"{url}/replan", headers=bearer(ADMIN, "BEARER")).status_code == 200
        # a browser opens the dashboard once with ?token=, its polls then carry the cookie
        with httpx.Client(base_url=url) as browser:
            page = browser.get("/dashboard", params={"token": READ})
            assert page.status_code == 200 and "httponly" in page.headers["set-cookie"].lower()
            assert browser.get("/dashboard/state.json").status_code == 200
            assert browser.get("/metrics").status_code == 401  # the cookie is for the dashboard only


def test_engines_answer_only_the_gateways_token(tmp_path):
    with runtime(tmp_path) as (url, controller):
        controller.replan()
        (engine_url,) = [i["url"] for i in controller.state()["instances"]]
        body = {"model": "phi-4", "prompt": "x", "max_tokens": 1}
        assert httpx.post(f"{engine_url}/v1/completions", json=body).status_code == 401
        assert httpx.get(f"{engine_url}/v1/models").status_code == 401
        assert httpx.get(f"{engine_url}/health").status_code == 200
        assert engine_url.startswith("http://127.0.0.1:")
        r = httpx.post(f"{url}/v1/completions", json=body, headers=bearer(KEY))
        assert r.status_code == 200 and r.json()["choices"][0]["text"]


def test_metrics_labels_come_only_from_the_plans_models():
    with stack() as s:
        s.engine("d0", "m", "decode", 1.0, FAST)
        url = s.gateway.url
        bad = b'{"model": "\\ud800", "messages": [{"role": "user", "content": "x"}]}'
        assert httpx.post(f"{url}/v1/chat/completions", content=bad).status_code in (400, 404)
        assert httpx.get(f"{url}/metrics").status_code == 200
        before = len(httpx.get(f"{url}/metrics").content)
        for i in range(50):
            r = httpx.post(f"{url}/v1/chat/completions", json=chat(model=f"{i}-" + "n" * 4096))
            assert r.status_code == 404
        metrics = httpx.get(f"{url}/metrics")
        assert metrics.status_code == 200
        assert "nnnn" not in metrics.text and 'model="_unknown",outcome="unknown_model"} 50.0' in metrics.text
        assert len(metrics.content) < before + 200
        assert httpx.post(f"{url}/v1/chat/completions", json=chat()).status_code == 200
        assert 'model="m",outcome="ok"' in httpx.get(f"{url}/metrics").text


def replan_server(tmp_path, controller: Controller | None = None, **router_kw) -> ServerThread:
    registry = Registry()
    c = controller or Controller(Store(tmp_path / "s.sqlite"), EmulatedBackend(time_scale=0.0), registry)
    app = create_gateway_app(registry, extra_routers=[controller_router(c, **router_kw)], health_checks=False)
    return ServerThread(app).start()


def test_replan_errors_are_json_and_the_size_limit_holds_however_framed(tmp_path, monkeypatch):
    srv = replan_server(tmp_path, max_body_bytes=300_000)
    try:
        deep = b"[" * 100_000 + b"]" * 100_000
        for body in (deep, b"{not json", b'{"scenario": 1}'):
            r = httpx.post(f"{srv.url}/replan", content=body)
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_plan"

        def chunks():  # chunked: no Content-Length to check
            for _ in range(400):
                yield b" " * 1000

        r = httpx.post(f"{srv.url}/replan", content=chunks())
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def unwritable(self, plan, pin=None):  # a read-only state file (root ignores file modes: injected)
            raise sqlite3.OperationalError("attempt to write a readonly database")

        monkeypatch.setattr(Store, "set_plan", unwritable)
        r = httpx.post(f"{srv.url}/replan", content=PLAN.model_dump_json())
        assert r.status_code == 503 and "readonly" in r.json()["error"]["message"]
        assert "s.sqlite" in r.json()["error"]["message"]
    finally:
        srv.stop()


def test_a_posted_plan_is_pinned_until_released(tmp_path):
    registry = Registry()
    c = Controller(Store(tmp_path / "s.sqlite"), EmulatedBackend(time_scale=0.0), registry, lambda: OTHER_PLAN)
    srv = replan_server(tmp_path, c)
    try:
        r = httpx.post(f"{srv.url}/replan?wait=true", content=PLAN.model_dump_json())
        assert r.status_code == 200 and r.json()["pinned"] is True
        c.replan()  # what the allocator's tick does: the posted plan stays
        assert c.store.plan() == PLAN and c.store.pinned()
        refused = httpx.post(f"{srv.url}/replan")
        assert refused.status_code == 409 and "release=true" in refused.json()["error"]["message"]
        released = httpx.post(f"{srv.url}/replan?release=true&wait=true")
        assert released.status_code == 200 and released.json()["pinned"] is False
        assert c.store.plan() == OTHER_PLAN
    finally:
        srv.stop()
        c.backend.close()  # type: ignore[attr-defined]


def test_a_refused_replan_leaves_the_store_writable_and_the_file_true(tmp_path):
    """A plan breaking the schema's invariants (a duplicate instance id) gets a 400 naming it; a write that fails
    inside the transaction rolls it back (no pin left behind, later writes work); every 200 is in the file, as a
    fresh Store on it reads."""
    registry = Registry()
    c = Controller(Store(tmp_path / "s.sqlite"), EmulatedBackend(time_scale=0.0), registry, lambda: OTHER_PLAN)
    srv = replan_server(tmp_path, c)
    try:
        doubled = json.loads(PLAN.model_dump_json())
        doubled["instances"].append(doubled["instances"][0])
        r = httpx.post(f"{srv.url}/replan", json=doubled)
        assert r.status_code == 400 and "ids must be unique" in r.json()["error"]["message"]
        assert PLAN.instances[0].id in r.json()["error"]["message"]
        broken = PLAN.model_construct(**{**dict(PLAN), "instances": [*PLAN.instances, PLAN.instances[0]]})
        with pytest.raises(sqlite3.IntegrityError):
            c.store.set_plan(broken, pin=True)  # what once wedged the store: UNIQUE failed mid-transaction
        assert not Store(tmp_path / "s.sqlite").pinned()  # rolled back with it
        assert httpx.post(f"{srv.url}/replan?wait=true", content=PLAN.model_dump_json()).status_code == 200
        assert Store(tmp_path / "s.sqlite").pinned() and Store(tmp_path / "s.sqlite").plan() == PLAN
        released = httpx.post(f"{srv.url}/replan?release=true&wait=true")
        assert released.status_code == 200 and released.json()["pinned"] is False
        reopened = Store(tmp_path / "s.sqlite")
        assert not reopened.pinned() and reopened.plan() == OTHER_PLAN
    finally:
        srv.stop()
        c.backend.close()  # type: ignore[attr-defined]


def raw_exchange(url: str, data: bytes) -> bytes:
    """Send `data` and read until the server closes the connection (a generous bound, not a timing check)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(data)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
        return out


@pytest.mark.parametrize("http", ["h11", "httptools"])
def test_slow_headers_and_bodies_are_cut_off(http):
    if http == "httptools":
        pytest.importorskip("httptools")
    app = create_gateway_app(Registry(), GatewayConfig(body_timeout_s=0.5), health_checks=False)
    srv = ServerThread(app, http=http, header_timeout_s=0.5).start()
    try:
        assert raw_exchange(srv.url, b"") == b""  # opened and silent
        assert raw_exchange(srv.url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n") == b""  # headers never end
        body_stalls = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"model\""
        answer = raw_exchange(srv.url, body_stalls)
        assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer
        assert httpx.get(f"{srv.url}/health").status_code == 200  # ordinary requests are untouched
    finally:
        srv.stop()


@pytest.mark.parametrize("http", ["h11", "httptools"])
def test_a_request_framed_by_both_content_length_and_transfer_encoding_is_refused(http):
    """Both headers (the request-smuggling ambiguity of RFC 9112 section 6.1) get 400 naming them before routing
    or credentials, and the connection is closed (`raw_exchange` reads until it is)."""
    if http == "httptools":
        pytest.importorskip("httptools")
    app = create_gateway_app(Registry(), GatewayConfig().with_api_keys([KEY]), health_checks=False)
    srv = ServerThread(app, http=http).start()
    try:
        body = b'{"model": "m", "prompt": "x"}'
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
        chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        for framing in (b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n" % len(body),
                        b"transfer-encoding: chunked\r\ncontent-length: 5\r\n"):
            answer = raw_exchange(srv.url, head + framing + b"\r\n" + chunked)  # no credential: not asked yet
            status, _, rest = answer.partition(b"\r\n")
            error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
            assert status.startswith(b"HTTP/1.1 400") and error["code"] == "ambiguous_framing"
            assert "Content-Length" in error["message"] and "Transfer-Encoding" in error["message"]
        one = b"Authorization: Bearer %s\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n" % KEY.encode()
        answer = raw_exchange(srv.url, head + one + chunked)
        assert answer.startswith(b"HTTP/1.1 404") and b"model_not_found" in answer  # one framing: routed
    finally:
        srv.stop()


def test_a_corrupt_state_database_is_kept_aside_and_replaced(tmp_path):
    path = tmp_path / "state.sqlite"
    path.write_bytes(b"this is not sqlite" * 100)
    store = Store(path)
    backups = list(tmp_path.glob("state.sqlite.corrupt-*"))
    assert len(backups) == 1 and backups[0].read_bytes().startswith(b"this is not sqlite")
    assert str(path) in store.notice and backups[0].name in store.notice
    assert store.actions()[0]["kind"] == "reset-state" and store.plan() is None
    store.set_plan(PLAN)
    assert store.plan() == PLAN


def test_an_unopenable_state_database_is_refused_naming_the_file(tmp_path):
    where = tmp_path / "a-folder.sqlite"
    where.mkdir()
    with pytest.raises(CoralInputError, match=r"a-folder\.sqlite: cannot open the controller state database"):
        Store(where)


def test_engine_app_without_a_key_stays_open():
    srv = ServerThread(create_engine_app("e0", "m", "decode", EngineTiming.constant())).start()
    try:
        r = httpx.post(f"{srv.url}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 200 and json.loads(r.text)["choices"]
    finally:
        srv.stop()


def test_a_forced_stop_still_ends_the_apps_lifespan(caplog):
    """A crash-like stop (open connections dropped) still runs the app's shutdown: nothing is cancelled midway,
    nothing logged as an error."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI

    phases: list[str] = []

    @asynccontextmanager
    async def lifespan(_app):
        phases.append("up")
        yield
        phases.append("down")

    srv = ServerThread(FastAPI(lifespan=lifespan)).start()
    with caplog.at_level("WARNING"):
        srv.stop(force=True)
    assert not srv.thread.is_alive() and phases == ["up", "down"]
    assert not [r for r in caplog.records if r.levelname in ("WARNING", "ERROR")]


def test_a_request_still_running_after_the_grace_is_cancelled_with_a_503_and_no_traceback(capfd):
    """An app that does not end its requests itself (no `closing_event`): past the grace the server cancels what is
    left, the client gets 503 `server_shutdown`, and the log says so in one warning, without a traceback."""
    from fastapi import FastAPI

    app = FastAPI()
    entered = threading.Event()

    @app.get("/stuck")
    async def stuck() -> None:
        entered.set()
        await asyncio.sleep(3600)

    srv = ServerThread(app, grace_s=0.1).start()
    answers: list[httpx.Response] = []
    client = threading.Thread(target=lambda: answers.append(httpx.get(f"{srv.url}/stuck", timeout=60)), daemon=True)
    client.start()
    assert entered.wait(30)
    srv.stop(timeout_s=30)
    client.join(30)
    assert not srv.thread.is_alive() and answers and answers[0].status_code == 503
    assert answers[0].json()["error"]["code"] == "server_shutdown"
    log = capfd.readouterr().err  # uvicorn's loggers write to stderr, not to the root logger caplog reads
    assert "cancelling 1 request(s) still running after the grace" in log
    assert "Traceback" not in log and "CancelledError" not in log and "ERROR" not in log, log


def read_while_stopping(app: Any, path: str, entered: threading.Event) -> list[str]:
    """Serve `app` (grace 0.1 s), stream GET `path` from another thread, and stop the server once `entered` is
    set; the body the client read."""
    srv = ServerThread(app, grace_s=0.1).start()
    bodies: list[str] = []

    def read() -> None:
        with httpx.stream("GET", f"{srv.url}{path}", timeout=60) as r:
            bodies.append(r.read().decode())

    client = threading.Thread(target=read, daemon=True)
    client.start()
    assert entered.wait(30)
    srv.stop(timeout_s=30)
    client.join(30)
    return bodies


def test_a_stream_still_running_after_the_grace_ends_with_an_error_event_and_done(capfd):
    """An app without a `closing_event` whose SSE stream had started: past the grace the server cancels it and ends
    the stream itself, with an error event and `[DONE]` (uvicorn logged "ASGI callable returned without
    completing response" at ERROR for each: 7 in one run of `benchmarks/reliability.py`)."""
    from fastapi import FastAPI
    from starlette.responses import StreamingResponse

    app = FastAPI()
    entered = threading.Event()

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def events():  # type: ignore[no-untyped-def]
            yield b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'
            entered.set()
            await asyncio.sleep(3600)
            yield b"never"

        return StreamingResponse(events(), media_type="text/event-stream")

    bodies = read_while_stopping(app, "/stream", entered)
    assert bodies and bodies[0].rstrip().endswith("data: [DONE]") and '"server_shutdown"' in bodies[0]
    log = capfd.readouterr().err
    assert "Traceback" not in log and "ERROR" not in log, log


def test_a_stream_whose_answer_was_whole_ends_quietly_when_cancelled_after_the_grace(capfd):
    """A stream that sent its last chunk but whose app had not returned yet (starlette still waiting on its
    disconnect listener) when the grace ran out: cancelled, nothing more is sent (uvicorn raised "Unexpected ASGI
    message 'http.response.body' sent, after response already completed" with a traceback, once in a run of
    `benchmarks/reliability.py`)."""
    entered = threading.Event()

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        entered.set()
        await asyncio.sleep(3600)

    assert read_while_stopping(app, "/", entered) == ["data: [DONE]\n\n"]
    log = capfd.readouterr().err
    assert "Traceback" not in log and "ERROR" not in log, log


def wait_until(check, tries: int = 600) -> bool:
    """Poll `check` (bounded: `tries` x 0.1 s)."""
    for _ in range(tries):
        with contextlib.suppress(httpx.HTTPError):
            if check():
                return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("second_signal", [False, True])
def test_sigterm_drains_stuck_requests_for_a_bounded_grace_then_exits(tmp_path, second_signal):
    """`coral serve` with a request that never finishes: SIGTERM exits after the grace period (a second SIGTERM:
    at once, the grace being far longer than the test's bound), and the stuck client sees its connection end."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    grace = "600" if second_signal else "1"
    cmd = [sys.executable, "-m", "coral.cli.main", "serve", "core", "--plan", str(PLAN.save(tmp_path / "p.json")),
           "--port", str(port), "--db", str(tmp_path / "s.sqlite"), "--time-scale", "1000", "--grace", grace]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    stuck: list[BaseException | int] = []

    def client() -> None:
        body = {"model": "phi-4", "prompt": "x", "max_tokens": 1000, "stream": True}
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                stuck.append(r.status_code)
                for _ in r.iter_bytes():
                    pass
        except httpx.HTTPError as exc:
            stuck.append(exc)

    try:
        assert wait_until(lambda: httpx.get(f"{url}/health").json()["routable"] == 1), proc.stdout.read1().decode()
        thread = threading.Thread(target=client, daemon=True)
        thread.start()
        assert wait_until(lambda: httpx.get(f"{url}/gateway/state").json()["queue"]["active"] == 1)
        proc.send_signal(signal.SIGTERM)
        if second_signal:
            time.sleep(1)  # let the first signal start the shutdown (not a timing assertion)
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=90)
        thread.join(timeout=30)
        assert not thread.is_alive() and stuck  # answered (a 5xx: cut by the shutdown) or its connection closed
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


@pytest.mark.parametrize("second_signal", [False, True])
def test_a_shutdown_ends_open_streams_with_an_error_event_and_done_and_logs_no_traceback(tmp_path, second_signal):
    """`coral serve` with streams that started and a request still waiting for its answer: past the grace (or at a
    second SIGTERM) each stream ends with an SSE error event `server_shutdown` and `data: [DONE]`, the waiting
    request gets 503 `server_shutdown`, the process exits 0, and nothing it logged is a traceback."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    grace = "600" if second_signal else "1"
    # time scale 20: phi-4's emulated steps take ~0.7 s, so the 1000-token answers below outlast the test
    cmd = [sys.executable, "-m", "coral.cli.main", "serve", "core", "--plan", str(PLAN.save(tmp_path / "p.json")),
           "--port", str(port), "--db", str(tmp_path / "s.sqlite"), "--time-scale", "20", "--grace", grace]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    streams, started = [b"", b""], [threading.Event(), threading.Event()]
    waiting: list[httpx.Response] = []

    def stream(k: int) -> None:
        body = {"model": "phi-4", "prompt": "x", "max_tokens": 1000, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            for piece in r.iter_bytes():
                streams[k] += piece
                started[k].set()

    def ask() -> None:
        body = {"model": "phi-4", "prompt": "x", "max_tokens": 1000}
        waiting.append(httpx.post(f"{url}/v1/completions", json=body, timeout=120))

    try:
        assert wait_until(lambda: httpx.get(f"{url}/health").json()["routable"] == 1), proc.stderr.read1().decode()
        threads = [threading.Thread(target=stream, args=(k,), daemon=True) for k in range(2)]
        threads.append(threading.Thread(target=ask, daemon=True))
        for t in threads:
            t.start()
        assert all(s.wait(60) for s in started)  # both streams have their first chunk
        assert wait_until(lambda: httpx.get(f"{url}/gateway/state").json()["queue"]["active"] == 3)
        proc.send_signal(signal.SIGTERM)
        if second_signal:
            time.sleep(1)  # let the first signal start the shutdown (not a timing assertion)
            proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=90)
        for t in threads:
            t.join(timeout=30)
        assert proc.returncode == 0 and not any(t.is_alive() for t in threads)
        for raw in streams:
            events = sse_events(raw.decode())
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "server_shutdown", raw[-400:]
            assert events[-2]["error"]["type"] == error_type(503) and len(events) > 2  # tokens came first
        assert waiting[0].status_code == 503 and waiting[0].json()["error"]["code"] == "server_shutdown"
        log = err.decode()
        assert "Traceback" not in log and "CancelledError" not in log and "ERROR" not in log, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)


def test_prompts_longer_than_the_context_are_refused_before_routing():
    with stack(GatewayConfig(max_prompt_tokens=1000)) as s:
        s.engine("d0", "m", "decode", 1.0, FAST)
        url = s.gateway.url
        for body in ({"model": "m", "prompt": "x" * 16_001}, {"model": "m", "prompt": list(range(1001))},
                     {"model": "m", "prompt": [list(range(5)), list(range(1001))]}, chat(text="y" * 16_001)):
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            r = httpx.post(f"{url}{path}", json=body)
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", body
        assert s.state("d0").served == 0
        with_output = {"model": "m", "prompt": list(range(1000)), "max_tokens": 1}  # the prompt fits, not its answer
        r = httpx.post(f"{url}/v1/completions", json=with_output)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        fits = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": list(range(999)), "max_tokens": 1})
        assert fits.status_code == 200 and s.state("d0").served == 1


def test_each_model_is_bounded_by_its_catalog_context_and_n_x_max_tokens_by_the_cap():
    from coral.catalog.loader import builtin_catalog

    assert GatewayConfig().context_of("llama-2-70b") == builtin_catalog().model("llama-2-70b").max_position_embeddings
    assert GatewayConfig(max_prompt_tokens=777).context_of("not-in-the-catalog") == 777
    with stack(GatewayConfig(max_output_tokens=100)) as s:
        s.engine("d0", "llama-2-70b", "decode", 1.0, FAST)  # a context of 4,096 tokens
        s.engine("d1", "m", "decode", 1.0, FAST)  # not in the catalog: the global bound (131,072)
        url = f"{s.gateway.url}/v1/completions"
        over = {"model": "llama-2-70b", "prompt": list(range(4000)), "max_tokens": 97}
        r = httpx.post(url, json=over)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert "4096" in r.json()["error"]["message"]
        assert httpx.post(url, json={**over, "model": "m"}).status_code == 200
        assert httpx.post(url, json={**over, "max_tokens": 96}).status_code == 200
        many = httpx.post(url, json={"model": "m", "prompt": "x", "max_tokens": 51, "n": 2})
        assert many.status_code == 400 and many.json()["error"]["code"] == "too_many_tokens"
        assert httpx.post(url, json={"model": "m", "prompt": "x", "max_tokens": 50, "n": 2}).status_code == 200


def test_a_timed_out_request_is_not_retried_and_its_instance_is_ejected():
    with stack(GatewayConfig(request_timeout_s=0.5, eject_s=3600)) as s:
        s.engine("stuck", "m", "decode", 10.0, EngineTiming.constant(ttft_s=3600))
        s.engine("ok", "m", "decode", 1.0, FAST)
        url = f"{s.gateway.url}/v1/chat/completions"
        r = httpx.post(url, json=chat(), timeout=60)
        assert r.status_code == 504 and "stuck did not answer" in r.json()["error"]["message"]
        assert s.state("ok").served == 0  # not sent again elsewhere
        for _ in range(5):
            r = httpx.post(url, json=chat(), timeout=60)
            assert r.status_code == 200 and r.headers["x-coral-instance"] == "ok"
        assert all(e.inflight == 0 for e in s.registry.all()) and s.gw.active == 0


@pytest.mark.parametrize(
    ("change", "where", "why"),
    [
        (("request_rate: 10", "request_rate: 1e12"), "models.0.request_rate", "less than or equal to 100000"),
        (("request_rate: 10", "request_rate: .inf"), "models.0.request_rate", "finite number"),
        (("decode_slo_ms: 60", "decode_slo_ms: .nan"), "models.0.decode_slo_ms", "finite number"),
        (("mean_input_tokens: 1155", "mean_input_tokens: 1e9"), "models.0.mean_input_tokens", "less than"),
        (("[aws-us-east-2, aws-ap-northeast-2]", "[aws-us-east-2, aws-us-east-2]"), "regions", "unique"),
    ],
)
def test_scenario_numbers_are_bounded_and_errors_name_file_and_field(tmp_path, change, where, why):
    from coral.catalog.loader import data_path, load_scenario

    text = data_path("scenarios", "core.yaml").read_text()
    assert change[0] in text
    path = tmp_path / "bad.yaml"
    path.write_text(text.replace(change[0], change[1], 1))
    with pytest.raises(CoralInputError) as e:
        load_scenario(path)
    assert str(path) in str(e.value) and where in str(e.value) and why in str(e.value)


def test_the_prefill_phase_times_out_from_its_own_budget_and_is_not_redone_by_decode():
    with stack(GatewayConfig(prefill_timeout_s={"m": 0.5}, eject_s=3600)) as s:
        s.engine("p0", "m", "prefill", 10.0, EngineTiming.constant(ttft_s=3600))
        s.engine("p1", "m", "prefill", 1.0, FAST)
        s.engine("d0", "m", "decode", 1.0, FAST)
        url = f"{s.gateway.url}/v1/chat/completions"
        r = httpx.post(url, json=chat(), timeout=60)
        assert r.status_code == 504 and "p0 did not answer within 0.5 s" in r.json()["error"]["message"]
        assert s.state("d0").served == 0 and s.state("p1").served == 0  # not prefilled elsewhere instead
        r = httpx.post(url, json=chat(), timeout=60)  # p0 ejected: p1 prefills
        assert r.status_code == 200 and s.state("p1").served == 1 and s.state("d0").prefills == 0


def test_pd_streams_are_retried_past_a_refused_connection():
    with stack() as s:
        s.engine("p0", "m", "prefill", 1.0, FAST)
        s.engine("d0", "m", "decode", 1.0, FAST)
        dead = s.engine("d1", "m", "decode", 100.0, FAST)
        dead.stop(force=True)  # picked first (larger weight), refuses the connection: retried on d0
        r = httpx.post(f"{s.gateway.url}/v1/chat/completions", json=chat(n=5), timeout=10)
        with httpx.stream("POST", f"{s.gateway.url}/v1/chat/completions", json=chat(n=3, stream=True)) as st:
            streamed = st.read().decode()
        assert r.status_code == 200 and r.headers["x-coral-instance"] == "d0"
        assert len(r.json()["choices"][0]["message"]["content"].split()) == 5
        assert streamed.rstrip().endswith("data: [DONE]") and streamed.count("data: ") == 4
        assert all(e.inflight == 0 for e in s.registry.all()) and s.gw.active == 0


def test_a_client_that_has_read_a_streams_end_sees_every_count_released():
    """The gateway releases an answer's instance and admission slot before it sends the stream's end, so counts
    read right after the end are true (they were released after it: 3 of 22 runs of the test above failed)."""
    with stack() as s:
        s.engine("p0", "m", "prefill", 1.0, FAST)
        s.engine("d0", "m", "decode", 1.0, FAST)
        with httpx.Client(base_url=s.gateway.url, timeout=10) as client:
            for _ in range(40):
                with client.stream("POST", "/v1/chat/completions", json=chat(n=2, stream=True)) as st:
                    assert st.read().decode().rstrip().endswith("data: [DONE]")
                assert [e.inflight for e in s.registry.all()] == [0, 0] and s.gw.active == 0


def test_serve_sizes_phase_timeouts_from_the_scenarios_ttft_and_tpot_slos():
    from coral.catalog.loader import load_scenario
    from coral.cli.runtime import prefill_timeouts, token_timeouts

    core = load_scenario("core")
    assert prefill_timeouts(core, 10.0) == {m.model: m.prefill_slo_ms / 100 for m in core.models}
    assert token_timeouts(core, 10.0) == {m.model: m.decode_slo_ms / 100 for m in core.models}
    assert prefill_timeouts(core, 0.0) == token_timeouts(core, 0.0) == {}


def test_answer_budgets_follow_the_slos_and_max_tokens():
    from coral.runtime.gateway import Budget, answer_budget

    cfg = GatewayConfig(request_timeout_s=300, prefill_timeout_s={"m": 2.0}, token_timeout_s={"m": 0.5},
                        max_prompt_tokens=1000)
    streamed = {"model": "m", "prompt": "x", "max_tokens": 100, "stream": True}
    assert answer_budget(cfg, "m", streamed, prefill_only=True) == Budget(2.0, 2.0, 2.0)
    assert answer_budget(cfg, "m", streamed, prefill_only=False) == Budget(2.0, 0.5, 52.0)
    whole = {**streamed, "stream": False}  # comes at the end: the first byte may take the whole bound
    assert answer_budget(cfg, "m", whole, prefill_only=False) == Budget(52.0, 0.5, 52.0)
    assert answer_budget(cfg, "m", {**whole, "max_tokens": 200}, prefill_only=False).total_s == 102.0
    no_max = {"model": "m", "messages": [], "stream": True}  # unset: as many as the context holds
    assert answer_budget(cfg, "m", no_max, prefill_only=False).total_s == 502.0
    assert answer_budget(cfg, "other", streamed, prefill_only=False) == Budget(300, 300)  # no SLO: no bound


def test_a_busy_instance_that_keeps_delivering_is_not_cut_for_one_streams_gaps():
    """Each stream gets a token every 1 s, more than the 0.8 s token timeout, but the instance delivers to one of
    its 5 staggered streams every 0.2 s: busy, not stalled, so no stream is cut (each would be, alone). (The
    margins are wide so that a loaded machine's jitter in the streams' starts does not open a 0.8 s gap; with
    0.5 s / 0.3 s / 0.1 s it failed once beside two busy processes.)"""
    from concurrent.futures import ThreadPoolExecutor

    with stack(GatewayConfig(token_timeout_s={"m": 0.8}, eject_s=3600)) as s:
        s.engine("busy", "m", "decode", 1.0, EngineTiming.constant(itl_s=1.0))
        url = f"{s.gateway.url}/v1/chat/completions"

        def one(delay: float) -> list[object]:
            time.sleep(delay)
            with httpx.stream("POST", url, json=chat(n=6, stream=True), timeout=60) as r:
                return sse_events(r.read().decode())

        with ThreadPoolExecutor(5) as pool:
            answers = list(pool.map(one, [0.2 * k for k in range(5)]))
        assert all(not any("error" in e for e in events) for events in answers), answers  # type: ignore[operator]
        busy = s.registry.get("busy")
        assert busy is not None and busy.ejections == 0


def test_a_phase_with_no_capacity_left_is_refused_with_a_finite_retry_after():
    """The decode instance of a PD model is found dead (its node killed) while the gateway sheds the model's
    lost capacity: nothing serves its decode phase, the wait for capacity is infinite, and the request gets 429
    `model_over_capacity` with the gateway's Retry-After (before: 500 `internal_error` OverflowError, once
    under `benchmarks/engine_load.py`'s node kill)."""
    plan = make_plan([make_instance("m", "prefill", [(40, ["1xL40S"])], 100.0, template_id=1),
                      make_instance("m", "decode", [(40, ["1xL4"])], 100.0, template_id=2)])
    with stack(GatewayConfig(shed="plan", retry_after_s=2)) as s:
        s.registry.plan = plan
        s.engine("p0", "m", "prefill", 100.0, FAST)
        decode = s.engine("d0", "m", "decode", 100.0, FAST)
        assert httpx.post(f"{s.gateway.url}/v1/chat/completions", json=chat(), timeout=30).status_code == 200
        dead = s.registry.get("d0")
        assert dead is not None
        dead.healthy = False  # as the health probe or the controller's watchdog marks it
        decode.stop(force=True)
        for stream in (False, True):
            r = httpx.post(f"{s.gateway.url}/v1/chat/completions", json=chat(stream=stream), timeout=30)
            assert r.status_code == 429, r.text
            err = r.json()["error"]
            assert err["code"] == "model_over_capacity" and r.headers["retry-after"] == "2"
            assert "nothing serves its decode now" in err["message"] and "decode 0 tokens/s" in err["message"]


def test_a_stream_that_stops_producing_tokens_is_cut_and_its_instance_ejected():
    with stack(GatewayConfig(token_timeout_s={"m": 0.3}, eject_s=3600)) as s:
        s.engine("slow", "m", "decode", 10.0, EngineTiming.constant(itl_s=3600))  # first token, then nothing
        s.engine("ok", "m", "decode", 1.0, FAST)
        url = f"{s.gateway.url}/v1/chat/completions"
        with httpx.stream("POST", url, json=chat(n=4, stream=True), timeout=60) as r:
            assert r.status_code == 200 and r.headers["x-coral-instance"] == "slow"
            events = sse_events(r.read().decode())
        assert len(events) == 2 and events[0]["choices"][0]["delta"]["content"]  # type: ignore[index]
        assert "slow stalled mid-answer" in events[1]["error"]["message"]  # type: ignore[index]
        assert s.state("ok").served == 0  # not sent again elsewhere
        for stream in (True, False, True):
            r = httpx.post(url, json=chat(n=4, stream=stream), timeout=60)
            assert r.status_code == 200 and r.headers["x-coral-instance"] == "ok"
        slow = s.registry.get("slow")
        assert slow is not None and not slow.routable and slow.ejections == 1
        assert 'coral_gateway_ejections_total{instance="slow"} 1.0' in httpx.get(f"{s.gateway.url}/metrics").text
        assert all(e.inflight == 0 for e in s.registry.all()) and s.gw.active == 0


def test_a_non_streamed_answer_is_bounded_by_its_max_tokens():
    cfg = GatewayConfig(prefill_timeout_s={"m": 0.2}, token_timeout_s={"m": 0.1}, eject_s=3600)
    with stack(cfg) as s:
        s.engine("slow", "m", "decode", 10.0, EngineTiming.constant(itl_s=3600))
        s.engine("ok", "m", "decode", 1.0, FAST)
        url = f"{s.gateway.url}/v1/chat/completions"
        r = httpx.post(url, json=chat(n=3), timeout=60)
        assert r.status_code == 504 and "slow did not answer within 0.5 s" in r.json()["error"]["message"]
        assert s.state("ok").served == 0
        r = httpx.post(url, json=chat(n=100), timeout=60)  # a longer answer gets a longer bound
        assert r.status_code == 200 and r.headers["x-coral-instance"] == "ok"
        assert all(e.inflight == 0 for e in s.registry.all()) and s.gw.active == 0


def test_an_ejected_instance_takes_one_request_at_a_time_until_one_completes():
    from coral.runtime.registry import Endpoint, InstanceState

    ep = Endpoint("e", "m", "decode", "http://x", 1.0, InstanceState.READY)
    for k in range(1, 8):  # each consecutive ejection doubles its length, up to 16 x
        before = time.monotonic()
        ep.eject(10.0)
        assert before + 10.0 * 2 ** min(k - 1, 4) <= ep.ejected_until <= time.monotonic() + 10.0 * 2 ** min(k - 1, 4)
    with stack(GatewayConfig(request_timeout_s=0.5, eject_s=0.0)) as s:  # eject_s=0: on probation at once
        s.engine("stuck", "m", "decode", 10.0, EngineTiming.constant(ttft_s=3600))
        s.engine("ok", "m", "decode", 1.0, FAST)
        url = f"{s.gateway.url}/v1/chat/completions"
        assert httpx.post(url, json=chat(), timeout=60).status_code == 504
        stuck = s.registry.get("stuck")
        assert stuck is not None and stuck.ejections == 1 and stuck.routable
        probe = s.registry.pick("m", "decode")  # its one request (it has most of the weight)
        assert probe is stuck
        for _ in range(4):  # while the probe is out, every request goes elsewhere
            r = httpx.post(url, json=chat(), timeout=60)
            assert r.status_code == 200 and r.headers["x-coral-instance"] == "ok"
        s.registry.release(probe, ok=True)  # the probe completed: back in full rotation
        assert stuck.ejections == 0
        assert s.registry.pick("m", "decode") is stuck and s.registry.pick("m", "decode") is stuck
        for _ in range(2):
            s.registry.release(stuck, ok=False)


def test_requests_pile_up_on_a_stuck_instance_only_up_to_its_weighted_share():
    """An instance that answers nothing (and no timeout yet) stops getting new requests once it holds more than
    `max_excess` above its weighted share of the pool's in-flight requests; the rest are served elsewhere."""
    with stack(GatewayConfig(request_timeout_s=600)) as s:
        s.engine("stuck", "m", "decode", 1.0, EngineTiming.constant(ttft_s=3600))
        s.engine("ok", "m", "decode", 1.0, FAST)
        stuck = s.registry.get("stuck")
        assert stuck is not None

        async def run() -> tuple[list[int], int]:
            async with httpx.AsyncClient(base_url=s.gateway.url, timeout=600) as c:
                tasks = []
                for i in range(30):  # one at a time: each is answered by "ok" or held by "stuck"
                    held = stuck.inflight
                    task = asyncio.create_task(c.post("/v1/chat/completions", json=chat(text=f"q {i}")))
                    while not task.done() and stuck.inflight == held:
                        await asyncio.sleep(0.01)
                    tasks.append(task)
                done, held = [t.result().status_code for t in tasks if t.done()], stuck.inflight
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                return done, held

        answered, held = asyncio.run(run())
        # equal weights: picked while held - (held + 1) / 2 <= max_excess, i.e. at most 2 max_excess + 2 times
        assert 1 <= held <= 2 * s.registry.max_excess + 2 and answered == [200] * (30 - held)
        assert s.state("ok").served == 30 - held
