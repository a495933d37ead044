"""Allocation experiments: planned cost of Coral vs the baselines (homo-ilp, homo-greedy, cauchy-paper; see
coral.allocation.baselines), every method at equal attainment in scarce markets and under imbalanced demand,
goodput below the estimated demand, a multi-epoch run with shifting demand and availability, and the waterfall
from the paper's setting to ours.

The scarce and imbalanced experiments compare methods as the paper's claims need: at equal SLO attainment.
Each method's planner goes through the same deterministic search as `coral run` (`coral.planning.search_plan`),
and where its market holds no plan meeting the targets it plans its most goodput instead (`at_target_rows`).

SLO goodput is measured as the paper measures it, by simulation: every plan of the default, scarce, below and
imbalanced experiments is run on the scenario's held-out workload (seed `HELD_OUT_SEED` of the held-out part of
each trace, the scenario's run length; the planner sizes demand on seed 0 of the tuning part) and scored by the
generated tokens/s of requests that met both SLOs, beside the planned share of demand served. Prices, instance
types and regions come from `offerings` when given (an offerings file, as `--offerings`), else from each
scenario's own market.

Every experiment returns an `ExperimentResult` (rows of a table) and writes `<out>/experiments/<name>.json` and
`<name>.png`. Libraries are built once per scenario and cached at `<out>/<scenario>.templates.sqlite`."""

from __future__ import annotations

import contextlib
import inspect
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from coral.allocation import baselines
from coral.allocation.allocator import (
    UNLIMITED,
    InfeasibleDemand,
    allocate,
    estimated_nodes,
    resolve_availability,
)
from coral.allocation.availability import headroom_availability, market_availability
from coral.allocation.demand import TUNING_SEED, DemandKey, run_length_s, scenario_demand
from coral.allocation.plan import Plan
from coral.catalog.loader import (
    Catalog,
    CoralInputError,
    builtin_catalog,
    data_path,
    scenario_and_market,
)
from coral.catalog.schema import Scenario, parse_config_name
from coral.experiments.paper import paper_setting, waterfall_settings
from coral.templates.library import TemplateLibrary
from coral.templates.store import load_library
from coral.workload.traces import RequestSet, thinned, workload_for

if TYPE_CHECKING:
    from coral.planning import SearchSettings

BELOW_FACTORS = (0.5, 0.8)  # availability below the estimate: demand cannot be met
EPOCH_SEED = 7
#: seed of the workload plans are scored on, read from the held-out part of each trace (`workload_for(...,
#: part="held_out")`): the planner, which sizes on the tuning part, never sees its requests
HELD_OUT_SEED = TUNING_SEED + 1
Progress = Callable[[str], None]


@dataclass
class ExperimentResult:
    name: str
    title: str
    columns: list[str]
    rows: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)


class Inputs:
    """Scenarios, their market and their libraries, loaded once per experiment: the market is `offerings` (an
    offerings file) when given, else each scenario's own."""

    def __init__(self, out: Path, offerings: Path | None = None) -> None:
        self.out, self.offerings = out, offerings
        self._cache: dict[str, tuple[Scenario, Catalog, TemplateLibrary]] = {}

    def __call__(self, name: str) -> tuple[Scenario, Catalog, TemplateLibrary]:
        if name not in self._cache:
            sc, cat = scenario_and_market(name, self.offerings)
            self._cache[name] = (sc, cat, load_library(name, self.out, cat))
        return self._cache[name]


