"""Template generation: exact parity with the paper's ILP, brute force, library round trip, bad input."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coral.catalog.loader import CoralInputError, builtin_catalog, load_scenario
from coral.perf import RooflineModel, Workload
from coral.perf.model import Phase
from coral.templates.build import build_library, prepare_job, run_jobs, scenario_jobs
from coral.templates.library import Stage, Template, TemplateLibrary, dominated_rows
from coral.templates.placement import brute_force, set_partitions, solve_node_sets
from coral.templates.reference_ilp import solve_reference


def random_tables(rng: np.random.Generator, n: int, n_configs: int, n_layers: int) -> np.ndarray:
    """Non-increasing-in-j node throughput tables with zeros where layers 'do not fit'."""
    raw = rng.random((n, n_configs, n_layers + 1)) * 100
    raw[rng.random(raw.shape) < 0.15] = 0
    out = np.zeros_like(raw)
    out[:, :, 1:] = np.minimum.accumulate(-np.sort(-raw[:, :, 1:], axis=2), axis=2)
    return out


def test_bell_numbers() -> None:
    assert [len(set_partitions(n)[0]) for n in range(1, 7)] == [1, 2, 5, 15, 52, 203]


def test_single_node_reproduces_profile() -> None:
    """S = 1 on one node: throughput is the node's table at L layers (paper §10.5 check)."""
    tables = np.zeros((1, 1, 5))
    tables[0, 0, 1:] = [40.0, 30.0, 20.0, 10.0]
    thr, _, layers = solve_node_sets(np.array([[0]]), np.array([1]), tables)
    assert thr[0] == 10.0 and layers[0, 0] == 4


def test_golden_two_stage_uneven_split() -> None:
    """Hand-solved: a fast node (A) and a slow node (B), L = 4. Pipelining A:3 layers, B:1 layer gives
    min(T_A(3), T_B(1)) = min(30, 25) = 25, better than one data-parallel stage (T_A(4) + T_B(4) = 15 + 2)."""
    tables = np.zeros((2, 2, 5))
    tables[0, 0, 1:] = [80, 60, 45, 15]  # S = 1 budget
    tables[0, 1, 1:] = [20, 10, 5, 2]
    tables[1, 0, 1:] = [70, 50, 30, 20]  # S = 2 budget (tighter)
    tables[1, 1, 1:] = [25, 12, 6, 3]
    thr, part, layers = solve_node_sets(np.array([[0, 1]]), np.array([2]), tables)
    assert thr[0] == pytest.approx(25.0)
    _, groups = set_partitions(2)
    assert groups[part[0]] == 2
    assert sorted(layers[0, :2].tolist()) == [1, 3]


def test_parity_with_paper_ilp_on_random_node_sets() -> None:
    """The fast solver equals the HiGHS ILP of §4.2 on random node sets, including odd ones."""
    rng = np.random.default_rng(2026)
    cases = 0
    for _ in range(300):
        n_configs, n_layers, n = int(rng.integers(1, 4)), int(rng.integers(1, 9)), int(rng.integers(1, 5))
        tables = random_tables(rng, n, n_configs, n_layers)
        if rng.random() < 0.1:
            tables[:, :, :] = 0  # nothing fits anywhere
        slots = sorted(rng.integers(0, n_configs, size=n).tolist())
        fast, _, _ = solve_node_sets(np.array([slots]), np.array([n]), tables)
        ref = solve_reference(slots, tables)
        assert fast[0] == pytest.approx(ref.throughput, rel=1e-6, abs=1e-6), (slots, tables)
        cases += 1
    assert cases == 300


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 5), st.integers(1, 3), st.integers(1, 6))
def test_parity_with_brute_force(seed: int, n: int, n_configs: int, n_layers: int) -> None:
    rng = np.random.default_rng(seed)
    tables = random_tables(rng, n, n_configs, n_layers)
    slots = sorted(rng.integers(0, n_configs, size=n).tolist())
    fast, part, layers = solve_node_sets(np.array([slots]), np.array([n]), tables)
    assert fast[0] == pytest.approx(brute_force(slots, tables), rel=1e-12, abs=1e-12)
    if fast[0] > 0:  # the returned placement achieves the value and covers all layers
        labels, groups = set_partitions(n)
        s_count = int(groups[part[0]])
        assert layers[0, :s_count].sum() == n_layers and layers[0, :s_count].min() >= 1
        stage = np.zeros(s_count)
        for k in range(n):
            g = labels[part[0], k]
            stage[g] += tables[s_count - 1, slots[k], layers[0, g]]
        assert stage.min() == pytest.approx(fast[0])


