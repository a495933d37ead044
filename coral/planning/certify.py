"""A verdict that holds beyond the traffic it was chosen on: choose on some windows of traffic, certify on others.

A window is one request set (a workload seed: other segments of the traces, `duration_s` long). Requests inside
a window share its bursts, so the window is the independent unit: a model's attainment over n windows is their
request-weighted mean, and its one-sided lower bound is Student's t over the windows' values (`summarize`).
A model *holds* on windows when that bound is at or above its target and its 5th-percentile window is at most
`tail` under it (`holds`): the promise is the long-run share, and a bursty half hour may not sink far below it.

The search's rounds (tuned on a few windows, `coral.planning.slo_search`) only propose candidates. Choosing the
cheapest of dozens that passed there rewards the luckiest (the optimizer's curse), so:
1. *Confirm*: each model's passing parts (its instances in some round's plan) are re-simulated alone on
   `confirm_seeds`, fresh windows of the whole traces, the same for every part (common random numbers),
   cheapest first; a part is confirmed when the model holds there. The plan is the cheapest
   composition of confirmed parts within availability (`coral.planning.compose`).
2. *Certify*: the plan's parts are simulated on `held_out_seeds`, windows of the whole traces on seeds that no
   step of any search reads. A model whose part does not hold gets its next confirmed part, certified on
   fresh held-out windows; each of the `looks` looks tests at (1 − confidence) / looks, so the chance that a
   model below its target is certified stays at most 1 − confidence over all looks (Bonferroni).
A model is reported as passing only on its certificate."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy import stats

from coral.allocation.plan import Plan, WindowStats
from coral.planning.compose import Part, cheapest_parts, composed_plan
from coral.planning.evaluation import LOOK_STRIDE, LOOKS, Attainment, Evaluator, evaluate_all

Progress = Callable[[str], None]
NodeLimits = Mapping[tuple[str, str], int] | None


@dataclass(frozen=True)
class Rule:
    """What a model must show on windows to hold (module doc)."""

    confidence: float = 0.95  # of the whole verdict, over every look
    tail: float = 0.03  # the 5th-percentile window may fall this far under the target
    looks: int = LOOKS  # certification looks per model (each on fresh windows)

    @property
    def per_look(self) -> float:
        """Confidence of one look's bound: the error rate split over the looks."""
        return 1.0 - (1.0 - self.confidence) / max(1, self.looks)


def summarize(values: Sequence[Attainment], seeds: Sequence[int], confidence: float) -> WindowStats:
    """One model's attainment over windows: pooled (request-weighted; equal weights when counts are unknown),
    its one-sided `confidence` lower bound (t over windows: the ratio estimator's standard error), and the
    windows' 5th percentile, median and worst. Fewer than two windows bound nothing: the bound is 0."""
    a = np.array([v.slo for v in values], dtype=float)
    w = np.array([v.requests for v in values], dtype=float)
    if not len(a):
        return WindowStats(windows=0, seeds=[], pooled=0.0, lower_bound=0.0, confidence=confidence, p5=0.0, p50=0.0,
                           worst=0.0)
    if (w <= 0).any():
        w = np.ones_like(a)
    pooled = float((w * a).sum() / w.sum())
    n = len(a)
    if n >= 2:
        mean_w = w.mean()
        se = math.sqrt(float((w ** 2 * (a - pooled) ** 2).sum()) / ((n - 1) * n * mean_w ** 2))
        lower = pooled - float(stats.t.ppf(confidence, n - 1)) * se
    else:
        lower = 0.0
    clip = lambda x: min(1.0, max(0.0, float(x)))  # noqa: E731
    return WindowStats(windows=n, seeds=list(seeds), pooled=clip(pooled), lower_bound=clip(lower),
                       confidence=confidence, p5=clip(np.percentile(a, 5)), p50=clip(np.median(a)),
                       worst=clip(a.min()))


def holds(s: WindowStats, target: float, tail: float) -> bool:
    """Whether a model with these windows meets `target` by the rule (module doc)."""
    return s.lower_bound >= target - 1e-12 and s.p5 >= target - tail - 1e-12


@dataclass
class Certification:
    """The chosen plan and what certified it."""

    plan: Plan
    parts: list[Part]
    stats: dict[str, WindowStats]  # per model: its certificate (or its last look's windows when none held)
    windows: int = 0  # request sets simulated (a part alone counts as one)
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)


class _Windows:
    """Each part's attainment on windows, simulated alone and kept (common random numbers: same seeds for all)."""

    def __init__(self, evaluate: Evaluator) -> None:
        self.evaluate, self.count = evaluate, 0
        self.seen: dict[tuple[str, tuple[int, ...]], list[Attainment]] = {}

    def of(self, part: Part, seeds: Sequence[int]) -> list[Attainment]:
        key = (part.signature, tuple(seeds))
        if key not in self.seen:
            plan = composed_plan([part])
            self.seen[key] = [r.get(part.model, Attainment(0.0, 0.0, 0.0))
                              for r in evaluate_all(self.evaluate, plan, seeds)]
            self.count += len(seeds)
        return self.seen[key]