class Judge:
    """A plan's SLO goodput by simulation (module doc), on the held-out workload of the scenario it serves (made
    once per scenario and kept). A plan that serves a model's demand only in part (scarcity) is offered that
    share of the model's requests, the rest shed at the door, as a gateway admitting only what the plan was
    sized for would (the paper's protocol scales the offered load down likewise); shed requests count as
    offered and missed."""

    def __init__(self) -> None:
        self._workloads: dict[str, dict[str, RequestSet]] = {}

    def __call__(self, plan: Plan, sc: Scenario, catalog: Catalog) -> dict[str, float]:
        from coral.simulation.run import simulate

        duration = run_length_s(sc)
        key = sc.model_dump_json(include={"models", "trace_scaling", "epochs", "epoch_minutes"})
        if key not in self._workloads:
            self._workloads[key] = workload_for(sc, duration, HELD_OUT_SEED, part="held_out")
        offered = self._workloads[key]
        admitted = thinned(offered, plan.model_shares(), HELD_OUT_SEED)
        # the share admitted is thinned here, as the paper scores partial service: no shedding on top of it
        sim = simulate(plan, sc, admitted, duration_s=duration, seed=HELD_OUT_SEED, catalog=catalog, shed="off")
        tokens = sum(float(r.output_tokens.sum()) for r in offered.values()) / duration
        requests = {m: len(r) for m, r in offered.items()}
        att = {m.model: m.slo_attainment for m in sim.models}
        good = {m: att.get(m, 0.0) * len(admitted[m]) / n if len(admitted[m]) else float(n == 0)
                for m, n in requests.items()}
        return {"sim_goodput": round(sim.goodput_tokens_s, 1),
                "goodput_share": round(sim.goodput_tokens_s / tokens, 4) if tokens else 1.0,
                "attainment": round(sum(good[m] * requests[m] for m in good) / max(sum(requests.values()), 1), 4),
                "least_attainment": round(min(good.values(), default=1.0), 4)}


def _min_served(plan: Plan) -> float:
    return min((s.served_fraction for s in plan.serving if s.demand > 0), default=1.0)


def _served(plan: Plan) -> float:
    """Planned share of demand served: Σ min(capacity, demand) / Σ demand over all (model, phase) (the paper's
    goodput, SLO-meeting tokens/s, is the `Judge`'s)."""
    dem = sum(s.demand for s in plan.serving)
    return sum(min(s.capacity, s.demand) for s in plan.serving) / dem if dem else 1.0


METHODS = ("coral", "homo-ilp", "homo-greedy", "cauchy-paper")


def compare_plans(lib: TemplateLibrary, sc: Scenario, avail: dict[str, dict[str, int]] | str,
                  demand: dict[DemandKey, float] | None, time_limit: float, catalog: Catalog | None = None
                  ) -> dict[str, Plan]:
    """Coral and every baseline on one setting. Coral and homo-ilp run in cost mode; when demand cannot be met
    they run in goodput mode (Coral also without its fairness floor, in max-min and in the paper's scaled
    mode, as "coral-no-floor", "coral-maxmin" and "coral-scaled")."""
    plans: dict[str, Plan] = {}
    common: dict[str, Any] = {"demand": demand, "availability": avail, "catalog": catalog}
    try:
        plans["coral"] = allocate(lib, sc, time_limit=time_limit, gap=1e-4, **common)
    except InfeasibleDemand:
        plans["coral"] = allocate(lib, sc, mode="goodput", time_limit=time_limit, **common)
        plans["coral-no-floor"] = allocate(lib, sc, mode="goodput", fairness=0.0, time_limit=time_limit, **common)
        for mode in ("maxmin", "scaled"):  # raise when no model can be served at a positive uniform share
            with contextlib.suppress(InfeasibleDemand):
                plans[f"coral-{mode}"] = allocate(lib, sc, mode=mode, time_limit=time_limit, **common)
    try:
        plans["homo-ilp"] = baselines.homo_ilp(lib, sc, time_limit=time_limit, gap=1e-4, **common)
    except InfeasibleDemand:
        plans["homo-ilp"] = baselines.homo_ilp(lib, sc, mode="goodput", time_limit=time_limit, **common)
    plans["homo-greedy"] = baselines.homo_greedy(lib, sc, **common)
    plans["cauchy-paper"] = baselines.cauchy_paper(lib, sc, time_limit=time_limit, **common)
    return plans


def _met(plan: Plan) -> bool:
    return _min_served(plan) >= 1 - 1e-9 and plan.demand_scale >= 1


