"""Online stage: demand forecast (step changes, peak tracking, determinism), latency correction (direction and
bounds), headroom from a plan, and the simulator's observations and re-planner wired to them."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from coral.allocation.forecast import DemandForecaster, LatencyCorrection, plan_headroom, planned_capacity
from coral.allocation.plan import ModelServing
from coral.catalog.loader import load_scenario
from coral.perf.model import Phase
from coral.simulation import ObservedDemand, RequestSet, simulate
from coral.simulation.stand_in import plan_of

KEY = ("phi-4", Phase.PREFILL)
SC = load_scenario("core")


def noisy_step(before: float, after: float, n_before: int, n_after: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.r_[before * (1 + 0.03 * rng.standard_normal(n_before)), after * (1 + 0.03 * rng.standard_normal(n_after))]


def forecasts_after_each(series: np.ndarray, f: DemandForecaster, first: int = 0) -> list[float]:
    """The forecast for 300-660 s ahead after each of `series`' values from index `first` on (0 before)."""
    out = []
    for i, v in enumerate(series):
        f.observe(KEY, [v])
        out.append(f.forecast(KEY, 300.0, 660.0) if i >= first else 0.0)
    return out


def test_forecast_follows_a_step_up_and_never_undershoots_after_it() -> None:
    f = DemandForecaster(60.0)
    y = noisy_step(100.0, 200.0, 12, 15)
    fc = forecasts_after_each(y, f, first=8)
    assert all(abs(v - 100) < 10 for v in fc[8:12])  # steady before the step (Holt fitted from 8 points)
    after = fc[12:]
    assert min(after[2:]) >= 0.97 * 200  # caught within 3 intervals, and never under-shot since
    assert max(after) < 2.0 * 200  # a step is a new level, not a trend to extrapolate
    # the decayed peak alone holds the new level once its window has filled, whatever the smoother does
    assert f.peak(KEY) >= 0.95 * 200


def test_forecast_gives_a_drop_back_gradually() -> None:
    f = DemandForecaster(60.0, peak_half_life=5.0)
    fc = forecasts_after_each(noisy_step(200.0, 100.0, 10, 30), f, first=10)
    assert fc[11] > 150  # the recent peak still holds just after the drop
    assert fc[-1] < 110  # ... and has decayed by the end
    assert all(a >= b - 5 for a, b in itertools.pairwise(fc[10:21]))  # no rebound on the way down


def test_forecast_with_few_points_is_the_last_value_or_peak() -> None:
    f = DemandForecaster(60.0, peak_window=1)
    assert f.forecast(KEY, 0, 60) == 0.0
    f.observe(KEY, [50.0, 80.0, 70.0])
    assert f.smoothed(KEY, 0, 60) == 70.0
    assert f.forecast(KEY, 0, 60) == pytest.approx(max(70.0, 80.0 * 0.5 ** (1 / 10)))
    with pytest.raises(ValueError):
        f.observe(KEY, [-1.0])


def test_forecast_is_deterministic() -> None:
    y = np.random.default_rng(7).gamma(4.0, 25.0, size=30)
    a, b = DemandForecaster(60.0), DemandForecaster(60.0)
    assert forecasts_after_each(y, a, first=28) == forecasts_after_each(y, b, first=28)
    other = np.random.default_rng(8).gamma(4.0, 25.0, size=30)
    assert forecasts_after_each(other, DemandForecaster(60.0), first=29)[-1] != a.forecast(KEY, 300.0, 660.0)
    assert a.forecasts(300.0, 660.0) == {KEY: a.forecast(KEY, 300.0, 660.0)}


def correction() -> LatencyCorrection:
    return LatencyCorrection.for_scenario(SC)


def test_correction_raises_capacity_when_latency_exceeds_the_slo() -> None:
    c = correction()
    slo = c.slo_s[KEY]
    assert slo == pytest.approx(1.2) and c.quantile["phi-4"] == SC.models[0].slo_attainment
    lat = np.full(100, 0.5 * slo)
    lat[:20] = 1.5 * slo  # 20 % miss: the 90th percentile is above the SLO
    first = c.observe(KEY, lat)
    assert first == pytest.approx(1.5 ** 0.5)
    assert planned_capacity({KEY: 1000.0}, {KEY: 2.0}, c)[KEY] == pytest.approx(2000.0 * first)
    # a step applies to the factor that served the requests, not again to one raised since (no windup)
    assert c.observe(KEY, lat, in_force=1.0) == pytest.approx(first)
    for _ in range(20):
        c.observe(KEY, np.full(100, math.inf))  # never served: the step is capped, the factor bounded
    assert c.factor(KEY) == c.bounds[1]


