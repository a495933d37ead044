"""`simulate`: run a plan (or a re-planner) against a workload and measure latency, goodput and cost."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Literal

import numpy as np

from coral.allocation.availability import market_availability
from coral.allocation.core import UNLIMITED
from coral.allocation.plan import Plan
from coral.allocation.shedding import Shedder
from coral.catalog.loader import Catalog, CoralInputError, builtin_catalog
from coral.catalog.schema import Scenario
from coral.catalog.suggest import did_you_mean
from coral.perf.roofline import RooflineModel
from coral.simulation.availability import AvailabilitySchedule, counts_in_force
from coral.simulation.engine import Counts, Engine, ModelDemand, ObservedDemand, ObservedLatency, Replanner
from coral.simulation.kernels import KernelCache
from coral.simulation.metrics import SimResult, collect
from coral.workload.traces import RequestSet, workload_for


def scenario_forecast(scenario: Scenario) -> dict[str, ModelDemand]:
    """The scenario's own demand: request rate x mean tokens per phase."""
    return {
        m.model: ModelDemand(m.request_rate, m.request_rate * m.mean_input_tokens,
                             m.request_rate * m.mean_output_tokens)
        for m in scenario.models
    }


def scenario_counts(scenario: Scenario, catalog: Catalog) -> Counts | str:
    """The scenario's own availability, what a schedule overrides: its table, the market's counts, or
    "unlimited" (a headroom rule, which needs a template library, counts as unlimited here)."""
    if isinstance(scenario.availability, dict):
        return scenario.availability
    if scenario.availability == "market":
        return market_availability(scenario, catalog)
    return UNLIMITED


def check_plan(plan: Plan, scenario: Scenario) -> None:
    known = {m.model for m in scenario.models}
    for i, inst in enumerate(plan.instances):
        if inst.model not in known:
            raise CoralInputError(f"plan: instances.{i}.model: {inst.model!r} is not a model of {scenario.name}"
                                  f"{did_you_mean(inst.model, known)}")
        if sum(s.layers for s in inst.stages) <= 0:
            raise CoralInputError(f"plan: instances.{i}.stages: no layers")
        for j, s in enumerate(inst.stages):
            if len(s.node_throughput) not in (0, len(s.nodes)):
                raise CoralInputError(f"plan: instances.{i}.stages.{j}: node_throughput must match nodes")