def _compare(name: str, lib: TemplateLibrary, sc: Scenario, avail: dict[str, dict[str, int]] | str,
             time_limit: float, catalog: Catalog, judge: Judge | None) -> list[dict[str, Any]]:
    """One row per method (`compare_plans`, on the scenario's demand); ratio = the method's $/h over Coral's
    (> 1: Coral is cheaper); with a `judge`, each plan's simulated SLO goodput and goodput_x = Coral's goodput
    over the method's (> 1: Coral serves more tokens/s within SLO)."""
    plans = compare_plans(lib, sc, avail, None, time_limit, catalog)
    coral = plans["coral"].cost_per_hour
    judged = {method: judge(p, sc, catalog) for method, p in plans.items()} if judge is not None else {}
    rows: list[dict[str, Any]] = [{
        "setting": name, "method": method, "cost_per_hour": round(p.cost_per_hour, 4),
        "ratio": round(p.cost_per_hour / coral, 4) if coral > 0 else None, "demand_met": _met(p),
        "instances": len(p.instances), "nodes": sum(i.n_nodes for i in p.instances),
        "heterogeneous": sum(i.heterogeneous for i in p.instances),
        "min_served": round(_min_served(p), 4), "served": round(_served(p), 4),
        "demand_scale": p.demand_scale, "solve_s": round(p.solve.time_s, 3),
        "gap": p.solve.gap, "status": p.solve.status,
        **judged.get(method, {}),
    } for method, p in plans.items()]
    if judged:
        best = judged["coral"]["sim_goodput"]
        for r in rows:
            got = judged[r["method"]]["sim_goodput"]
            r["goodput_x"] = round(best / got, 4) if got > 0 else None
    return rows


COMPARE_COLUMNS = ["setting", "method", "cost_per_hour", "ratio", "demand_met", "instances", "nodes",
                   "heterogeneous", "min_served", "served", "demand_scale", "solve_s", "gap", "status"]
JUDGED_COLUMNS = ["sim_goodput", "goodput_share", "goodput_x", "attainment", "least_attainment"]


def _columns(judge: Judge | None) -> list[str]:
    return COMPARE_COLUMNS + (JUDGED_COLUMNS if judge is not None else [])


def _availability(sc: Scenario, lib: TemplateLibrary, factor: float, catalog: Catalog) -> dict[str, dict[str, int]]:
    """The headroom rule at `factor` × E_c (the nodes of the scenario's unlimited cost-optimal plan, memoised)."""
    return headroom_availability(sc, estimated_nodes(sc, lib, catalog), factor, catalog)


def exp_default(inputs: Inputs, judge: Judge | None, time_limit: float = 30.0) -> ExperimentResult:
    """The default setting (core and extended): at the headroom rule (its factor, 3 for the shipped scenarios,
    which plan in the market now; derived from Coral's own unlimited plan, so it offers few nodes of shapes Coral
    does not use) and with unlimited availability (no such bias)."""
    rows = []
    for name in ("core", "extended"):
        sc, cat, lib = inputs(name)
        factor = getattr(sc.availability, "factor", 3.0)
        rows += _compare(name, lib, sc, _availability(sc, lib, factor, cat), time_limit, cat, judge)
        rows += _compare(f"{name} unlimited", lib, sc, UNLIMITED, time_limit, cat, judge)
    return ExperimentResult("default", "Default setting: planned $/h", _columns(judge), rows,
                            notes=["ratio = method $/h / Coral $/h; a ratio is a saving only where demand_met",
                                   *_judged_notes(judge)])


def _judged_notes(judge: Judge | None) -> list[str]:
    if judge is None:
        return ["not simulated (--no-simulate): served is the planned share of demand, not SLO goodput"]
    return [f"sim_goodput = generated tokens/s of requests meeting both SLOs, simulated on the held-out workload "
            f"(seed {HELD_OUT_SEED}, the held-out half of each trace), each model offered the share of its "
            "requests the plan serves (the rest shed); "
            "goodput_share = of all tokens/s offered; goodput_x = Coral's sim_goodput / the method's (> 1: Coral "
            "serves more within SLO); attainment = share of all offered requests served within SLO"]


#: the scarce experiment's markets per scenario (offerings files with node counts, `coral/data/markets/`): of
#: our own making, shaped like the paper's §6.4 (its best GPU types few per region, the weaker ones limited too),
#: independent of any method's plan; the first of each scenario is the tighter
SCARCE_MARKETS = {"core": ("core-scarce", "core-scarce-loose"), "extended": ("extended-scarce",)}
#: the planners an at-target experiment searches with (`coral.planning.search_plan`)
PLANNERS: dict[str, Callable[..., Plan]] = {"coral": allocate, "homo-ilp": baselines.homo_ilp,
                                            "homo-greedy": baselines.homo_greedy,
                                            "cauchy-paper": baselines.cauchy_paper}


def market_file(name: str) -> Path:
    """A shipped market (`SCARCE_MARKETS`): an offerings file whose every offering carries its node count."""
    return data_path("markets", f"{name}.yaml")


