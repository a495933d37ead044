"""Held-out means unseen: tuning and held-out request sets read disjoint parts of each trace's time range (both
trace scalings, any seeds), are seeded-deterministic, the percentile rule sizes on the tuning part only, and the
simulator-in-the-loop evaluator gives held-out seeds the held-out part."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import coral.allocation.demand as demand
import coral.planning.evaluation as evaluation
import coral.workload.traces as traces
from coral.catalog.loader import CoralInputError, load_scenario
from coral.catalog.schema import ScenarioModel
from coral.planning.slo_search import SearchSettings, simulator_evaluator
from coral.workload.burst import burst_factors
from coral.workload.traces import (
    TRACE_SPLIT,
    RequestSet,
    part_bounds,
    request_sets,
    superpose,
    thinned,
    trace_part,
    workload_for,
)

CORE = load_scenario("core")
DURATION = 1800.0
TUNE, HELD = SearchSettings().tune_seeds, SearchSettings().held_out_seeds


def _same(a: RequestSet, b: RequestSet) -> bool:
    return (len(a) == len(b) and np.array_equal(a.arrival_s, b.arrival_s)
            and np.array_equal(a.input_tokens, b.input_tokens) and np.array_equal(a.output_tokens, b.output_tokens)
            and a.trace_s is not None and b.trace_s is not None and np.array_equal(a.trace_s, b.trace_s))


@pytest.mark.parametrize("scaling", ["superpose", "compress"])
def test_held_out_sets_share_no_request_with_tuning_sets(scaling: str) -> None:
    how: Any = scaling
    tune = [workload_for(CORE, DURATION, s, scaling=how, part="tune") for s in (*TUNE, *HELD)]
    held = [workload_for(CORE, DURATION, s, scaling=how, part="held_out") for s in (*HELD, *TUNE)]
    for sm in CORE.models:
        base = traces._shipped(sm.trace)
        split = TRACE_SPLIT * base.span_s
        seen = set().union(*(w[sm.model].origins() for w in tune))
        unseen = set().union(*(w[sm.model].origins() for w in held))
        assert seen and unseen and not seen & unseen, sm.model
        # origins are recorded requests of the trace, each from its own part of the time range
        recorded = base.origins()
        assert seen <= recorded and unseen <= recorded
        assert max(t for t, _, _ in seen) < split <= min(t for t, _, _ in unseen)
        for w in (*tune, *held):  # each set still reaches the model's rate
            assert len(w[sm.model]) == pytest.approx(sm.request_rate * DURATION, rel=0.05)


def test_whole_trace_without_a_part_is_unchanged() -> None:
    """Callers that neither tune nor score (simulate, experiments) read the whole trace with the old seeds."""
    w = workload_for(CORE, 600, 3)
    for i, sm in enumerate(CORE.models):
        old = superpose(traces._shipped(sm.trace), sm.request_rate, 600, 3 * 1009 + i)
        assert _same(w[sm.model], old)
    spans = np.concatenate([r.trace_s for r in workload_for(CORE, DURATION, 0).values() if r.trace_s is not None])
    assert spans.max() > TRACE_SPLIT * traces._shipped("azure-code").span_s  # reads past the split


@pytest.mark.parametrize("part", ["tune", "held_out"])
def test_request_sets_are_seeded_deterministic(part: str) -> None:
    a = workload_for(CORE, 900, 10, part=part)  # type: ignore[arg-type]
    b = workload_for(CORE, 900, 10, part=part)  # type: ignore[arg-type]
    c = workload_for(CORE, 900, 11, part=part)  # type: ignore[arg-type]
    for m in a:
        assert _same(a[m], b[m])
        assert not _same(a[m], c[m])


def test_synthetic_models_draw_other_requests_per_part() -> None:
    sm = CORE.models[0].model_copy(update={"trace": "synthetic"})
    sc = CORE.model_copy(update={"models": [sm]})
    tune = workload_for(sc, 600, 0, part="tune")[sm.model]
    held = workload_for(sc, 600, 0, part="held_out")[sm.model]
    assert tune.trace_s is None and held.trace_s is None
    assert not np.array_equal(tune.arrival_s[:20], held.arrival_s[:20])
    assert _same_synthetic(tune, workload_for(sc, 600, 0, part="tune")[sm.model])


def _same_synthetic(a: RequestSet, b: RequestSet) -> bool:
    return np.array_equal(a.arrival_s, b.arrival_s) and np.array_equal(a.input_tokens, b.input_tokens)


def test_trace_part_bounds_and_bad_parts() -> None:
    assert part_bounds("tune") == (0.0, TRACE_SPLIT) and part_bounds("held_out") == (TRACE_SPLIT, 1.0)
    base = traces._shipped("azure-conversation")
    tune, held = trace_part(base, "tune"), trace_part(base, "held_out")
    assert len(tune) + len(held) == len(base)
    assert tune.arrival_s[0] == 0.0 and held.arrival_s[0] == 0.0
    assert tune.span_s == pytest.approx(TRACE_SPLIT * base.span_s, rel=0.01)
    with pytest.raises(ValueError, match="trace part"):
        part_bounds("test")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="trace part"):
        workload_for(CORE, 60, 0, part="all")  # type: ignore[arg-type]
    two = RequestSet(np.array([0.0, 100.0]), np.array([5, 5]), np.array([5, 5]))
    with pytest.raises(CoralInputError, match="held_out part"):
        trace_part(two, "held_out")


def test_trace_times_survive_thinning_and_cutting() -> None:
    r = workload_for(CORE, 600, 1, part="held_out")
    assert all(x.trace_s is not None for x in r.values())
    cut = r["phi-4"].until(300)
    assert cut.trace_s is not None and len(cut.trace_s) == len(cut)
    thin = thinned(r, 0.3, 5)["phi-4"]
    assert thin.trace_s is not None and thin.origins() <= r["phi-4"].origins()


def _trace(second_half_burst: bool) -> RequestSet:
    """One hour at 2 req/s: a steady first half; the second half steady too, or one huge clump."""
    rng = np.random.default_rng(3)
    first = np.sort(rng.uniform(0, 1800, 3600))
    second = (np.sort(rng.uniform(1810, 3590, 3600)) if not second_half_burst
              else np.sort(rng.uniform(2500, 2530, 3600)))
    t = np.r_[first, second, 3599.5]
    n = len(t)
    return traces._make(t, rng.integers(200, 2000, n), rng.integers(20, 300, n), "hand-made")


def test_burst_rule_sizes_on_the_tuning_part_only(monkeypatch: pytest.MonkeyPatch) -> None:
    sm = ScenarioModel(model="phi-4", prefill_slo_ms=1200, decode_slo_ms=60, request_rate=10, mean_input_tokens=1100,
                       mean_output_tokens=160, trace="azure-conversation")
    sc = CORE.model_copy(update={"models": [sm]})
    calls: list[Any] = []
    real = demand.workload_for

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("part"))
        return real(*args, **kwargs)

    monkeypatch.setattr(demand, "workload_for", spy)
    got: dict[object, tuple[float, float]] = {}
    for burst in (False, True):
        monkeypatch.setattr(traces, "_shipped", lambda _name, burst=burst: _trace(burst))
        monkeypatch.setattr(demand, "_BURST", {})
        monkeypatch.setattr(demand, "_TUNING", {})
        got[burst] = demand.model_burst(sc, sm)
        # the whole trace does see the clump: the rule would size for it if it read the held-out part
        whole = workload_for(sc, demand.run_length_s(sc), demand.TUNING_SEED)[sm.model]
        got[("whole", burst)] = burst_factors(whole, 1.2, 0.06, sm.slo_attainment)
    assert calls == ["tune", "tune"]
    assert got[False] == got[True]
    assert got[("whole", True)][0] > 1.5 * got[("whole", False)][0]


class _Plan:
    def model_dump_json(self, **_: Any) -> str:
        return "plan"


def test_evaluator_tunes_on_the_first_half_and_reads_windows_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    parts: dict[int, str | None] = {}

    def fake_workload(_sc: Any, _d: float, seed: int, *_: Any, part: str | None = None, **__: Any) -> dict:
        parts[seed] = part
        return {}

    monkeypatch.setattr(evaluation, "workload_for", fake_workload)
    monkeypatch.setattr(evaluation, "simulate", lambda *_, **__: type("Sim", (), {"models": []})())
    evaluate = simulator_evaluator(CORE, 60.0)  # the signature cli/run.py and the benchmarks call
    windows = SearchSettings().window_seeds  # the confirmation's and every certification look's
    for seed in (*TUNE, *windows):
        evaluate(_Plan(), seed, 1.0)  # type: ignore[arg-type]
    # the rounds tune on the first half of every trace; windows read the whole traces, as `coral simulate --seed`
    assert parts == {**dict.fromkeys(TUNE, "tune"), **dict.fromkeys(windows, None)}
    parts.clear()
    evaluate = simulator_evaluator(CORE, 60.0, None, windows=(10,))
    for seed in (0, 1, 10):
        evaluate(_Plan(), seed, 1.0)  # type: ignore[arg-type]
    assert parts == {0: "tune", 1: "tune", 10: None}


def test_request_set_counts_per_model() -> None:
    rows = request_sets(CORE, DURATION, TUNE, HELD)
    assert len(rows) == 2 * len(CORE.models)
    for sm in CORE.models:
        tune, held = (next(r for r in rows if r["model"] == sm.model and r["part"] == p) for p in ("tune", "held_out"))
        base = traces._shipped(sm.trace)
        assert tune["trace_requests"] + held["trace_requests"] == len(base)  # type: ignore[operator]
        assert tune["shared"] == held["shared"] == 0
        assert tune["minutes"] == 30 * len(TUNE) and held["minutes"] == 30 * len(HELD)
        assert tune["trace_to_min"] == held["trace_from_min"] == pytest.approx(base.span_s * TRACE_SPLIT / 60, abs=0.01)
        assert tune["requests"] == pytest.approx(sm.request_rate * DURATION * 3, rel=0.05)
        assert 0 < held["distinct_used"] <= held["trace_requests"]  # type: ignore[operator]