def test_correction_lowers_capacity_only_when_latency_is_far_below() -> None:
    c = correction()
    slo = c.slo_s[KEY]
    raised = c.observe(KEY, np.full(100, 2.0 * slo))
    assert raised == pytest.approx(2.0 ** 0.5)
    assert c.observe(KEY, np.full(100, 0.8 * slo)) == raised  # within the dead band: kept
    assert c.observe(KEY, np.full(100, 0.4 * slo)) == pytest.approx(raised * 0.8 ** 0.5)
    for _ in range(20):
        c.observe(KEY, np.full(100, 0.01 * slo))
    assert c.factor(KEY) == c.bounds[0] == 1.0  # never below the plan's own headroom by default
    assert c.observe(KEY, np.full(5, 10 * slo)) == 1.0  # too few samples: no change
    assert c.factor(("phi-4", Phase.DECODE)) == 1.0
    loose = LatencyCorrection.for_scenario(SC, bounds=(0.5, 3.0))
    assert loose.observe(KEY, np.full(100, 0.25 * slo)) == pytest.approx(0.5 ** 0.5)


def test_headroom_of_a_plan() -> None:
    plan = plan_of("core", [])
    plan.serving = [
        ModelServing(model="phi-4", phase="prefill", demand=300.0, capacity=310.0, served_fraction=1.0,
                     cost_per_hour=1.0, traffic_tokens_s=100.0),
        ModelServing(model="phi-4", phase="decode", demand=50.0, capacity=60.0, served_fraction=1.0,
                     cost_per_hour=1.0),
    ]
    assert plan_headroom(plan) == {KEY: 3.0}
    assert planned_capacity({KEY: 10.0, ("phi-4", Phase.DECODE): 10.0}, plan_headroom(plan)) == {
        KEY: 30.0, ("phi-4", Phase.DECODE): 10.0}


# --- wired to the simulator ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def phi_only():
    from coral.templates.build import build_library

    sc = SC.model_copy(update={"models": [SC.models[0]]})
    return sc, build_library(sc, workers=1)


def step_requests(slow_s: float, fast_s: float, slow_rate: float, fast_rate: float) -> RequestSet:
    slow = np.arange(0.0, slow_s, 1 / slow_rate)
    fast = np.arange(slow_s, slow_s + fast_s, 1 / fast_rate)
    arrival = np.r_[slow, fast]
    return RequestSet(arrival, np.full(len(arrival), 1155), np.full(len(arrival), 211))


def test_simulator_shows_per_interval_demand_and_latencies(phi_only) -> None:
    from coral.simulation.stand_in import greedy_plan

    sc, library = phi_only
    seen: list[ObservedDemand] = []
    plan = greedy_plan(library, sc, rate_scale=0.1)

    def replan(epoch: int, observed: ObservedDemand, running: object) -> object:
        seen.append(observed)
        return plan

    reqs = step_requests(60.0, 60.0, 1.0, 4.0)
    simulate(replan, sc, {"phi-4": reqs}, duration_s=120, epoch_s=60.0, interval_s=25.0)  # type: ignore[arg-type]
    first, second = seen
    assert first.series == {} and first.latency == {}  # epoch 0: the scenario's forecast
    series = second.series["phi-4"]
    assert second.interval_s == 25.0 and len(series) == 3  # 25 + 25 + 10 s
    assert [round(d.rate * s) for d, s in zip(series, (25, 25, 10), strict=True)] == [25, 25, 10]
    assert sum(d.prefill_tokens_s * s for d, s in zip(series, (25, 25, 10), strict=True)) == \
        pytest.approx(second.models["phi-4"].prefill_tokens_s * 60)
    lat = second.latency["phi-4"]
    assert len(lat.ttft_s) == len(lat.tpot_s) == 60
    assert np.isfinite(lat.ttft_s).all() and (lat.ttft_s > 0).all()
    assert np.nanmax(lat.tpot_s) > 0 and np.isnan(lat.tpot_s).sum() < 60


def test_replanner_with_forecast_plans_for_the_step_before_the_mean_does(phi_only) -> None:
    from coral.simulation.replan import allocator_replanner

    sc, library = phi_only
    reqs = step_requests(120.0, 120.0, 0.5, 3.0)
    capacity: dict[str, list[float]] = {}
    for name, fc in (("mean", None), ("forecast", DemandForecaster(10.0, min_points=4, peak_window=2))):
        inner = allocator_replanner(library, sc, forecaster=fc, correction=LatencyCorrection.for_scenario(sc))
        caps: list[float] = []

        def replan(epoch: int, observed: ObservedDemand, running: object, inner=inner, caps=caps) -> object:
            plan = inner(epoch, observed, running)  # type: ignore[arg-type]
            caps.append(sum(i.throughput for i in plan.instances_of("phi-4", "decode")))
            return plan

        simulate(replan, sc, {"phi-4": reqs}, duration_s=240, epoch_s=90.0, startup_delay_s=10.0,  # type: ignore[arg-type]
                 interval_s=10.0)
        capacity[name] = caps
    # epoch 2 starts at 180 s: the previous epoch (90-180 s) is 1/3 slow, 2/3 fast; its mean under-states the
    # 3 req/s now arriving, the forecast (last intervals and their peak) does not
    assert capacity["forecast"][2] >= 3.0 * 211
    assert capacity["forecast"][2] > capacity["mean"][2]