def most_goodput(method: str, lib: TemplateLibrary, sc: Scenario, avail: dict[str, dict[str, int]] | str,
                 catalog: Catalog, time_limit: float) -> Plan:
    """The method's plan when it cannot meet the targets: goodput mode for Coral and homo-ilp (the most SLO
    goodput, then cost), the baselines' own rule otherwise (what fits; baselines module doc), at the
    scenario's demand (the percentile rule)."""
    common: dict[str, Any] = {"availability": avail, "catalog": catalog}
    if method == "coral":
        return allocate(lib, sc, mode="goodput", time_limit=time_limit, **common)
    if method == "homo-ilp":
        return baselines.homo_ilp(lib, sc, mode="goodput", time_limit=time_limit, **common)
    return PLANNERS[method](lib, sc, **common)


def _mixed_gpu_share(plan: Plan) -> float:
    """Share of the plan's GPUs that sit in instances mixing GPU types."""
    def gpus(i: Any) -> int:
        return sum(n * parse_config_name(c)[1] for c, n in i.counts.items())

    total = sum(gpus(i) for i in plan.instances)
    return sum(gpus(i) for i in plan.instances if i.heterogeneous) / total if total else 0.0


def at_target_rows(setting: str, lib: TemplateLibrary, sc: Scenario, avail: dict[str, dict[str, int]] | str,
                   catalog: Catalog, judge: Judge, time_limit: float, progress: Progress | None = None,
                   settings: SearchSettings | None = None) -> list[dict[str, Any]]:
    """One row per method at equal attainment: the cheapest plan its search finds that meets every model's
    target on the tuning requests (`coral.planning.search_plan`, the same deterministic search for every method;
    Coral's also runs homo-ilp's rounds, so it is never dearer), or, where the market cannot hold one, its
    most-goodput plan (`most_goodput`); each scored by the `judge` on held-out requests. `settings`: the search's
    (default: its own defaults, as `coral run`)."""
    from coral.planning import SearchSettings, search_method
    from coral.planning.slo_search import simulator_evaluator

    settings = settings or SearchSettings()
    # one evaluator for every method: a plan two searches share is simulated once
    evaluate = simulator_evaluator(sc, run_length_s(sc), catalog, settings.window_seeds)
    rows: list[dict[str, Any]] = []
    for method, fn in PLANNERS.items():
        say = (lambda line, m=method: progress(f"{setting}, {m}: {line}")) if progress else None
        t0 = time.perf_counter()
        res = search_method(fn, lib, sc, avail, settings, catalog=catalog, evaluate=evaluate, progress=say)
        at_target = res.plan is not None and res.tuned_passed
        plan = res.plan if at_target and res.plan is not None else most_goodput(method, lib, sc, avail, catalog,
                                                                                time_limit)
        rows.append({"setting": setting, "method": method, "planned": "at target" if at_target else "goodput mode",
                     "cost_per_hour": round(plan.cost_per_hour, 4), "met": at_target and res.met,
                     "served": round(_served(plan), 4), "instances": len(plan.instances),
                     "heterogeneous": sum(i.heterogeneous for i in plan.instances),
                     "mixed_gpus": round(_mixed_gpu_share(plan), 4), "rounds": len(res.rounds),
                     "safety_net": res.safety_net, "search_s": round(time.perf_counter() - t0, 1),
                     **judge(plan, sc, catalog)})
    coral = rows[0]
    for r in rows:
        r["ratio"] = round(r["cost_per_hour"] / coral["cost_per_hour"], 4) if coral["cost_per_hour"] else None
        r["goodput_x"] = round(coral["sim_goodput"] / r["sim_goodput"], 4) if r["sim_goodput"] > 0 else None
    return rows


AT_TARGET_COLUMNS = ["setting", "method", "planned", "cost_per_hour", "ratio", "sim_goodput", "goodput_share",
                     "goodput_x", "attainment", "least_attainment", "met", "served", "instances", "heterogeneous",
                     "mixed_gpus", "rounds", "search_s"]