def test_real_profiles_parity_on_small_model() -> None:
    """On real perf-model tables (GPT-OSS 20B prefill, mixed L4/A10G/L40S) the fast solver equals the ILP."""
    jobs = [j for j in scenario_jobs(load_scenario("core"), builtin_catalog()) if j.model.name == "gpt-oss-20b"]
    res = run_jobs(jobs[:1], RooflineModel())[0]
    rng = np.random.default_rng(7)
    rows = rng.choice(np.flatnonzero(res.sizes <= 3), size=12, replace=False)
    for r in rows:
        slots = [int(c) for c in res.node_sets[r] if c >= 0]
        ref = solve_reference(slots, res.tables)
        assert res.throughput[r] == pytest.approx(ref.throughput, rel=1e-6)


def tiny_library() -> TemplateLibrary:
    def t(counts: dict[str, int], stages: tuple[Stage, ...], thr: float) -> Template:
        return Template(0, "m", Phase.PREFILL, 1000.0, counts, stages, thr)

    return TemplateLibrary.from_templates(
        ["1xA", "1xB"],
        [
            t({"1xA": 1}, (Stage(4, ("1xA",), (10.0,)),), 10.0),
            t({"1xA": 2}, (Stage(4, ("1xA", "1xA"), (10.0, 10.0)),), 20.0),
            t({"1xA": 1, "1xB": 1}, (Stage(4, ("1xA", "1xB"), (10.0, 0.0)),), 10.0),  # B adds nothing
        ],
        {"scenario": "tiny"},
    )


def test_dominated_templates_are_flagged() -> None:
    lib = tiny_library()
    assert dominated_rows(lib).tolist() == [False, False, True]


def test_library_round_trip(tmp_path: Path) -> None:
    lib = tiny_library()
    path = lib.save(tmp_path / "lib.sqlite")
    back = TemplateLibrary.load(path)
    assert len(back) == 3 and back.configs == lib.configs
    assert back.template(1) == lib.template(1)
    assert back.costs({"1xA": 2.0, "1xB": 3.0}).tolist() == [2.0, 4.0, 5.0]
    assert np.isinf(back.costs({"1xA": 2.0})[2])
    assert not list(tmp_path.glob(".coral-lib-*")), "no temporary file left behind"


def test_build_core_library_is_consistent() -> None:
    lib = build_library(load_scenario("core"), workers=1)
    assert {m for m, _ in lib.keys()} == {"phi-4", "gpt-oss-20b", "qwen3-32b"}
    for i in np.random.default_rng(0).choice(len(lib), size=50, replace=False):
        t = lib.template(int(i))
        assert sum(s.layers for s in t.stages) == builtin_catalog().model(t.model).num_hidden_layers
        assert t.throughput == pytest.approx(min(s.throughput for s in t.stages))
        assert sum(len(s.nodes) for s in t.stages) == t.n_nodes <= 6
    regions, costs = lib.region_costs()
    assert regions == sorted(load_scenario("core").regions)
    i = int(np.flatnonzero(np.isfinite(costs[:, 0]))[0])
    assert costs[i, 0] == pytest.approx(lib.template(i).cost(builtin_catalog().prices(regions[0])))


def test_parallel_build_equals_serial() -> None:
    sc = load_scenario("core")
    a = build_library(sc, workers=1, models=["gpt-oss-20b"])
    b = build_library(sc, workers=2, models=["gpt-oss-20b"])
    assert np.array_equal(a.throughput, b.throughput) and np.array_equal(a.counts, b.counts)


def test_model_that_fits_nowhere_is_a_clear_error(tmp_path: Path) -> None:
    sc = load_scenario("core").model_copy(update={"configs": ["1xL4"], "n_max": 2})
    with pytest.raises(CoralInputError, match="qwen3-32b/prefill"):
        build_library(sc)


def test_prepare_respects_memory_caps() -> None:
    pm = RooflineModel()
    job = next(j for j in scenario_jobs(load_scenario("core"), builtin_catalog()) if j.model.name == "phi-4")
    res = prepare_job(job, pm)
    mem = np.array([c.memory_gb for c in job.configs])
    total = np.where(res.node_sets >= 0, mem[np.maximum(res.node_sets, 0)], 0).sum(axis=1)
    assert total.max() <= job.rho * pm.shape(job.model).model_bytes / 1e9
    assert res.sizes.max() <= job.n_max


