"""The view model: one JSON-able dict holding every number the report page and the live dashboard render.

The page's JavaScript only formats and draws; all sums, ratios, quantiles and splits are computed here so
tests can check them against the plan without a browser.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from coral.allocation.plan import Plan, PlanInstance, SolveReport
from coral.catalog.loader import Catalog, CoralInputError, builtin_catalog, load_scenario
from coral.catalog.schema import Scenario, parse_config_name
from coral.deploy.bom import bill_of_materials, plan_market
from coral.report.adapters import as_inputs
from coral.report.inputs import (
    MAX_CDF_POINTS,
    EpochPoint,
    LatencySeries,
    MethodResult,
    ReportInputs,
    TimeSeries,
    adapt_inputs,
    cdf_at,
    cdf_points,
    quantile,
)
from coral.simulation.metrics import SimResult

VIEW_VERSION = 1
#: a model passes an SLO when at least this share of its requests meets it (unless its plan sets another target)
SLO_TARGET = 0.9
ENGINE_NAMES = {"coral": "the Coral engine", "vllm": "stock vLLM"}
# Dark enough for white labels; indexed by catalog GPU order, so a GPU type keeps its colour across reports.
PALETTE = (
    "#1B9E9E", "#D55E00", "#009E73", "#CC79A7", "#6A3D9A", "#B8860B", "#0072B2", "#8C564B",
    "#E7298A", "#4D4D4D", "#66A61E", "#A6761D",
)  # fmt: skip


def gpu_of(config: str) -> str:
    """'4xL40S' -> 'L40S' (the config name itself when it does not parse)."""
    try:
        return parse_config_name(config)[0]
    except ValueError:
        return config


def gpus_in(config: str) -> int:
    try:
        return parse_config_name(config)[1]
    except ValueError:
        return 1


def gpu_colors(gpus: Iterable[str], catalog: Catalog | None = None) -> dict[str, str]:
    """A stable colour per GPU type: by catalog order for known GPUs, by name hash otherwise."""
    known = list((catalog or builtin_catalog()).gpus)
    out = {}
    for g in sorted(set(gpus)):
        idx = known.index(g) if g in known else zlib.crc32(g.encode())
        out[g] = PALETTE[idx % len(PALETTE)]
    return out


def gpu_cost_split(inst: PlanInstance, catalog: Catalog) -> dict[str, float]:
    """Split an instance's $/h over its GPU types by catalog node prices (by GPU count if a price is missing)."""
    prices = catalog.prices(inst.region)
    if all(c in prices for c in inst.counts):
        weights = {c: prices[c] * n for c, n in inst.counts.items()}
    else:
        weights = {c: float(gpus_in(c) * n) for c, n in inst.counts.items()}
    total = sum(weights.values())
    out: dict[str, float] = defaultdict(float)
    for c, w in weights.items():
        out[gpu_of(c)] += inst.cost_per_hour * (w / total if total > 0 else 1.0 / len(weights))
    return dict(out)


def _bars(totals: Mapping[str, float]) -> list[dict[str, Any]]:
    return [{"label": k, "value": v} for k, v in sorted(totals.items(), key=lambda kv: (-kv[1], kv[0]))]


def cost_breakdowns(plan: Plan, catalog: Catalog) -> dict[str, list[dict[str, Any]]]:
    """$/h by model, phase, region and GPU type; each list sums to the instances' total cost."""
    by: dict[str, dict[str, float]] = {k: defaultdict(float) for k in ("model", "phase", "region", "gpu")}
    for inst in plan.instances:
        by["model"][inst.model] += inst.cost_per_hour
        by["phase"][inst.phase] += inst.cost_per_hour
        by["region"][inst.region] += inst.cost_per_hour
        for g, c in gpu_cost_split(inst, catalog).items():
            by["gpu"][g] += c
    return {f"by_{k}": _bars(v) for k, v in by.items()}


def _group_key(inst: PlanInstance) -> tuple[str, str, str, int, str]:
    layout = "|".join(f"{s.first_layer}:{s.layers}:{','.join(s.nodes)}" for s in inst.stages)
    return (inst.model, inst.phase, inst.region, inst.template_id, layout)


