"""`coral run`: the main job, end to end on one scenario (library, plans, baselines, simulation, report)."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.status import Status

from coral.catalog.loader import CoralInputError, scenario_and_market
from coral.cli.common import (
    DEFAULT_OUT,
    ENGINE_HELP,
    JSON_HELP,
    OFFERINGS_HELP,
    F,
    check_out_folder,
    current_plan_path,
    err_console,
    friendly_errors,
    out_console,
    print_json,
    staged_folder,
)
from coral.cli.deploy import TARGET_HELP

if TYPE_CHECKING:
    from coral.allocation.plan import Plan
    from coral.planning.slo_search import Attainment, Evaluator, SearchResult

#: seconds before an instance a re-plan starts serves (the simulator's default)
STARTUP_DELAY_S = 300.0
#: exit code of a run whose Coral plan missed a target (on its tuning or held-out requests), without --allow-miss
MISSED_EXIT_CODE = 3
#: whose rounds a search's plan came from (`coral.planning.search_plan`'s trial labels), in words
TRIALS = {"subset": "homo-ilp's rounds", "planner": "its own rounds", "variant 1": "its rounds pricing slack",
          "composed": "composed of its rounds' cheapest passing part per model",
          "confirmed": "each model's cheapest part that held on fresh windows",
          "refined": "one model refined at a time within what the others leave of scarce nodes"}


def register(app: typer.Typer) -> None:
    app.command("run")(run_cmd)


def kept_on_interrupt(fn: F) -> F:
    """`coral run` stopped by Ctrl-C says that the previous run's outputs are unchanged (they are: the new ones
    are written aside and moved into place only when complete) and exits 130."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            out, scenario = Path(kwargs.get("out", DEFAULT_OUT)), str(kwargs.get("scenario", "core"))
            market = kwargs.get("offerings")
            folder = out / (f"run-{Path(scenario).stem}" + (f".offerings-{Path(market).stem}" if market else ""))
            err_console.print(f"[yellow]interrupted:[/] nothing of this run was kept; {folder} and the current plan "
                              f"({current_plan_path(scenario, out)}) are the previous run's, unchanged")
            raise typer.Exit(code=130) from None

    return wrapper  # type: ignore[return-value]


