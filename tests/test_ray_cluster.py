"""The Coral engine on a multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`: one raylet per
plan node, each advertising its node config as `coral-node/<config>`), behind the real gateway and controller:
a heterogeneous PD plan exact against the whole model (official `openai` client), a re-plan that scales one
instance up and drains another, and a raylet killed mid-traffic (no request lost before its first token, the
instance failed, re-placed when a matching node is back, counters back to zero). Engines bind to 127.0.0.1."""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from coral.allocation.plan import Plan
from coral.cli.runtime import build_runtime
from coral.engine.reference import WholeModel
from coral.http_serving import ServerThread
from coral.runtime.controller import Store
from coral.runtime.handmade import make_instance, make_plan, two_gpu_catalog

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

PREFILL = make_instance("phi-4", "prefill", [(24, ["2xL40S"]), (16, ["1xL4"])], 6000.0, template_id=1)
DECODE = make_instance("phi-4", "decode", [(16, ["1xL4"]), (24, ["1xL4", "2xA10G"])], 500.0, template_id=2)
DECODE_B = make_instance("phi-4", "decode", [(20, ["1xL4"]), (20, ["1xL4"])], 500.0, template_id=3)
RAYLETS = {"2xL40S": 1, "1xL4": 5, "2xA10G": 1}  # the PD plan and a second decode instance, placed side by side
PROMPTS = [[11, 52, 300, 7], [500], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [999, 123, 45]]


