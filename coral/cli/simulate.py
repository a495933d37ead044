"""`coral simulate`: run a plan (or the allocator every epoch) on request traces, without GPUs."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console

from coral.catalog.loader import CoralInputError, scenario_and_market
from coral.cli.common import (
    DEFAULT_OUT,
    JSON_HELP,
    OFFERINGS_HELP,
    check_out_folder,
    friendly_errors,
    out_console,
    print_json,
)

if TYPE_CHECKING:
    from coral.allocation.plan import ModelServing, Plan
    from coral.catalog.schema import Scenario, ScenarioModel
    from coral.report.terminal import FoldingTable
    from coral.simulation.metrics import ModelMetrics, SimResult
    from coral.workload.traces import RequestSet

#: relative difference between a trace and what a plan was made for above which `coral simulate` warns
MISMATCH = 0.25


def register(app: typer.Typer) -> None:
    app.command("simulate")(simulate_cmd)


def parse_traces(values: list[str], models: list[str]) -> dict[str, Path]:
    """'PATH' (every model) or 'MODEL=PATH' (one model) -> {model: path}; PATH may also name a shipped trace
    (azure-code, azure-conversation, burstgpt)."""
    out: dict[str, Path] = {}
    for v in values:
        name, sep, path = v.partition("=")
        if sep and name in models:
            out[name] = trace_file(path, v)
        elif sep and not Path(v).exists():
            raise CoralInputError(f"--trace {v}: {name!r} is not a model of the scenario ({', '.join(models)})")
        else:
            out.update(dict.fromkeys(models, trace_file(v, v)))
    return out


def trace_file(value: str, given: str) -> Path:
    """The file of a shipped trace's name or a path (`given`: the whole --trace value, for messages)."""
    from coral.workload.traces import SHIPPED_TRACES, shipped_path

    if value in SHIPPED_TRACES:
        return shipped_path(value)
    path = Path(value)
    if path.exists():
        return path
    if path.suffix or "/" in value:
        raise CoralInputError(f"--trace {given}: {value}: no such file")
    try:
        return shipped_path(value)
    except CoralInputError as exc:
        raise CoralInputError(f"--trace {given}: no file {value!r}, and {exc} (or give a trace CSV)") from None


def passes(result: SimResult, targets: Mapping[str, float]) -> dict[str, bool]:
    """{model: whether its simulated SLO attainment meets its target} for the models `targets` names (the
    scenario's `slo_attainment` per model)."""
    return {m.model: m.slo_attainment >= targets[m.model] for m in result.models if m.model in targets}


def results_table(result: SimResult, targets: Mapping[str, float]) -> FoldingTable:
    """Per model (and overall) latency, SLO attainment against its target with pass/fail, goodput, utilisation."""
    from coral.report.terminal import FoldingTable

    table = FoldingTable(title=f"Simulation of {result.scenario} ({result.router} router, {result.duration_s:g} s)")
    for col in ("model", "requests", "TTFT p50/p99 ms", "TPOT p50/p99 ms", "SLO att.", "target", "verdict",
                "goodput tok/s", "util P/D", "batch fill"):
        table.add_column(col, justify="left" if col in ("model", "verdict") else "right", no_wrap=col == "model",
                         optional=col in ("util P/D", "batch fill"))
    passed = passes(result, targets)
    for m in [*result.models, result.overall]:
        if m is result.overall:
            failed = sum(not ok for ok in passed.values())
            target, verdict = "", f"[red]{failed} fail[/]" if failed else "[green]all pass[/]"
        elif m.model in passed:
            target = f"{targets[m.model]:.1%}"
            verdict = "[green]pass[/]" if passed[m.model] else "[red]fail[/]"
        else:
            target, verdict = "-", "-"
        table.add_row(
            m.model, f"{m.finished}/{m.requests}", f"{m.ttft_ms.p50:.0f} / {m.ttft_ms.p99:.0f}",
            f"{m.tpot_ms.p50:.1f} / {m.tpot_ms.p99:.1f}", f"{m.slo_attainment:.1%}", target, verdict,
            f"{m.goodput_tokens_s:,.0f}", f"{m.prefill_gpu_util:.0%} / {m.decode_gpu_util:.0%}",
            f"{m.decode_batch_fill:.0%}",
        )
    return table


def sim_folder(out: Path, scenario: str, router: str, plan: Path | None = None, fingerprint: str = "",
               greedy: bool = False) -> Path:
    """Where one run's results go, named after what was simulated so that another plan never overwrites them:
    out/sim/<scenario>-<router> (the allocator every epoch), <scenario>-greedy-<router> (the greedy stand-in),
    <scenario>-<plan file's stem>-<plan fingerprint, 8 digits>-<router> (a plan)."""
    name = Path(scenario).stem
    if plan is not None:
        name += f"-{plan.name.removesuffix('.json').removesuffix('.plan')}-{fingerprint[:8]}"
    elif greedy:
        name += "-greedy"
    return out / "sim" / f"{name}-{router}"