@kept_on_interrupt
@friendly_errors
def run_cmd(
    scenario: str = typer.Argument("core", help="built-in scenario name or scenario YAML"),
    out: Path = typer.Option(DEFAULT_OUT, help="output folder"),
    duration: float | None = typer.Option(None, help="simulated seconds per request set (default: epochs x "
                                           "epoch length)"),
    engine: str = typer.Option("coral", help=ENGINE_HELP),
    rounds: int | None = typer.Option(None, min=1, help="rounds each method's SLO search may take, its budget "
                                      "(default: 14 for 3 models, one more per model beyond: 17 for extended)"),
    budget: float | None = typer.Option(None, help="wall-clock safety net of each method's SLO search, s, checked "
                                        "between rounds: the search's budget is --rounds, so a plan does not depend "
                                        "on the machine's load unless this stops it, which the run reports (default: "
                                        "480 for 3 models, growing with their square: 1920 for extended; half as much again for each search "
                                        "trial beyond two: Coral's search, with its slack-priced trial, 720 and 2880)"),
    windows: int = typer.Option(20, min=2, max=500, help="held-out windows (request sets of the run's length) each "
                                "plan is certified on: a model passes when the one-sided 95 % lower bound of its "
                                "attainment over them, and its 5th-percentile window less 3 points, reach its target"),
    allow_miss: bool = typer.Option(False, "--allow-miss", help=f"exit 0 even when Coral's plan misses a target "
                                    f"(default: exit {MISSED_EXIT_CODE})"),
    baselines: str = typer.Option(
        "searched", help="searched: each baseline gets its own SLO search (equal attainment) | same-headroom: "
        "baselines planned once with Coral's headroom (faster, unequal attainment) | none"),
    offerings: Path | None = typer.Option(None, help=OFFERINGS_HELP),
    target: str | None = typer.Option(None, help=TARGET_HELP),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Build (or load) the template library; find with the simulator in the loop the cheapest Coral plan (and
    baseline plans) meeting every model's SLO-attainment target on the tuning requests; score each on held-out
    requests, simulate Coral re-planning every epoch, give a verdict per model, and write plans, simulation
    results and an HTML report. When Coral's plan misses a target (no search round met every one on the tuning
    requests, or a model fails on held-out ones) the run says so on stderr and in summary.json and the plan,
    and exits 3 unless --allow-miss; a wall-clock safety net that stopped a search or a solve is reported too."""
    from coral.allocation import baselines as base
    from coral.allocation.allocator import allocate, resolve_availability
    from coral.allocation.demand import run_length_s
    from coral.allocation.forecast import DemandForecaster, LatencyCorrection
    from coral.perf.model import Phase
    from coral.planning import SearchSettings, search_method
    from coral.planning.evaluation import HELD_OUT_SEEDS
    from coral.planning.slo_search import default_rounds, score, simulator_evaluator, with_traffic
    from coral.report import build_report
    from coral.report.adapters import inputs_from_sim, method_result
    from coral.report.terminal import FoldingTable, print_comparison, print_plan
    from coral.report.view import plan_fingerprint
    from coral.simulation.replan import allocator_replanner
    from coral.simulation.run import simulate
    from coral.templates.engines import engine_library
    from coral.templates.store import load_library
    from coral.workload.traces import stand_in_notes, workload_for

    if baselines not in ("searched", "same-headroom", "none"):
        raise CoralInputError(f"--baselines: must be searched, same-headroom or none, not {baselines!r}")
    check_out_folder(out)
    t_start = time.perf_counter()
    console = out_console(as_json)
    sc, cat = scenario_and_market(scenario, offerings)
    # a run in another market (--offerings) never replaces the default one's outputs
    folder = out / (f"run-{sc.name}" + (f".offerings-{offerings.stem}" if offerings is not None else ""))
    for note in stand_in_notes(sc):
        console.print(f"[yellow]note:[/] {note}")
    engine = "vllm" if target else engine  # every deploy target launches stock vLLM
    lib = engine_library(load_library(scenario, out, cat), engine, cat, target)
    t_lib = time.perf_counter()
    console.print(f"library: {len(lib):,} templates for {len(lib.keys())} (model, phase) pairs")
    avail = resolve_availability(sc, lib, cat)
    settings = SearchSettings(duration_s=duration, max_rounds=rounds, time_budget_s=budget,
                              held_out_seeds=tuple(range(HELD_OUT_SEEDS[0], HELD_OUT_SEEDS[0] + windows)))
    # one evaluator for every method: each seed's requests are made once, and a plan two searches share is
    # simulated once
    evaluate = simulator_evaluator(sc, settings.duration_s or run_length_s(sc), cat, settings.window_seeds)
    methods = {"coral": allocate, "homo-greedy": base.homo_greedy, "cauchy-paper": base.cauchy_paper}
    if baselines == "none":
        methods = {"coral": methods["coral"]}
    plans = {}
    results: dict[str, SearchResult] = {}
    for name, method in methods.items():
        if name != "coral" and baselines == "same-headroom":
            continue
        with console.status(f"{name}: searching for the cheapest plan meeting every SLO target") as status:
            trials = 3 if method is allocate else 1  # Coral: homo-ilp's rounds, its own, the slack-priced ones
            watch = SearchStatus(name, status, console, evaluate,
                                 trials * (settings.max_rounds or default_rounds(sc)))
            result = search_method(method, lib, sc, avail, settings, catalog=cat, evaluate=watch,
                                   progress=watch.show)
        if result.plan is None:
            raise CoralInputError(f"{name}: no plan in any round of the search: "
                                  + "; ".join(r.note for r in result.rounds if r.note))
        result.plan.method = name
        plans[name] = result.plan
        results[name] = result
        chosen = result.chosen_trial
        console.print(f"{name}: {len(result.rounds)} rounds in {result.wall_s:.0f} s -> "
                      f"${result.plan.cost_per_hour:,.2f}/h" + (f" (round {result.chosen + 1}, {TRIALS[chosen]})"
                                                               if result.chosen is not None and chosen in TRIALS else ""))
    plan = plans["coral"]
    misses = coral_misses(results["coral"])
    nets = {name: r.safety_net for name, r in results.items() if r.safety_net}
    for line in misses:
        err_console.print(f"[bold red]coral missed a target:[/] {line}")
    for name, net in nets.items():
        err_console.print(f"[yellow]safety net:[/] {name}'s search depends on this machine's speed and load: {net}")
    plan.engine = engine  # type: ignore[assignment]  # checked by engine_library
    plan.target = target  # type: ignore[assignment]  # checked by engine_library
    assert plan.slo is not None
    duration_s = plan.slo.duration_s
    room = {(s.model, Phase(s.phase)): s.headroom or 1.0 for s in plan.serving}
    if baselines == "same-headroom":
        traffic = {(s.model, Phase(s.phase)): s.traffic_tokens_s or 0.0 for s in plan.serving}
        demand = {k: v * room[k] for k, v in traffic.items()}
        for name in ("homo-greedy", "cauchy-paper"):
            with console.status(f"{name}: planning with Coral's headroom, scoring on "
                                f"{len(settings.held_out_seeds)} held-out request sets"):
                p = with_traffic(methods[name](lib, sc, demand=demand, availability=avail, catalog=cat), traffic)
                p.slo = score(p, sc, settings, duration_s, {}, room, evaluate=evaluate)
            plans[name] = p
    others = [p for name, p in plans.items() if name != "coral"]
    t_search = time.perf_counter()
    print_plan(plan, console)
    print_comparison(plan, others, console)
    with staged_folder(folder) as work:  # moved into place as `folder` only when complete
        for p in plans.values():
            p.save(work / f"plan.{p.mode}.{p.method}.json")

        seed = plan.slo.held_out_seeds[0] if plan.slo.held_out_seeds else settings.tune_seeds[0]
        requests = workload_for(sc, duration_s, seed, part=None if plan.slo.held_out_seeds else "tune")
        replanner = allocator_replanner(lib, sc, catalog=cat, headroom=room, initial=plan, forecaster=DemandForecaster(60.0),
                                        correction=LatencyCorrection.for_scenario(sc), ahead_s=STARTUP_DELAY_S,
                                        hold=0.25)
        with console.status(f"simulating {duration_s:.0f} s of held-out traffic with re-planning every "
                            f"{sc.epoch_minutes:g} min (demand forecast and latency correction)"):
            sim = simulate(replanner, sc, requests, duration_s=duration_s, seed=seed, startup_delay_s=STARTUP_DELAY_S,
                           catalog=cat)
        sim.plan_fingerprint = plan_fingerprint(plan)  # the run starts from this plan, then re-plans
        sim.save_json(work / "sim.json")
        fixed = []
        for i, p in enumerate(plans.values(), 1):
            with console.status(f"simulating the {p.method} plan held fixed ({i} of {len(plans)}) on the same "
                                f"{sum(len(r) for r in requests.values()):,} requests"):
                run = simulate(p, sc, requests, duration_s=duration_s, seed=seed, catalog=cat)
            run.plan_fingerprint = plan_fingerprint(p)
            run.save_json(work / f"sim.fixed.{p.method}.json")
            fixed.append(method_result(run, p.method, "plan held fixed"))
        inputs = inputs_from_sim(sim, sc, plan.method)
        inputs.methods = [method_result(sim, plan.method, f"re-planned every {sc.epoch_minutes:g} min, forecast"), *fixed]
        inputs.run = (f"Coral's plan re-planned every {sc.epoch_minutes:g} min on forecast demand, "
                      f"${sim.mean_cost_per_hour:,.2f}/h mean (simulated on held-out set {seed}; the plan itself is "
                      f"${plan.cost_per_hour:,.2f}/h, its verdict above)")
        t_sim = time.perf_counter()
        with console.status("writing plots and the HTML report"):
            sim.plots(work)
            (work / "report-inputs.json").write_text(inputs.model_dump_json(indent=1))
            (work / "report.html").write_text(build_report(plan, baselines=others, sim=inputs))
        t_report = time.perf_counter()

        attainment = FoldingTable(title=f"SLO attainment on one held-out window (seed {seed}, {duration_s:.0f} s): "
                                  "what each policy shows there, not a verdict (the verdict is certified, below)")
        for col in ("method", "run", *(m.model for m in sim.models), "all", "cost $/h"):
            attainment.add_column(col, justify="left" if col in ("method", "run") else "right", no_wrap=col == "method")
        for r in inputs.methods:
            attainment.add_row(r.method, r.how, *(f"{r.by_model.get(m.model, 0.0):.1%}" for m in sim.models),
                               f"{r.slo_attainment:.1%}", f"{r.cost_per_hour:,.2f}")
        console.print(attainment)
        console.print(verdict_table(plan))
        summary = {
            "scenario": sc.name,
            "planned_cost_per_hour": {p.method: round(p.cost_per_hour, 4) for p in plans.values()},
            "slo": {p.method: p.slo.model_dump() if p.slo else None for p in plans.values()},
            "headroom": {f"{m}/{ph.value}": round(v, 4) for (m, ph), v in room.items()},
            "solve_seconds": plan.solve.time_s,
            "simulated_cost_per_hour": sim.mean_cost_per_hour,
            "slo_attainment": sim.slo_attainment,
            "goodput_tokens_s": sim.goodput_tokens_s,
            "fixed_plan_slo_attainment": {r.method: r.slo_attainment for r in fixed},
            "fixed_plan_cost_per_hour": {r.method: r.cost_per_hour for r in fixed},
            "wall_s": time.perf_counter() - t_start,
            "missed": misses,  # Coral's plan: why it is not one that met every target (empty: it met them all)
            "safety_net": nets,  # per method whose search (or a solve in it) a wall-clock safety net stopped
            "rounds": {name: len(r.rounds) for name, r in results.items()},
            # whose round each method's plan is: "subset" (homo-ilp's), "planner", "variant 1" (slack priced),
            # "composed" (each model's cheapest passing part of any round), "refined" (one model at a time)
            "chosen_trial": {name: r.chosen_trial for name, r in results.items() if r.chosen is not None},
            # per method and model: the certified verdict's figures (`coral.planning.certify`)
            "certified": {p.method: certified_summary(p) for p in plans.values()},
        }
        (work / "summary.json").write_text(json.dumps(summary, indent=2))
    report = folder / "report.html"
    current = current_plan_path(scenario, out)
    if not misses or allow_miss:  # the plan to rent: what serve, deploy, plan bom and report take by default
        plan.save(current)
    met = all(plan.slo.passed(m) for m in plan.slo.target)
    console.print(("[green]every model meets its SLO target[/]" if met else
                   "[red]not every model meets its SLO target (see the verdicts)[/]") +
                  f", certified on {max((c.windows for c in plan.slo.certified.values()), default=0)} held-out "
                  f"windows ({plan.slo.certification_s:.0f} s): Coral ${plan.cost_per_hour:,.2f}/h" + "".join(
                      f"{', ' if i else ' vs '}{p.method} ${p.cost_per_hour:,.2f}/h" for i, p in enumerate(others)))
    console.print(f"time: {time.perf_counter() - t_start:.0f} s end to end (scenario and library load "
                  f"{t_lib - t_start:.1f} s, SLO searches {t_search - t_lib:.1f} s, held-out simulations "
                  f"{t_sim - t_search:.1f} s, plots and report {t_report - t_sim:.1f} s)")
    console.print(f"wrote [bold]{report}[/] and plans, sim*.json, report-inputs.json, plots, summary.json in "
                  f"{folder}")
    console.print(f"current plan of {escape(scenario)}: [bold]{current}[/] (`coral serve`, `deploy`, `plan bom` and "
                  f"`report` take it)" if not misses or allow_miss else
                  f"[yellow]not recorded as the current plan of {escape(scenario)}[/] (it missed a target; "
                  f"--allow-miss records it): {current} is unchanged")
    if as_json:
        print_json({**summary, "folder": str(folder), "report": str(report),
                    "current_plan": str(current) if not misses or allow_miss else None})
    if misses:
        err_console.print(f"[bold red]Coral's plan missed a target[/] ({len(misses)}: see above and summary.json)"
                          + ("; --allow-miss: exit 0" if allow_miss else f"; exit {MISSED_EXIT_CODE} (--allow-miss "
                                                                          "to accept it)"))
        if not allow_miss:
            raise typer.Exit(code=MISSED_EXIT_CODE)


def certified_summary(plan: Plan) -> dict[str, Any]:
    """A plan's certified verdict per model, as summary.json and --json carry it."""
    slo = plan.slo
    if slo is None:
        return {}
    return {"seconds": round(slo.certification_s, 2), "windows_simulated": slo.certification_windows,
            "models": {m: {"target": goal, "pass": slo.passed(m),
                           **({k: v for k, v in slo.certified[m].model_dump().items() if k != "seeds"}
                              if m in slo.certified else {})} for m, goal in slo.target.items()}}