class Runtime:
    """Gateway + controller + Ray backend on one Ray cluster; plans posted to `/replan`."""

    def __init__(self, tmp: Any) -> None:
        from coral.runtime.ray_backend import LocalRayCluster, RayCoralBackend

        self.cluster = LocalRayCluster(Counter(RAYLETS))
        store = Store(tmp / "state.sqlite")
        self.backend = RayCoralBackend(cache_dir=tmp / "cache", log_dir=tmp / "logs", api_key=store.engine_token(),
                                       address=self.cluster.address, host="127.0.0.1", place_timeout_s=5)
        app, self.controller = build_runtime(lambda: make_plan([PREFILL]), store, self.backend, 3600.0,
                                             ready_timeout_s=300, catalog=two_gpu_catalog)
        self.controller.retry_s = 1.0
        self.backend.on_change = lambda: self.controller.trigger(plan=False)
        self.server = ServerThread(app).start()
        self.url = self.server.url
        self.controller.start()
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)
        self.whole = WholeModel(self.backend.model_dir("phi-4"))  # phi-4 is served by the tiny phi3

    def post(self, plan: Plan) -> dict[str, Any]:
        r = httpx.post(f"{self.url}/replan?wait=true", content=plan.model_dump_json(), timeout=600)
        assert r.status_code == 200, r.text
        return r.json()

    def state(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/state", timeout=10).json()

    def wait_for(self, states: dict[str, str], timeout_s: float = 240) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            st = self.state()
            if {i["id"]: i["state"] for i in st["instances"] if i["id"] in states} == states:
                return st
            time.sleep(0.2)
        raise AssertionError(f"instances not {states}: {self.state()['instances']}, actions {st['actions'][:8]}")

    def complete(self, prompt: list[int], max_tokens: int = 5) -> list[int]:
        r = self.client.completions.create(model="phi-4", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           extra_body={"ignore_eos": True, "return_token_ids": True})
        return list(r.choices[0].model_extra["token_ids"])

    def expected(self, prompt: list[int], max_tokens: int = 5) -> list[int]:
        return list(self.whole.greedy(prompt, max_tokens)[0])

    def close(self) -> None:
        self.controller.stop()
        self.server.stop(force=True)
        self.backend.close()
        ray.shutdown()
        self.cluster.shutdown()


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    rt = Runtime(tmp_path_factory.mktemp("ray-cluster"))
    yield rt
    rt.close()


def test_heterogeneous_pd_plan_on_ray_nodes_is_exact(runtime):
    """Prefill on a 2xL40S (a TP pair) and a 1xL4 Ray node, decode on three: KV handed over between Ray nodes."""
    runtime.post(make_plan([PREFILL, DECODE]))
    st = runtime.wait_for({PREFILL.id: "ready", DECODE.id: "ready"})
    placed = runtime.backend.placed
    assert len(set(placed[PREFILL.id].handle["ray_nodes"])) == 2
    assert len(set(placed[DECODE.id].handle["ray_nodes"])) == 3
    assert not set(placed[PREFILL.id].handle["ray_nodes"]) & set(placed[DECODE.id].handle["ray_nodes"])
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        outputs = list(pool.map(runtime.complete, PROMPTS))
    assert outputs == [runtime.expected(p) for p in PROMPTS]
    stream = runtime.client.chat.completions.create(
        model="phi-4", messages=[{"role": "user", "content": "hello ray"}], max_tokens=4, stream=True)
    assert list(stream)[-1].choices[0].finish_reason in ("length", "stop")
    decode_url = next(i["url"] for i in st["instances"] if i["id"] == DECODE.id)
    assert httpx.get(f"{decode_url}/health").json()["remote_prefills"] >= 1  # KV taken across Ray nodes
    assert httpx.post(f"{decode_url}/v1/completions", json={"model": "phi-4", "prompt": [1]}).status_code == 401


def test_replan_scales_one_instance_up_and_drains_another(runtime):
    """{P, D} -> {P, D2}: D2 is placed on free Ray nodes first, then D drains: a long request on it finishes."""
    runtime.post(make_plan([PREFILL, DECODE]))
    long_done: list[list[int]] = []
    started = threading.Event()

    def long_request() -> None:
        started.set()
        long_done.append(runtime.complete(PROMPTS[0], max_tokens=40))

    t = threading.Thread(target=long_request)
    t.start()
    started.wait()
    time.sleep(0.5)
    runtime.post(make_plan([PREFILL, DECODE_B]))
    t.join(120)
    assert long_done == [runtime.expected(PROMPTS[0], 40)]  # drained, not cut
    st = runtime.wait_for({PREFILL.id: "ready", DECODE_B.id: "ready"})
    assert DECODE.id not in runtime.backend.placed and DECODE.id not in {i["id"] for i in st["instances"]}
    kinds = [(a["kind"], a["instance_id"], a["status"]) for a in st["actions"]]
    assert ("drain", DECODE.id, "done") in kinds and ("start", DECODE_B.id, "done") in kinds
    assert kinds.index(("drain", DECODE.id, "done")) < kinds.index(("start", DECODE_B.id, "done"))  # newest first
    assert runtime.complete(PROMPTS[1]) == runtime.expected(PROMPTS[1])


def test_raylet_killed_mid_traffic(runtime):
    """Two decode instances; the raylet under D's 2xA10G node dies while requests run: every request that had not
    streamed is answered (retried on D2), D is marked failed, and re-placed once a 2xA10G Ray node is back."""
    runtime.post(make_plan([PREFILL, DECODE, DECODE_B]))
    runtime.wait_for({PREFILL.id: "ready", DECODE.id: "ready", DECODE_B.id: "ready"})
    (victim,) = runtime.cluster.raylets["2xA10G"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(12)]
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(runtime.complete, p, 12) for p in prompts]
        time.sleep(1.0)
        runtime.cluster.kill(victim)
        outputs = [f.result(timeout=300) for f in futures]
    assert outputs == [runtime.expected(p, 12) for p in prompts]  # none lost
    deadline = time.monotonic() + 60
    while not (lost := [a for a in runtime.state()["actions"] if a["kind"] == "lost" and a["instance_id"] == DECODE.id]):
        assert time.monotonic() < deadline, "the instance on the lost Ray node was not marked failed"
        time.sleep(0.2)
    assert lost[0]["status"] == "done" and lost[0]["detail"]
    assert runtime.state()["instances"][[i["id"] for i in runtime.state()["instances"]].index(DECODE.id)]["state"] in (
        "failed", "starting")  # no Ray node advertises 2xA10G now: every re-placement fails
    assert runtime.complete(PROMPTS[1]) == runtime.expected(PROMPTS[1])  # served by D2 meanwhile
    runtime.cluster.add("2xA10G")
    st = runtime.wait_for({DECODE.id: "ready"}, timeout_s=120)
    assert runtime.complete(PROMPTS[2]) == runtime.expected(PROMPTS[2])
    time.sleep(0.5)
    st = runtime.state()
    assert all(i["inflight"] == 0 for i in st["instances"]) and st["queue"].get("active", 0) == 0