# --- wired to the runtime ------------------------------------------------------------------------------------
def test_traffic_meter_reads_the_gateway() -> None:
    import time

    from coral.runtime.gateway import GatewayConfig, create_gateway_app
    from coral.runtime.registry import Registry
    from coral.runtime.traffic import TrafficMeter

    meter = TrafficMeter(SC)
    before = meter.observe()  # no gateway yet: the scenario's forecast
    assert before.start_s == before.end_s and before.models["phi-4"].rate == SC.models[0].request_rate
    gw = create_gateway_app(Registry(), GatewayConfig()).state.gateway
    meter.gateway = gw
    assert meter.observe().latency == {}  # first reading: the counters' origin
    for _ in range(30):
        start = time.perf_counter() - 2.0
        gw.record("phi-4", start, start + 1.5, "ok")  # streamed: first byte after 1.5 s, done after 2 s
    for _ in range(10):
        gw.record("phi-4", time.perf_counter(), None, "rejected")
    seen = meter.observe()
    span = seen.end_s - seen.start_s
    assert seen.epoch == 2 and seen.interval_s == span > 0
    phi = seen.models["phi-4"]
    assert phi.rate * span == pytest.approx(40) and phi.prefill_tokens_s == pytest.approx(phi.rate * 1155)
    assert seen.series["phi-4"] == [phi] and seen.models["qwen3-32b"].rate == 0
    lat = seen.latency["phi-4"]
    assert len(lat.ttft_s) == 30 and lat.ttft_s == pytest.approx(np.full(30, 1.5), abs=0.05)
    assert lat.tpot_s == pytest.approx(np.full(30, 0.5 / 210), abs=0.05 / 210)
    assert len(meter.observe().latency["phi-4"].ttft_s) == 0  # nothing new since
    slow = TrafficMeter(SC, gw, time_scale=4.0)  # engines slowed 4x: 4x the rate and 1/4 of the latency seen
    slow.observe()
    start = time.perf_counter() - 2.0
    gw.record("phi-4", start, start + 1.5, "ok")
    seen = slow.observe()
    assert seen.models["phi-4"].rate * seen.interval_s == pytest.approx(1)
    assert seen.interval_s == pytest.approx((seen.end_s - seen.start_s) / 4)
    assert seen.latency["phi-4"].ttft_s == pytest.approx([1.5 / 4], abs=0.05)


def test_runtime_planner_follows_observed_traffic(phi_only, tmp_path) -> None:
    from coral.cli.runtime import allocator_planner
    from coral.simulation import ModelDemand

    sc, library = phi_only
    path = tmp_path / "phi.yaml"
    path.write_text(sc.model_dump_json())
    library.save(tmp_path / "phi.templates.sqlite")
    shown = [ObservedDemand(0, 0.0, 0.0, {"phi-4": ModelDemand(10.0, 11550.0, 2110.0)})]
    shown += [ObservedDemand(e, 60.0 * e, 60.0 * (e + 1), {"phi-4": ModelDemand(r, r * 1155, r * 211)},
                             interval_s=60.0, series={"phi-4": [ModelDemand(r, r * 1155, r * 211)]})
              for e, r in ((1, 1.0), (2, 1.0), (3, 4.0), (4, 0.0))]
    plans = []
    planner = allocator_planner(str(path), lambda: plans[-1] if plans else None, out=tmp_path,
                                observe=lambda: shown[len(plans)])
    for _ in shown:
        plans.append(planner())
    decode = [sum(i.throughput for i in p.instances_of("phi-4", "decode")) for p in plans]
    assert decode[1] < decode[0] and decode[3] >= 4 * 211 > decode[2]
    assert 0 < decode[4] < decode[3]  # idle: the decayed peak, and never no instance at all