@friendly_errors
def simulate_cmd(
    scenario: str = typer.Argument(..., help="built-in scenario name or scenario YAML"),
    plan: Path | None = typer.Option(None, help="plan JSON to run unchanged (default: the allocator every epoch)"),
    trace: list[str] = typer.Option(
        [], help="trace CSV (Azure or BurstGPT) or shipped trace name (azure-code, azure-conversation, burstgpt) as PATH or "
        "MODEL=PATH, rescaled to the model's rate; repeatable"
    ),
    duration: float = typer.Option(0.0, help="simulated seconds (default: the scenario's epochs x epoch length)"),
    seed: int = typer.Option(0, help="seed of the workload (trace offsets, synthetic requests)"),
    router: str = typer.Option(
        "wrr", help="wrr (weighted round-robin, the paper), lor (least outstanding, weighted) or both (compare)"
    ),
    rate_scale: float = typer.Option(1.0, help="multiply every model's request rate"),
    trace_scaling: str = typer.Option("", help="superpose (overlay independent trace segments) or compress "
                                      "(compress time); default: the scenario's trace_scaling"),
    startup_delay: float = typer.Option(300.0, help="seconds before a newly planned instance serves"),
    availability: Path | None = typer.Option(
        None, help="availability schedule (YAML/JSON) or trace (CSV); default: the scenario's availability_schedule"
    ),
    greedy: bool = typer.Option(False, help="no plan: run the greedy stand-in plan instead of the allocator"),
    headroom: float = typer.Option(1.0, help="allocator: plan for observed demand x this"),
    handover: bool = typer.Option(True, help="removed instances serve until their replacements are ready"),
    oracle: bool = typer.Option(False, help="allocator sees the coming epoch's demand, not the previous one's"),
    shed: str = typer.Option("plan", help="refuse requests beyond the capacity serving their model at arrival, as "
                             "the gateway does (coral.allocation.shedding): plan (while the plan serves only a share "
                             "of some model's demand, or a model lost instances) | always | off"),
    requests_csv: bool = typer.Option(False, help="also write requests.csv (one row per request)"),
    kv_reserve: str = typer.Option("mean", help="KV charged per decoding request: mean (prompt + output/2) or max"),
    out: Path = typer.Option(DEFAULT_OUT, help="output folder (library looked up here; results in "
                             "OUT/sim/SCENARIO[-PLAN-FINGERPRINT | -greedy]-ROUTER, one folder per plan)"),
    offerings: Path | None = typer.Option(None, help=OFFERINGS_HELP),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Simulate serving a plan: TTFT/TPOT, SLO attainment, goodput, cost, GPU utilisation (JSON + PNG)."""
    from coral.allocation.plan import Plan
    from coral.report.view import plan_fingerprint
    from coral.simulation.availability import load_availability
    from coral.simulation.engine import Replanner
    from coral.simulation.replan import allocator_replanner
    from coral.simulation.run import simulate
    from coral.simulation.stand_in import greedy_plan
    from coral.templates.store import load_library
    from coral.workload.traces import stand_in_notes, workload_for

    routers = ["wrr", "lor"] if router == "both" else [router]
    if router not in ("wrr", "lor", "both"):
        raise CoralInputError(f"--router must be wrr, lor or both, not {router!r}")
    if kv_reserve not in ("mean", "max"):
        raise CoralInputError(f"--kv-reserve must be mean or max, not {kv_reserve!r}")
    check_out_folder(out)
    say = out_console(as_json)
    if shed not in ("plan", "always", "off"):
        raise CoralInputError(f"--shed: must be plan, always or off, not {shed!r}")
    sc, cat = scenario_and_market(scenario, offerings)
    duration_s = duration or sc.epochs * sc.epoch_minutes * 60.0
    names = [m.model for m in sc.models]
    targets = {m.model: m.slo_attainment for m in sc.models}
    files = parse_traces(trace, names)
    requests = workload_for(sc, duration_s, seed, files, rate_scale=rate_scale,
                            scaling=trace_scaling or None)  # type: ignore[arg-type]  # checked there
    for note in stand_in_notes(sc, files):
        say.print(f"[yellow]note:[/] {note}")
    sched = load_availability(availability, sc) if availability else sc.availability_schedule
    fixed_plan = Plan.load(plan) if plan is not None else None
    warnings = trace_warnings(sc, fixed_plan, {m: requests[m] for m in files}, duration_s) if fixed_plan else []
    for w in warnings:
        say.print(f"[yellow]warning:[/] {w}")
    library = load_library(scenario, out, cat) if fixed_plan is None else None
    runs = []
    for r in routers:
        runner: Plan | Replanner
        log: list[str] = []
        if fixed_plan is not None:
            runner = fixed_plan
        elif greedy:
            assert library is not None
            runner = greedy_plan(library, sc, rate_scale=rate_scale)
        else:
            assert library is not None
            runner = allocator_replanner(library, sc, headroom=headroom, log=log)
        with say.status(f"simulating {sum(len(x) for x in requests.values()):,} requests over {duration_s:,.0f} s "
                        f"({r} router)"):
            result = simulate(
                runner, sc, requests, duration_s=duration_s, seed=seed, router=r, startup_delay_s=startup_delay,
                availability=sched, handover=handover, forecast="oracle" if oracle else "previous",
                shed=shed, kv_reserve=kv_reserve,  # type: ignore[arg-type]
            )
        result.notes.extend(log)
        why = unfinished_reasons(result, sc, fixed_plan, requests, duration_s) if fixed_plan is not None else []
        if fixed_plan is not None:
            result.plan_fingerprint = plan_fingerprint(fixed_plan)
        folder = sim_folder(out, scenario, r, plan, result.plan_fingerprint, greedy)
        path = report(result, folder, requests_csv, say, why, targets)
        runs.append((result, path, why))
    if len(runs) > 1:
        say.print(compare_table([r for r, _, _ in runs]))
    if as_json:
        print_json({"scenario": sc.name, "plan": str(plan) if plan else None, "trace_warnings": warnings,
                    "runs": [sim_summary(r, path, why, targets) for r, path, why in runs]})


def trace_warnings(scenario: Scenario, plan: Plan, requests: Mapping[str, RequestSet], duration_s: float) -> list[str]:
    """One line per model whose requests (from a --trace) differ by more than MISMATCH from what `plan` was made
    for: request rate and mean prompt/output lengths against the scenario's, mean tokens/s per phase against the
    plan's (`planned_traffic`), naming the numbers."""
    lines = []
    for sm in scenario.models:
        if sm.model not in requests or not len(requests[sm.model]):
            continue
        got = requests[sm.model]
        offered = {"prefill": float(got.input_tokens.sum()) / duration_s,
                   "decode": float(got.output_tokens.sum()) / duration_s}
        pairs = [("requests/s", len(got) / duration_s, sm.request_rate),
                 ("mean prompt tokens", float(got.input_tokens.mean()), sm.mean_input_tokens),
                 ("mean output tokens", float(got.output_tokens.mean()), sm.mean_output_tokens)]
        for s in plan.serving:
            if s.model == sm.model:
                pairs.append((f"{s.phase} tok/s", offered[s.phase], planned_traffic(s, sm)))
        off = [f"{what} {_num(have)} vs {_num(want)} planned ({have / want - 1:+.0%})" for what, have, want in pairs
               if want > 0 and abs(have / want - 1) > MISMATCH]
        if off:
            lines.append(f"{sm.model}: its trace differs from what the plan was made for by more than "
                         f"{MISMATCH:.0%}: " + ", ".join(off))
    return lines


def planned_traffic(serving: ModelServing, sm: ScenarioModel) -> float:
    """Mean tokens/s a plan's (model, phase) was made for: recorded in the plan (`coral run`'s), else the
    scenario's rate x mean length (the plan's demand adds headroom for bursts on top)."""
    if serving.traffic_tokens_s:
        return serving.traffic_tokens_s
    return sm.request_rate * (sm.mean_input_tokens if serving.phase == "prefill" else sm.mean_output_tokens)


def _num(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def unfinished_reasons(result: SimResult, scenario: Scenario, plan: Plan, requests: Mapping[str, RequestSet],
                       duration_s: float) -> list[str]:
    """One line per model with requests left unfinished, saying why: the phase whose offered tokens/s exceed
    the capacity of the plan's instances the most, or queues from bursts when the mean fits."""
    lines = []
    by_name = {sm.model: sm for sm in scenario.models}
    for m in result.models:
        missing = m.requests - m.finished
        if missing <= 0 or m.model not in requests:
            continue
        got = requests[m.model]
        offered = {"prefill": float(got.input_tokens.sum()) / duration_s,
                   "decode": float(got.output_tokens.sum()) / duration_s}
        capacity = {s.phase: sum(i.throughput for i in plan.instances_of(m.model, s.phase)) for s in plan.serving
                    if s.model == m.model}
        load = sorted(((offered[s.phase] / capacity[s.phase] if capacity[s.phase] else math.inf, s)
                       for s in plan.serving if s.model == m.model), key=lambda x: -x[0])
        head = f"{m.model}: {missing:,} of {m.requests:,} requests did not finish"
        if not load:
            lines.append(f"{head}: the plan serves no {m.model}")
            continue
        ratio, s = load[0]
        sized = (f"the plan's {s.phase} was sized for {planned_traffic(s, by_name[m.model]):,.0f} tok/s "
                 f"(capacity {capacity[s.phase]:,.0f} tok/s)")
        if ratio > 1:
            lines.append(f"{head}: {sized}, the trace offers {offered[s.phase]:,.0f} tok/s")
        else:
            lines.append(f"{head}: {sized} and the trace offers {offered[s.phase]:,.0f} tok/s on average, but its "
                         "bursts queued requests that were still waiting when the run ended")
    return lines


def report(result: SimResult, folder: Path, requests_csv: bool, say: Console, why: list[str],
           targets: Mapping[str, float]) -> Path:
    """Save JSON and plots (and the per-request CSV) of one run in `folder`, print its summary (`why`: the reasons
    requests did not finish, when known; `targets`: each model's SLO-attainment target) and return the JSON's
    path."""
    path = result.save_json(folder / "result.json")
    if requests_csv:
        result.save_requests_csv(folder / "requests.csv")
    pngs = result.plots(folder)
    say.print(results_table(result, targets))
    say.print(
        f"cost {result.mean_cost_per_hour:,.2f} $/h (total ${result.total_cost:,.2f}), GPU utilisation "
        f"{result.gpu_utilisation:.0%}; simulation time: {result.wall_s:,.1f} s for {result.requests:,} requests "
        f"({result.requests_per_wall_s:,.0f} per second, the simulator alone)"
    )
    for note in result.notes:
        say.print(f"[yellow]note:[/] {note}")
    for e in result.epochs:
        if e.over_availability:
            say.print(f"[yellow]epoch {e.epoch} uses more nodes than available:[/] {', '.join(e.over_availability)}")
    for line in why:
        say.print(f"[yellow]{line}[/]")
    if result.unfinished and not why:
        say.print(f"[yellow]{result.unfinished:,} requests did not finish[/]")
    say.print(f"wrote to [bold]{folder}[/]: " + ", ".join(p.name for p in (path, *pngs)))
    return path


def sim_summary(result: SimResult, path: Path, why: list[str], targets: Mapping[str, float]) -> dict[str, Any]:
    """What `coral simulate --json` prints per run: the headline metrics, per model latency percentiles,
    attainment against its target (`targets`) with pass/fail, and goodput, whether every model passed, the
    notes, why requests did not finish, and where the full result was written."""
    passed = passes(result, targets)

    def metrics(m: ModelMetrics) -> dict[str, Any]:
        return {"model": m.model, "requests": m.requests, "finished": m.finished,
                "slo_attainment": m.slo_attainment, "slo_target": targets.get(m.model),
                "passed": passed.get(m.model), "ttft_attainment": m.ttft_attainment,
                "tpot_attainment": m.tpot_attainment, "goodput_tokens_s": m.goodput_tokens_s,
                "ttft_ms": {"p50": m.ttft_ms.p50, "p99": m.ttft_ms.p99},
                "tpot_ms": {"p50": m.tpot_ms.p50, "p99": m.tpot_ms.p99},
                "prefill_gpu_util": m.prefill_gpu_util, "decode_gpu_util": m.decode_gpu_util}

    return {"router": result.router, "seed": result.seed, "duration_s": result.duration_s,
            "requests": result.requests, "finished": result.finished, "unfinished": result.unfinished,
            "slo_attainment": result.slo_attainment, "all_passed": all(passed.values()),
            "goodput_tokens_s": result.goodput_tokens_s,
            "mean_cost_per_hour": result.mean_cost_per_hour, "total_cost": result.total_cost,
            "gpu_utilisation": result.gpu_utilisation, "overall": metrics(result.overall),
            "models": [metrics(m) for m in result.models], "notes": result.notes, "unfinished_reasons": why,
            "wall_s": result.wall_s, "folder": str(path.parent), "result_path": str(path)}


def compare_table(results: list[SimResult]) -> FoldingTable:
    from coral.report.terminal import FoldingTable

    table = FoldingTable(title="Routers compared")
    for col in ("router", "SLO att.", "goodput tok/s", "TTFT p99 ms", "TPOT p99 ms", "finished"):
        table.add_column(col, justify="left" if col == "router" else "right")
    for r in results:
        o = r.overall
        table.add_row(r.router, f"{o.slo_attainment:.1%}", f"{o.goodput_tokens_s:,.0f}", f"{o.ttft_ms.p99:,.0f}",
                      f"{o.tpot_ms.p99:,.1f}", f"{o.finished}/{o.requests}")
    return table