def _where_from(rows: list[dict[str, Any]]) -> list[str]:
    """Coral's lead split in two, per setting: heterogeneity (homo-ilp -> coral: the same ILP and search with
    heterogeneous templates added) and cross-model coordination (homo-greedy -> homo-ilp: one ILP over every
    model instead of a per-model greedy choice)."""
    def step(a: dict[str, Any], b: dict[str, Any]) -> str:
        return (f"goodput x{b['sim_goodput'] / a['sim_goodput']:.2f}, $/h x{b['cost_per_hour'] / a['cost_per_hour']:.2f}"
                if a["sim_goodput"] > 0 and a["cost_per_hour"] > 0 else "n/a")

    out = []
    for setting in dict.fromkeys(r["setting"] for r in rows):
        by = {r["method"]: r for r in rows if r["setting"] == setting}
        out.append(f"{setting}: heterogeneity (homo-ilp -> coral) {step(by['homo-ilp'], by['coral'])}; coordination "
                   f"(homo-greedy -> homo-ilp) {step(by['homo-greedy'], by['homo-ilp'])}; Coral's GPUs in mixed "
                   f"instances {by['coral']['mixed_gpus']:.0%}")
    return out


def _at_target_notes(judge: Judge) -> list[str]:
    return ["planned: 'at target' = the cheapest plan its search found meeting every model's target on the tuning "
            "requests; 'goodput mode' = the market holds none, so the most SLO goodput it can plan (homo-greedy, "
            "cauchy-paper: what fits)",
            "met = every model meets its target on the held-out requests too; ratio = $/h / Coral's; mixed_gpus = "
            "share of the plan's GPUs in instances mixing GPU types", *_judged_notes(judge)]


def _scenarios(scenario: str | None, known: tuple[str, ...]) -> tuple[str, ...]:
    if scenario is None:
        return known
    if scenario not in known:
        raise CoralInputError(f"scenario {scenario!r}: this experiment runs on {' or '.join(known)}")
    return (scenario,)


def _named(name: str, scenario: str | None) -> str:
    return f"{name}-{scenario}" if scenario else name


def _market_words(market: str) -> str:
    """The market file's own description (its first line: '# <name>: <description>')."""
    first = market_file(market).read_text().splitlines()[0]
    return first.split(": ", 1)[-1].rstrip(".")


def _needs_judge(name: str, judge: Judge | None) -> Judge:
    if judge is None:
        raise CoralInputError(f"experiment {name!r} plans at equal attainment, which needs the simulator")
    return judge


def exp_scarce(inputs: Inputs, judge: Judge | None, time_limit: float = 30.0, scenario: str | None = None,
               progress: Progress | None = None) -> ExperimentResult:
    """Scarce availability in the paper's sense (§6.4): markets whose best GPU types are few per region and whose
    weaker types are limited too (`SCARCE_MARKETS`, independent of any method's plan; or the offerings file the
    `inputs` were given, with its counts). Every method plans at
    equal attainment where the market holds a plan meeting its targets, in goodput mode where it does not
    (`at_target_rows`); SLO goodput on held-out requests."""
    judge = _needs_judge("scarce", judge)
    rows = []
    names = _scenarios(scenario, tuple(SCARCE_MARKETS))
    for name in names:
        lib = inputs(name)[2]
        # `--offerings FILE` is the market (its counts) instead of the shipped ones
        files = [inputs.offerings] if inputs.offerings else [market_file(m) for m in SCARCE_MARKETS[name]]
        for path in files:
            sc, cat = scenario_and_market(name, path)
            label = path.stem if len(names) == 1 or path.stem.startswith(name) else f"{name} {path.stem}"
            rows += at_target_rows(label, lib, sc, market_availability(sc, cat), cat, judge, time_limit, progress)
    return ExperimentResult(_named("scarce", scenario),
                            "Scarce markets: every method at equal attainment, or its most goodput",
                            AT_TARGET_COLUMNS, rows,
                            notes=[(f"market: {inputs.offerings} (--offerings)" if inputs.offerings else
                                    "markets (coral/data/markets/): " + "; ".join(
                                        f"{m}: {_market_words(m)}" for n in names for m in SCARCE_MARKETS[n])),
                                   *_at_target_notes(judge), *_where_from(rows)])


def exp_below(inputs: Inputs, judge: Judge | None, time_limit: float = 30.0) -> ExperimentResult:
    """Availability below the estimate (the headroom rule at 0.5x and 0.8x Coral's unlimited plan's nodes): demand
    cannot be met, so Coral runs the goodput, max-min and scaled modes beside the baselines."""
    rows = []
    for name in ("core", "extended"):
        sc, cat, lib = inputs(name)
        for f in BELOW_FACTORS:
            rows += _compare(f"{name} x{f:g}", lib, sc, _availability(sc, lib, f, cat), time_limit, cat, judge)
    return ExperimentResult("below", "Availability below the estimate: cost and goodput", _columns(judge), rows,
                            notes=["availability = ceil(factor × E_c / |R_c|), E_c the nodes of Coral's unlimited "
                                   "plan", *_judged_notes(judge)])


