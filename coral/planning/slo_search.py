"""The cheapest plan whose certified attainment meets every model's target: candidates from a bounded search with
the simulator in the loop, a choice that does not reward luck, and a verdict on traffic the search never read.

1. *Rounds* (`_run_rounds`). Each round plans capacity = mean traffic x h per (model, phase) key and simulates
   the plan on the tuning sets (`tune_seeds`: the first half of every trace). Per key a bracket [lo, hi] of the
   capacity planned narrows: a model meeting its target with `margin` to spare lowers hi, a model short of it
   raises lo on the phase its misses blame (TTFT: prefill; TPOT: decode). The budget is rounds, never seconds
   (`default_rounds`); `time_budget_s` is a wall-clock safety net only, and reported when it acts.
2. *Trials*. With a `subset` planner (Coral's: the homogeneous ILP) its whole search runs first, so the result is
   never dearer; then the planner's rounds, then each variant's (Coral's allocator pricing slack).
3. *Parts*. A model's attainment depends on its own instances only, so the cheapest passing part per model from
   any rounds is composed (`coral.planning.compose`), and where models compete for scarce nodes each is refined
   alone within what the others leave.
4. *Choice and verdict* (`coral.planning.certify`): the passing parts are confirmed on fresh windows
   (common to all), the cheapest confirmed composition is certified on held-out windows, and a model passes only
   on its certificate; a model with no part left to try is planned again alone with more headroom (`Escalator`). A failing verdict says why: requests too long even served alone (the ceiling), capacity
   capped by availability, or a budget that ran out.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import astuple, dataclass, field, replace

from coral.allocation.allocator import InfeasibleDemand, allocate
from coral.allocation.availability import PLENTY
from coral.allocation.baselines import homo_ilp
from coral.allocation.core import Availability, SlackPrice
from coral.allocation.demand import TUNING_SEED, DemandKey, headroom, run_length_s, scenario_traffic
from coral.allocation.plan import Plan, SloCheck, WindowStats
from coral.catalog.loader import Catalog
from coral.catalog.schema import Scenario
from coral.perf.model import Phase
from coral.planning.certify import Certification, Rule, certify, holds, summarize
from coral.planning.compose import (
    Part,
    alone,
    availability_limits,
    cheapest_parts,
    composed_plan,
    leftover,
    node_use,
    part_of,
    plan_key,
    seen_limits,
)
from coral.planning.evaluation import (
    CONFIRM_SEEDS,
    HELD_OUT_SEEDS,
    Attainment,
    Evaluator,
    evaluate_all,
    simulator_evaluator,
    window_seeds,
)
from coral.templates.library import TemplateLibrary

Planner = Callable[[dict[DemandKey, float]], Plan]
Progress = Callable[[str], None]


#: step down from a sufficient headroom while no insufficient one above the mean has been seen
SHRINK = 0.85


def default_rounds(scenario: Scenario) -> int:
    """Rounds of the search by default: 14 for up to 3 models, one more per model beyond (each adds two brackets
    to settle; rounds settle all brackets at once, so they grow with the models far slower than the seconds a
    round takes): core 14, extended 17."""
    return 14 + max(0, len(scenario.models) - 3)


def default_budget_s(scenario: Scenario, trials: int = 2) -> float:
    """The search's wall-clock safety net by default (not its budget: that is `default_rounds`): 4x the seconds
    the rounds of up to two trials (a subset's and a planner's) take on 2 shared cores, growing with the square of
    the models (more rounds, each simulating and planning more models), at most 36 minutes: core 480 s,
    extended 1920 s; half as much again for every trial beyond two (Coral's search with its slack-priced
    variant: core 720 s, extended 2880 s, which its extended search with 4 H100 GPUs at ≥ 99 % ran past at
    1920 s on a loaded machine); the refined rounds count as one more trial where the availability is a table
    (Coral's search there: core 960 s, extended 3840 s)."""
    return min(2160.0, 480.0 * (len(scenario.models) / 3) ** 2) * max(1.0, trials / 2)

#: share of requests kept when measuring the ceiling (requests served alone, nothing queued)
CEILING_SAMPLE = 0.02


@dataclass(frozen=True)
class SearchSettings:
    """Bounds and data of the search (module doc)."""

    duration_s: float | None = None  # simulated seconds per request set (default: the scenario's run length)
    # request sets tuned on, read from the tuning part of each trace (its first half): a model's worst one counts
    tune_seeds: tuple[int, ...] = (TUNING_SEED, 10, 11)
    # windows the chosen plan is certified on (its first look; look k adds `LOOK_STRIDE` x k): the whole traces
    # on seeds no other step reads
    held_out_seeds: tuple[int, ...] = HELD_OUT_SEEDS
    # fresh windows of the whole traces each model's candidate parts are confirmed on before one is chosen
    confirm_seeds: tuple[int, ...] = CONFIRM_SEEDS
    rule: Rule = field(default_factory=Rule)  # what a model must show on windows to hold (`coral.planning.certify`)
    max_rounds: int | None = None  # the search's budget; default: `default_rounds` (core 14, extended 17)
    time_budget_s: float | None = None  # wall-clock safety net only; default: `default_budget_s` (core 480 s,
    # extended 1920 s, half as much again for each trial beyond two: Coral's search 720 s and 2880 s)
    tolerance: float = 1.06
    margin: float = 0.1  # a model passes a tuning round with at most (1 - margin) x its allowed misses
    # rounds each planner gets per model when the search refines one model at a time, from the burst factors as in
    # the trials: with 6, `benchmarks/scarce_split.py` found each model's cheapest part per share of the scarce
    # nodes on core (from the best plan's own headroom instead, 5 did not: qwen3-32b's plain-allocator plan there
    # attained 72 % where its slack-priced part of the same cost attained 91 %)
    refine_rounds: int = 6

    @property
    def window_seeds(self) -> tuple[int, ...]:
        """Every seed of a window (the confirmation's and each certification look's): the whole traces."""
        return window_seeds(self.held_out_seeds, self.confirm_seeds, self.rule.looks)


@dataclass
class Round:
    """One planned and simulated candidate."""

    index: int
    headroom: dict[DemandKey, float]
    cost_per_hour: float | None  # None: no plan (availability)
    attainment: dict[str, float]
    passed: bool
    note: str = ""
    wall_s: float = 0.0
    trial: str = ""  # the planner whose round it is (`search_plan`: "subset", "planner", "variant 1", ...), or
    # "composed" (parts of other rounds, `coral.planning.compose`), or "refined" (one model planned alone)


@dataclass
class SearchResult:
    plan: Plan | None  # the cheapest plan that met every target on the tuning requests, else the closest one
    headroom: dict[DemandKey, float]
    rounds: list[Round] = field(default_factory=list)
    wall_s: float = 0.0
    safety_net: str | None = None  # what a wall-clock safety net stopped (the search's, or the allocator's in a
    # round), in words; None: the result depends on the inputs alone
    chosen: int | None = None  # index of the round whose plan was chosen

    @property
    def tuned_passed(self) -> bool:
        """Whether the chosen round met every target on the tuning requests."""
        return self.chosen is not None and self.rounds[self.chosen].passed

    @property
    def met(self) -> bool:
        return self.plan is not None and self.plan.slo is not None and all(
            self.plan.slo.passed(m) for m in self.plan.slo.target)

    @property
    def chosen_trial(self) -> str | None:
        """Whose round the plan came from (`Round.trial`); None: no round was chosen."""
        return self.rounds[self.chosen].trial if self.chosen is not None else None


@dataclass
class _Bracket:
    h: float
    lo: float = 1.0
    hi: float | None = None
    lo_seen: bool = False  # lo was measured (not the floor)

    def settled(self, tolerance: float) -> bool:
        return self.hi is not None and self.hi <= self.lo * tolerance


#: slack the search's slack-priced variant of Coral's allocator prices (`coral.allocation.core.SlackPrice`): the
#: demand it is asked is an estimate of a percentile, so capacity above it is worth keeping where whole instances
#: carry it for little (README "Slack priced"; at 0.5 the priced plan still trimmed gpt-oss-20b's slack on core,
#: `tests/test_latency_rating.py`'s equal-demand test)
SEARCH_SLACK = SlackPrice(share=0.15, price=0.8)  # the defaults
ESCALATIONS = 2  # steps of `Escalator` per model
ESCALATION_ROOM = 0.25  # each step starts its rounds this much more headroom above the failed part's
ESCALATION_MARGIN = 0.2  # and passes a round only with this much more of the allowed misses to spare


def allocator_planner(library: TemplateLibrary, scenario: Scenario, availability: Availability | str | None,
                      catalog: Catalog | None = None, method: Callable[..., Plan] = allocate,
                      slack: SlackPrice | None = None) -> Planner:
    """demand -> plan with `method` (the allocator, or a baseline with the same keyword interface), pricing
    `slack` (the allocator and homo-ilp only)."""
    extra = {} if slack is None else {"slack": slack}
    return lambda demand: method(library, scenario, demand=demand, availability=availability, catalog=catalog,
                                 **extra)


def homogeneous_subset(library: TemplateLibrary, scenario: Scenario, availability: Availability | str | None,
                       catalog: Catalog | None, method: Callable[..., Plan]) -> Planner | None:
    """The `subset` planner of `search_plan` for `method`: the homogeneous ILP when `method` is Coral's allocator
    (its search first runs that one's rounds, so its plan is never dearer), None for any other method."""
    return allocator_planner(library, scenario, availability, catalog, homo_ilp) if method is allocate else None


def slack_variants(library: TemplateLibrary, scenario: Scenario, availability: Availability | str | None,
                   catalog: Catalog | None, method: Callable[..., Plan]) -> list[Planner]:
    """The `variants` of `search_plan` for `method`: for Coral's allocator, itself pricing `SEARCH_SLACK` (its
    rounds run after the plain allocator's, and the cheapest passing plan of all is kept); none otherwise
    (homo-ilp's search priced so ended dearer than its plain one on core, at ≥ 90 %: $57.87 against $56.01/h
    with the market unlimited, $135.03 against $129.36/h with 4 L40S GPUs; and Coral's search runs homo-ilp's
    rounds, which it must contain to be never dearer)."""
    return [allocator_planner(library, scenario, availability, catalog, allocate, SEARCH_SLACK)] if (
        method is allocate) else []


def search_method(method: Callable[..., Plan], library: TemplateLibrary, scenario: Scenario,
                  availability: Availability | str | None, settings: SearchSettings | None = None, *,
                  catalog: Catalog | None = None, evaluate: Evaluator | None = None,
                  progress: Progress | None = None) -> SearchResult:
    """`search_plan` for `method` (Coral's allocator or a baseline) as every caller runs it: its planner within
    `availability`, with Coral's allocator homo-ilp's rounds first (`homogeneous_subset`) and its slack-priced
    rounds after (`slack_variants`), the composed round within `availability`."""

    def within(market: Availability) -> list[Planner]:
        """The search's planners within `market`, in the order of its trials: subset, planner, variants."""
        subset = homogeneous_subset(library, scenario, market, catalog, method)
        return [*([subset] if subset is not None else []), allocator_planner(library, scenario, market, catalog, method),
                *slack_variants(library, scenario, market, catalog, method)]

    return search_plan(allocator_planner(library, scenario, availability, catalog, method), scenario, settings,
                       catalog=catalog, evaluate=evaluate, progress=progress,
                       subset=homogeneous_subset(library, scenario, availability, catalog, method),
                       variants=slack_variants(library, scenario, availability, catalog, method),
                       availability=availability, within=within)


def worst_of(results: list[Mapping[str, Attainment]]) -> dict[str, Attainment]:
    """Per model, a cautious attainment over several request sets: the worst set's, less half the spread between
    the sets (the held-out sets are as likely as any to hold the worst half hour, so a bursty model, whose sets
    spread widely, gets more room than a steady one); phase shares are the worst set's."""
    out: dict[str, Attainment] = {}
    for m in dict.fromkeys(m for r in results for m in r):
        seen = [r[m] for r in results if m in r]
        worst = min(seen, key=lambda a: a.slo)
        spread = max(a.slo for a in seen) - worst.slo
        out[m] = Attainment(max(0.0, worst.slo - spread / 2), worst.ttft, worst.tpot)
    return out


def _blamed(miss_prefill: float, miss_decode: float, allowed: float) -> list[Phase]:
    blamed = [p for p, miss in ((Phase.PREFILL, miss_prefill), (Phase.DECODE, miss_decode)) if miss > allowed / 2]
    return blamed or [Phase.PREFILL if miss_prefill >= miss_decode else Phase.DECODE]


def tuning_attainment(plan: Plan, cfg: SearchSettings, evaluate: Evaluator) -> dict[str, Attainment]:
    """What the search reads of a plan: per model, its cautious attainment over the tuning sets (`worst_of`)."""
    return worst_of(evaluate_all(evaluate, plan, cfg.tune_seeds))


def with_traffic(plan: Plan, traffic: Mapping[DemandKey, float]) -> Plan:
    """`plan` with each (model, phase)'s mean traffic recorded beside the demand it was sized for."""
    for s in plan.serving:
        s.traffic_tokens_s = float(traffic.get((s.model, Phase(s.phase)), 0.0))
    return plan


@dataclass
class _Trial:
    """The rounds of one planner (`_run_rounds`)."""

    rounds: list[Round] = field(default_factory=list)
    plans: dict[int, Plan] = field(default_factory=dict)
    cap: dict[DemandKey, float] = field(default_factory=dict)  # h at which availability ran out
    closest: tuple[float, int] | None = None  # (least attainment - target, round)
    nets: list[str] = field(default_factory=list)
    unresponsive: dict[DemandKey, str] = field(default_factory=dict)  # keys that stopped drawing capacity, why
    headroom: dict[DemandKey, float] = field(default_factory=dict)  # the last proposal


#: a key that kept missing while its capacity grew by this factor with under `RESPONSE` of its shortfall made up
#: stops drawing capacity
UNRESPONSIVE_GROWTH = 1.5
RESPONSE = 0.25


def _run_rounds(planner: Planner, scenario: Scenario, cfg: SearchSettings, start: Mapping[DemandKey, float],
                evaluate: Evaluator, say: Progress, t0: float, max_rounds: int, budget: float, first_index: int = 0,
                label: str = "planner", models: Sequence[str] | None = None) -> _Trial:
    """Rounds of the bracket search (module doc) from headroom `start`, numbered from `first_index`, each
    labelled `label`; `budget`: the whole search's wall-clock safety net, from `t0`. With `models`, only their
    keys are searched; the others keep their `start`."""
    traffic = scenario_traffic(scenario)
    keys = [k for k, v in traffic.items() if v > 0 and (models is None or k[0] in models)]
    target = {sm.model: sm.slo_attainment for sm in scenario.models}
    brackets = {k: _Bracket(h=max(1.0, start[k])) for k in keys}
    fixed = {k: start.get(k, 1.0) for k, v in traffic.items() if v > 0 and k not in brackets}
    trial = _Trial()
    cap, rounds, plans = trial.cap, trial.rounds, trial.plans
    misses: dict[DemandKey, list[tuple[float, float]]] = {}  # (capacity ÷ traffic, phase attainment) while short
    while len(rounds) < max_rounds:
        if (rounds or first_index) and time.perf_counter() - t0 >= budget:  # the safety net, never the budget
            trial.nets.append(f"the search's wall-clock safety net ({budget:.0f} s) stopped it after "
                              f"{first_index + len(rounds)} rounds")
            break
        t_round = time.perf_counter()
        h = {**fixed, **{k: b.h for k, b in brackets.items()}}
        demand = {k: traffic[k] * h.get(k, 1.0) for k in traffic}
        index = first_index + len(rounds)
        try:
            plan = with_traffic(planner(demand), traffic)
            if plan.solve.safety_net:
                trial.nets.append(f"round {index + 1}: the allocator's wall-clock safety net: {plan.solve.safety_net}")
        except InfeasibleDemand as exc:
            for k in exc.models or keys:
                if k in brackets:
                    cap[k] = min(cap.get(k, math.inf), brackets[k].h)
                    b = brackets[k]
                    b.h = max(b.lo, math.sqrt(b.lo * b.h)) if b.h > b.lo * cfg.tolerance else b.lo
            rounds.append(Round(index, h, None, {}, False, f"infeasible: {exc}", time.perf_counter() - t_round,
                                label))
            say(f"round {index + 1}: no plan (availability)")
            if all(b.h <= b.lo for b in brackets.values()):
                break
            continue
        result = tuning_attainment(plan, cfg, evaluate)
        att = {m: a.slo for m, a in result.items()}
        ok = _meets(att, target, cfg.margin)
        passed = all(ok.values())
        rounds.append(Round(index, h, plan.cost_per_hour, att, passed, wall_s=time.perf_counter() - t_round,
                            trial=label))
        plans[index] = plan
        worst = min(att.get(m, 0.0) - target[m] for m in target)
        if trial.closest is None or worst > trial.closest[0]:
            trial.closest = (worst, index)
        say(f"round {index + 1}: ${plan.cost_per_hour:,.2f}/h, " + ", ".join(
            f"{m} {att.get(m, 0.0):.1%}" for m in target) + (" - meets every target" if passed else ""))
        settled_before = all(b.settled(cfg.tolerance) for b in brackets.values())
        before = [astuple(b) for b in brackets.values()]
        # brackets hold the capacity planned (rounded up to whole instances) ÷ traffic, not the demand asked for:
        # what the simulator saw is the capacity, and asking for it again gets at least as much
        got = {(s.model, Phase(s.phase)): s.capacity / traffic[(s.model, Phase(s.phase))] for s in plan.serving
               if traffic.get((s.model, Phase(s.phase)), 0.0) > 0}
        grow: set[DemandKey] = set()
        for m in target:
            model_keys = [k for k in keys if k[0] == m]
            if ok[m]:
                for k in model_keys:
                    b = brackets[k]
                    # asking for h again gets this plan, which passed: h is enough too (a method that plans far
                    # more than asked, e.g. Cauchy's fixed prefill-decode units, must not drive h up after a pass)
                    b.hi = min(got.get(k, b.h), b.h)
                    if b.lo >= b.hi:
                        b.lo, b.lo_seen = 1.0, False
            else:
                allowed = 1.0 - target[m]
                seen = result.get(m, Attainment(0.0, 0.0, 0.0))
                for p in _blamed(1.0 - seen.ttft, 1.0 - seen.tpot, allowed):
                    short = brackets.get((m, p))
                    if short is None or (m, p) in trial.unresponsive:
                        continue
                    short.lo, short.lo_seen = got.get((m, p), short.h), True
                    if short.hi is not None and short.hi <= short.lo:
                        short.hi = None
                    history = misses.setdefault((m, p), [])
                    history.append((short.lo, seen.ttft if p is Phase.PREFILL else seen.tpot))
                    why = _unresponsive(history, 1.0 - allowed * (1.0 - cfg.margin))
                    if why:  # capacity does not lift it: stop drawing more (module doc)
                        trial.unresponsive[(m, p)] = why
                        short.hi, short.lo = short.lo, short.lo / cfg.tolerance
                        say(f"{m}/{p.value}: {why}")
                    else:
                        grow.add((m, p))
        if passed and settled_before:
            break
        for k, b in brackets.items():
            if b.settled(cfg.tolerance):
                b.h = b.hi  # type: ignore[assignment]
            elif b.hi is not None:
                b.h = math.sqrt(b.lo * b.hi) if b.lo_seen else max(b.lo, b.hi * SHRINK)
            elif k in grow:
                m = k[0]
                miss = 1.0 - att.get(m, 0.0)
                b.h = b.lo * min(3.0, max(1.2, math.sqrt(miss / max(1.0 - target[m], 1e-6))))
            if k in cap:
                b.h = min(b.h, cap[k] / cfg.tolerance ** 0.5)
        if [astuple(b) for b in brackets.values()] == before:  # the next round would ask the same again
            say(f"round {index + 1}: no bracket moved, so another round would repeat this one: stopped")
            break
    trial.headroom = {k: b.h for k, b in brackets.items()}
    return trial


def _cheapest_first(r: Round) -> tuple[float, int]:
    """Order of passing rounds: cheapest first, to the micro-dollar (sums of the same prices in another order
    differ in the last bits), then the earliest: a later plan of the same $/h is not chosen over an earlier one."""
    return round(r.cost_per_hour or 0.0, 6), r.index


def _meets(attainment: Mapping[str, float], target: Mapping[str, float], margin: float) -> dict[str, bool]:
    """Per model: whether it met its target with `margin` to spare (misses ≤ (1 − margin) × allowed)."""
    return {m: 1.0 - attainment.get(m, 0.0) <= (1.0 - t) * (1.0 - margin) for m, t in target.items()}


def _composed_rounds(trials: Sequence[_Trial], scenario: Scenario, cfg: SearchSettings,
                     limits: Mapping[tuple[str, str], int] | None, evaluate: Evaluator, say: Progress, t0: float,
                     budget: float, first_index: int) -> _Trial:
    """The round of the composed plan of `trials` (`coral.planning.compose`): the cheapest plan of parts where
    each model met its target in one of their rounds (within `limits`), simulated when it is cheaper than every
    passing round of `trials` and not a plan they already simulated."""
    target = {sm.model: sm.slo_attainment for sm in scenario.models}
    traffic = scenario_traffic(scenario)
    out = _Trial()
    every = [(r, t.plans[r.index]) for t in trials for r in t.rounds if r.index in t.plans]
    best = min((r.cost_per_hour or 0.0 for r, _ in every if r.passed), default=math.inf)
    parts = cheapest_parts(passing_parts(every, target, cfg.margin), limits)
    if parts is None:
        return out
    plan = with_traffic(composed_plan(parts), traffic)
    if plan.cost_per_hour >= best - 1e-9 or plan_key(plan) in {plan_key(p) for _, p in every}:
        return out
    if time.perf_counter() - t0 >= budget:
        out.nets.append(f"the search's wall-clock safety net ({budget:.0f} s) stopped it before its composed round")
        return out
    t_round = time.perf_counter()
    att = {m: a.slo for m, a in tuning_attainment(plan, cfg, evaluate).items()}
    passed = all(_meets(att, target, cfg.margin).values())
    by_index = {r.index: r for r, _ in every}
    part_round = {p.model: by_index[p.round_index] for p in parts}
    room = {k: part_round[k[0]].headroom.get(k, 1.0) for k in traffic if k[0] in part_round}
    out.rounds.append(Round(first_index, room, plan.cost_per_hour, att, passed, "; ".join(plan.solve.notes),
                            time.perf_counter() - t_round, "composed"))
    out.plans[first_index] = plan
    say(f"round {first_index + 1}: ${plan.cost_per_hour:,.2f}/h, composed of the cheapest part of each model that "
        "met its target in some round, " + ", ".join(f"{m} {att.get(m, 0.0):.1%}" for m in target)
        + (" - meets every target" if passed else ""))
    return out


def passing_parts(every: Sequence[tuple[Round, Plan]], target: Mapping[str, float], margin: float
                  ) -> dict[str, list[Part]]:
    """Per model, its distinct parts of the rounds (with their plans) where it met its target, in round order."""
    options: dict[str, list[Part]] = {m: [] for m in target}
    for r, plan in every:
        for m in (m for m, ok in _meets(r.attainment, target, margin).items() if ok):
            part = part_of(plan, m, r.index)
            if all(part.signature != o.signature for o in options[m]):
                options[m].append(part)
    return options


def binds(plan: Plan, availability: Mapping[str, Mapping[str, int]]) -> bool:
    """Whether `plan` uses every node of some limited (region, config) of `availability`: the models compete
    for those nodes."""
    use = node_use(plan.instances)
    return any(0 < n < PLENTY and use.get((r, c), 0) >= n for r, cs in availability.items() for c, n in cs.items())


class AloneEvaluator:
    """`evaluate` for plans that change `model`'s part only: that part simulated alone, every other model's
    attainment its own in `others` (a model's attainment depends on its own instances only, exactly:
    `tests/test_compose.py`)."""

    def __init__(self, model: str, others: Plan, evaluate: Evaluator) -> None:
        self.model, self.others, self.evaluate = model, others, evaluate

    def __call__(self, plan: Plan, seed: int, share: float = 1.0) -> dict[str, Attainment]:
        return self.many(plan, [seed], share)[0]

    def many(self, plan: Plan, seeds: Sequence[int], share: float = 1.0) -> list[dict[str, Attainment]]:
        mine = evaluate_all(self.evaluate, composed_plan([part_of(plan, self.model, 0)]), seeds, share)
        theirs = evaluate_all(self.evaluate, self.others, seeds, share)
        return [{**t, self.model: m[self.model]} for t, m in zip(theirs, mine, strict=True)]


def _refined_rounds(trials: Sequence[_Trial], planners: Callable[[Availability], Sequence[Planner]],
                    availability: Mapping[str, Mapping[str, int]], scenario: Scenario, cfg: SearchSettings,
                    start: Mapping[DemandKey, float], evaluate: Evaluator, say: Progress, t0: float, budget: float,
                    first_index: int) -> _Trial:
    """One model at a time (in the scenario's order), `cfg.refine_rounds` rounds from headroom `start` of each of
    `planners` (given the availability to plan within) for that model alone within what the other models' parts
    of the best passing plan leave of `availability` (`coral.planning.compose.alone`, `leftover`); a cheaper
    passing round becomes the plan the next ones refine. None when no plan passed or the best one `binds` no
    limit (then each model's part is what its planner gives it alone already)."""
    out = _Trial()
    passing = [(r, t.plans[r.index]) for t in trials for r in t.rounds if r.passed and r.index in t.plans]
    if not passing:
        return out
    best_round, best = min(passing, key=lambda rp: _cheapest_first(rp[0]))
    if not binds(best, availability):
        return out
    say(f"refining one model at a time, the others keeping their parts of round {best_round.index + 1} "
        f"(${best.cost_per_hour:,.2f}/h): the models compete for scarce nodes")
    for m in (sm.model for sm in scenario.models):
        for planner in planners(leftover(availability, best, m)):
            if time.perf_counter() - t0 >= budget:  # the safety net, never the budget
                out.nets.append(f"the search's wall-clock safety net ({budget:.0f} s) stopped its refined rounds "
                                f"at {m}")
                return out
            room = {**best_round.headroom, **{k: v for k, v in start.items() if k[0] == m}}
            trial = _run_rounds(alone(m, best, planner), scenario, cfg, room, AloneEvaluator(m, best, evaluate),
                                say, t0, cfg.refine_rounds, budget, first_index + len(out.rounds), "refined", models=[m])
            out.rounds += trial.rounds
            out.plans.update(trial.plans)
            out.nets += trial.nets
            for r in trial.rounds:
                if r.passed and (r.cost_per_hour or 0.0) < (best_round.cost_per_hour or 0.0) - 1e-9:
                    best_round, best = r, trial.plans[r.index]
    return out


def _unresponsive(history: list[tuple[float, float]], needed: float) -> str | None:
    """Words when a key that missed in every entry of `history` ((capacity ÷ traffic, its phase's attainment),
    in round order) grew its capacity by `UNRESPONSIVE_GROWTH` or more since its first miss while its phase's
    attainment made up under `RESPONSE` of the shortfall: its misses are latency, not load."""
    if len(history) < 3:
        return None
    (h0, a0), (h1, a1) = history[0], history[-1]
    if h1 < h0 * UNRESPONSIVE_GROWTH or a1 - a0 >= RESPONSE * max(needed - a0, 1e-9):
        return None
    return (f"does not respond to capacity ({a0:.1%} at {h0:.2f}x its traffic, {a1:.1%} at {h1:.2f}x): "
            "latency-bound on these templates; stops drawing capacity (other templates, a looser SLO or a lower "
            "target would help)")


def search_plan(
    planner: Planner,
    scenario: Scenario,
    settings: SearchSettings | None = None,
    *,
    catalog: Catalog | None = None,
    evaluate: Evaluator | None = None,
    progress: Progress | None = None,
    subset: Planner | None = None,
    variants: Sequence[Planner] = (),
    availability: Availability | str | None = None,
    within: Callable[[Availability], Sequence[Planner]] | None = None,
) -> SearchResult:
    """The cheapest plan found whose simulated attainment meets every model's `slo_attainment` on the tuning
    requests, scored on held-out ones, with per-model verdicts (module doc). With `subset` (a planner over a
    subset of `planner`'s columns, e.g. the homogeneous templates), the search first runs the rounds `subset`'s
    own search would run, then `planner`'s, and keeps the cheapest plan of either that passed: never dearer
    than the subset's search. (`planner`'s rounds start from the burst factors, not from where the subset's
    ended: in one version of this change, continuing from there found a dearer plan on core at 90 %.) Each of
    `variants` (e.g. `planner` pricing slack, `slack_variants`) then runs its own rounds the same way, and the
    cheapest passing plan of every trial is kept. Last, the cheapest plan composed of each model's passing parts
    of all rounds (`coral.planning.compose`) within `availability` (the planners'; None: no more nodes of a
    region and config than one round's plan used) is simulated as a round of its own when it is cheaper than
    every passing round; with `within` (the planners of the trials, subset first, given an availability) and a
    table of `availability`, the refined rounds follow where models compete for its limited nodes, and one more
    composed round. With `subset`, its rounds are composed and refined (its planner alone) before `planner`'s
    run, as its own search would, so the result is never dearer than that search's."""
    cfg = settings or SearchSettings()
    t0 = time.perf_counter()
    say = progress or (lambda _: None)
    duration = cfg.duration_s or run_length_s(scenario)
    target = {sm.model: sm.slo_attainment for sm in scenario.models}
    evaluate = evaluate or simulator_evaluator(scenario, duration, catalog, cfg.window_seeds)
    max_rounds = cfg.max_rounds if cfg.max_rounds is not None else default_rounds(scenario)
    start = headroom(scenario)
    table = availability if availability is not None and not isinstance(availability, str) else None
    budget = cfg.time_budget_s if cfg.time_budget_s is not None else default_budget_s(
        scenario, (subset is not None) + 1 + len(variants) + (within is not None and table is not None))
    trials: list[_Trial] = []

    def finish(group: list[_Trial], within: Callable[[Availability], Sequence[Planner]] | None) -> list[_Trial]:
        """The composed round of `group`, then (with `within`, in a market that binds) the refined rounds and
        the composed round of all of them."""
        limits = availability_limits(availability) if availability is not None else seen_limits(
            [p for t in group for p in t.plans.values()])

        def composed(of: list[_Trial]) -> _Trial:
            return _composed_rounds(of, scenario, cfg, limits, evaluate, say, t0, budget,
                                    sum(len(t.rounds) for t in trials + done))

        done: list[_Trial] = []
        done.append(composed(group))
        if within is not None and table is not None:
            done.append(_refined_rounds(group + done, within, table, scenario, cfg, start, evaluate, say, t0,
                                        budget, sum(len(t.rounds) for t in trials + done)))
            if done[-1].rounds:
                done.append(composed(group + done))
        return done

    if subset is not None:
        say("first the subset's own search (Coral's: the homogeneous ILP's), whole; the plan chosen is never "
            "dearer than its")
        trials.append(_run_rounds(subset, scenario, cfg, start, evaluate, say, t0, max_rounds, budget,
                                  label="subset"))
        trials += finish(trials[:1], None if within is None else lambda av: list(within(av))[:1])
    trials.append(_run_rounds(planner, scenario, cfg, start, evaluate, say, t0, max_rounds, budget,
                              sum(len(t.rounds) for t in trials)))
    for i, variant in enumerate(variants, 1):
        say(f"then the rounds of variant {i} of the planner (Coral's: the allocator pricing slack)")
        trials.append(_run_rounds(variant, scenario, cfg, start, evaluate, say, t0, max_rounds, budget,
                                  sum(len(t.rounds) for t in trials), label=f"variant {i}"))
    last_proposal = trials[-1].headroom
    searched = (subset is not None) + 1 + len(variants)
    trials += finish(list(trials), within)
    rounds = [r for t in trials for r in t.rounds]
    plans = {i: p for t in trials for i, p in t.plans.items()}
    cap: dict[DemandKey, float] = {}
    for t in trials:
        for k, v in t.cap.items():
            cap[k] = min(cap.get(k, math.inf), v)
    closest = max((t.closest for t in trials if t.closest is not None), default=None)
    passing = [r for r in rounds if r.passed]
    chosen = min(passing, key=_cheapest_first) if passing else (
        rounds[closest[1]] if closest is not None else None)
    net = "; ".join(n for t in trials for n in t.nets) or None
    unresponsive = {k: v for t in trials for k, v in t.unresponsive.items()}
    if chosen is None or chosen.index not in plans:
        return SearchResult(None, last_proposal, rounds, time.perf_counter() - t0, net)
    best = plans[chosen.index]
    cert = None
    if cfg.held_out_seeds:
        every = [(r, plans[r.index]) for r in rounds if r.index in plans]
        limits = availability_limits(availability) if availability is not None else seen_limits(list(plans.values()))
        escalate = Escalator(planner, within, table, subset is not None, scenario, cfg, rounds, plans, evaluate, say,
                             t0, budget)
        cert = certify(passing_parts(every, target, cfg.margin) if passing else {},
                       [part_of(best, m, chosen.index) for m in target], target, limits, evaluate,
                       cfg.confirm_seeds if passing else (), cfg.held_out_seeds, cfg.rule, say,
                       escalate if passing else None)
        chosen = _certified_round(cert, rounds, plans, chosen, scenario)
        best = plans[chosen.index]
    best.slo = score(best, scenario, cfg, duration, chosen.attainment, chosen.headroom, cap, evaluate, cert)
    best.slo.safety_net = net
    best.slo.notes += [f"{m}/{p.value} {why}" for (m, p), why in unresponsive.items()]
    if not chosen.passed:
        best.slo.notes.append(missed_words(chosen, target, len(rounds), max_rounds * searched))
    return SearchResult(best, chosen.headroom, rounds, time.perf_counter() - t0, net, chosen.index)


class Escalator:
    """More headroom for a model none of whose parts held (`coral.planning.certify.Escalation`): step k runs
    `refine_rounds` rounds for that model alone (the other models' parts kept, within what they leave of a
    table's availability), from the most headroom any of its passing rounds had x (1 + ESCALATION_ROOM x k), where
    a round passes only with the margin `cfg.margin + ESCALATION_MARGIN x k` (fewer misses to spare); the parts
    passing so are the step's.
    Its rounds join the search's (`rounds`, `plans`), trial "escalated"; at most `ESCALATIONS` steps a model."""

    def __init__(self, planner: Planner, within: Callable[[Availability], Sequence[Planner]] | None,
                 table: Mapping[str, Mapping[str, int]] | None, has_subset: bool, scenario: Scenario,
                 cfg: SearchSettings, rounds: list[Round], plans: dict[int, Plan], evaluate: Evaluator,
                 say: Progress, t0: float, budget: float) -> None:
        self.planner, self.within, self.table, self.main = planner, within, table, int(has_subset)
        self.scenario, self.cfg, self.rounds, self.plans = scenario, cfg, rounds, plans
        self.evaluate, self.say, self.t0, self.budget = evaluate, say, t0, budget
        self.steps: dict[str, int] = {}

    def __call__(self, model: str, parts: Sequence[Part]) -> list[Part]:
        step = self.steps[model] = self.steps.get(model, 0) + 1
        if step > ESCALATIONS or time.perf_counter() - self.t0 >= self.budget:
            return []
        base = composed_plan(list(parts))
        planner = self.planner if self.within is None or self.table is None else list(
            self.within(leftover(self.table, base, model)))[self.main]
        target = {sm.model: sm.slo_attainment for sm in self.scenario.models}
        tried = [r for r in self.rounds if r.index in self.plans and r.attainment
                 and _meets(r.attainment, {model: target[model]}, self.cfg.margin)[model]]
        room = {k: max([r.headroom.get(k, 1.0) for r in tried], default=1.0) * (1 + ESCALATION_ROOM * step)
                for k in scenario_traffic(self.scenario) if k[0] == model}
        start = {**headroom(self.scenario), **room}
        cfg = replace(self.cfg, margin=self.cfg.margin + ESCALATION_MARGIN * step)
        self.say(f"{model}: no part of it is left that held and fits beside the others' parts; planning it alone "
                 f"with more headroom (step {step}: from "
                 f"{max(room.values(), default=1.0):.2f}x its traffic, a round passing with {cfg.margin:.0%} of its "
                 "allowed misses to spare)")
        trial = _run_rounds(alone(model, base, planner), self.scenario, cfg, start,
                            AloneEvaluator(model, base, self.evaluate), self.say, self.t0, cfg.refine_rounds,
                            self.budget, len(self.rounds), "escalated", models=[model])
        self.rounds += trial.rounds
        self.plans.update(trial.plans)
        found = passing_parts([(r, trial.plans[r.index]) for r in trial.rounds if r.index in trial.plans],
                              {model: target[model]}, cfg.margin)
        return found.get(model, [])


def _certified_round(cert: Certification, rounds: list[Round], plans: dict[int, Plan], chosen: Round,
                     scenario: Scenario) -> Round:
    """The round of the certified plan: the round whose plan it is, else a new one (trial "confirmed") made of
    its parts' rounds (each model's tuning attainment and headroom its part's), appended to `rounds`."""
    key = plan_key(cert.plan)
    same = [r for r in rounds if r.index in plans and plan_key(plans[r.index]) == key]
    if same:
        return min(same, key=_cheapest_first)
    by_index = {r.index: r for r in rounds}
    source = {p.model: by_index.get(p.round_index, chosen) for p in cert.parts}
    traffic = scenario_traffic(scenario)
    index = len(rounds)
    rounds.append(Round(index, {k: source[k[0]].headroom.get(k, 1.0) for k in traffic if k[0] in source},
                        cert.plan.cost_per_hour, {m: r.attainment.get(m, 0.0) for m, r in source.items()},
                        chosen.passed, "; ".join(cert.plan.solve.notes), cert.wall_s, "confirmed"))
    plans[index] = with_traffic(cert.plan, traffic)
    return rounds[-1]


def missed_words(chosen: Round, target: Mapping[str, float], n_rounds: int, max_rounds: int) -> str:
    """Why the chosen plan is not one that met every target on the tuning requests, in words."""
    short = ", ".join(f"{m} {chosen.attainment.get(m, 0.0):.1%} < {t:.0%}" for m, t in target.items()
                      if chosen.attainment.get(m, 0.0) < t) or "every model at its target but short of the margin"
    return (f"missed: no round met every target on the tuning requests ({n_rounds} of {max_rounds} rounds); the "
            f"closest, round {chosen.index + 1}, was chosen ({short})")


def score(plan: Plan, scenario: Scenario, cfg: SearchSettings, duration: float, tuned: Mapping[str, float],
          room: Mapping[DemandKey, float], capped: Mapping[DemandKey, float] | None = None,
          evaluate: Evaluator | None = None, cert: Certification | None = None) -> SloCheck:
    """The verdict per model on `plan` (planned with headroom `room`, attaining `tuned` on the tuning requests;
    `capped`: the headroom at which availability ran out per key): pass when the model holds on its certificate
    (`cert`, else the plan simulated on `cfg.held_out_seeds`, one look), else fail with the reason (module doc).
    Without held-out windows the verdict is on the tuning attainment."""
    capped = capped or {}
    evaluate = evaluate or simulator_evaluator(scenario, duration, windows=cfg.window_seeds)
    target = {sm.model: sm.slo_attainment for sm in scenario.models}
    rule = cfg.rule
    seeds = list(cfg.held_out_seeds)
    if cert is not None:
        certified = dict(cert.stats)
    else:
        t0 = time.perf_counter()
        sets = evaluate_all(evaluate, plan, seeds)
        certified = {m: summarize([r.get(m, Attainment(0.0, 0.0, 0.0)) for r in sets], seeds, rule.per_look)
                     for m in target} if sets else {}
        spent = time.perf_counter() - t0
    ok = {m: holds(certified[m], target[m], rule.tail) if m in certified else tuned.get(m, 0.0) >= target[m]
          for m in target}
    ceiling: dict[str, float] = {}
    if not all(ok.values()):
        seed = seeds[0] if seeds else cfg.tune_seeds[0]
        ceiling = {m: a.slo for m, a in evaluate(plan, seed, CEILING_SAMPLE).items()}
    verdict = {m: _verdict(m, target[m], certified.get(m), ok[m], tuned.get(m, 0.0), ceiling, capped, room, rule,
                           plan.cost_per_hour) for m in target}
    return SloCheck(target=target, tuned=dict(tuned),
                    held_out={m: c.pooled for m, c in certified.items()},
                    held_out_worst={m: c.worst for m, c in certified.items()}, held_out_seeds=seeds,
                    duration_s=duration, certified=certified, tail=rule.tail,
                    certification_s=cert.wall_s if cert is not None else spent if seeds else 0.0,
                    certification_windows=cert.windows if cert is not None else len(seeds), verdict=verdict,
                    notes=list(cert.notes) if cert is not None else [])


def certificate_words(c: WindowStats) -> str:
    """A model's windows in a few words."""
    return (f"{c.lower_bound:.1%} certified ({c.confidence:.1%} lower bound over {c.windows} held-out windows; "
            f"pooled {c.pooled:.1%}, p5 {c.p5:.1%}, worst {c.worst:.1%})")


def _verdict(m: str, target: float, c: WindowStats | None, ok: bool, tuned: float, ceiling: Mapping[str, float],
             capped: Mapping[DemandKey, float], room: Mapping[DemandKey, float], rule: Rule, cost: float) -> str:
    """One model's verdict (module doc of `coral.planning.certify` for the rule)."""
    got = certificate_words(c) if c is not None else f"{tuned:.1%} on the tuning requests (no held-out windows)"
    if ok:
        return f"pass: {got} >= {target:.0%}" + (f", p5 within {rule.tail:.0%} of it" if c is not None else "")
    if m in ceiling and ceiling[m] < target:
        return (f"fail: {got}; even served alone only {ceiling[m]:.1%} of its requests meet both SLOs on these "
                "templates (single requests too long for the SLO), so no added capacity meets "
                f"{target:.0%}: relax the SLO or set slo_attainment <= {math.floor(ceiling[m] * 100) / 100:.2f}")
    if any(k[0] == m for k in capped):
        return (f"fail: {got}; availability caps its capacity (no plan at "
                f"{max(v for k, v in capped.items() if k[0] == m):.2f}x its mean traffic): add nodes or plan in "
                "goodput mode")
    return (f"fail: not certified for {target:.0%}: {got} ({tuned:.1%} when tuned) at ${cost:,.2f}/h; more "
            f"headroom than {max((v for k, v in room.items() if k[0] == m), default=1.0):.2f}x the mean (a larger "
            "search budget or margin) should meet it")