def plan_fingerprint(plan: Plan) -> str:
    """Short hash of what a simulation of the plan depends on: scenario, demand scale and every instance's
    model, phase, region and stage layout (not ids, times or solver details)."""
    instances = sorted(
        json.dumps([i.model, i.phase, i.region, [[s.first_layer, s.layers, sorted(s.nodes)] for s in i.stages]])
        for i in plan.instances
    )
    text = json.dumps([plan.scenario, plan.demand_scale, instances])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def engines_for(inst: PlanInstance, catalog: Catalog) -> dict[str, Any]:
    """Which engines can run an instance: the Coral engine runs every template; stock vLLM only some layouts."""
    from coral.deploy.vllm import realisable

    check = realisable(inst, catalog.models.get(inst.model), inst.phase)
    return {"coral": True, "vllm": check.ok, "vllm_reason": check.reason}


def instance_groups(plan: Plan, catalog: Catalog | None = None) -> list[dict[str, Any]]:
    """Identical instances (same model, phase, region, template, layout) drawn once with a count."""
    groups: dict[tuple[str, str, str, int, str], list[PlanInstance]] = {}
    for inst in plan.instances:
        groups.setdefault(_group_key(inst), []).append(inst)
    out = []
    for (model, phase, region, template_id, _), insts in sorted(groups.items(), key=lambda kv: kv[0][:4]):
        first = insts[0]
        out.append(
            {
                "model": model,
                "phase": phase,
                "region": region,
                "template_id": template_id,
                "count": len(insts),
                "ids": [i.id for i in insts],
                "throughput": first.throughput,
                "cost_per_hour": first.cost_per_hour,
                "total_cost_per_hour": sum(i.cost_per_hour for i in insts),
                "heterogeneous": first.heterogeneous,
                "n_nodes": first.n_nodes,
                "counts": dict(sorted(first.counts.items())),
                "engines": engines_for(first, catalog) if catalog is not None else None,
                "stages": [
                    {
                        "index": k,
                        "first_layer": s.first_layer,
                        "last_layer": s.first_layer + s.layers - 1,
                        "layers": s.layers,
                        "nodes": [
                            {
                                "config": c,
                                "gpu": gpu_of(c),
                                "gpus": gpus_in(c),
                                "throughput": s.node_throughput[j] if j < len(s.node_throughput) else None,
                            }
                            for j, c in enumerate(s.nodes)
                        ],
                    }
                    for k, s in enumerate(first.stages)
                ],
            }
        )
    return out


SCARCITY_GOALS = {
    "goodput": "first the most SLO goodput the nodes allow with every model at its fairness floor",
    "maxmin": "first the largest share of its demand every model can get",
    "scaled": "first the largest uniform scale of all demand that fits",
}


def solver_in_words(sv: SolveReport, mode: str = "cost") -> str:
    """The solver's outcome in plain words: proven cheapest, stopped early (and how far from the best it can be),
    no feasible plan, or a rule without a solver; in a scarcity mode, what was maximised before the cost (the
    stages' own outcomes are in the report's notes)."""
    if mode in SCARCITY_GOALS:
        early = [s for s in sv.stopped if not s.startswith("cost:")]
        proof = f"; not proven optimal, stopped early: {'; '.join(early)}" if early else ""
        return f"{SCARCITY_GOALS[mode]} (stages in the notes{proof}), then at that level: {solver_in_words(sv)}"
    status = sv.status.lower()
    took = f" ({sv.time_s:.2f} s)"
    if status == "greedy":
        return "picked by a greedy rule, no solver" + took
    if status == "optimal":
        return "the solver found the cheapest plan and proved that no cheaper one exists" + took
    if "infeasible" in status:
        return "the solver found no plan that meets the demand with the nodes available" + took
    if sv.objective is None:
        return f"the solver found no plan ({sv.status})" + took
    if "time limit" in status:
        words = "the solver stopped at its time limit"
    else:
        words = f"the solver stopped early ({sv.status})"
    if sv.gap is not None and sv.bound is not None:
        words += (f"; the plan's objective ({sv.objective:,.2f}) is at most {sv.gap:.1%} above the best any plan "
                  f"could reach ({sv.bound:,.2f})")
    return words + took