def verdict_table(plan: Plan) -> Any:
    """The verdict per model: target, certified lower bound, pooled, 5th-percentile and worst window, windows."""
    from coral.report.terminal import FoldingTable

    assert plan.slo is not None
    slo = plan.slo
    conf = max((c.confidence for c in slo.certified.values()), default=0.0)
    table = FoldingTable(title=f"Verdict per model: Coral's plan, ${plan.cost_per_hour:,.2f}/h, certified on held-out "
                         f"windows ({conf:.1%} one-sided lower bound; pass: bound >= target and p5 window within "
                         f"{slo.tail:.0%} of it)")
    for col in ("model", "target", "certified", "pooled", "p5 window", "worst window", "windows", "tuned (cautious)",
                "verdict"):
        table.add_column(col, justify="left" if col in ("model", "verdict") else "right", no_wrap=col == "model",
                         optional=col in ("tuned (cautious)", "worst window", "windows"))
    for m, goal in slo.target.items():
        c = slo.certified.get(m)
        table.add_row(m, f"{goal:.1%}", f"{c.lower_bound:.1%}" if c else "-", f"{c.pooled:.1%}" if c else "-",
                      f"{c.p5:.1%}" if c else "-", f"{c.worst:.1%}" if c else "-", str(c.windows) if c else "0",
                      f"{slo.tuned.get(m, 0.0):.1%}", "pass" if slo.passed(m) else slo.verdict.get(m, ""))
    return table