def _by_size(sc: Scenario) -> list[str]:
    """The scenario's models, smallest first by parameter count (as the paper ranks them: phi-4 14B <
    gpt-oss-20b < qwen3-32b, although gpt-oss-20b's 4-bit experts take the fewest bytes)."""
    from coral.perf.roofline import RooflineModel

    perf, cat = RooflineModel(), builtin_catalog()
    size = {}
    for sm in sc.models:
        arch = cat.model(sm.model)
        sh = perf.shape(arch)
        size[sm.model] = arch.num_hidden_layers * (sh.attn_params + sh.dense_mlp_params
                                                   + (arch.num_experts or 0) * sh.expert_params)
    return sorted(size, key=lambda m: size[m])


def with_rates(sc: Scenario, rates: dict[str, float], label: str) -> Scenario:
    """The scenario with other request rates per model (its traces brought to them like any rate)."""
    return sc.model_copy(update={"name": f"{sc.name} {label}", "models": [
        m.model_copy(update={"request_rate": rates[m.model]}) for m in sc.models]})


def paper_imbalanced_rates(sc: Scenario, large_heavy: bool, heavy_share: float = 0.8) -> dict[str, float]:
    """The paper's (§6.5): the scenario's total request rate, `heavy_share` of it split equally over the largest
    (or smallest) third of the models, the rest split equally over the others."""
    ranked = _by_size(sc)
    n_heavy = max(1, round(len(ranked) / 3))
    heavy = set(ranked[-n_heavy:] if large_heavy else ranked[:n_heavy])
    total = sum(sm.request_rate for sm in sc.models)
    light = len(ranked) - len(heavy)
    return {sm.model: total * (heavy_share / len(heavy) if sm.model in heavy else (1 - heavy_share) / max(light, 1))
            for sm in sc.models}


def exp_imbalanced(inputs: Inputs, judge: Judge | None, time_limit: float = 30.0, scenario: str | None = None,
                   progress: Progress | None = None) -> ExperimentResult:
    """Imbalanced demand as the paper defines it (§6.5: 80 % of the requests on the largest or the smallest third of
    the models), large-heavy and small-heavy, on core and extended (or `scenario`) in each scenario's own market
    (the paper's default availability: every method can fit): every method at equal attainment
    (`at_target_rows`)."""
    judge = _needs_judge("imbalanced", judge)
    rows = []
    for name in _scenarios(scenario, ("core", "extended")):
        base, cat, lib = inputs(name)
        for heavy in (True, False):
            setting = f"{name} {'large' if heavy else 'small'}-heavy"
            sc = with_rates(base, paper_imbalanced_rates(base, heavy), setting.split(" ", 1)[1])
            rows += at_target_rows(setting, lib, sc, resolve_availability(sc, lib, cat), cat, judge, time_limit,
                                   progress)
    return ExperimentResult(_named("imbalanced", scenario), "Imbalanced demand: every method at equal attainment",
                            AT_TARGET_COLUMNS, rows,
                            notes=["80 % of the total request rate on the largest (large-heavy) or smallest "
                                   "(small-heavy) third of the models by parameters, the rest shared equally",
                                   *_at_target_notes(judge), *_where_from(rows)])


def _churn(prev: Plan | None, new: Plan) -> tuple[int, int]:
    def tally(p: Plan | None) -> dict[tuple[int, str], int]:
        out: dict[tuple[int, str], int] = {}
        for i in (p.instances if p else []):
            out[(i.template_id, i.region)] = out.get((i.template_id, i.region), 0) + 1
        return out

    a, b = tally(prev), tally(new)
    started = sum(max(0, n - a.get(k, 0)) for k, n in b.items())
    stopped = sum(max(0, n - b.get(k, 0)) for k, n in a.items())
    return started, stopped


