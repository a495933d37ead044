"""Issue 31, item 3, on real loopback servers: a plan posted to `/replan` is checked against the catalog, the
scenario served and the caps (`coral serve --max-instances/--max-nodes`) before it is adopted; a refused plan gets
400 naming the field and the reason and leaves the running plan and its pin as they were; an instance whose start
fails (the backend raises, or it is not healthy in time) says why in `/state`, also while it is started again; a
pass that fails says why in the answer and in `/state`'s `last_error`."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from test_hardening import OTHER_PLAN, PLAN, replan_server, wait_until

from coral.allocation.plan import Plan, PlanInstance
from coral.allocation.plan_check import PlanLimits
from coral.catalog.loader import load_scenario
from coral.cli.runtime import build_runtime
from coral.http_serving import ServerThread, free_port
from coral.runtime.backends import Backend, EmulatedBackend
from coral.runtime.controller import Controller, Store
from coral.runtime.handmade import make_instance, make_plan
from coral.runtime.registry import Registry

pytestmark = pytest.mark.timeout(120)

CORE = load_scenario("core")
IID = PLAN.instances[0].id
AT = f"instances.0 ({IID})"


def changed(**fields: Any) -> dict[str, Any]:
    """PLAN as JSON with its instance's fields changed (`stages__0__layers=...` reaches into its first stage)."""
    doc = PLAN.model_dump(mode="json")
    for path, value in fields.items():
        *head, last = path.split("__")
        obj = doc["instances"][0]
        for key in head:
            obj = obj[int(key)] if key.isdigit() else obj[key]
        obj[int(last) if last.isdigit() else last] = value
    return doc


def many(n: int) -> dict[str, Any]:
    """A plan of `n` valid instances."""
    return make_plan([make_instance("phi-4", "decode", [(40, ["1xL40S"])], 100.0, index=k)
                      for k in range(n)]).model_dump(mode="json")


BAD_PLANS = {
    "unknown GPU": (changed(stages__0__nodes=["1xNOPE"], counts={"1xNOPE": 1}),
                    f"{AT}.stages.0.nodes: unknown GPU 'NOPE' in '1xNOPE'"),
    "unknown config": (changed(stages__0__nodes=["3xL40S"], counts={"3xL40S": 1}),
                       f"{AT}.stages.0.nodes: config '3xL40S' must look like"),
    "config not offered there": (changed(stages__0__nodes=["2xL40S"], counts={"2xL40S": 1}),
                                 f"{AT}.stages.0.nodes: no offering of 2xL40S in region 'aws-us-east-2'"),
    "unknown model": (changed(model="no-such-model"), f"{AT}.model: unknown model 'no-such-model'"),
    "unknown region": (changed(region="mars-north-1"), f"{AT}.region: no offerings known for region 'mars-north-1'"),
    "count -5": (changed(counts={"1xL40S": -5}), f"{AT}.counts.1xL40S: -5 nodes, must be at least 1"),
    "count 10^6": (changed(counts={"1xL40S": 10**6}),
                   "instances: their counts hold 1000000 nodes in all, over the cap of 1024 per plan (max_nodes)"),
    "10,000 layers": (changed(stages__0__layers=10_000), f"{AT}.stages: cover 10000 layers, phi-4 has 40"),
    "306 instances": (many(306), "instances: 306 instances, over the cap of 256 per plan (max_instances)"),
    "a model the scenario does not serve": (
        make_plan([make_instance("llama-2-70b", "decode", [(80, ["8xL40S"])], 100.0)]).model_dump(mode="json"),
        "instances.0 (llama-2-70b.decode.t0.aws-us-east-2.0).model: 'llama-2-70b' is not a model of scenario core"),
    "a region outside the scenario": (changed(region="gcp-us-central1", stages__0__nodes=["1xL4"],
                                              counts={"1xL4": 1}),
                                      f"{AT}.region: 'gcp-us-central1' is not a region of scenario core"),
}