def coral_misses(result: SearchResult) -> list[str]:
    """Why the plan `result` chose is not one that met every target, in words (empty when it met them all: a
    round passed on the tuning requests and every model passes on held-out ones); also noted in its plan."""
    plan = result.plan
    if plan is None or plan.slo is None:
        return ["no plan"]
    out = [n for n in plan.slo.notes if n.startswith("missed")]
    if not result.tuned_passed and not out:
        out.append("missed: the chosen round did not meet every target on the tuning requests")
    for m in plan.slo.target:
        if not plan.slo.passed(m):
            out.append(f"missed on held-out requests: {m}: {plan.slo.verdict.get(m, 'no verdict')}")
    plan.slo.notes.extend(n for n in out if n not in plan.slo.notes)
    return out


class SearchStatus:
    """Keeps one method's SLO search visible: each finished round printed, and the status line saying what
    runs now (the round or the held-out scoring, the request set being simulated, seconds so far)."""

    def __init__(self, name: str, status: Status, console: Console, evaluate: Evaluator, most_rounds: int = 0) -> None:
        self.name, self.status, self.console, self.inner = name, status, console, evaluate
        self.stage = "round 1"
        self.round = 1
        self.most = most_rounds  # the search's round budget over all its trials (it often stops well before)
        self.t0 = time.perf_counter()

    def pace(self) -> str:
        """Rounds done of the budget, and at this pace the most time the remaining ones take."""
        elapsed = time.perf_counter() - self.t0
        if not self.most or self.stage == "certification":
            return f"{elapsed:.0f} s so far"
        done = self.round - 1
        left = max(0, self.most - done)
        eta = f", at most ~{elapsed / done * left:.0f} s more at this pace" if done else ""
        return f"round {self.round} of at most {self.most}; {elapsed:.0f} s so far{eta}"

    def show(self, line: str) -> None:
        """The search's progress callback: a round's result, or the start of the held-out scoring."""
        self.console.print(f"  {self.name} {line}")
        if line.startswith("round "):
            self.round = int(line.split()[1].rstrip(':')) + 1
            self.stage = f"round {self.round}"
        elif line.startswith(("scoring", "confirmed", "look ")):
            self.stage = "certification"
        self.status.update(f"{self.name}: {line}")

    def __call__(self, plan: Plan, seed: int, share: float = 1.0) -> Mapping[str, Attainment]:
        """The shared evaluator, saying which plan and request set it simulates."""
        return self.many(plan, [seed], share)[0]

    def many(self, plan: Plan, seeds: list[int], share: float = 1.0) -> list[Mapping[str, Attainment]]:
        """The shared evaluator on several request sets at once (in its worker processes where it has them)."""
        from coral.planning.evaluation import evaluate_all

        sets = f"request set {seeds[0]}" if len(seeds) == 1 else f"{len(seeds)} request sets"
        self.status.update(f"{self.name} {self.stage}: simulating the ${plan.cost_per_hour:,.2f}/h plan on {sets}"
                           f"{'' if share == 1.0 else f' ({share:.0%} of each)'} ({self.pace()})")
        return evaluate_all(self.inner, plan, seeds, share)