def plan_title(plan: Plan, kind: str = "Coral plan") -> str:
    """'Coral plan — core (coral) for the Coral engine': scenario, method and the engine the plan targets."""
    return f"{kind} — {plan.scenario} ({plan.method}) for {ENGINE_NAMES[plan.engine]}"


def summary(plan: Plan) -> dict[str, Any]:
    n_nodes = sum(i.n_nodes for i in plan.instances)
    n_gpus = sum(gpus_in(c) * n for i in plan.instances for c, n in i.counts.items())
    return {
        "scenario": plan.scenario,
        "method": plan.method,
        "mode": plan.mode,
        "engine": plan.engine,
        "demand_scale": plan.demand_scale,
        "cost_per_hour": plan.cost_per_hour,
        "penalty_per_hour": plan.penalty_per_hour,
        "instances_cost_per_hour": sum(i.cost_per_hour for i in plan.instances),
        "n_instances": len(plan.instances),
        "n_heterogeneous": sum(1 for i in plan.instances if i.heterogeneous),
        "n_nodes": n_nodes,
        "n_gpus": n_gpus,
        "min_served_fraction": min((s.served_fraction for s in plan.serving), default=1.0),
        "created_at": plan.created_at,
        "solve": plan.solve.model_dump(mode="json"),
        "solve_words": solver_in_words(plan.solve, plan.mode),
    }


def serving_rows(plan: Plan) -> list[dict[str, Any]]:
    return [
        {**s.model_dump(mode="json"), "n_instances": len(plan.instances_of(s.model, s.phase))}
        for s in sorted(plan.serving, key=lambda s: (s.model, s.phase))
    ]


def _model_costs(plan: Plan) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for inst in plan.instances:
        out[inst.model] += inst.cost_per_hour
    return dict(out)


def slo_targets(plan: Plan) -> dict[str, float]:
    """The share of requests each model must serve within its SLOs, as the plan was checked against (none: the
    plan was not checked, `SLO_TARGET` applies)."""
    return dict(plan.slo.target) if plan.slo is not None else {}


def attainment_of(p: Plan, runs: Sequence[MethodResult], default: float = SLO_TARGET) -> dict[str, Any]:
    """A plan's SLO attainment (share of requests meeting both SLOs) and whether it passes its target: simulated
    on the report's requests when a run of its method is given, else the planner's check of the worst model
    (held-out requests when checked on them); None when neither is known."""
    targets = slo_targets(p)
    run = next((r for r in runs if r.method == p.method), None)
    if run is not None:
        target = max(targets.values(), default=default)
        return {"attainment": run.slo_attainment, "attainment_pass": run.slo_attainment >= target,
                "attainment_source": "simulated"}
    if p.slo is not None:
        got = p.slo.held_out or p.slo.tuned
        if got:
            worst = min(got, key=lambda m: got[m])
            return {"attainment": got[worst],
                    "attainment_pass": all(got[m] >= p.slo.target.get(m, default) for m in got),
                    "attainment_source": f"planner's check, worst model ({worst})"}
    return {"attainment": None, "attainment_pass": None, "attainment_source": None}


def comparison(plan: Plan, baselines: Sequence[Plan], runs: Sequence[MethodResult] = ()) -> dict[str, Any]:
    """Plan vs baselines: total $/h, ratio baseline/plan (>1: the plan is cheaper), served fraction, SLO
    attainment (`attainment_of`; `runs` are simulated method runs), per model."""
    methods = [plan, *baselines]
    models = sorted(
        {m for p in methods for m in _model_costs(p)} | {s.model for p in methods for s in p.serving}
    )
    rows = []
    for p in methods:
        costs = _model_costs(p)
        rows.append(
            {
                "method": p.method,
                "cost_per_hour": p.cost_per_hour,
                "ratio": p.cost_per_hour / plan.cost_per_hour if plan.cost_per_hour > 0 else None,
                "min_served_fraction": min((s.served_fraction for s in p.serving), default=1.0),
                **attainment_of(p, runs),
                "by_model": {m: costs.get(m, 0.0) for m in models},
            }
        )
    return {"models": models, "rows": rows}