@contextlib.contextmanager
def serving(tmp_path: Any, backend: Backend | None = None, **router_kw: Any) -> Iterator[tuple[str, Controller]]:
    """The controller API for scenario core on loopback (no loop running: `?wait=true` reconciles)."""
    engines = backend or EmulatedBackend(time_scale=0.0)
    c = Controller(Store(tmp_path / "s.sqlite"), engines, Registry(), ready_timeout_s=30)
    srv = replan_server(tmp_path, c, **{"scenario": CORE, **router_kw})
    try:
        yield srv.url, c
    finally:
        srv.stop()
        c.stop()
        close = getattr(engines, "close", None)
        if close is not None:
            close()


def post(url: str, doc: dict[str, Any] | Plan, wait: bool = False) -> httpx.Response:
    body = doc.model_dump_json() if isinstance(doc, Plan) else json.dumps(doc)
    return httpx.post(f"{url}/replan", params={"wait": wait}, content=body, timeout=60)


@pytest.mark.parametrize("case", list(BAD_PLANS))
def test_a_bad_posted_plan_is_refused_naming_the_field_and_the_running_plan_stays(tmp_path, case):
    doc, why = BAD_PLANS[case]
    with serving(tmp_path) as (url, c):
        assert post(url, PLAN, wait=True).status_code == 200
        before = httpx.get(f"{url}/state").json()
        r = post(url, doc)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "invalid_plan" and why in error["message"], error["message"]
        assert "POST /replan body" in error["message"] and "nothing was adopted" in error["message"]
        after = httpx.get(f"{url}/state").json()
        assert after["plan"] == before["plan"] == PLAN.model_dump(mode="json") and after["pinned"]
        assert after["actions"] == before["actions"] and [i["id"] for i in after["instances"]] == [IID]
        assert c.store.desired() == {IID: PLAN.instances[0]}


def test_valid_plans_are_still_adopted(tmp_path):
    with serving(tmp_path) as (url, _c):
        for plan in (PLAN, OTHER_PLAN):
            r = post(url, plan, wait=True)
            assert r.status_code == 200, r.text
            assert r.json()["plan"] == plan.model_dump(mode="json")
        assert {i["id"]: i["state"] for i in r.json()["instances"]} == {OTHER_PLAN.instances[0].id: "ready"}
        assert post(url, Plan.model_validate(many(256)), wait=False).status_code == 200  # at the cap: taken


def test_the_caps_are_configurable(tmp_path):
    limits = PlanLimits(max_instances=2, max_nodes=3)
    with serving(tmp_path, limits=limits) as (url, _c):
        r = post(url, many(3))
        assert r.status_code == 400 and "3 instances, over the cap of 2 per plan (max_instances)" in r.text
        wide = changed(stages__0__nodes=["1xL40S"] * 4, stages__0__node_throughput=[25.0] * 4, counts={"1xL40S": 4})
        r = post(url, wide)
        assert r.status_code == 400 and "stages hold 4 nodes in all, over the cap of 3 per plan (max_nodes)" in r.text
        assert post(url, many(2)).status_code == 200