def exp_epochs(inputs: Inputs, judge: Judge | None, time_limit: float = 30.0, scenario: str = "extended"
               ) -> ExperimentResult:
    """Five epochs with demand (×U[0.6, 1.4] per model) and availability (factor U[1.5, 3]) shifting
    deterministically (seed EPOCH_SEED); each epoch re-plans from the previous one with the scale-up penalty.
    Planned figures only (`judge` unused): the simulator's re-planning runs are `coral simulate`'s."""
    sc, cat, lib = inputs(scenario)
    rng = np.random.default_rng(EPOCH_SEED)
    base = scenario_demand(sc)
    avail0 = _availability(sc, lib, 1.0, cat)
    rows = []
    prev: Plan | None = None
    for epoch in range(sc.epochs):
        mult = {sm.model: float(rng.uniform(0.6, 1.4)) for sm in sc.models}
        factor = float(rng.uniform(1.5, 3.0))
        dem = {(m, p): v * mult[m] for (m, p), v in base.items()}
        avail = {r: {c: int(np.ceil(n * factor)) for c, n in cs.items()} for r, cs in avail0.items()}
        t0 = time.perf_counter()
        try:
            plan = allocate(lib, sc, demand=dem, availability=avail, running=prev, catalog=cat,
                            time_limit=time_limit)
        except InfeasibleDemand:
            plan = allocate(lib, sc, demand=dem, availability=avail, running=prev, mode="goodput", catalog=cat,
                            time_limit=time_limit)
        wall = time.perf_counter() - t0
        started, stopped = _churn(prev, plan)
        rows.append({"epoch": epoch, "demand_x": round(float(np.mean(list(mult.values()))), 3),
                     "avail_factor": round(factor, 3), "cost_per_hour": round(plan.cost_per_hour, 4),
                     "penalty_per_hour": round(plan.penalty_per_hour, 4), "instances": len(plan.instances),
                     "started": started, "stopped": stopped, "min_served": round(_min_served(plan), 4),
                     "solve_s": round(plan.solve.time_s, 3), "wall_s": round(wall, 3), "gap": plan.solve.gap})
        prev = plan
    cols = ["epoch", "demand_x", "avail_factor", "cost_per_hour", "penalty_per_hour", "instances", "started",
            "stopped", "min_served", "solve_s", "wall_s", "gap"]
    return ExperimentResult(f"epochs-{sc.name}", f"Five epochs of shifting demand and availability ({sc.name})", cols,
                            rows,
                            notes=[f"availability = ceil(factor × E_c / |R_c|), seed {EPOCH_SEED}"])


def waterfall_rows(lib: TemplateLibrary, sc: Scenario, time_limit: float = 30.0) -> list[dict[str, Any]]:
    """One row per waterfall step (`paper.waterfall_settings`): each method's $/h and its ratio to Coral."""
    rows = []
    for step, st in enumerate(waterfall_settings(sc)):
        avail = UNLIMITED if st.unlimited else resolve_availability(st.scenario, lib, st.catalog)
        plans = compare_plans(lib, st.scenario, avail, None, time_limit, st.catalog)
        coral = plans["coral"].cost_per_hour
        row: dict[str, Any] = {"step": step, "change": st.name, "coral": round(coral, 4)}
        for method in METHODS[1:]:
            row[method] = round(plans[method].cost_per_hour, 4)
            row[f"{method} x"] = round(plans[method].cost_per_hour / coral, 4)
        row["all_met"] = all(_met(p) for m, p in plans.items() if m in METHODS)
        rows.append(row)
    return rows


def exp_waterfall(inputs: Inputs, judge: Judge | None, time_limit: float = 30.0, scenario: str = "core"
                  ) -> ExperimentResult:
    """From the paper's setting to ours, one change at a time (coral/data/paper_setting.yaml); planned figures."""
    sc, _cat, lib = inputs(scenario)
    rows = waterfall_rows(lib, sc, time_limit)
    cols = ["step", "change", "coral", *(c for m in METHODS[1:] for c in (m, f"{m} x")), "all_met"]
    return ExperimentResult(f"waterfall-{sc.name}", f"From the paper's setting to ours ({sc.name})", cols, rows,
                            notes=["$/h per method; 'x' = method $/h / Coral $/h (> 1: Coral is cheaper)",
                                   "paper prices: Table 1 relative cost per GPU × mean L4 $/GPU-h of the market",
                                   f"source: {paper_setting().source}"])