def savings(plan: Plan, baselines: Sequence[Plan]) -> list[dict[str, Any]]:
    """Where the plan's saving against each baseline comes from: $/h per (model, phase), largest first."""
    mine = {(s.model, s.phase): s.cost_per_hour for s in plan.serving}
    out = []
    for b in baselines:
        theirs = {(s.model, s.phase): s.cost_per_hour for s in b.serving}
        keys = sorted(set(mine) | set(theirs), key=lambda k: (mine.get(k, 0.0) - theirs.get(k, 0.0), k))
        rows: list[dict[str, Any]] = [
            {"model": m, "phase": ph, "plan": mine.get((m, ph), 0.0), "baseline": theirs.get((m, ph), 0.0),
             "saving": theirs.get((m, ph), 0.0) - mine.get((m, ph), 0.0)}
            for m, ph in keys
        ]
        total = b.cost_per_hour - plan.cost_per_hour
        top = rows[0] if rows and rows[0]["saving"] > 0 else None
        if total > 0 and top:
            text = (f"{plan.method} costs ${total:,.2f}/h less than {b.method} "
                    f"({total / b.cost_per_hour:.0%}); the largest part, ${top['saving']:,.2f}/h, "
                    f"is {top['model']} {top['phase']}.")
        elif total > 0:
            text = f"{plan.method} costs ${total:,.2f}/h less than {b.method}."
        else:
            text = f"{plan.method} costs ${-total:,.2f}/h more than {b.method}."
        out.append({"method": b.method, "total": total, "text": text, "rows": rows})
    return out


def verdict_section(plan: Plan) -> dict[str, Any] | None:
    """The report's headline: the plan's own verdict per model on held-out requests (attainment over every
    held-out set, the worst set alone, the target, pass/fail and why) beside the plan's cost, exactly what `coral
    run` prints; None for a plan not scored on held-out requests."""
    slo = plan.slo
    if slo is None or not slo.held_out:
        return None
    cert = slo.certified
    models = [{"model": m, "target": goal, "held_out": slo.held_out.get(m), "worst": slo.held_out_worst.get(m),
               "certified": cert[m].lower_bound if m in cert else None, "p5": cert[m].p5 if m in cert else None,
               "windows": cert[m].windows if m in cert else len(slo.held_out_seeds),
               "tuned": slo.tuned.get(m), "pass": slo.passed(m), "verdict": slo.verdict.get(m, "")}
              for m, goal in slo.target.items()]
    confidence = max((c.confidence for c in cert.values()), default=None)
    return {"cost_per_hour": plan.cost_per_hour, "passed": all(r["pass"] for r in models),
            "n_sets": max((c.windows for c in cert.values()), default=len(slo.held_out_seeds)), "duration_s": slo.duration_s, "models": models,
            "confidence": confidence, "tail": slo.tail, "notes": [n for n in slo.notes if n.startswith("missed")]}