def test_serve_has_the_cap_options_and_passes_the_scenario_and_caps(tmp_path):
    """`coral serve` itself: its options reach the router, and so does its scenario."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "coral.cli.main", "serve", "core", "--plan", str(PLAN.save(tmp_path / "p.json")),
           "--port", str(port), "--db", str(tmp_path / "s.sqlite"), "--time-scale", "1000",
           "--max-instances", "2", "--max-nodes", "5"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert wait_until(lambda: httpx.get(f"{url}/health").status_code == 200), "coral serve did not start"
        r = post(url, many(3))
        assert r.status_code == 400 and "over the cap of 2 per plan (max_instances)" in r.text
        r = post(url, BAD_PLANS["a model the scenario does not serve"][0])
        assert r.status_code == 400 and "is not a model of scenario core" in r.text
        assert post(url, many(2)).status_code == 200
    finally:
        proc.terminate()
        proc.communicate(timeout=60)


def test_build_runtime_checks_posted_plans_against_the_catalog_by_default(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    engines = EmulatedBackend(time_scale=0.0)
    app, c = build_runtime(lambda: PLAN, store, engines, 3600.0)
    srv = ServerThread(app).start()
    try:
        r = post(srv.url, changed(stages__0__layers=10_000))
        assert r.status_code == 400 and "cover 10000 layers, phi-4 has 40" in r.text
        assert c.store.plan() is None
    finally:
        srv.stop()
        c.stop()
        engines.close()


class RetriedStart(EmulatedBackend):
    """The first start fails for want of capacity; the next waits for `go` before starting."""

    def __init__(self) -> None:
        super().__init__(time_scale=0.0)
        self.go = threading.Event()
        self.tries = 0

    def start(self, instance: PlanInstance) -> dict[str, Any]:
        self.tries += 1
        if self.tries == 1:
            raise RuntimeError("no 1xL40S capacity in aws-us-east-2 right now")
        self.go.wait(60)
        return super().start(instance)


def row(url: str) -> dict[str, Any]:
    (only,) = httpx.get(f"{url}/state").json()["instances"]
    return dict(only)


def test_a_failed_start_says_why_in_state_also_while_it_is_started_again(tmp_path):
    backend = RetriedStart()
    with serving(tmp_path, backend) as (url, c):
        r = post(url, PLAN, wait=True)
        assert r.status_code == 200
        failed = row(url)
        assert failed["state"] == "failed"
        assert failed["last_error"] == "RuntimeError: no 1xL40S capacity in aws-us-east-2 right now"
        retry = threading.Thread(target=c.reconcile)
        retry.start()
        try:
            assert wait_until(lambda: row(url)["state"] == "starting")
            assert row(url)["last_error"] == failed["last_error"]  # why it is being started again
        finally:
            backend.go.set()
            retry.join(60)
        assert row(url)["state"] == "ready" and row(url)["last_error"] == ""


class SickEngines:
    """Starts engines whose `/health` answers 503 with why."""

    def __init__(self) -> None:
        self.servers: dict[str, ServerThread] = {}

    def start(self, instance: PlanInstance) -> dict[str, Any]:
        app = FastAPI()

        @app.get("/health")
        def health() -> JSONResponse:
            return JSONResponse({"error": {"message": "CUDA out of memory while loading the weights"}}, 503)

        srv = self.servers[instance.id] = ServerThread(app).start()
        return {"url": srv.url}

    def stop(self, instance_id: str, handle: dict[str, Any]) -> None:
        srv = self.servers.pop(instance_id, None)
        if srv is not None:
            srv.stop()

    def alive(self, instance_id: str, handle: dict[str, Any]) -> bool:
        return instance_id in self.servers


def test_an_instance_not_healthy_in_time_says_what_its_health_answered(tmp_path):
    with serving(tmp_path, SickEngines()) as (url, c):
        c.ready_timeout_s = 0.5
        assert post(url, PLAN, wait=True).status_code == 200
        failed = row(url)
        assert failed["state"] == "failed"
        assert failed["last_error"] == ("not healthy within 0.5 s: /health answered 503: CUDA out of memory while "
                                        "loading the weights")


class StopFails(EmulatedBackend):
    """Stopping an engine fails while `down` (its cloud API is down)."""

    down = True

    def stop(self, instance_id: str, handle: dict[str, Any]) -> None:
        if self.down:
            raise RuntimeError("the cloud API is down")
        super().stop(instance_id, handle)


def test_a_failed_pass_says_why_in_the_answer_and_in_state(tmp_path):
    backend = StopFails(time_scale=0.0)
    with serving(tmp_path, backend) as (url, _c):
        assert post(url, PLAN, wait=True).status_code == 200
        r = post(url, OTHER_PLAN, wait=True)  # draining PLAN's instance fails
        assert r.status_code == 500 and r.json()["error"]["code"] == "reconcile_failed"
        assert "RuntimeError: the cloud API is down" in r.json()["error"]["message"]
        state = httpx.get(f"{url}/state").json()
        assert state["last_error"] == "RuntimeError: the cloud API is down"
        assert state["plan"] == OTHER_PLAN.model_dump(mode="json")  # adopted: the next pass tries again
        backend.down = False
        assert post(url, OTHER_PLAN, wait=True).status_code == 200
        assert httpx.get(f"{url}/state").json()["last_error"] == ""

