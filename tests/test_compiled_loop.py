"""The compiled event loop (`coral.simulation.compiled`) against the Python loop it replaces, which stays as the
reference: random plans (1–3 stages, 1–3 data-parallel nodes per stage of mixed configs, some models without
a decode instance), random bursty traffic, both routers, both KV reserves, request classes, and pools started
tiny so that they must grow. Every request's timestamps, instances and counts are equal to the last bit, and so
is the whole SimResult."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coral.allocation.plan import Plan, PlanClass, PlanInstance
from coral.catalog.loader import builtin_catalog, load_scenario
from coral.simulation import RequestSet, simulate
from coral.simulation import compiled as compiled_loop
from coral.simulation.stand_in import plan_of

CAT = builtin_catalog()
SC = load_scenario("core")
LAYERS = {m.model: CAT.model(m.model).num_hidden_layers for m in SC.models}
CONFIGS = ["1xL4", "1xA10G", "4xA10G", "1xL40S", "4xL40S", "1xH100", "4xL4"]
PER_REQUEST = ("first_token_s", "decode_admit_s", "done_s", "done_count", "prefill_instance", "decode_instance")


def random_instance(rng: np.random.Generator, model: str, phase: str, idx: int) -> PlanInstance:
    n_stages = int(rng.integers(1, 4))
    cuts = np.sort(rng.choice(np.arange(1, LAYERS[model]), n_stages - 1, replace=False))
    layers = np.diff([0, *cuts, LAYERS[model]]).tolist()
    stages = []
    for x in layers:
        nodes = [str(c) for c in rng.choice(CONFIGS, int(rng.integers(1, 4)))]
        if rng.random() < 0.5:  # identical nodes, as templates have: stride ties
            nodes, weights = [nodes[0]] * len(nodes), np.full(len(nodes), 3.0)
        else:
            weights = rng.uniform(0, 10, len(nodes)) * (rng.random(len(nodes)) > 0.1)  # some nodes weighted 0
        stages.append((int(x), nodes, weights.tolist()))
    return PlanInstance.of_stages(model, phase, idx, "aws-us-east-2", idx, stages, float(rng.uniform(0.5, 50)), 1.0)


def random_plan(rng: np.random.Generator) -> Plan:
    instances = []
    for m in LAYERS:
        for phase in ("prefill", "decode"):
            if phase == "decode" and rng.random() < 0.1:
                continue  # no decode instance: its requests wait for one, never served
            for _ in range(int(rng.integers(1, 4))):
                instances.append(random_instance(rng, m, phase, len(instances)))
    return plan_of("core", instances)


def random_traffic(rng: np.random.Generator, n: int) -> dict[str, RequestSet]:
    """Bursts of requests (on-off arrivals) at a load from light to far beyond the plan, prompts from 1 to a few
    thousand tokens, outputs from 1 to a few hundred."""
    out: dict[str, RequestSet] = {}
    gap = 10 ** rng.uniform(-2, 0)
    for m in LAYERS:
        gaps = rng.exponential(np.where(rng.random(n) < 0.3, gap / 20, gap))
        out[m] = RequestSet(np.cumsum(gaps), rng.integers(1, 4000, n), rng.integers(1, 400, n))
    return out


def with_classes(plan: Plan, rng: np.random.Generator) -> Plan:
    """phi-4 planned with a short and a long class, its instances each planned for one or both."""
    classes = [PlanClass(name="short", share=0.6, mean_input_tokens=300, mean_output_tokens=200, max_input_tokens=1000),
               PlanClass(name="long", share=0.4, mean_input_tokens=3000, mean_output_tokens=200)]
    instances = [
        i.model_copy(update={"class_throughput": {"short": float(rng.uniform(0, 9)), "long": float(rng.uniform(0, 3))}})
        if i.model == "phi-4" else i
        for i in plan.instances
    ]
    return plan.model_copy(update={"instances": instances, "request_classes": {"phi-4": classes}})


def both(plan: Plan, requests: dict[str, RequestSet], duration: float, **kw: object) -> tuple[dict, dict]:
    runs = [simulate(plan, SC, requests, duration_s=duration, loop=loop, **kw) for loop in ("python", "compiled")]  # type: ignore[arg-type]
    return tuple(  # type: ignore[return-value]
        (r.model_dump(exclude={"wall_s", "requests_per_wall_s"}), r.per_request()) for r in runs
    )


def assert_same(plan: Plan, requests: dict[str, RequestSet], duration: float, **kw: object) -> None:
    (ref, ref_pr), (fast, fast_pr) = both(plan, requests, duration, **kw)
    for k in PER_REQUEST:
        np.testing.assert_array_equal(np.asarray(fast_pr[k]), np.asarray(ref_pr[k]), err_msg=k)
    assert fast == ref


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), router=st.sampled_from(["wrr", "lor"]), reserve=st.sampled_from(["mean", "max"]),
       classes=st.booleans())
def test_the_compiled_loop_is_the_python_loop_on_random_plans_and_traffic(seed: int, router: str, reserve: str,
                                                                         classes: bool) -> None:
    rng = np.random.default_rng(seed)
    plan = random_plan(rng)
    if classes:
        plan = with_classes(plan, rng)
    assert_same(plan, random_traffic(rng, 400), 400.0, router=router, kv_reserve=reserve, drain_limit_s=60.0)


@pytest.mark.parametrize("pool", [1, 7])
def test_pools_that_run_out_grow_and_the_run_is_the_same(pool: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pools of 1 or 7 entries: every run outgrows them (chunks, events, finishing targets) and is run again
    with them doubled until it fits; the result is the reference's."""
    rng = np.random.default_rng(5)
    serve, loop = compiled_loop.serve, compiled_loop._loop
    runs: list[int] = []

    def counted(*args: object) -> float:
        runs.append(1)
        return loop(*args)

    monkeypatch.setattr(compiled_loop, "_loop", counted)
    monkeypatch.setattr(compiled_loop, "serve", lambda engine, duration_s: serve(engine, duration_s, pool))
    assert_same(random_plan(rng), random_traffic(rng, 300), 20.0)
    assert len(runs) > 3  # 1 or 7 entries, doubled until a few hundred requests' chunks and events fit


def test_the_scenario_traffic_of_core_on_a_planned_mix_is_the_same() -> None:
    """The real traces (core, 5 simulated minutes, seeded) on a plan of every model in several shapes."""
    rng = np.random.default_rng(11)
    assert_same(random_plan(rng), None, 300.0, seed=3)  # type: ignore[arg-type]


def test_runs_that_change_plans_stay_on_the_python_loop() -> None:
    """A re-planner's run is served by the reference loop (the compiled one serves plans that stay put): asking
    for either gives one result."""
    rng = np.random.default_rng(2)
    plan = random_plan(rng)
    traffic = random_traffic(rng, 200)
    runs = [simulate(lambda e, d, r: plan, SC, traffic, duration_s=20.0, epoch_s=10.0, loop=loop)  # type: ignore[arg-type]
            for loop in ("python", "compiled")]
    assert runs[0].model_dump(exclude={"wall_s", "requests_per_wall_s"}) == runs[1].model_dump(
        exclude={"wall_s", "requests_per_wall_s"})