def slo_section(
    inputs: ReportInputs, targets: Mapping[str, float] | None = None, default: float = SLO_TARGET
) -> dict[str, Any] | None:
    """Overall and per-model SLO attainment with pass/fail per SLO (pass: at least the model's target share of
    its requests, `targets`, else `default`; overall: the strictest target)."""
    if not inputs.latency:
        return None
    targets = targets or {}
    models = []
    for model, lat in sorted(inputs.latency.items()):
        target = targets.get(model, default)
        ttft = lat.ttft_attainment
        tpot = lat.tpot_attainment
        if ttft is None and lat.slo_ttft_ms is not None and lat.ttft_ms:
            ttft = cdf_at(cdf_points(lat.ttft_ms), lat.slo_ttft_ms)
        if tpot is None and lat.slo_tpot_ms is not None and lat.tpot_ms:
            tpot = cdf_at(cdf_points(lat.tpot_ms), lat.slo_tpot_ms)
        models.append({
            "model": model,
            "target": target,
            "slo_ttft_ms": lat.slo_ttft_ms,
            "slo_tpot_ms": lat.slo_tpot_ms,
            "ttft_attainment": ttft,
            "tpot_attainment": tpot,
            "attainment": lat.slo_attainment,
            "ttft_pass": None if ttft is None else ttft >= target,
            "tpot_pass": None if tpot is None else tpot >= target,
            "pass": None if lat.slo_attainment is None else lat.slo_attainment >= target,
        })
    overall = inputs.overall_attainment
    target = max((targets.get(m, default) for m in inputs.latency), default=default)
    return {
        "target": target,
        "overall": overall,
        "overall_pass": None if overall is None else overall >= target,
        "models": models,
        "run": inputs.run,
    }


def demand_section(scenario: Scenario | None) -> list[dict[str, Any]]:
    """The workload the plan was sized for: rate, mean tokens, SLOs and trace per model."""
    if scenario is None:
        return []
    return [
        {"model": m.model, "request_rate": m.request_rate, "mean_input_tokens": m.mean_input_tokens,
         "mean_output_tokens": m.mean_output_tokens, "slo_ttft_ms": m.prefill_slo_ms,
         "slo_tpot_ms": m.decode_slo_ms, "trace": m.trace}
        for m in scenario.models
    ]


def timeseries_view(ts: TimeSeries | None) -> dict[str, Any] | None:
    """Time series as [[t, value], ...] per model and metric (bins without data left out)."""
    if ts is None or not ts.t_s:
        return None

    def pts(series: dict[str, list[float | None]]) -> dict[str, list[list[float]]]:
        return {m: [[t, v] for t, v in zip(ts.t_s, vals, strict=False) if v is not None]
                for m, vals in sorted(series.items())}

    return {"bin_s": ts.bin_s, "rate": pts(ts.rate), "ttft_p99_ms": pts(ts.ttft_p99_ms),
            "tpot_p99_ms": pts(ts.tpot_p99_ms), "queue": pts(ts.queue)}


def mismatch_notes(plan: Plan, inputs: ReportInputs) -> list[str]:
    """Warnings when the simulation results given were not produced by this plan."""
    notes = []
    if inputs.scenario and inputs.scenario != plan.scenario:
        notes.append(f"the simulation given is of scenario {inputs.scenario!r}, this plan of {plan.scenario!r}: "
                     "its latencies and SLO attainment do not describe this plan")
    elif inputs.plan_fingerprint and inputs.plan_fingerprint != plan_fingerprint(plan):
        notes.append(f"the simulation given ran another plan (fingerprint {inputs.plan_fingerprint}, this plan "
                     f"{plan_fingerprint(plan)}): its latencies and SLO attainment do not describe this plan")
    return notes


def _scenario_named(name: str) -> Scenario | None:
    try:
        return load_scenario(name)
    except CoralInputError:
        return None


def epoch_series(points: Sequence[EpochPoint], default_method: str) -> list[dict[str, Any]]:
    """Per-epoch points grouped into one series per method, sorted by epoch."""
    series: dict[str, list[EpochPoint]] = defaultdict(list)
    for p in points:
        series[p.method or default_method].append(p)
    return [
        {
            "method": m,
            "points": [
                p.model_dump(include={"epoch", "cost_per_hour", "goodput", "churn"})
                for p in sorted(pts, key=lambda p: p.epoch)
            ],
        }
        for m, pts in sorted(series.items(), key=lambda kv: (kv[0] != default_method, kv[0]))
    ]