def confirmed_parts(parts: Sequence[Part], check: Callable[[Part], bool], first: int = 4) -> tuple[list[Part], int]:
    """The parts (cheapest first) that pass `check`, and how many were checked: the `first` cheapest; when none
    of them passes, the dearest, then a bisection over the rest for the cheapest that passes (attainment grows
    with capacity, if not strictly). Returned cheapest first."""
    ordered = sorted(parts, key=lambda p: (round(p.cost_per_hour, 6), p.round_index))
    out = [p for p in ordered[:first] if check(p)]
    looked = min(first, len(ordered))
    rest = ordered[first:]
    if out or not rest:
        return out, looked
    looked += 1
    if not check(rest[-1]):
        return out, looked
    lo, hi = -1, len(rest) - 1  # rest[hi] passes
    while hi - lo > 1:
        mid = (lo + hi) // 2
        looked += 1
        if check(rest[mid]):
            hi = mid
        else:
            lo = mid
    return ([rest[hi]] if hi == len(rest) - 1 else [rest[hi], rest[-1]]), looked


#: more parts of a model: (model, the parts of the plan so far, one per model) -> its parts planned with more
#: headroom than before (each call a step further), empty when there are no more
Escalation = Callable[[str, Sequence[Part]], Sequence[Part]]


def certify(options: Mapping[str, Sequence[Part]], fallback: Sequence[Part], target: Mapping[str, float],
            limits: NodeLimits, evaluate: Evaluator, confirm_seeds: Sequence[int], held_out_seeds: Sequence[int],
            rule: Rule, say: Progress, escalate: Escalation | None = None) -> Certification:
    """Confirm each model's candidate `options` on `confirm_seeds`, compose the cheapest confirmed plan within
    `limits` (else `fallback`, one part per model: the search's own choice) and certify it on `held_out_seeds`
    (module doc). A model none of whose parts is left to try (none confirmed, or each failed a look) gets parts
    from `escalate`, confirmed the same way, until one is confirmed or it has no more."""
    t0 = time.perf_counter()
    windows = _Windows(evaluate)
    confirmed: dict[str, list[Part]] = {}
    looked: dict[str, int] = {}

    def check(p: Part) -> bool:
        return holds(summarize(windows.of(p, confirm_seeds), confirm_seeds, rule.per_look), target[p.model],
                     rule.tail)

    def escalated(m: str, plan: Sequence[Part]) -> list[Part]:
        """Confirmed parts of `m` from `escalate`'s steps (the first step that gives some)."""
        while escalate is not None:
            more = list(escalate(m, plan))
            if not more:
                break
            found, n = confirmed_parts(more, check) if confirm_seeds else (more, 0)
            looked[m] = looked.get(m, 0) + n
            if found:
                return found
        return []

    for m in target:
        confirmed[m], looked[m] = confirmed_parts(options.get(m, []), check) if confirm_seeds else (
            list(options.get(m, [])), 0)
    for m in target:
        if not confirmed[m]:
            confirmed[m] = escalated(m, [*(p for p in fallback if p.model != m),
                                         *(p for p in fallback if p.model == m)])
    notes: list[str] = []
    chosen = cheapest_parts(confirmed, limits) if all(confirmed.values()) else None
    if chosen is None:
        chosen = list(fallback)
        short = [m for m in target if not confirmed.get(m)]
        notes.append("confirmation: " + (f"no part of {', '.join(short)} held on the {len(confirm_seeds)} fresh "
                                         "windows" if short else "the confirmed parts do not fit the "
                                         "availability together") + "; the search's own plan is certified")
    say(f"confirmed {sum(len(v) for v in confirmed.values())} parts of {sum(looked.values())} looked at on "
        f"{len(confirm_seeds)} fresh windows; certifying the ${sum(p.cost_per_hour for p in chosen):,.2f}/h "
        f"plan on {len(held_out_seeds)} held-out windows")
    stats: dict[str, WindowStats] = {}
    certified: dict[str, bool] = {}
    tried: dict[str, set[str]] = {m: set() for m in target}
    for look in range(max(1, rule.looks)):
        seeds = [s + LOOK_STRIDE * look for s in held_out_seeds]
        pending = [p for p in chosen if not certified.get(p.model)]
        for p in pending:
            stats[p.model] = summarize(windows.of(p, seeds), seeds, rule.per_look)
            certified[p.model] = holds(stats[p.model], target[p.model], rule.tail)
            tried[p.model].add(p.signature)
        failed = [p.model for p in pending if not certified[p.model]]
        if not failed or look + 1 >= rule.looks:
            break
        mine = {p.model: p for p in chosen}
        left = {m: [mine[m]] if certified.get(m) else [o for o in confirmed.get(m, []) if o.signature not in tried[m]]
                for m in target}
        for m in failed:
            if not left[m]:
                left[m] = confirmed[m] = escalated(m, chosen)
        nxt = cheapest_parts(left, limits)
        if nxt is None:  # what is left does not fit beside the others: planned within what they leave
            for m in failed:
                left[m] = confirmed[m] = escalated(m, chosen)
            nxt = cheapest_parts(left, limits)
        if nxt is None:
            break
        say(f"look {look + 2}: {', '.join(failed)} did not hold on look {look + 1}'s windows; certifying the next "
            f"confirmed part on {len(seeds)} fresh held-out windows")
        chosen = nxt
    plan = composed_plan(chosen)
    return Certification(plan, list(chosen), stats, windows.count, time.perf_counter() - t0, notes)