def simulate(
    plan_or_replanner: Plan | Replanner,
    scenario: Scenario,
    requests: dict[str, RequestSet] | None = None,
    *,
    duration_s: float,
    seed: int = 0,
    router: str = "wrr",
    catalog: Catalog | None = None,
    perf: RooflineModel | None = None,
    startup_delay_s: float = 300.0,
    epoch_s: float | None = None,
    availability: AvailabilitySchedule | None = None,
    drain_limit_s: float = 600.0,
    handover: bool = True,
    forecast: Literal["previous", "oracle"] = "previous",
    kv_reserve: Literal["mean", "max"] = "mean",
    interval_s: float = 60.0,
    shed: Literal["plan", "always", "off"] = "plan",
    loop: Literal["compiled", "python"] = "compiled",
    kernels: KernelCache | None = None,
) -> SimResult:
    """Serve `requests` (default: the scenario's traces, seeded) for `duration_s` with a fixed plan, or with
    `replan(epoch, observed_demand, running_plan) -> Plan` called at the start of every epoch (epoch 0 sees
    the scenario's forecast). Arrivals stop at `duration_s`; in-flight requests then get `drain_limit_s` more
    to finish, after which they count as unfinished. With `handover`, an instance a re-plan removes keeps
    serving until the new instances of its (model, phase) are ready, then drains; without, it drains at once.
    `forecast` is the demand a re-planner is shown: the previous epoch's ("previous") or the coming epoch's
    actual demand ("oracle", a perfect forecast, for comparison), with its demand per `interval_s` and, for the
    previous epoch, the latencies observed so far (`ObservedDemand`). `kv_reserve` is the KV a decoding request
    is charged: prompt + half its output ("mean", a paged cache's average) or prompt + output ("max").
    `availability` may change prices too (its steps' `prices`): a re-planner is shown the market in force, and
    an instance is billed the price its plan was made at. Its counts override the scenario's availability from
    each step on (before the first step the scenario's own is in force, `counts_in_force`); when a step leaves
    fewer nodes than running instances hold, instances on them are lost at once (`Engine.lose`: they stop serving
    and billing, requests not yet decoding are routed again, decoding ones fail), and an instance a re-plan removes
    is handed over only while its nodes and its replacements' fit the count in force. `shed`: requests beyond the
    capacity serving their model are refused at arrival, as the gateway refuses them (`coral.allocation.shedding`):
    while the plan in force serves only a share of some model's demand ("plan"), always, or never ("off").
    `loop`: a plan that stays put (no re-planner, no availability step, nothing shed) runs in the compiled event
    loop (`coral.simulation.compiled`); "python" runs the reference loop, which also serves every other run.
    `kernels`: step-time tables made for this scenario, catalog and perf model, kept across runs of several plans
    (default: made for this run)."""
    if duration_s <= 0 or interval_s <= 0:
        raise CoralInputError("duration_s and interval_s must be > 0")
    if forecast not in ("previous", "oracle"):
        raise CoralInputError(f"forecast must be 'previous' or 'oracle', not {forecast!r}")
    t_wall = time.perf_counter()
    catalog = catalog or builtin_catalog()
    perf = perf or RooflineModel()
    epoch_s = epoch_s or scenario.epoch_minutes * 60.0
    requests = requests if requests is not None else workload_for(scenario, duration_s, seed)
    names = [m.model for m in scenario.models]
    unknown = sorted(set(requests) - set(names))
    if unknown:
        raise CoralInputError(f"requests for model(s) {', '.join(unknown)} not in scenario {scenario.name}"
                              + "".join(did_you_mean(m, names) for m in unknown))
    parts = [(i, requests[m].until(duration_s)) for i, m in enumerate(names) if m in requests]
    arrival = np.concatenate([r.arrival_s for _, r in parts]) if parts else np.zeros(0)
    model_of = np.concatenate([np.full(len(r), i, dtype=np.int64) for i, r in parts]) if parts else np.zeros(0, int)
    inp = np.concatenate([r.input_tokens for _, r in parts]) if parts else np.zeros(0, int)
    out = np.concatenate([r.output_tokens for _, r in parts]) if parts else np.zeros(0, int)
    order = np.lexsort((model_of, arrival))
    arrival, model_of, inp, out = arrival[order], model_of[order], inp[order], out[order]
    if kernels is None:
        kernels = KernelCache(scenario, catalog, perf)
    elif kernels.scenario is not scenario or kernels.catalog is not catalog:
        raise ValueError("kernels: made for another scenario or catalog")
    available: Callable[[float], Counts] | None = None  # node counts in force at a time
    if availability is not None:
        available = partial(counts_in_force, availability, scenario_counts(scenario, catalog), scenario)

    engine = Engine(
        kernels, names, arrival, model_of, inp, out,
        router=router, startup_delay_s=startup_delay_s, horizon_s=duration_s + drain_limit_s, handover=handover,
        kv_reserve=kv_reserve, available=available, shedder=Shedder.for_scenario(scenario), shed=shed,
    )

    def demand_of(epoch: int) -> ObservedDemand:
        window = epoch - 1 if forecast == "previous" else epoch
        a, b = window * epoch_s, (window + 1) * epoch_s
        lo, hi = (int(x) for x in np.searchsorted(arrival, [a, b]))
        mod, t_in, t_out = model_of[lo:hi], inp[lo:hi], out[lo:hi]
        cut = np.append(np.arange(a, b, interval_s), b)
        slot = np.searchsorted(cut, arrival[lo:hi], side="right") - 1
        span = np.diff(cut)

        def per_interval(sel: np.ndarray) -> list[ModelDemand]:
            count = np.bincount(slot[sel], minlength=len(span))
            pre = np.bincount(slot[sel], weights=t_in[sel], minlength=len(span))
            dec = np.bincount(slot[sel], weights=t_out[sel], minlength=len(span))
            return [ModelDemand(float(c / d), float(p / d), float(o / d))
                    for c, p, o, d in zip(count, pre, dec, span, strict=True)]

        models: dict[str, ModelDemand] = {}
        series: dict[str, list[ModelDemand]] = {}
        for i, m in enumerate(names):
            sel = mod == i
            models[m] = ModelDemand(float(sel.sum() / (b - a)), float(t_in[sel].sum() / (b - a)),
                                    float(t_out[sel].sum() / (b - a)))
            series[m] = per_interval(sel)
        return ObservedDemand(epoch, a, b, models, available(epoch * epoch_s) if available is not None else None,
                              interval_s, series, observed_latency(lo, hi, epoch * epoch_s) if window < epoch else {},
                              market_at(epoch * epoch_s))

    def market_at(t: float) -> Catalog | None:
        """The catalog with the schedule's prices in force at `t`; None while it sets none."""
        prices = availability.prices_at(t) if availability else {}
        return catalog.with_prices(prices) if prices else None

    def observed_latency(lo: int, hi: int, now: float) -> dict[str, ObservedLatency]:
        """Latencies of requests lo..hi as known at `now` (see `ObservedLatency`)."""
        first = np.array(engine.t_first[lo:hi])
        done = np.array(engine.t_done[lo:hi])
        arrived, mod = arrival[lo:hi], model_of[lo:hi]
        ttft = np.where(np.isnan(first), now, first) - arrived
        tokens = out[lo:hi] - 1
        tpot = np.where(tokens > 0, (np.where(np.isnan(done), now, done) - first) / np.maximum(tokens, 1), np.nan)
        seen: dict[str, ObservedLatency] = {}
        for i, m in enumerate(names):
            sel = mod == i
            seen[m] = ObservedLatency(ttft[sel], tpot[sel])
        return seen

    if isinstance(plan_or_replanner, Plan):
        first, replan = plan_or_replanner, None
    else:
        replan = plan_or_replanner
        avail0 = available(0.0) if available is not None else None
        if forecast == "oracle":
            first = replan(0, demand_of(0), None)
        else:
            first = replan(0, ObservedDemand(0, 0.0, 0.0, scenario_forecast(scenario), avail0,
                                             market=market_at(0.0)), None)
    check_plan(first, scenario)

    def checked(epoch: int, demand: ObservedDemand, running: Plan | None) -> Plan:
        assert replan is not None
        plan = replan(epoch, demand, running)
        check_plan(plan, scenario)
        return plan

    changes = [s.at_s for s in availability.steps] if availability else []
    compiled = loop == "compiled" and replan is None and not changes
    engine.start(first, changes, lists=not compiled)
    if compiled and engine.stays_put():
        from coral.simulation.compiled import serve  # numba: loaded by the runs that use it

        trace, record = serve(engine, duration_s)
    else:
        trace = engine.serve(first, checked if replan else None, epoch_s, duration_s, demand_of)
        record = engine.record()
    result = collect(
        engine, trace, record, scenario=scenario.name, router=router, seed=seed, duration_s=duration_s, epoch_s=epoch_s,
        startup_delay_s=startup_delay_s,
        ttft_slo_s=np.array([kernels.models[m].ttft_slo_s for m in names]),
        tpot_slo_s=np.array([kernels.models[m].tpot_slo_s for m in names]),
        available=available,
    )
    result.wall_s = time.perf_counter() - t_wall
    result.requests_per_wall_s = result.requests / result.wall_s if result.wall_s > 0 else 0.0
    missing = sorted({m for m in names if m in requests and len(requests[m])} - {i.model for i in first.instances})
    if missing:
        result.notes.append(f"plan serves no instance of: {', '.join(missing)}")
    result.notes += trace.losses
    if result.refused:
        result.notes.append(f"{result.refused:,} requests shed at arrival: beyond the capacity serving their model "
                            f"(shed={shed})")
    if trace.losses:
        result.notes.append(f"instances lost with their nodes: {trace.rerouted} requests routed again, "
                            f"{trace.failed} lost mid-decode (unfinished)")
    return result