def test_replanner_holds_keys_whose_running_capacity_is_within_the_band(phi_only) -> None:
    from coral.simulation import ModelDemand
    from coral.simulation.replan import allocator_replanner, capacity

    sc, library = phi_only
    log: list[str] = []
    replan = allocator_replanner(library, sc, hold=0.25, log=log)
    first = replan(0, ObservedDemand(0, 0.0, 0.0, {"phi-4": ModelDemand(10.0, 11550.0, 2110.0)}), None)
    keys = [("phi-4", Phase.PREFILL), ("phi-4", Phase.DECODE)]
    have = {k: capacity(first, k) for k in keys}
    slightly_less = ObservedDemand(1, 0.0, 60.0, {"phi-4": ModelDemand(9.0, 9.0 * 1155, 9.0 * 211)})
    kept = replan(1, slightly_less, first)
    assert log[-1].endswith("2 held")
    assert all(capacity(kept, k) >= have[k] for k in keys)
    much_less = ObservedDemand(2, 60.0, 120.0, {"phi-4": ModelDemand(2.0, 2.0 * 1155, 2.0 * 211)})
    smaller = replan(2, much_less, kept)
    assert log[-1].endswith("0 held") and smaller.cost_per_hour < kept.cost_per_hour


def test_floor_keeps_an_idle_model_served(phi_only) -> None:
    from coral.simulation import ModelDemand
    from coral.simulation.replan import allocator_replanner

    sc, library = phi_only
    idle = ObservedDemand(1, 0.0, 60.0, {"phi-4": ModelDemand(0.0, 0.0, 0.0)})
    assert allocator_replanner(library, sc)(1, idle, None).instances == []
    kept = allocator_replanner(library, sc, floor_tokens_s=1.0)(1, idle, None)
    assert {(i.model, i.phase) for i in kept.instances} == {("phi-4", "prefill"), ("phi-4", "decode")}


def test_serve_starts_from_the_current_plan_and_never_plans_below_its_headroom(phi_only, tmp_path) -> None:
    """`coral serve` with the current plan (SLO-true, from `coral run`): the first plan is that plan itself, at
    its cost; every re-plan keeps at least that plan's headroom x the traffic observed, even when the forecast
    lags a jump, and light traffic may shrink the plan but never below that floor."""
    from coral.allocation.allocator import allocate
    from coral.cli.runtime import allocator_planner
    from coral.planning.slo_search import with_traffic
    from coral.simulation import ModelDemand
    from coral.simulation.replan import capacity

    sc, library = phi_only
    path = tmp_path / "phi.yaml"
    path.write_text(sc.model_dump_json())
    library.save(tmp_path / "phi.templates.sqlite")
    traffic = {("phi-4", Phase.PREFILL): 10.0 * 1155, ("phi-4", Phase.DECODE): 10.0 * 211}
    room = {("phi-4", Phase.PREFILL): 3.0, ("phi-4", Phase.DECODE): 2.0}
    current = with_traffic(allocate(library, sc, demand={k: v * room[k] for k, v in traffic.items()}), traffic)
    rates = (10.0, 1.0, 1.0, 12.0)
    shown = [ObservedDemand(0, 0.0, 0.0, {"phi-4": ModelDemand(10.0, 11550.0, 2110.0)})]
    shown += [ObservedDemand(e, 60.0 * e, 60.0 * (e + 1), {"phi-4": ModelDemand(r, r * 1155, r * 211)},
                             interval_s=60.0, series={"phi-4": [ModelDemand(r, r * 1155, r * 211)]})
              for e, r in enumerate(rates, 1)]
    plans = []
    planner = allocator_planner(str(path), lambda: plans[-1] if plans else None, out=tmp_path,
                                observe=lambda: shown[len(plans)], initial=current)
    for _ in shown:
        plans.append(planner())
    assert plans[0] is current
    for plan, seen in zip(plans[1:], shown[1:], strict=True):
        for k, h in room.items():
            observed = seen.models["phi-4"].prefill_tokens_s if k[1] is Phase.PREFILL else seen.models[
                "phi-4"].decode_tokens_s
            assert capacity(plan, k) >= h * observed * (1 - 1e-9)
    assert plans[2].cost_per_hour < current.cost_per_hour  # light traffic: a smaller plan


def test_every_replan_is_said_with_old_and_new_cost_and_why(phi_only) -> None:
    from coral.allocation.allocator import allocate
    from coral.cli.runtime import logged_planner, replan_words

    sc, library = phi_only
    big = allocate(library, sc, demand={("phi-4", Phase.PREFILL): 40_000.0, ("phi-4", Phase.DECODE): 8_000.0})
    small = allocate(library, sc, demand={("phi-4", Phase.PREFILL): 4_000.0, ("phi-4", Phase.DECODE): 800.0})
    assert replan_words(big, big.model_copy(deep=True)) is None
    line = replan_words(big, small)
    assert line is not None
    assert line.startswith(f"re-plan: ${big.cost_per_hour:,.2f}/h -> ${small.cost_per_hour:,.2f}/h")
    assert "phi-4/prefill asks 4,000 tok/s" in line and "phi-4/decode asks 800 tok/s" in line
    said: list[str] = []
    running = [big]
    plan = logged_planner(lambda: small, lambda: running[-1], said.append)
    running.append(plan())
    plan()  # the same plan again: nothing said
    assert said == [line]