@pytest.mark.ray
@pytest.mark.cluster
def test_ray_build_equals_local() -> None:
    """In the cluster tier: a local Ray instance beside 8 busy processes did not finish its workers in 20 minutes,
    so the default run starts no Ray."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    try:
        sc = load_scenario("core")
        a = build_library(sc, workers=1, models=["gpt-oss-20b"])
        b = build_library(sc, use_ray=True, models=["gpt-oss-20b"])
        assert np.array_equal(a.throughput, b.throughput)
    finally:
        ray.shutdown()


def test_pipeline_throughput_shares_one_micro_batch() -> None:
    """Qwen3-32B decode on [1xL40S 19 layers -> 1xH100 45 layers]: the H100 caps the micro-batch at K (its KV
    room / 2), so the L40S runs K too and the pipeline gives 2K / (2 t_L40S(K)), not min(T_L40S, T_H100)."""
    sc = load_scenario("extended")
    lib = build_library(sc, models=["qwen3-32b"])
    pm, cat = RooflineModel(), builtin_catalog()
    arch = cat.model("qwen3-32b")
    sm = next(m for m in sc.models if m.model == "qwen3-32b")
    w = Workload(sm.mean_input_tokens, sm.mean_output_tokens)
    rows = [int(r) for r in lib.select("qwen3-32b", "decode")
            if lib.template(int(r)).counts == {"1xL40S": 1, "1xH100": 1}]
    assert rows
    t = lib.template(rows[0])
    by_cfg = {s.nodes[0]: s for s in t.stages}
    h100, l40s = by_cfg["1xH100"], by_cfg["1xL40S"]
    _, batch = pm.throughput_table(arch, Phase.DECODE, cat.node_config("1xH100"), sm.decode_slo_ms / 1e3, 2, w)
    k = batch[h100.layers]
    step = float(pm.step_time(arch, Phase.DECODE, cat.node_config("1xL40S"), l40s.layers, k, w, True))
    assert t.throughput == pytest.approx(k / step, rel=0.02)
    table, _ = pm.throughput_table(arch, Phase.DECODE, cat.node_config("1xL40S"), sm.decode_slo_ms / 1e3, 2, w)
    assert t.throughput < min(table[l40s.layers], h100.node_throughput[0] * 2)


def test_library_fingerprint_names_what_changed_and_stale_libraries_are_rebuilt(tmp_path, monkeypatch, capsys):  # type: ignore[no-untyped-def]
    import json as json_

    from coral.catalog.loader import load_scenario as load_sc
    from coral.templates import store

    sc = load_sc("core")
    lib = TemplateLibrary.from_templates(["1xL4"], [], {"fingerprint": json_.dumps(store.fingerprint(sc))})
    assert store.changed_parts(lib, sc) == []
    slower = sc.models[0].model_copy(update={"decode_slo_ms": sc.models[0].decode_slo_ms * 2})
    assert store.changed_parts(lib, sc.model_copy(update={"models": [slower, *sc.models[1:]]})) == ["slos"]
    assert store.changed_parts(lib, sc.model_copy(update={"n_max": sc.n_max - 1, "rho": 8.0})) == ["n_max", "rho"]
    assert store.changed_parts(TemplateLibrary.from_templates(["1xL4"], [], {}), sc) == list(store.fingerprint(sc))
    built: list[str] = []

    def fake_build(scenario, catalog=None, **_):  # type: ignore[no-untyped-def]
        built.append(scenario.name)
        return TemplateLibrary.from_templates(["1xL4"], [], {"fingerprint": json_.dumps(store.fingerprint(scenario))})

    monkeypatch.setattr("coral.templates.build.build_library", fake_build)
    lib.meta["fingerprint"] = json_.dumps({**store.fingerprint(sc), "perf": "old"})
    lib.save(tmp_path / "core.templates.sqlite")
    store.load_library("core", tmp_path)
    assert built == ["core"] and "perf changed" in capsys.readouterr().err
    store.load_library("core", tmp_path)  # now current: loaded, not rebuilt
    assert built == ["core"]


def test_a_first_build_on_a_machine_counts_numbas_compile_in_its_estimate(tmp_path, monkeypatch, capsys) -> None:
    """A fresh clone's first core build took 22 s (numba compiling the solver), not the 4 s it announced."""
    from coral.catalog.loader import load_scenario
    from coral.templates import store

    core = load_scenario("core")
    assert store.build_estimate_s(core, 2, compiled=False) == pytest.approx(store.build_estimate_s(core, 2) + 18.0)
    compiled = store.solver_compiled
    monkeypatch.setattr(store, "solver_compiled", lambda: False)
    monkeypatch.setattr("coral.templates.build.build_library", lambda *_a, **_k: (_ for _ in ()).throw(RuntimeError("stop")))
    with pytest.raises(RuntimeError, match="stop"):
        store.load_library("core", tmp_path)
    said = " ".join(capsys.readouterr().err.split())
    assert "numba compiling the placement solver first (once per machine)" in said
    assert re.search(r"expected about 2\d s on", said), said
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    assert compiled() == any((Path(store.__file__).parent / "__pycache__").rglob("placement.*.nbi"))