def latency_charts(
    latency: Mapping[str, LatencySeries],
    max_points: int = MAX_CDF_POINTS,
    targets: Mapping[str, float] | None = None,
    default: float = SLO_TARGET,
) -> list[dict[str, Any]]:
    """One CDF chart per (model, metric); quantiles and SLO attainment (unless given exactly) from the full series;
    `target`: the share within the SLO the model must reach (`targets`, else `default`)."""
    targets = targets or {}
    charts = []
    for model in sorted(latency):
        lat = latency[model]
        for metric, series, slo, exact in (
            ("ttft", lat.ttft_ms, lat.slo_ttft_ms, lat.ttft_attainment),
            ("tpot", lat.tpot_ms, lat.slo_tpot_ms, lat.tpot_attainment),
        ):
            full = cdf_points(series)
            if not full:
                continue
            if exact is None and slo is not None:
                exact = cdf_at(full, slo)
            charts.append(
                {
                    "model": model,
                    "metric": metric,
                    "slo_ms": slo,
                    "attainment": exact,
                    "target": targets.get(model, default),
                    "p50": quantile(full, 0.5),
                    "p90": quantile(full, 0.9),
                    "p99": quantile(full, 0.99),
                    "n": lat.count if lat.count is not None else len(series),
                    "points": cdf_points(series, max_points),
                }
            )
    return charts


def _f(rec: Mapping[str, Any], *keys: str) -> float:
    """The first of `keys` present in `rec` as a float (0 when absent or not a number)."""
    for key in keys:
        if rec.get(key) is not None:
            try:
                return float(rec[key])
            except (TypeError, ValueError):
                return 0.0
    return 0.0


def bom_section(plan: Plan, catalog: Catalog, source: str) -> dict[str, Any] | None:
    """What to rent (`coral.deploy.bom`), each row with the plan instances using it in words
    ('qwen3-32b prefill ×2, phi-4 decode'); None for a plan without instances."""
    if not plan.instances:
        return None
    bom = bill_of_materials(plan, catalog, source)
    insts = {i.id: i for i in plan.instances}
    rows = []
    for r in bom.rows:
        users: dict[tuple[str, str], int] = defaultdict(int)
        for iid in r.instances:
            users[(insts[iid].model, insts[iid].phase)] += 1
        words = ", ".join(f"{m} {ph}" + (f" ×{n}" if n > 1 else "") for (m, ph), n in sorted(users.items()))
        rows.append({**r.model_dump(mode="json"), "used_by": words})
    return {**bom.model_dump(mode="json"), "rows": rows, "count": sum(r.count for r in bom.rows)}


