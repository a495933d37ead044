"""Gateway API keys, per-key rate limits, body-size limits, the controller's admin token, loopback defaults and
no secrets in output."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import openai
import pytest
import typer
from test_runtime_gateway import FAST, chat, stack

from coral.catalog.loader import CoralInputError
from coral.cli.main import app as cli_app
from coral.http_serving import ServerThread, free_port
from coral.runtime.controller import Controller, Store, controller_router
from coral.runtime.emulated import EngineTiming, create_engine_app
from coral.runtime.gateway import GatewayConfig, RateLimiter, create_gateway_app, load_secrets
from coral.runtime.handmade import make_instance, make_plan
from coral.runtime.registry import Registry

pytestmark = pytest.mark.timeout(120)

KEY_A, KEY_B = "sk-coral-test-alpha-0001", "sk-coral-test-beta-0002"


def openai_client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def test_api_keys_guard_the_openai_routes():
    with stack(GatewayConfig().with_api_keys([KEY_A, KEY_B])) as s:
        s.engine("d0", "m", "decode", 1.0, FAST)
        url = s.gateway.url
        for key in (KEY_A, KEY_B):
            r = openai_client(url, key).completions.create(model="m", prompt="x", max_tokens=1)
            assert r.choices[0].text
        with pytest.raises(openai.AuthenticationError) as e:
            openai_client(url, KEY_A + "x").models.list()
        assert e.value.body["code"] == "invalid_api_key"  # type: ignore[index]
        assert KEY_A not in e.value.response.text
        for headers in ({}, {"Authorization": KEY_A}, {"Authorization": f"Basic {KEY_A}"}):
            r = httpx.post(f"{url}/v1/chat/completions", json=chat(), headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.post(f"{url}/v1/embeddings", json={"model": "m", "input": "x"}).status_code == 401
        assert httpx.get(f"{url}/health").status_code == 200  # probes stay open
        assert KEY_A not in repr(s.gw.config) and KEY_A not in str(s.gw.state())


def test_rate_limit_per_key_answers_429_with_retry_after():
    cfg = GatewayConfig(rate_limit_rps=0.5, rate_limit_burst=2).with_api_keys([KEY_A, KEY_B])
    with stack(cfg) as s:
        s.engine("d0", "m", "decode", 1.0, FAST)
        a = openai_client(s.gateway.url, KEY_A)
        for _ in range(2):
            a.completions.create(model="m", prompt="x", max_tokens=1)
        with pytest.raises(openai.RateLimitError) as e:
            a.completions.create(model="m", prompt="x", max_tokens=1)
        assert int(e.value.response.headers["retry-after"]) >= 1
        assert e.value.body["type"] == "rate_limit_error"  # type: ignore[index]
        # another key has its own bucket
        openai_client(s.gateway.url, KEY_B).completions.create(model="m", prompt="x", max_tokens=1)
        assert s.gw.active == 0


def test_rate_limiter_refills_at_its_rate(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    rl = RateLimiter(rate=2.0, burst=2)
    assert [rl.wait_s("k") for _ in range(2)] == [0.0, 0.0]
    assert rl.wait_s("k") == pytest.approx(0.5)
    now[0] += 0.5
    assert rl.wait_s("k") == 0.0 and rl.wait_s("other") == 0.0
    assert RateLimiter(0.0, 0).wait_s("k") == 0.0  # off


def test_a_client_still_sending_a_body_over_the_limit_reads_the_413() -> None:
    """The gateway reads and drops the rest of a refused body (up to DRAIN_BYTES past the limit) before it answers:
    closing on unread data reset the connection, so an async client sending 20 MB got a ReadError, not the 413
    (`benchmarks/reliability.py`, 3 of 3)."""
    import asyncio

    async def post(url: str) -> httpx.Response:
        async with httpx.AsyncClient(timeout=60) as client:
            return await client.post(url, content=b"x" * (20 << 20), headers={"content-type": "application/json"})

    with stack(GatewayConfig(max_body_bytes=1 << 20)) as s:
        s.engine("d0", "m", "decode", 1.0, FAST)
        for _ in range(3):
            r = asyncio.run(post(f"{s.gateway.url}/v1/chat/completions"))
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_body_size_limit_gives_413_even_without_content_length():
    with stack(GatewayConfig(max_body_bytes=2000)) as s:
        s.engine("d0", "m", "decode", 1.0, FAST)
        url = f"{s.gateway.url}/v1/chat/completions"
        big = chat(text="word " * 1000)
        r = httpx.post(url, json=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunks():  # chunked transfer: no Content-Length to trust
            yield b'{"model": "m", "messages": [{"role": "user", "content": "'
            for _ in range(100):
                yield b"x" * 100
            yield b'"}]}'

        r = httpx.post(url, content=chunks())
        assert r.status_code == 413
        assert httpx.post(url, json=chat()).status_code == 200
        assert s.gw.active == 0 and s.registry.get("d0").inflight == 0  # type: ignore[union-attr]


def test_controller_replan_needs_the_admin_token(tmp_path):
    backend_plan = make_plan([make_instance("phi-4", "decode", [(40, ["1xL40S"])], 100.0)])

    class NoBackend:
        def start(self, instance):  # type: ignore[no-untyped-def]
            raise RuntimeError("not started in this test")

        def stop(self, instance_id, handle):  # type: ignore[no-untyped-def]
            pass

        def alive(self, instance_id, handle):  # type: ignore[no-untyped-def]
            return False

    registry = Registry()
    c = Controller(Store(tmp_path / "s.sqlite"), NoBackend(), registry)  # type: ignore[arg-type]
    token = "admin-token-for-tests-123"
    app = create_gateway_app(
        registry, extra_routers=[controller_router(c, admin_token=token)], health_checks=False
    )
    srv = ServerThread(app).start()
    try:
        body = backend_plan.model_dump_json()
        for headers in ({}, {"Authorization": "Bearer wrong-token-123"}, {"Authorization": token}):
            r = httpx.post(f"{srv.url}/replan", content=body, headers=headers)
            assert r.status_code == 401 and token not in r.text
        assert c.store.plan() is None  # nothing adopted
        assert httpx.get(f"{srv.url}/state").status_code == 200  # reading stays open
        ok = httpx.post(f"{srv.url}/replan", content=body, headers={"Authorization": f"Bearer {token}"})
        assert ok.status_code == 200 and c.store.plan() is not None
    finally:
        srv.stop()


def test_cli_binds_loopback_by_default():
    commands = typer.main.get_command(cli_app).commands  # type: ignore[attr-defined]
    for name in ("gateway", "serve"):
        host = next(p for p in commands[name].params if p.name == "host")
        assert host.default == "127.0.0.1", name


def test_load_secrets_from_file_and_env_without_echoing_them(tmp_path, monkeypatch):
    f = tmp_path / "keys.txt"
    f.write_text(f"# team keys\n{KEY_A}\n\n  {KEY_B}  \n")
    monkeypatch.setenv("X_KEYS", "sk-from-env-0003, sk-from-env-0004")
    assert load_secrets("X_KEYS", f) == ["sk-from-env-0003", "sk-from-env-0004", KEY_A, KEY_B]
    f.write_text("short\n")
    with pytest.raises(CoralInputError) as e:
        load_secrets("NOPE_UNSET", f)
    assert "short" not in str(e.value)
    with pytest.raises(CoralInputError, match="cannot read"):
        load_secrets("NOPE_UNSET", tmp_path / "missing.txt")


def test_gateway_cli_with_keys_never_prints_them(tmp_path):
    """`coral gateway` with keys from a file and the env: requests with right and wrong keys; the key appears
    nowhere in its output."""
    from coral.deploy.endpoints import EndpointsFile, EndpointSpec

    engine = ServerThread(create_engine_app("e0", "m", "decode", EngineTiming.constant())).start()
    spec = EndpointsFile(
        endpoints=[EndpointSpec(id="e0", model="m", phase="decode", url=engine.url, weight=1.0)]
    )  # type: ignore[arg-type]
    path = spec.save(tmp_path / "endpoints.json")
    keys = tmp_path / "keys.txt"
    keys.write_text(KEY_A + "\n")
    port = free_port()
    cmd = [sys.executable, "-m", "coral.cli.main", "gateway", "--endpoints", str(path), "--port", str(port)]
    env = {**os.environ, "CORAL_API_KEYS": KEY_B}
    proc = subprocess.Popen(
        [*cmd, "--api-keys-file", str(keys)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                httpx.get(f"{url}/health", timeout=2)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        for key, status in ((KEY_A, 200), (KEY_B, 200), (KEY_A[:-1], 401)):
            r = httpx.post(
                f"{url}/v1/chat/completions", json=chat(), headers={"Authorization": f"Bearer {key}"}
            )
            assert r.status_code == status
    finally:
        proc.terminate()
        out = proc.communicate(timeout=20)[0].decode()
        engine.stop()
    assert "API keys: 2" in out
    assert KEY_A not in out and KEY_B not in out and KEY_A[:-1] not in out


def test_answers_name_their_instance_only_when_enabled_or_for_the_admin_token():
    admin = "admin-token-for-ids-0004"
    for enabled in (False, True):
        with stack(GatewayConfig().with_tokens(admin=[admin]), instance_header=enabled) as s:
            s.engine("d0", "m", "decode", 1.0, FAST)
            url = f"{s.gateway.url}/v1/chat/completions"
            for asked in ({}, {"x-coral-admin-token": admin + "x"}, {"x-coral-admin-token": admin}):
                shown = enabled or asked.get("x-coral-admin-token") == admin
                r = httpx.post(url, json=chat(), headers=asked, timeout=10)
                with httpx.stream("POST", url, json=chat(stream=True), headers=asked, timeout=10) as st:
                    streamed = st.read().decode()
                    headers = st.headers
                assert r.status_code == 200 and streamed.rstrip().endswith("data: [DONE]")
                for h in (r.headers, headers):
                    assert h.get("x-coral-instance") == ("d0" if shown else None), (enabled, asked)
