"""Routing by request-length class: the registry's per-class smooth WRR, the gateway's prompt-length estimate,
and a loopback run (controller + emulated engines + gateway, official `openai` client) where short prompts go
to the instances planned for the short class and long ones to the others, also after a re-weighting re-plan."""

from __future__ import annotations

from collections import Counter

import openai
import pytest
from test_runtime_controller import TIME_SCALE, backend  # noqa: F401  (fixture)

from coral.allocation.plan import Plan, PlanClass
from coral.http_serving import ServerThread
from coral.runtime.controller import Controller, Store
from coral.runtime.gateway import CHARS_PER_TOKEN, create_gateway_app, prompt_tokens
from coral.runtime.handmade import make_instance, make_plan
from coral.runtime.registry import Endpoint, InstanceState, Registry

pytestmark = pytest.mark.timeout(120)

CLASSES = [
    PlanClass(name="q1", share=0.7, mean_input_tokens=20, mean_output_tokens=8, max_input_tokens=50),
    PlanClass(name="q2", share=0.3, mean_input_tokens=400, mean_output_tokens=8),
]


def ep(iid: str, weight: float, class_weights: dict[str, float] | None) -> Endpoint:
    return Endpoint(iid, "m", "decode", "http://x", weight, InstanceState.READY, class_weights=class_weights)


def picks(reg: Registry, classes: list[str | None], rounds: int, exclude: frozenset[str] = frozenset()):
    """Per class, how many picks each endpoint got; the classes' picks interleave, each released at once."""
    counts: dict[str | None, Counter[str]] = {c: Counter() for c in classes}
    for _ in range(rounds):
        for c in classes:
            e = reg.pick("m", "decode", exclude, c)
            assert e is not None
            counts[c][e.id] += 1
            reg.release(e, ok=True)
    return counts


def test_registry_routes_each_class_by_its_weights():
    reg = Registry()
    reg.add(ep("A", 1.0, {"q1": 3.0, "q2": 2.0}))
    reg.add(ep("B", 3.0, {"q1": 1.0, "q2": 0.0}))
    reg.add(ep("C", 4.0, None))  # no class weights: every class at its plain weight
    got = picks(reg, ["q1", "q2", None, "q9"], 480)
    assert got["q1"] == {"A": 180, "B": 60, "C": 240}  # 3:1:4
    assert got["q2"] == {"A": 160, "C": 320}  # 2:0:4, B never
    assert got[None] == {"A": 60, "B": 180, "C": 240}  # plain 1:3:4
    assert got["q9"] == {"C": 480}  # only C serves an unplanned class
    # without C (e.g. a retry that excluded it): q2 still only to A; nobody has q9, so plain weights 1:3
    got = picks(reg, ["q2", "q9"], 480, frozenset({"C"}))
    assert got["q2"] == {"A": 480} and got["q9"] == {"A": 120, "B": 360}
    # re-registration replaces the class weights in place
    same = reg.add(ep("A", 1.0, {"q1": 0.0, "q2": 1.0}))
    assert same is reg.get("A") and same.class_weights == {"q1": 0.0, "q2": 1.0}
    assert picks(reg, ["q1"], 100, frozenset({"C"}))["q1"] == {"B": 100}


def test_registry_class_of_follows_the_plan_classes():
    reg = Registry(classes={"m": CLASSES})
    assert [reg.class_of("m", t) for t in (1, 50, 50.5, 1e6)] == ["q1", "q1", "q2", "q2"]
    assert reg.class_of("other", 10) is None


@pytest.mark.parametrize(
    ("body", "tokens"),
    [
        ({"prompt": "x" * 100}, 100 / CHARS_PER_TOKEN),
        ({"prompt": [1, 2, 3]}, 3),
        ({"prompt": [[1, 2], [1, 2, 3, 4, 5], []]}, 5),
        ({"prompt": ["ab", "x" * 40]}, 40 / CHARS_PER_TOKEN),
        (
            {"messages": [{"role": "system", "content": "x" * 30}, {"role": "user", "content": None},
                          {"role": "user", "content": [{"type": "text", "text": "y" * 10},
                                                        {"type": "image_url", "image_url": {"url": "u"}}]}]},
            40 / CHARS_PER_TOKEN,
        ),
    ],
)
def test_prompt_tokens_estimate(body, tokens):
    assert prompt_tokens(body) == tokens


def split_plan(short: int) -> Plan:
    """phi-4 with prefill and decode instances 0 and 1: those of index `short` serve q1 only, the others q2."""
    insts = [make_instance("phi-4", "prefill", [(40, ["1xL40S"])], 6000.0, template_id=1, index=k) for k in (0, 1)]
    insts += [make_instance("phi-4", "decode", [(40, ["1xL4"])], 500.0, template_id=2, index=k) for k in (0, 1)]
    for i in insts:
        q1 = i.id.endswith(f".{short}")
        i.class_throughput = {"q1": i.throughput, "q2": 0.0} if q1 else {"q1": 0.0, "q2": i.throughput}
    plan = make_plan(insts)
    plan.request_classes = {"phi-4": CLASSES}
    return plan


def test_gateway_routes_short_and_long_prompts_to_their_instances(tmp_path, backend):  # noqa: F811
    assert TIME_SCALE < 0.01
    registry = Registry()
    c = Controller(Store(tmp_path / "s.sqlite"), backend, registry, ready_timeout_s=10)
    c.set_plan(split_plan(0))
    assert len(c.reconcile()["started"]) == 4
    assert registry.classes == {"phi-4": CLASSES}
    srv = ServerThread(create_gateway_app(registry, health_checks=False)).start()
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)

        def send() -> dict[str, int]:
            """3 short and 4 long requests of every prompt shape; served count per instance, by index."""
            before = {e.id: e.served for e in registry.all()}
            short, long = "hi " * 10, "word " * 60  # 7.5 and 75 estimated tokens
            for text in (short, long):
                client.completions.create(model="phi-4", prompt=text, max_tokens=2)
                client.chat.completions.create(model="phi-4", messages=[{"role": "user", "content": text}],
                                               max_tokens=2)
                stream = client.completions.create(model="phi-4", prompt=text, max_tokens=2, stream=True)
                assert len(list(stream)) >= 2
            client.completions.create(model="phi-4", prompt=list(range(60)), max_tokens=2)
            return {e.id: e.served - before[e.id] for e in registry.all()}

        ids = {i.phase + i.id[-1]: i.id for i in split_plan(0).instances}
        served = send()
        assert [served[ids[k]] for k in ("prefill0", "prefill1", "decode0", "decode1")] == [3, 4, 3, 4]
        # a re-plan swapping the classes re-weights the running instances in place (nothing restarts)
        c.set_plan(split_plan(1))
        assert c.reconcile() == {"started": [], "stopped": []}
        assert registry.get(ids["decode1"]).class_weights == {"q1": 500.0, "q2": 0.0}  # type: ignore[union-attr]
        served = send()
        assert [served[ids[k]] for k in ("prefill0", "prefill1", "decode0", "decode1")] == [4, 3, 4, 3]
        state = {i["id"]: i for i in c.state(srv.server.config.app.state.gateway.state())["instances"]}
        assert state[ids["decode0"]]["class_throughput"] == {"q1": 0.0, "q2": 500.0}
    finally:
        srv.stop()
