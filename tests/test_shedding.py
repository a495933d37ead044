"""Shedding at the planned share in the gateway: the rule (`Shedder`) by hand, and a burst on loopback refused
beyond its model's capacity at once (429 `model_over_capacity` with Retry-After) while the plan sheds."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_runtime_controller import TIME_SCALE
from test_runtime_gateway import chat, stack, wait_for

from coral.allocation.plan import ModelServing, Plan
from coral.allocation.shedding import Shedder, sheds
from coral.catalog.loader import load_scenario
from coral.cli.runtime import build_runtime
from coral.http_serving import ServerThread
from coral.runtime.backends import EmulatedBackend
from coral.runtime.controller import Store
from coral.runtime.emulated import EngineTiming
from coral.runtime.gateway import GatewayConfig
from coral.runtime.gateway.config import ShedMode
from coral.runtime.handmade import make_instance, make_plan
from coral.runtime.registry import Endpoint, InstanceState, Registry

pytestmark = pytest.mark.timeout(120)


def test_shedder_buckets_by_hand():
    s = Shedder({("m", "prefill"): 2.0, ("m", "decode"): 10.0}, {"m": 5.0})
    s.set_capacity({("m", "prefill"): 100.0, ("m", "decode"): 4.0}, now=0.0)  # depths 200 and 40 tokens
    assert s.admit("m", 150, None, 0.0) == 0.0  # takes 150 prompt and the mean 5 output tokens: left 50 and 35
    assert s.admit("m", 100, 8, 0.0) == pytest.approx(0.5)  # 50 prompt tokens short at 100/s; nothing taken
    assert s.admit("m", 100, 8, 0.5) == 0.0  # refilled to 100 and 37: left 0 and 29
    assert s.admit("m", 500, None, 0.5) == pytest.approx(2.0)  # beyond the depth: waits for a full bucket (200)
    assert s.admit("m", 500, None, 2.5) == 0.0  # full: takes 200 (the depth) and 5: left 0 and 32
    s.set_capacity({("m", "prefill"): 50.0, ("m", "decode"): 4.0}, now=4.5)  # refilled to 200, capped at 100
    assert s.buckets[("m", "prefill")].level == pytest.approx(100.0)
    assert s.buckets[("m", "decode")].level == pytest.approx(40.0)
    assert s.admit("m", 100, 40, 4.5) == 0.0  # both empty now
    assert s.admit("m", 10, 4, 4.5) == pytest.approx(1.0)  # prefill 0.2 s short, decode 1 s: the longer
    assert s.admit("other", 1e9, 1e9, 4.5) == 0.0  # a model without capacity is not shed
    s.set_capacity({("m", "decode"): 4.0}, now=4.5)  # prefill dropped: no longer shed on prompts
    assert s.admit("m", 1e9, 0, 4.5) == 0.0
    d = Shedder({}, {})
    d.set_capacity({("x", "decode"): 30.0}, now=0.0)
    assert d.buckets[("x", "decode")].depth == 30.0  # 1 s of capacity without a scenario


def test_shedder_of_slowed_engines_refills_at_their_pace():
    """Engines slowed 4x (`coral serve --time-scale 4`) make their tokens/s in 4 clock seconds: the bucket holds
    the same tokens and refills 4x slower; unscaled, it would admit 4x the engines' capacity."""
    s = Shedder({("m", "decode"): 1.0}, {"m": 5.0}, time_scale=4.0)
    s.set_capacity({("m", "decode"): 100.0}, now=0.0)
    assert s.buckets[("m", "decode")].depth == 100.0
    assert s.admit("m", 1, 100, 0.0) == 0.0
    assert s.admit("m", 1, 100, 1.0) == pytest.approx(3.0)  # 25 tokens back after 1 s: 75 short at 25/s
    assert s.admit("m", 1, 100, 4.0) == 0.0


def test_capacity_counts_routable_instances_only():
    registry = Registry()
    for iid, phase, weight, state in [("a", "decode", 3.0, InstanceState.READY), ("b", "decode", 2.0, InstanceState.READY),
                                      ("c", "decode", 7.0, InstanceState.DRAINING),
                                      ("p", "prefill", 5.0, InstanceState.READY)]:
        registry.add(Endpoint(iid, "m", phase, f"http://{iid}", weight, state))
    registry.add(Endpoint("u", "m", "decode", "http://u", 11.0, InstanceState.READY, healthy=False))
    assert registry.capacity() == {("m", "decode"): 5.0, ("m", "prefill"): 5.0}


