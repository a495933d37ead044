"""What the search and the certification read of a plan: per model, its simulated attainment on one request set
(a window of traffic), from the simulator on the scenario's workload of a seed."""

from __future__ import annotations

import multiprocessing
import os
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from coral.allocation.plan import Plan
from coral.catalog.loader import Catalog, builtin_catalog
from coral.catalog.schema import Scenario
from coral.perf.roofline import RooflineModel
from coral.simulation.kernels import KernelCache
from coral.simulation.run import simulate
from coral.workload.traces import RequestSet, thinned, workload_for


@dataclass(frozen=True)
class Attainment:
    """One model's simulated shares of requests: meeting both SLOs, the TTFT SLO, and the TPOT SLO (finished);
    `requests`: how many it had (0: unknown, the windows then weigh alike)."""

    slo: float
    ttft: float
    tpot: float
    requests: int = 0


#: (plan, workload seed, share of the requests kept) -> attainment per model
Evaluator = Callable[[Plan, int, float], Mapping[str, Attainment]]

#: the windows a plan is certified on by default (its first look)
HELD_OUT_SEEDS = tuple(range(1000, 1020))
#: the fresh windows candidate parts are confirmed on by default
CONFIRM_SEEDS = tuple(range(100, 116))
#: seed offset between the held-out windows of two certification looks
LOOK_STRIDE = 10_000
#: certification looks by default (`coral.planning.certify.Rule.looks`)
LOOKS = 2


def window_seeds(held_out_seeds: Collection[int] = HELD_OUT_SEEDS, confirm_seeds: Collection[int] = CONFIRM_SEEDS,
                 looks: int = LOOKS) -> tuple[int, ...]:
    """Every seed of a window: the confirmation's and each certification look's (they read the whole traces)."""
    return (*confirm_seeds, *(s + LOOK_STRIDE * k for k in range(max(1, looks)) for s in held_out_seeds))


def simulator_evaluator(scenario: Scenario, duration_s: float, catalog: Catalog | None = None,
                        windows: Collection[int] | None = None, workers: int | None = None) -> SimulatorEvaluator:
    """Attainment from the simulator on the scenario's workload of each seed (kept once made), thinned to a share
    of its requests when asked (requests served alone: nothing queues). The search's rounds tune on sets of the
    first half of every trace (`coral.workload.traces.TracePart` "tune"); a seed of `windows` (the search's
    `SearchSettings.window_seeds`; None: the defaults, `window_seeds()`) is a window of the whole traces, as
    `coral simulate --seed` reads them: fresh traffic like the user's, never tuned on. `workers`: processes that
    simulate several seeds of one plan at once (`evaluate_all`; default `default_workers`)."""
    whole = frozenset(window_seeds() if windows is None else windows)
    return SimulatorEvaluator(scenario, duration_s, catalog, whole, default_workers() if workers is None else workers)


def default_workers() -> int:
    """Processes for simulating request sets: `CORAL_WORKERS` when set (1: none beside this one), else the cores
    this process may use, at most 8."""
    if os.environ.get("CORAL_WORKERS", "").strip():
        return max(1, int(os.environ["CORAL_WORKERS"]))
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


class SimulatorEvaluator:
    """The simulator as an `Evaluator` (`simulator_evaluator`); `many` simulates one plan on several seeds, in a
    pool of worker processes when there are two or more to do. Each result is the simulator's, whichever process
    ran it (the simulation depends on its inputs and seed alone), so the search decides the same either way."""

    def __init__(self, scenario: Scenario, duration_s: float, catalog: Catalog | None, whole: frozenset[int],
                 workers: int = 1) -> None:
        self.scenario, self.duration_s, self.catalog, self.whole, self.workers = (scenario, duration_s, catalog, whole,
                                                                                 workers)
        self.token = uuid.uuid4().hex  # names this evaluator's workloads in the worker processes
        self.workloads: dict[int, dict[str, RequestSet]] = {}
        self.seen: dict[tuple[str, int, float], dict[str, Attainment]] = {}
        self.kernels: KernelCache | None = None  # step-time tables, made once for every plan this evaluates

    @staticmethod
    def _key(plan: Plan, seed: int, share: float) -> tuple[str, int, float]:
        return plan.model_dump_json(include={"instances", "request_classes"}), seed, share

    def __call__(self, plan: Plan, seed: int, share: float = 1.0) -> dict[str, Attainment]:
        key = self._key(plan, seed, share)
        if key in self.seen:  # rounds whose demand moved too little to change the plan: same plan, same result
            return self.seen[key]
        if seed not in self.workloads:
            self.workloads[seed] = workload_for(self.scenario, self.duration_s, seed,
                                                part=None if seed in self.whole else "tune")
        requests = self.workloads[seed] if share >= 1 else thinned(self.workloads[seed], share, seed)
        if self.kernels is None:
            self.kernels = KernelCache(self.scenario, self.catalog or builtin_catalog(), RooflineModel())
        sim = simulate(plan, self.scenario, requests, duration_s=self.duration_s, seed=seed, catalog=self.catalog,
                       kernels=self.kernels)
        self.seen[key] = {m.model: Attainment(m.slo_attainment, m.ttft_attainment, m.tpot_attainment, m.requests)
                          for m in sim.models}
        return self.seen[key]

    def many(self, plan: Plan, seeds: Sequence[int], share: float = 1.0) -> list[dict[str, Attainment]]:
        """`plan` on each of `seeds`, in order; the ones not yet simulated in the worker pool when two or more."""
        todo = list(dict.fromkeys(s for s in seeds if self._key(plan, s, share) not in self.seen))
        if len(todo) >= 2 and self.workers > 1:
            config = (self.token, self.scenario, self.duration_s, self.catalog, self.whole)
            done = _pool(self.workers).map(_simulate_in_worker, [(config, plan, s, share) for s in todo])
            for s, result in zip(todo, done, strict=True):
                self.seen[self._key(plan, s, share)] = result
        return [self(plan, s, share) for s in seeds]


def evaluate_all(evaluate: Evaluator, plan: Plan, seeds: Sequence[int], share: float = 1.0
                 ) -> list[Mapping[str, Attainment]]:
    """`evaluate` of `plan` on each of `seeds`: at once (its `many`) where it can, else one after another."""
    many = getattr(evaluate, "many", None)
    return list(many(plan, seeds, share)) if many is not None else [evaluate(plan, s, share) for s in seeds]


_POOL: tuple[int, ProcessPoolExecutor] | None = None
#: evaluators a worker process keeps (their workloads), most recent last
_WORKER_EVALUATORS: dict[str, SimulatorEvaluator] = {}
_WORKER_KEEPS = 4


def _pool(workers: int) -> ProcessPoolExecutor:
    """The process's worker pool (made once; spawned, so no lock or thread of this process is copied)."""
    global _POOL
    if _POOL is None or _POOL[0] != workers:
        if _POOL is not None:
            _POOL[1].shutdown()
        _POOL = (workers, ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")))
    return _POOL[1]


def _simulate_in_worker(task: tuple[tuple[str, Scenario, float, Catalog | None, frozenset[int]], Plan, int, float]
                        ) -> dict[str, Attainment]:
    (token, scenario, duration_s, catalog, whole), plan, seed, share = task
    if token not in _WORKER_EVALUATORS:
        while len(_WORKER_EVALUATORS) >= _WORKER_KEEPS:
            _WORKER_EVALUATORS.pop(next(iter(_WORKER_EVALUATORS)))
        _WORKER_EVALUATORS[token] = SimulatorEvaluator(scenario, duration_s, catalog, whole)
    return _WORKER_EVALUATORS[token](plan, seed, share)