EXPERIMENTS: dict[str, Callable[..., ExperimentResult]] = {
    "default": exp_default,
    "scarce": exp_scarce,
    "below": exp_below,
    "imbalanced": exp_imbalanced,
    "epochs": exp_epochs,
    "waterfall": exp_waterfall,
}


def _plot(result: ExperimentResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    if result.name.startswith("waterfall"):
        steps = [r["step"] for r in result.rows]
        axes[0].plot(steps, [r["coral"] for r in result.rows], marker="o", label="coral")
        for m in METHODS[1:]:
            axes[0].plot(steps, [r[m] for r in result.rows], marker=".", label=m)
            axes[1].plot(steps, [r[f"{m} x"] for r in result.rows], marker="o", label=m)
        axes[1].axhline(1.0, color="grey", lw=0.8)
        for ax, label in ((axes[0], "$/h"), (axes[1], "method $/h / Coral $/h")):
            ax.set_xticks(steps, [r["change"] for r in result.rows], rotation=20, ha="right", fontsize=7)
            ax.set_ylabel(label)
            ax.legend()
    elif result.name.startswith("epochs"):
        ep = [r["epoch"] for r in result.rows]
        axes[0].plot(ep, [r["cost_per_hour"] for r in result.rows], marker="o", label="$/h")
        axes[0].plot(ep, [r["penalty_per_hour"] for r in result.rows], marker="x", label="penalty $/h")
        axes[0].set_xlabel("epoch")
        axes[0].legend()
        axes[1].bar(np.array(ep) - 0.2, [r["started"] for r in result.rows], 0.4, label="started")
        axes[1].bar(np.array(ep) + 0.2, [r["stopped"] for r in result.rows], 0.4, label="stopped")
        axes[1].set_xlabel("epoch")
        axes[1].legend()
    else:
        settings = list(dict.fromkeys(r["setting"] for r in result.rows))
        methods = list(dict.fromkeys(r["method"] for r in result.rows))
        width = 0.8 / max(len(methods), 1)
        # at equal attainment the second panel is SLO goodput; otherwise the planned share of demand served
        second, label2 = (("sim_goodput", "SLO goodput, tokens/s (held-out)") if "planned" in result.columns
                          else ("served", "served fraction of demand"))
        for i, m in enumerate(methods):
            xs = [settings.index(r["setting"]) + i * width for r in result.rows if r["method"] == m]
            axes[0].bar(xs, [r["cost_per_hour"] for r in result.rows if r["method"] == m], width, label=m)
            axes[1].bar(xs, [r[second] for r in result.rows if r["method"] == m], width, label=m)
        for ax, label in ((axes[0], "$/h"), (axes[1], label2)):
            ax.set_xticks(np.arange(len(settings)) + 0.4 - width / 2, settings, rotation=15)
            ax.set_ylabel(label)
        axes[0].legend()
    fig.suptitle(result.title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def takes(name: str, option: str) -> bool:
    """Whether experiment `name` takes `option` (e.g. "scenario", "progress")."""
    return option in inspect.signature(EXPERIMENTS[name]).parameters


def run_experiment(name: str, out: Path = Path("out"), time_limit: float = 30.0, *, offerings: Path | None = None,
                   simulate: bool = True, progress: Progress | None = None, **options: Any) -> ExperimentResult:
    """Run one experiment and write its JSON and PNG under `out/experiments/` (`offerings`: the market file;
    `simulate`: measure SLO goodput by simulation; `progress`: told each search round, where the experiment
    searches; `options`: e.g. scenario= for epochs)."""
    from coral.catalog.suggest import did_you_mean

    if name not in EXPERIMENTS:
        raise CoralInputError(f"experiment {name!r}: unknown{did_you_mean(name, EXPERIMENTS)}; known: "
                              f"{', '.join(EXPERIMENTS)}")
    if progress is not None and takes(name, "progress"):
        options["progress"] = progress
    result = EXPERIMENTS[name](Inputs(out, offerings), Judge() if simulate else None, time_limit=time_limit,
                               **options)
    folder = out / "experiments"
    folder.mkdir(parents=True, exist_ok=True)
    js = folder / f"{result.name}.json"
    js.write_text(json.dumps({"name": result.name, "title": result.title, "columns": result.columns, "rows": result.rows,
                              "notes": result.notes}, indent=2, default=float))
    png = folder / f"{result.name}.png"
    _plot(result, png)
    result.files = [js, png]
    return result