def test_burst_beyond_capacity_is_refused_at_once_and_the_rest_served():
    """Decode capacity 0.01 tokens/s, 2000 s deep: 20 tokens, 5 requests of max_tokens 4 (refilling one more takes
    400 s). The engine holds every admitted request until the refusals are in: they did not wait behind them."""
    gate = threading.Event()

    def held(_n: int) -> float:
        gate.wait(60)
        return 0.0

    with stack(GatewayConfig(shed="always")) as s:
        s.gw.shedder = Shedder({("m", "decode"): 2000.0}, {"m": 4.0})
        s.engine("d0", "m", "decode", 0.01, EngineTiming(held, lambda _a, _c: 0.0))
        with ThreadPoolExecutor(10) as pool:
            sent = [pool.submit(httpx.post, f"{s.gateway.url}/v1/chat/completions", json=chat(n=4), timeout=60)
                    for _ in range(10)]
            assert wait_for(lambda: sum(f.done() for f in sent) == 5, 30)
            refused = [f.result() for f in sent if f.done()]
            try:  # the admitted ones reach admission (they may trail the refusals) and are held by the engine
                assert wait_for(lambda: s.gw.active == 5, 30)
            finally:
                gate.set()
            answers = [f.result() for f in sent]
    assert [r.status_code for r in refused] == [429] * 5
    for r in refused:
        err = r.json()["error"]
        assert (err["code"], err["type"], err["param"]) == ("model_over_capacity", "rate_limit_error", None)
        assert "m is over its capacity (decode 0.01 tokens/s)" in err["message"]
        assert 1 <= int(r.headers["retry-after"]) <= 400
    assert sorted(r.status_code for r in answers) == [200] * 5 + [429] * 5
    assert s.gw.client_requests() == {"m": {"ok": 5.0, "shed": 5.0}}


def tiny_plan(goodput: bool) -> Plan:
    """phi-4 with a decode instance of 0.001 tokens/s; `goodput`: it serves half its decode demand (sheds)."""
    plan = make_plan([make_instance("phi-4", "prefill", [(40, ["1xL40S"])], 1000.0, template_id=1),
                      make_instance("phi-4", "decode", [(20, ["1xL4"]), (20, ["1xL4"])], 0.001, template_id=2)])
    if not goodput:
        return plan
    half = ModelServing(model="phi-4", phase="decode", demand=0.002, capacity=0.001, served_fraction=0.5,
                        cost_per_hour=1.0)
    return plan.model_copy(update={"mode": "goodput", "serving": [half]})


@pytest.mark.parametrize(("shed", "goodput", "refused"), [("plan", False, False), ("plan", True, True),
                                                          ("off", True, False), ("always", False, True)])
def test_controller_plan_decides_whether_the_gateway_sheds(tmp_path, shed: ShedMode, goodput: bool, refused: bool):
    """A decode bucket of 4 tokens refilled in 4000 s: the second request of max_tokens 4 is refused when the
    gateway sheds (with shed=plan, only under a goodput plan that serves a model in part), else served."""
    engines = EmulatedBackend(time_scale=TIME_SCALE, scenario=load_scenario("core"))
    app, controller = build_runtime(lambda: tiny_plan(goodput), Store(tmp_path / "rt.sqlite"), engines, 3600,
                                    GatewayConfig(shed=shed), shedder=Shedder({("phi-4", "decode"): 4000.0}, {}))
    srv = ServerThread(app).start()
    try:
        st = httpx.post(f"{srv.url}/replan", params={"wait": True}, timeout=30).json()
        assert {i["state"] for i in st["instances"]} == {"ready"}
        assert sheds(controller.registry.plan) is goodput  # type: ignore[arg-type]
        body = {"model": "phi-4", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        codes = [httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=30) for _ in range(3)]
        assert [r.status_code for r in codes] == ([200, 429, 429] if refused else [200, 200, 200])
        if refused:
            assert 3990 <= int(codes[1].headers["retry-after"]) <= 4000  # 4 tokens at 0.001/s, less what refilled
        assert httpx.get(f"{srv.url}/gateway/state").json()["shedding"] is refused
    finally:
        srv.stop()
        controller.stop()
        engines.close()


def test_shed_capacity_is_one_rule_for_the_plan_lost_instances_and_the_modes():
    """Which (model, phase)s are shed, and at what capacity: every key of a plan serving only a share of a model;
    of a plan serving all its demand, only a key that lost instances while it is below its planned capacity; never
    a key whose instances are only starting; every ready key with "always"; none with "off"."""
    from coral.allocation.shedding import shed_capacity

    full, part = tiny_plan(goodput=False), tiny_plan(goodput=True)
    planned = {(i.model, i.phase): i.throughput for i in full.instances}
    keys = sorted(planned)
    ready = {k: v / 2 for k, v in planned.items()}  # half of each pool ready
    assert shed_capacity(ready, part, "plan") == ready
    assert shed_capacity(ready, full, "plan") == {}  # starting, not lost: requests wait for them
    assert shed_capacity(ready, full, "plan", down={keys[0]}) == {keys[0]: ready[keys[0]]}
    assert shed_capacity(planned, full, "plan", down={keys[0]}) == {}  # back to its plan: not shed
    assert shed_capacity({}, full, "plan", down={keys[0]}) == {keys[0]: 0.0}  # nothing left: refused
    assert shed_capacity(ready, None, "always") == ready and shed_capacity(ready, part, "off") == {}
