"""Controller on loopback: reconcile through the emulated backend, drain-then-stop, restart from SQLite,
HTTP API and `coral status`, and an end-to-end request through controller-managed emulated engines."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from typer.testing import CliRunner

from coral.allocation.plan import Plan
from coral.catalog.loader import load_scenario
from coral.cli.main import app as cli_app
from coral.cli.runtime import build_runtime
from coral.http_serving import ServerThread
from coral.runtime.backends import EmulatedBackend, Handle
from coral.runtime.controller import Controller, Store, controller_router
from coral.runtime.gateway import create_gateway_app
from coral.runtime.handmade import make_instance, make_plan
from coral.runtime.registry import InstanceState, Registry

pytestmark = pytest.mark.timeout(120)

TIME_SCALE = 0.001  # perf-model delays shrunk 1000x


def plan_of(n_decode: int) -> Plan:
    insts = [make_instance("phi-4", "prefill", [(40, ["1xL40S"])], 6000.0, template_id=1)]
    insts += [
        make_instance("phi-4", "decode", [(20, ["1xL4"]), (20, ["1xL4"])], 500.0, template_id=2, index=k)
        for k in range(n_decode)
    ]
    return make_plan(insts)


class Crash(Exception):
    """Stands for the controller process dying."""


class CrashOnStop:
    """Backend wrapper whose first `stop` crashes the controller (the instance keeps running)."""

    def __init__(self, inner: EmulatedBackend) -> None:
        self.inner = inner

    def start(self, instance):  # type: ignore[no-untyped-def]
        return self.inner.start(instance)

    def stop(self, instance_id: str, handle: Handle) -> None:
        raise Crash(instance_id)

    def alive(self, instance_id: str, handle: Handle) -> bool:
        return self.inner.alive(instance_id, handle)


@pytest.fixture
def backend():
    b = EmulatedBackend(time_scale=TIME_SCALE, scenario=load_scenario("core"))
    yield b
    b.close()


def controller(tmp_path, backend, registry=None, **kw) -> Controller:
    return Controller(
        Store(tmp_path / "state.sqlite"), backend, registry or Registry(), ready_timeout_s=10, **kw
    )


def test_reconcile_scale_up_and_drain_down(tmp_path, backend):
    c = controller(tmp_path, backend)
    c.set_plan(plan_of(3))
    done = c.reconcile()
    assert len(done["started"]) == 4 and done["stopped"] == []
    assert {e.id for e in c.registry.all() if e.routable} == {i.id for i in plan_of(3).instances}
    assert all(backend.alive(i.id, {}) for i in plan_of(3).instances)
    assert c.reconcile() == {"started": [], "stopped": []}  # idempotent

    gone = plan_of(3).instances[-1].id
    c.set_plan(plan_of(2))
    assert c.reconcile() == {"started": [], "stopped": [gone]}
    assert not backend.alive(gone, {}) and c.registry.get(gone) is None
    kinds = [(a["kind"], a["status"]) for a in c.store.actions()]
    assert kinds.count(("start", "done")) == 4 and kinds.count(("drain", "done")) == 1
    assert backend.starts == 4


def test_drain_waits_for_inflight(tmp_path, backend):
    c = controller(tmp_path, backend, drain_timeout_s=60)
    c.set_plan(plan_of(2))
    c.reconcile()
    victim = plan_of(2).instances[-1].id
    ep = c.registry.get(victim)
    assert ep is not None
    ep.state = InstanceState.READY
    ep.inflight += 1  # one request still running on it
    c.set_plan(plan_of(1))
    t = threading.Thread(target=c.reconcile)
    t.start()
    deadline = time.monotonic() + 10
    while ep.state is not InstanceState.DRAINING and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ep.state is InstanceState.DRAINING and not ep.routable
    assert backend.alive(victim, {})  # not stopped while the request runs
    c.registry.release(ep, ok=True)
    t.join(10)
    assert not t.is_alive() and not backend.alive(victim, {})
    assert c.store.actions()[0]["detail"] == "drained"


def test_restart_resumes_pending_drain_from_sqlite(tmp_path, backend):
    a = controller(tmp_path, backend)
    a.set_plan(plan_of(3))
    a.reconcile()
    victim = plan_of(3).instances[-1].id
    a.set_plan(plan_of(2))
    a.backend = CrashOnStop(backend)
    with pytest.raises(Crash):
        a.reconcile()
    pending = [r for r in a.store.actions() if r["status"] == "pending"]
    assert [(r["kind"], r["instance_id"]) for r in pending] == [("drain", victim)]
    a.store.close()

    registry = Registry()
    b = controller(tmp_path, backend, registry)  # a new process: fresh gateway registry, same SQLite file
    assert b.store.plan() == plan_of(2)
    assert {e.id: e.state for e in registry.all()}[victim] is InstanceState.DRAINING
    assert sum(e.routable for e in registry.all()) == 3  # survivors adopted, not restarted
    assert b.reconcile() == {"started": [], "stopped": [victim]}
    assert backend.starts == 4 and not backend.alive(victim, {})
    row = next(r for r in b.store.actions() if r["seq"] == pending[0]["seq"])
    assert row["status"] == "done"  # the same action row completed, not a duplicate
    assert sum(r["kind"] == "drain" for r in b.store.actions()) == 1


def test_restart_forgets_instances_that_died(tmp_path, backend):
    a = controller(tmp_path, backend)
    a.set_plan(plan_of(1))
    a.reconcile()
    a.store.close()
    dead = plan_of(1).instances[-1].id
    backend.stop(dead, {})
    b = controller(tmp_path, backend)
    assert b.registry.get(dead) is None
    assert b.reconcile()["started"] == [dead]  # still planned: started again
    assert any(r["kind"] == "lost" and r["instance_id"] == dead for r in b.store.actions())


def test_http_api_status_and_end_to_end(tmp_path):
    plans = [plan_of(1)]
    engines = EmulatedBackend(time_scale=TIME_SCALE, scenario=load_scenario("core"))
    gw_app, c = build_runtime(lambda: plans[-1], Store(tmp_path / "rt.sqlite"), engines, 3600)
    srv = ServerThread(gw_app).start()
    try:
        r = httpx.post(f"{srv.url}/replan", params={"wait": True}, timeout=30)
        assert r.status_code == 200
        st = r.json()
        assert {i["state"] for i in st["instances"]} == {"ready"} and len(st["instances"]) == 2
        chat = {"model": "phi-4", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        out = httpx.post(f"{srv.url}/v1/chat/completions", json=chat, timeout=30)
        assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 4
        st = httpx.get(f"{srv.url}/state").json()
        assert sum(i["served"] for i in st["instances"]) == 2  # one prefill + one decode
        assert st["plan"]["scenario"] == "handmade" and st["latency"]["phi-4"]["count"] == 1
        # posting a plan adopts it without asking the planner
        r = httpx.post(
            f"{srv.url}/replan", params={"wait": True}, content=plan_of(2).model_dump_json(), timeout=30
        )
        assert sum(i["state"] == "ready" for i in r.json()["instances"]) == 3
        bad = httpx.post(f"{srv.url}/replan", content=b'{"schema_version": 1}')
        assert bad.status_code == 400 and "scenario" in bad.json()["error"]["message"]
        res = CliRunner().invoke(cli_app, ["status", "--url", srv.url])
        assert res.exit_code == 0, res.output
        assert "phi-4.decode.t2.aws-us-east-2.1" in res.output and "ready" in res.output
        assert httpx.get(f"{srv.url}/dashboard").status_code == 200
    finally:
        srv.stop()
        c.stop()
        engines.close()


def test_status_cli_unreachable():
    res = CliRunner().invoke(cli_app, ["status", "--url", "http://127.0.0.1:9"])
    assert res.exit_code == 2 and "cannot reach" in res.output


def test_controller_loop_runs_planner(tmp_path, backend):
    registry = Registry()
    c = controller(tmp_path, backend, registry, planner=lambda: plan_of(1), interval_s=3600).start()
    try:
        deadline = time.monotonic() + 20
        while sum(e.routable for e in registry.all()) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sum(e.routable for e in registry.all()) == 2
        app = create_gateway_app(registry, extra_routers=[controller_router(c)], health_checks=False)
        srv = ServerThread(app).start()
        try:
            assert len(httpx.get(f"{srv.url}/state").json()["instances"]) == 2
        finally:
            srv.stop()
    finally:
        c.stop()


def test_coral_serve_cli_end_to_end(tmp_path):
    """`coral serve core --plan ... --backend emulated` as a real process: ready instances, a completion."""
    import subprocess
    import sys

    from coral.http_serving import free_port

    plan_path = plan_of(1).save(tmp_path / "plan.json")
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "coral.cli.main",
        "serve",
        "core",
        "--plan",
        str(plan_path),
        "--port",
        str(port),
    ]
    cmd += ["--time-scale", str(TIME_SCALE), "--db", str(tmp_path / "serve.sqlite")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        ready = 0
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                ready = sum(
                    i["state"] == "ready" for i in httpx.get(f"{url}/state", timeout=2).json()["instances"]
                )
            except httpx.HTTPError:
                ready = 0
            if ready == 2:
                break
            time.sleep(0.1)
        assert ready == 2, (
            proc.stdout.read().decode() if proc.poll() is not None and proc.stdout else "not ready"
        )
        chat = {"model": "phi-4", "prompt": "hello", "max_tokens": 3}
        r = httpx.post(f"{url}/v1/completions", json=chat, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.terminate()
        proc.wait(20)


def test_serve_rejects_unknown_backend(tmp_path):
    res = CliRunner().invoke(cli_app, ["serve", "core", "--backend", "sglang"])
    assert res.exit_code == 2 and "coral deploy" in res.output


FAKE_VLLM = """
import argparse, json, os, sys
import uvicorn
from coral.runtime.emulated import EngineTiming, create_engine_app
ap = argparse.ArgumentParser()
ap.add_argument("cmd"); ap.add_argument("model")
ap.add_argument("--served-model-name"); ap.add_argument("--host"); ap.add_argument("--port", type=int)
args, _ = ap.parse_known_args()
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({"argv": sys.argv[1:], "gpus": os.environ.get("CUDA_VISIBLE_DEVICES")}) + "\\n")
app = create_engine_app(args.model, args.served_model_name, "decode", EngineTiming.constant())
uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
"""


def test_vllm_process_backend_with_a_fake_vllm(tmp_path, monkeypatch):
    import json
    import sys

    from coral.catalog.loader import CoralInputError
    from coral.runtime.backends import VllmProcessBackend

    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_VLLM)
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "launches.jsonl"))
    plan = make_plan(
        [
            make_instance("phi-4", "decode", [(40, ["2xL40S"])], 100.0, template_id=5, index=k)
            for k in range(2)
        ]
    )
    backend = VllmProcessBackend(gpus=[0, 1, 2, 3], executable=[sys.executable, str(script)])
    registry = Registry()
    c = Controller(Store(tmp_path / "v.sqlite"), backend, registry, ready_timeout_s=30)
    try:
        c.set_plan(plan)
        assert len(c.reconcile()["started"]) == 2
        launches = [json.loads(x) for x in (tmp_path / "launches.jsonl").read_text().splitlines()]
        assert sorted(x["gpus"] for x in launches) == ["0,1", "2,3"]
        argv = launches[0]["argv"]
        assert (
            argv[:2] == ["serve", "microsoft/phi-4"] and argv[argv.index("--tensor-parallel-size") + 1] == "2"
        )
        assert backend.free == []
        with pytest.raises(CoralInputError, match="needs 2 GPU"):
            backend.start(make_instance("phi-4", "decode", [(40, ["2xL40S"])], 1.0, index=9))
        with pytest.raises(CoralInputError, match="coral deploy"):
            backend.command(make_instance("phi-4", "decode", [(20, ["1xL4"]), (20, ["1xL4"])], 1.0), 8000)
        c.set_plan(make_plan(plan.instances[:1]))
        assert c.reconcile()["stopped"] == [plan.instances[1].id]
        assert len(backend.free) == 2
    finally:
        backend.close()


def test_coral_gateway_cli_over_static_endpoints(tmp_path):
    """`coral gateway --endpoints endpoints.json` (as written by `coral deploy`) in front of running engines."""
    import subprocess
    import sys

    from coral.deploy.endpoints import EndpointsFile, EndpointSpec
    from coral.http_serving import free_port
    from coral.runtime.emulated import EngineTiming, create_engine_app

    engines = [
        ServerThread(create_engine_app(f"e{k}", "phi-4", phase, EngineTiming.constant())).start()
        for k, phase in enumerate(["prefill", "decode"])
    ]
    spec = EndpointsFile(
        endpoints=[
            EndpointSpec(id=f"e{k}", model="phi-4", phase=phase, url=e.url, weight=1.0)  # type: ignore[arg-type]
            for k, (phase, e) in enumerate(zip(["prefill", "decode"], engines, strict=True))
        ]
    )
    path = spec.save(tmp_path / "endpoints.json")
    port = free_port()
    cmd = [sys.executable, "-m", "coral.cli.main", "gateway", "--endpoints", str(path), "--host", "127.0.0.1",
           "--instance-header"]
    proc = subprocess.Popen([*cmd, "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        r = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                r = httpx.post(
                    f"http://127.0.0.1:{port}/v1/completions",
                    json={"model": "phi-4", "prompt": "x"},
                    timeout=5,
                )
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        assert r is not None and r.status_code == 200 and r.headers["x-coral-instance"] == "e1"
    finally:
        proc.terminate()
        proc.wait(20)
        for e in engines:
            e.stop()
    bad = CliRunner().invoke(cli_app, ["gateway", "--endpoints", str(tmp_path / "missing.json")])
    assert bad.exit_code == 2 and "cannot read" in bad.output


def test_controller_replans_when_the_market_changes(tmp_path, backend):
    """`coral serve --market URL`: the controller plans in the market a loopback HTTP source publishes; when
    every price in the region it uses rises ×5, the next read wakes it and it moves the instances to the other
    region (started there, drained here). A source that stops answering keeps the last market."""
    import json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import yaml

    from coral.catalog.loader import builtin_catalog
    from coral.cli.runtime import allocator_planner
    from coral.runtime.market import MarketWatcher
    from coral.templates.build import build_library

    core = load_scenario("core")
    sc = core.model_copy(update={"name": "phi", "models": [m for m in core.models if m.model == "phi-4"]})
    scenario_file = tmp_path / "phi.yaml"
    scenario_file.write_text(yaml.safe_dump(sc.model_dump(mode="json")))
    out = tmp_path / "out"
    out.mkdir()
    build_library(sc, workers=1).save(out / "phi.templates.sqlite")
    offers = [o.model_dump(mode="json") for o in builtin_catalog().offerings]
    body = {"data": json.dumps({"schema_version": 1, "offerings": offers}).encode()}

    class Market(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if not body["data"]:
                self.send_error(503)
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body["data"])

        def log_message(self, *args) -> None:  # type: ignore[no-untyped-def]
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Market)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/market.json"
    try:
        store = Store(tmp_path / "state.sqlite")
        watcher = MarketWatcher(url, sc, builtin_catalog(), poll_s=3600)
        c = Controller(store, backend, Registry(), ready_timeout_s=10, interval_s=3600,
                       planner=allocator_planner(str(scenario_file), store.plan, out=out, market=watcher))
        watcher.on_change = c.trigger
        c.start()

        def regions(timeout_s: float = 30.0, differ_from: set[str] | None = None) -> set[str]:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                plan = store.plan()
                live = {inst.region for inst, state, _h in store.observed().values() if state == "ready"}
                if plan is not None and live == {i.region for i in plan.instances} and live != differ_from:
                    return live
                time.sleep(0.05)
            raise AssertionError("the controller did not settle")

        first = regions()
        assert len(first) == 1
        cheap = first.pop()
        for o in offers:
            if o["region"] == cheap:
                o["price_per_hour"] *= 5
        body["data"] = json.dumps({"schema_version": 1, "offerings": offers}).encode()
        assert watcher.poll() and watcher.changes == 1
        moved = regions(differ_from={cheap})
        assert cheap not in moved and len(moved) == 1
        assert not watcher.poll()  # unchanged: no re-plan
        body["data"] = b""
        assert not watcher.poll() and "503" in watcher.error and watcher.changes == 1
        c.stop()
    finally:
        server.shutdown()