def client_requests(rows: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Client requests per model from instance rows, each once: those of the instances answering the client
    (decode where the model has decode instances; a prefill instance only prefilled them)."""
    rows = list(rows)
    decoded = {r["model"] for r in rows if r["phase"] == "decode"}
    out: dict[str, float] = defaultdict(float)
    for r in rows:
        if r["phase"] == "decode" or r["model"] not in decoded:
            out[r["model"]] += r["requests"]
    return dict(out)


def live_section(
    plan: Plan | None,
    instances: Iterable[Mapping[str, Any]],
    requests: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """Runtime state: instance rows, counts per state, the traffic split (weight share) per model/phase, and
    client requests per model (`requests`, e.g. the gateway's counters; default: `client_requests`).

    Rows are {id, state, inflight, requests, weight}; the gateway's `served` and `target_share` stand in for
    `requests` and `weight` when those are absent.
    """
    known = {i.id: i for i in plan.instances} if plan else {}
    rows: list[dict[str, Any]] = []
    for rec in instances:
        if not isinstance(rec, Mapping):
            continue
        iid = str(rec.get("id", "?"))
        inst = known.get(iid)
        state = str(rec.get("state") or "unknown").lower()
        rows.append(
            {
                "id": iid,
                "model": inst.model if inst else str(rec.get("model", "?")),
                "phase": inst.phase if inst else str(rec.get("phase", "?")),
                "state": state,
                "inflight": _f(rec, "inflight"),
                "requests": _f(rec, "requests", "served"),
                "weight": _f(rec, "weight", "target_share"),
            }
        )
    states: dict[str, int] = defaultdict(int)
    for r in rows:
        states[r["state"]] += 1
    split: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        split[(r["model"], r["phase"])].append(r)
    traffic = []
    for (model, phase), rs in sorted(split.items()):
        total = sum(r["weight"] for r in rs)
        traffic.append(
            {
                "model": model,
                "phase": phase,
                "shares": [{"id": r["id"], "share": r["weight"] / total if total > 0 else 0.0} for r in rs],
            }
        )
    by_model = dict(requests) if requests is not None else client_requests(rows)
    return {
        "instances": sorted(rows, key=lambda r: (r["model"], r["phase"], r["id"])),
        "states": dict(sorted(states.items())),
        "traffic": traffic,
        "total_inflight": sum(r["inflight"] for r in rows),
        "requests_by_model": dict(sorted(by_model.items())),
        "total_requests": sum(by_model.values()),
    }


def view_model(
    plan: Plan,
    *,
    baselines: Sequence[Plan] = (),
    sim: SimResult | ReportInputs | BaseModel | Mapping[str, Any] | None = None,
    epochs: Sequence[EpochPoint | Mapping[str, Any]] | None = None,
    live: Iterable[Mapping[str, Any]] | None = None,
    live_requests: Mapping[str, float] | None = None,
    catalog: Catalog | None = None,
    scenario: Scenario | None = None,
    slo_target: float | None = None,
) -> dict[str, Any]:
    """Everything the page renders, as plain JSON types.

    `sim` carries latency (and maybe epochs): a SimResult or ReportInputs (or their dicts), see
    `coral.report.inputs`; `epochs` adds per-epoch points;
    `live` is the runtime's instance list [{id, state, inflight, requests, weight}] for the dashboard, and
    `live_requests` its client requests per model (see `live_section`).
    `scenario` (default: the built-in one the plan names, if any) gives the demand assumptions;
    `catalog` the offerings the plan rents (default: those of its scenario, `coral.deploy.bom.plan_market`);
    a model passes its SLOs when `slo_target` of its requests meet them (default: the plan's target per model,
    else `SLO_TARGET`); `notes` are warnings shown prominently; the solver's own notes stay in
    `summary.solve.notes`.
    """
    catalog, source = (catalog, "the given offerings") if catalog is not None else plan_market(plan)
    targets = {} if slo_target is not None else slo_targets(plan)
    default = SLO_TARGET if slo_target is None else slo_target
    inputs = as_inputs(sim)
    if epochs:
        inputs = inputs.merged(adapt_inputs({"epochs": list(epochs)}, "epochs"))
    gpus = {gpu_of(c) for p in (plan, *baselines) for i in p.instances for c in i.counts}
    notes = []
    total = sum(i.cost_per_hour for i in plan.instances)
    if abs(total - plan.cost_per_hour) > 1e-6 * max(1.0, plan.cost_per_hour):
        notes.append(f"instances add up to ${total:.2f}/h but the plan states ${plan.cost_per_hour:.2f}/h")
    notes.extend(mismatch_notes(plan, inputs))
    scenario = scenario or _scenario_named(plan.scenario)
    verdict, slo = verdict_section(plan), slo_section(inputs, targets, default)
    if verdict is not None and slo is not None:  # one verdict a page: a simulated run is one window, not a verdict
        slo["graded"] = False
    return {
        "version": VIEW_VERSION,
        "title": plan_title(plan),
        "summary": summary(plan),
        "bom": bom_section(plan, catalog, source),
        "gpu_colors": gpu_colors(gpus, catalog),
        "serving": serving_rows(plan),
        "costs": cost_breakdowns(plan, catalog),
        "instance_groups": instance_groups(plan, catalog),
        "comparison": comparison(plan, baselines, inputs.methods) if baselines else None,
        "savings": savings(plan, baselines),
        "verdict": verdict,
        "slo": slo,
        "methods": [m.model_dump(mode="json") for m in inputs.methods],
        "demand": demand_section(scenario),
        "timeseries": timeseries_view(inputs.timeseries),
        "epochs": epoch_series(inputs.epochs, plan.method),
        "latency": latency_charts(inputs.latency, targets=targets, default=default),
        "live": live_section(plan, live, live_requests) if live is not None else None,
        "notes": notes,
    }
